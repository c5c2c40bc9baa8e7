"""Faults injected into a real engine behind the app, in process: a step that raises in the model's forward, a
drafter that raises, a grammar matcher that fails mid-output. The requests concerned end with a clear error
(an SSE error event and [DONE] when streaming, a 4xx/5xx body otherwise), the others are untouched, and the
server goes on answering with plain decoding's output, /health 200 and the counters in /metrics."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.config import EngineConfig
from specserve.engine.engine import LLMEngine
from specserve.spec_decode.suffix import SuffixProposer
from specserve.structured.grammar import GrammarError, GrammarMatcher
from tests.server.helpers import app_over

MODEL = "SmolLM2-135M-Instruct"
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
POISON = "Say zebra-crossing twice."  # the prompt whose prefill step the injected fault hits
PROBE = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(max_model_len=512, kv_cache_memory_bytes=64 << 20, speculative_config={
        "method": "suffix", "num_speculative_tokens": 4, "adaptive_draft_length": False}))


def serve(engine, scenario):
    """Run `scenario(client)` against the app over `engine`; returns what it returns."""
    async_engine, app = app_over(engine, MODEL)

    async def main():
        async_engine.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
                return await scenario(client)
        finally:
            await async_engine.shutdown()

    return asyncio.run(asyncio.wait_for(main(), 300))


def events(text: str) -> list:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def counters(text: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


async def healthy_and_plain(client, plain: str) -> dict[str, float]:
    """The server answers a normal request with plain decoding's text and /health 200; its counters."""
    probe = await client.post("/v1/completions", json=PROBE)
    assert probe.status_code == 200 and probe.json()["choices"][0]["text"] == plain
    assert (await client.get("/health")).status_code == 200
    return counters((await client.get("/metrics")).text)


@pytest.fixture(scope="module")
def plain(engine) -> str:
    async def scenario(client):
        return (await client.post("/v1/completions", json=PROBE)).json()["choices"][0]["text"]

    return serve(engine, scenario)


async def _long_stream_and_poisoned_request(client, engine) -> tuple[list, httpx.Response]:
    """A long streamed chat in flight; once it generates, a request whose prefill step faults."""
    generated = engine.metrics.num_generation_tokens
    streamed = asyncio.ensure_future(client.post("/v1/chat/completions", json=LONG))
    while engine.metrics.num_generation_tokens == generated:
        await asyncio.sleep(0.01)
    poisoned = await client.post("/v1/completions", json={"model": MODEL, "prompt": POISON, "max_tokens": 8})
    return events((await streamed).text), poisoned


def test_a_fault_in_the_forward_fails_the_requests_in_flight_and_the_server_serves_on(engine, plain, monkeypatch):
    forward, poison = engine.model.forward, set(engine.tokenizer.encode(POISON, add_special_tokens=False))
    faults = []

    def faulty_forward(input_ids, *args, **kwargs):
        if not faults and poison <= set(input_ids.tolist()):
            faults.append(None)
            raise RuntimeError("injected fault in the forward")
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", faulty_forward)

    async def scenario(client):
        streamed, poisoned = await _long_stream_and_poisoned_request(client, engine)
        return streamed, poisoned, await healthy_and_plain(client, plain)

    streamed, poisoned, metrics = serve(engine, scenario)
    assert faults
    assert streamed[-1] == "[DONE]"
    error = json.loads(streamed[-2])["error"]
    assert error["code"] == "request_failed" and error["type"] == "server_error"
    assert "injected fault in the forward" in error["message"] and "reset" in error["message"]
    assert poisoned.status_code == 500 and poisoned.json()["error"]["code"] == "request_failed"
    assert metrics["specserve:num_engine_restarts_total"] == 1


def test_a_failing_drafter_costs_its_requests_their_drafts_only(engine, plain, monkeypatch):
    propose, calls = SuffixProposer.propose, []

    def failing_propose(self, inputs):
        calls.append(None)
        if len(calls) == 4:
            raise RuntimeError("injected drafter fault")
        return propose(self, inputs)

    body = {**LONG, "stream": False, "max_tokens": 48}

    async def scenario(client):
        before = counters((await client.get("/metrics")).text)
        answer = await client.post("/v1/chat/completions", json=body)
        return before, answer, await healthy_and_plain(client, plain)

    _, reference, _ = serve(engine, scenario)
    monkeypatch.setattr(SuffixProposer, "propose", failing_propose)
    before, answer, after = serve(engine, scenario)
    assert len(calls) > 4 and answer.status_code == 200
    assert answer.json()["choices"][0]["message"] == reference.json()["choices"][0]["message"]
    for name in ("specserve:num_engine_restarts_total", "specserve:num_requests_failed_alone_total"):
        assert after[name] == before[name]


def test_a_grammar_failing_mid_output_is_that_requests_400(engine, plain, monkeypatch):
    fill = GrammarMatcher._fill

    def failing_fill(self, words):
        if self._num_accepted >= 2:
            raise GrammarError("injected")
        fill(self, words)

    monkeypatch.setattr(GrammarMatcher, "_fill", failing_fill)
    constrained = {"model": MODEL, "messages": [{"role": "user", "content": "A word?"}], "max_tokens": 16,
                   "min_tokens": 8, "structured_outputs": {"regex": "[a-z ]+"}}

    async def scenario(client):
        before = counters((await client.get("/metrics")).text)
        other = asyncio.ensure_future(client.post("/v1/completions", json=PROBE))
        whole = await client.post("/v1/chat/completions", json=constrained)
        streamed = await client.post("/v1/chat/completions", json={**constrained, "stream": True})
        assert (await other).json()["choices"][0]["text"] == plain
        return before, whole, events(streamed.text), await healthy_and_plain(client, plain)

    before, whole, streamed, after = serve(engine, scenario)
    assert whole.status_code == 400 and "injected" in whole.json()["error"]["message"], (whole.text, streamed)
    assert whole.json()["error"]["type"] == "invalid_request_error"
    assert streamed[-1] == "[DONE]" and json.loads(streamed[-2])["error"]["type"] == "invalid_request_error"
    assert after["specserve:num_requests_failed_alone_total"] == before["specserve:num_requests_failed_alone_total"] + 2
    assert after["specserve:num_engine_restarts_total"] == before["specserve:num_engine_restarts_total"]
