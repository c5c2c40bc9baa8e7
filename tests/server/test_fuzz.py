"""Property-based fuzzing with schemathesis from the server's own OpenAPI schema, valid and invalid bodies:
no 5xx, every error in the OpenAI error body, no hang, and correct answers afterwards."""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from tests.server.helpers import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
# Generation is capped so the run stays short on two busy cores; validation sees every value the fuzzer makes.
MAX_TOKENS_CAP, N_CAP = 4, 2
REQUEST_TIMEOUT_S = 60
EXAMPLES = {GenerationMode.POSITIVE: 12, GenerationMode.NEGATIVE: 20}
OPERATIONS = [("/v1/completions", "POST"), ("/v1/chat/completions", "POST")]
PROBE = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--max-model-len", "512",
                         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}')
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def probe_before(server) -> str:
    r = httpx.post(server.url + "/v1/completions", json=PROBE, timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200
    return r.json()["choices"][0]["text"]


def cap_generation(body) -> None:
    """Shrink valid length/count fields in place (invalid ones are left for the server to refuse)."""
    if not isinstance(body, dict):
        return
    for name, cap in (("max_tokens", MAX_TOKENS_CAP), ("max_completion_tokens", MAX_TOKENS_CAP), ("n", N_CAP),
                      ("best_of", N_CAP), ("min_tokens", MAX_TOKENS_CAP)):
        value = body.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > cap:  # 9.0 counts as 9
            body[name] = cap
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:  # chat: the whole context
        body["max_tokens"] = MAX_TOKENS_CAP
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 4:
        body["prompt"] = body["prompt"][:4]


def check_response(response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["type"]
    elif "text/event-stream" in str(response.headers.get("content-type")):  # schemathesis: a list per header
        assert response.text.rstrip().endswith("data: [DONE]"), response.text[-300:]
    else:
        response.json()


@pytest.mark.parametrize("mode", list(EXAMPLES), ids=lambda m: m.value)
@pytest.mark.parametrize("path,method", OPERATIONS, ids=[p for p, _ in OPERATIONS])
def test_fuzz_finds_no_server_error(server, probe_before, path, method, mode):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operation = schema[path][method]

    @settings(max_examples=EXAMPLES[mode], deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case):
        cap_generation(case.body)
        response = case.call(base_url=server.url, timeout=REQUEST_TIMEOUT_S)
        check_response(response)

    fuzz()


def test_server_answers_correctly_after_fuzzing(server, probe_before):
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.post(server.url + "/v1/completions", json=PROBE, timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == probe_before
    metrics = httpx.get(server.url + "/metrics").text
    assert "specserve:num_requests_running" in metrics
