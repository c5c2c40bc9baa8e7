"""Admitting requests into a real engine (a tiny random Llama over the default model's tokenizer, in process):
a grammar slow to compile holds up only its own request, and JSON nested too deep where a schema goes is a 400
naming its field, after which the engine serves plain decoding's text."""
from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest
import torch

from specserve.config import EngineConfig
from specserve.engine.engine import LLMEngine
from specserve.sampling_params import SamplingParams, StructuredOutputsParams
from specserve.server.async_engine import AsyncLLM
from specserve.structured.grammar import GrammarCompiler
from specserve.tokenizer import load_tokenizer
from tests.tiny_models import tiny_hf_model
from tests.server.helpers import app_over

MODEL = "tiny"
MAX_MODEL_LEN = 2048
SLOW_COMPILE_S = 1.0
MAX_GAP_S = 0.05
# Attempts at the gap measurement: a busy shared host can deschedule the engine thread for 50 ms on its own,
# while a compile on the engine thread stalls every attempt for the whole second.
ATTEMPTS = 3
LONG_PROMPT = "Tell me a long story about a lighthouse keeper."
PROBE = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
DEEP = 5000  # levels: past Python's recursion limit, so json.loads raises RecursionError on such a text


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    """The engine over a tiny random Llama with the default model's 49,152-token vocabulary and tokenizer: steps
    take milliseconds, so a stalled step shows."""
    folder = tmp_path_factory.mktemp("tiny_llama_default_vocab")
    model = tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=MAX_MODEL_LEN)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)  # peaked next-token distributions, as a trained model has
    model.save_pretrained(str(folder))
    tokenizer = load_tokenizer(None)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": tokenizer.eos_token, "bos_token": tokenizer.bos_token, "chat_template": tokenizer.chat_template}))
    engine = LLMEngine(EngineConfig(model=str(folder), max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                                    kv_cache_memory_bytes=32 << 20))
    engine.compile_grammar(StructuredOutputsParams(regex="[a-z]+"))  # the compiler's one-time vocabulary index
    return engine


class OutputTimes:
    """A stat logger noting when the engine thread hands out each output of one request."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.times: list[float] = []

    def record_output(self, output, replica=None) -> None:
        if output.request_id == self.request_id:
            self.times.append(time.monotonic())

    def record_abort(self, request_id, replica=None) -> None:
        pass


def _long_params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_MODEL_LEN - 64, ignore_eos=True)


def _max_gap_within(times: list[float], start: float, end: float) -> float:
    """The longest time without an output across [start, end] (from the last output before it to the first
    after it)."""
    before = [t for t in times if t <= start][-1:]
    after = [t for t in times if t >= end][:1]
    ticks = before + [t for t in times if start < t < end] + after
    assert before and after, "the stream did not run across the whole compile"
    return max(b - a for a, b in zip(ticks, ticks[1:]))


def test_a_grammar_slow_to_compile_does_not_stall_the_other_streams(engine, monkeypatch):
    """While one request's grammar takes a second to compile, another stream's outputs keep coming at step
    pace (gaps under 50 ms), its tokens are plain decoding's, and the constrained request then follows its
    grammar."""
    compile_grammar, compile_windows = GrammarCompiler.compile, []

    def slow_compile(self, kind, spec=None):
        start = time.monotonic()
        time.sleep(SLOW_COMPILE_S)
        compiled = compile_grammar(self, kind, spec)
        compile_windows.append((start, time.monotonic()))
        return compiled

    async def one_attempt(llm: AsyncLLM, times: OutputTimes, attempt: int) -> tuple[float, list[int], str]:
        times.times.clear()
        long = await llm.add_request(times.request_id, LONG_PROMPT, _long_params())
        outputs = llm.outputs(long)
        while len(times.times) < 5:
            await anext(outputs)
        params = SamplingParams(temperature=0, max_tokens=8,
                                structured_outputs=StructuredOutputsParams(regex=f"[a-z]{{1,{8 + attempt}}}"))
        constrained = [o async for o in llm.generate(f"constrained-{attempt}", "Say a word:", params)]
        last_long = await anext(outputs)
        await outputs.aclose()  # aborts the long request
        gap = _max_gap_within(times.times, *compile_windows[-1])
        return gap, last_long.outputs[0].token_ids, constrained[-1].outputs[0].text

    async def main():
        times = OutputTimes("long")
        llm = AsyncLLM(engine, stat_logger=times)
        llm.start()
        try:
            reference = [o async for o in llm.generate("reference", LONG_PROMPT, _long_params())][-1]
            monkeypatch.setattr(GrammarCompiler, "compile", slow_compile)
            results = []
            for attempt in range(ATTEMPTS):
                results.append(await one_attempt(llm, times, attempt))
                if results[-1][0] < MAX_GAP_S:
                    break
            return reference.outputs[0].token_ids, results
        finally:
            await llm.shutdown()

    reference, results = asyncio.run(asyncio.wait_for(main(), 300))
    for gap, long_ids, constrained_text in results:
        assert long_ids == reference[:len(long_ids)] and len(long_ids) > 5
        assert re.fullmatch("[a-z]+", constrained_text), constrained_text
    gaps = [round(gap, 3) for gap, _, _ in results]
    assert min(gaps) < MAX_GAP_S, f"the longest gap between the other stream's outputs per attempt: {gaps} s"


# ---- hostile JSON where a schema goes, through the app ---------------------------------------------------------

def _deep_text(depth: int) -> str:
    return "[" * depth + "]" * depth


def _deep_object_text(depth: int) -> str:
    return '{"anyOf": [' * depth + "{}" + "]}" * depth


def _body_text(body: dict, deep_text: str) -> str:
    """The body as JSON text with the string "DEEP" replaced by `deep_text` (too deep for json.dumps)."""
    return json.dumps(body).replace('"DEEP"', deep_text)


MESSAGES = [{"role": "user", "content": "Reply in JSON."}]
_TOOL = {"type": "function", "function": {"name": "f", "parameters": "DEEP"}}
HOSTILE_BODIES = {
    # a schema as a JSON string, decoded by the grammar compiler
    "guided_json text": ("completions", {"prompt": "x", "guided_json": _deep_text(DEEP)},
                         "guided_json"),
    "structured_outputs.json text": ("completions", {"prompt": "x", "structured_outputs": {
        "json": _deep_text(DEEP)}}, "structured_outputs"),
    # decoded JSON nested past the limit but within what the body parser decodes
    "response_format schema": ("chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": "DEEP"}}}, "response_format"),
    "tool parameters": ("chat/completions", {"messages": MESSAGES, "tools": [_TOOL], "tool_choice": "required"},
                        "tools"),
    "guided_json object": ("completions", {"prompt": "x", "guided_json": "DEEP"}, "guided_json"),
    "structured_outputs regex": ("completions", {"prompt": "x", "structured_outputs": {"regex": "DEEP"}},
                                 "structured_outputs"),
}


@pytest.fixture(scope="module")
def served(engine):
    """An event loop running the app over `engine`, and a client calling it from this thread."""
    async_engine, app = app_over(engine, MODEL)
    loop = asyncio.new_event_loop()
    async_engine.start()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=30)

    def call(method: str, path: str, **kwargs) -> httpx.Response:
        return loop.run_until_complete(asyncio.wait_for(client.request(method, path, **kwargs), 60))

    yield call
    loop.run_until_complete(async_engine.shutdown())
    loop.run_until_complete(client.aclose())
    loop.close()


@pytest.mark.parametrize("case", HOSTILE_BODIES)
def test_json_nested_too_deep_is_a_400_naming_its_field_and_the_engine_serves_on(served, case):
    plain = served("POST", "/v1/completions", json=PROBE).json()["choices"][0]["text"]
    path, body, param = HOSTILE_BODIES[case]
    deep = _deep_object_text(150)  # within what the body parser decodes, past the schema limit
    r = served("POST", f"/v1/{path}", content=_body_text({"model": MODEL, "max_tokens": 4, **body}, deep),
               headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:500]
    error = r.json()["error"]
    assert error["param"] == param and "nests objects and arrays more than 100 levels deep" in error["message"]
    probe = served("POST", "/v1/completions", json=PROBE)
    assert probe.status_code == 200 and probe.json()["choices"][0]["text"] == plain
    assert served("GET", "/health").status_code == 200
