"""The FastAPI app over a fake engine, in process (httpx's ASGI transport): status codes, error bodies,
API key, the OpenAPI schema and the metrics endpoint, without loading a model."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.server.api_server import build_app
from specserve.server.async_engine import AsyncLLM
from specserve.server.metrics import ServerMetrics
from specserve.server.serving import ServingContext
from tests.server.fake_engine import FakeEngine, FakeTokenizer

MODEL = "fake"


def make_app(max_waiting_requests=None, api_key=None):
    engine = AsyncLLM(FakeEngine(), max_waiting_requests=max_waiting_requests)
    metrics = ServerMetrics(engine, MODEL)
    engine.stat_logger = metrics
    ctx = ServingContext(engine, FakeTokenizer(), [MODEL], max_model_len=64, vocab_size=1000)
    return build_app(ctx, metrics, api_key=api_key), engine


def call(app, engine, method: str, path: str, **kw) -> httpx.Response:
    async def main():
        engine.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return await client.request(method, path, **kw)
        finally:
            await engine.shutdown()

    return asyncio.run(asyncio.wait_for(main(), 30))


def test_completion_and_stream_over_fake_engine():
    app, engine = make_app()
    r = call(app, engine, "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "aaa"
    app, engine = make_app()
    r = call(app, engine, "POST", "/v1/chat/completions",
             json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True})
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1]) == "aaa"
    assert r.headers["content-type"].startswith("text/event-stream")


def test_queue_full_is_503_with_retry_after():
    app, engine = make_app(max_waiting_requests=0)
    r = call(app, engine, "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "queue_full"


@pytest.mark.parametrize("headers,status", [({}, 401), ({"Authorization": "Bearer wrong"}, 401),
                                            ({"Authorization": "Bearer s3cret"}, 200)])
def test_api_key_guards_v1(headers, status):
    app, engine = make_app(api_key="s3cret")
    r = call(app, engine, "GET", "/v1/models", headers=headers)
    assert r.status_code == status
    if status == 401:
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_health_and_metrics_stay_open_with_an_api_key():
    app, engine = make_app(api_key="s3cret")
    assert call(app, engine, "GET", "/health").status_code == 200
    app, engine = make_app(api_key="s3cret")
    r = call(app, engine, "GET", "/metrics")
    names = {f.name for f in text_string_to_metric_families(r.text)}
    assert {"specserve:num_requests_running", "specserve:kv_cache_usage_perc",
            "specserve:spec_decode_num_drafts", "specserve:time_to_first_token_seconds"} <= names


def test_unknown_route_and_method_use_the_error_body():
    app, engine = make_app()
    r = call(app, engine, "GET", "/v1/nope")
    assert r.status_code == 404 and "message" in r.json()["error"]
    app, engine = make_app()
    assert call(app, engine, "GET", "/v1/completions").status_code == 405


@pytest.mark.parametrize("body,param", [
    ([1, 2], None),  # not an object
    ({"prompt": "hi", "n": "many"}, "n"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "suffix": "x"}, "suffix"),
    ({"prompt": "hi", "echo": True, "logprobs": 1}, "echo"),
    ('{"prompt": "hi", "temperature": 1e400}', "temperature"),  # inf and NaN are refused
    ('{"prompt": "hi", "top_p": NaN}', "top_p"),
])
def test_validation_errors(body, param):
    app, engine = make_app()
    content = body if isinstance(body, str) else json.dumps(body)
    r = call(app, engine, "POST", "/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_openapi_documents_400_not_422():
    app, _ = make_app()
    schema = app.openapi()
    op = schema["paths"]["/v1/completions"]["post"]
    assert "422" not in op["responses"] and "400" in op["responses"]
    assert "HTTPValidationError" not in schema["components"]["schemas"]


@pytest.mark.parametrize("prompt", ["hi", [104, 105]])
def test_echo_prepends_the_prompt_streamed_or_not(prompt):
    body = {"prompt": prompt, "max_tokens": 3, "echo": True}
    app, engine = make_app()
    assert call(app, engine, "POST", "/v1/completions", json=body).json()["choices"][0]["text"] == "hiaaa"
    app, engine = make_app()
    r = call(app, engine, "POST", "/v1/completions", json={**body, "stream": True})
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")][:-1]
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events) == "hiaaa"
