"""The server through the official `openai` client, against one real `specserve serve` (ngram speculation on)
and the offline `LLM` (speculation off) as the reference: greedy output must match token for token."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from tests.server.helpers import ServerProcess, metric, scrape, wait_for_metric

MAX_MODEL_LEN = 1024
# Fixed draft length: the adaptive policy may stop drafting when 32 clients make the step compute-bound,
# and these tests need drafts in flight.
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "adaptive_draft_length": False}
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
REPETITIVE = "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--max-model-len", str(MAX_MODEL_LEN), "--speculative-config", json.dumps(SPEC))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def reference():
    """The offline engine without speculation: what every greedy answer must equal."""
    return LLM(max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def streamed_completion(client, **kw) -> tuple[dict[int, str], dict[int, str]]:
    """(text, finish_reason) per choice index, from a streamed completion."""
    texts, reasons = {}, {}
    for chunk in client.completions.create(model=MODEL, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, reasons


def streamed_chat(client, **kw) -> tuple[dict[int, str], list]:
    texts, chunks = {}, []
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        chunks.append(chunk)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    return texts, chunks


# ------------------------------------------------------------------------------------------- basics


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200


def test_completion_matches_offline_llm_streamed_or_not(client, reference):
    ref = reference.generate(PROMPT, greedy(12), use_tqdm=False)[0].outputs[0]
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    texts, reasons = streamed_completion(client, prompt=PROMPT, max_tokens=12, temperature=0)
    assert whole.choices[0].text == ref.text == texts[0]
    assert whole.choices[0].finish_reason == ref.finish_reason == reasons[0]
    assert whole.usage.prompt_tokens == len(reference.get_tokenizer().encode(PROMPT))
    assert whole.usage.completion_tokens == len(ref.token_ids)


def test_completion_from_token_ids(client, reference):
    ids = reference.get_tokenizer().encode(PROMPT)
    ref = reference.generate(PROMPT, greedy(8), use_tqdm=False)[0].outputs[0]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert out.choices[0].text == ref.text


def test_chat_matches_offline_llm_streamed_or_not(client, reference):
    ref = reference.chat(CHAT, greedy(16), use_tqdm=False)[0].outputs[0]
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=16, temperature=0)
    texts, chunks = streamed_chat(client, messages=CHAT, max_tokens=16, temperature=0)
    assert whole.choices[0].message.content == ref.text == texts[0]
    assert whole.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == ref.finish_reason
    assert len({c.id for c in chunks}) == 1


def test_n2_streamed_equals_non_streamed(client):
    kw = dict(prompt="Once upon a time", max_tokens=10, temperature=0.9, seed=1234, n=2)
    whole = client.completions.create(model=MODEL, **kw)
    texts, reasons = streamed_completion(client, **kw)
    assert sorted(c.index for c in whole.choices) == [0, 1]
    assert {c.index: c.text for c in whole.choices} == texts
    assert set(reasons) == {0, 1}
    assert whole.usage.completion_tokens == 20


def test_batched_prompts_give_n_choices_each(client, reference):
    refs = [reference.generate(p, greedy(6), use_tqdm=False)[0].outputs[0].text for p in (PROMPT, "Hello")]
    out = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=6, temperature=0)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == refs


# ------------------------------------------------------------------------------------------- stops, logprobs


def test_stop_string_truncates_streamed_and_whole_alike(client, reference):
    ref = reference.generate(PROMPT, greedy(16), use_tqdm=False)[0].outputs[0].text
    words = ref.split()
    assert len(words) >= 3, ref
    stop = " " + words[2]  # a multi-character stop in the middle of the output
    expected = ref[: ref.index(stop)]
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    texts, reasons = streamed_completion(client, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert whole.choices[0].text == texts[0] == expected
    assert whole.choices[0].finish_reason == reasons[0] == "stop"
    assert whole.choices[0].model_extra["stop_reason"] == stop


def test_completion_logprobs(client, reference):
    ref = reference.generate(PROMPT, greedy(6, logprobs=3), use_tqdm=False)[0].outputs[0]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for token_id, value, top, entry in zip(ref.token_ids, lp.token_logprobs, lp.top_logprobs, ref.logprobs):
        assert value == pytest.approx(entry[token_id].logprob, abs=1e-4)
        assert len(top) == 3 and max(top.values()) == pytest.approx(value, abs=1e-6)  # greedy = the argmax
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_chat_logprobs_streamed_equal_whole(client):
    kw = dict(messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(model=MODEL, **kw)
    content = whole.choices[0].logprobs.content
    assert "".join(t.token for t in content) == whole.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in content)
    assert all(bytes(t.bytes).decode() == t.token for t in content)
    _, chunks = streamed_chat(client, **kw)
    streamed = [t for ch in chunks for c in ch.choices if c.logprobs for t in c.logprobs.content]
    assert [(t.token, round(t.logprob, 5)) for t in streamed] == [(t.token, round(t.logprob, 5)) for t in content]


# ------------------------------------------------------------------------------------------- usage, speculation


def test_stream_include_usage(client):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_per_request_speculation_reported_in_usage(client, reference):
    ref = reference.generate(REPETITIVE, greedy(16, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    spec = client.completions.create(model=MODEL, prompt=REPETITIVE, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True})
    plain = client.completions.create(model=MODEL, prompt=REPETITIVE, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True, "num_speculative_tokens": 0})
    assert spec.choices[0].text == plain.choices[0].text == ref
    stats = spec.usage.model_extra["speculation"]
    assert stats["num_drafts"] > 0 and 0 < stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    assert stats["mean_acceptance_length"] == pytest.approx(1 + stats["num_accepted_tokens"] / stats["num_drafts"])
    assert plain.usage.model_extra.get("speculation") is None


def test_32_concurrent_streaming_clients_match_prompts_run_alone(server, reference):
    # 8 distinct prompts, each sent by 4 of the 32 clients (running 32 prompts alone would dominate the time).
    distinct = [f"Write one sentence about the number {i}." for i in range(5)]
    distinct += [f"Count from {i}: {i}, {i + 1}, {i + 2}," for i in range(3)]  # ngram drafts get accepted here
    alone = {p: reference.chat([{"role": "user", "content": p}], greedy(16), use_tqdm=False)[0].outputs[0].text
             for p in distinct}
    prompts = [distinct[i % len(distinct)] for i in range(32)]
    drafts_before = metric(scrape(server.url), "specserve:spec_decode_num_drafts_total")

    async def one(aclient, prompt):
        text, reason = "", None
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0, stream=True)
        async for chunk in stream:
            for c in chunk.choices:
                text += c.delta.content or ""
                reason = c.finish_reason or reason
        return text, reason

    async def all_clients():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=180) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    results = asyncio.run(all_clients())
    assert [text for text, _ in results] == [alone[p] for p in prompts]
    assert all(reason in ("stop", "length") for _, reason in results)
    assert metric(scrape(server.url), "specserve:spec_decode_num_drafts_total") > drafts_before


# ------------------------------------------------------------------------------------------- bad input

_LONG = "hello " * (MAX_MODEL_LEN + 10)
_BAD = [
    ("completions", {"temperature": -1}, "temperature"),
    ("completions", {"top_p": 0}, "top_p"),
    ("completions", {"top_p": 1e-30}, "top_p"),  # rounds to 0 in float32
    ("completions", {"repetition_penalty": 1e-300}, "repetition_penalty"),  # overflows float32 logits
    ("completions", {"prompt": "a\ud800b"}, "prompt"),  # a lone surrogate: valid JSON, not valid text
    ("completions", {"n": 0}, "n"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("completions", {"logprobs": 50}, "logprobs"),
    ("completions", {"model": "no-such-model"}, "model"),
    ("completions", {"prompt": _LONG}, "prompt"),
    ("completions", {"prompt": [10 ** 9]}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"stop": [""]}, "stop"),
    ("completions", {"min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"presence_penalty": 3}, "presence_penalty"),
    ("completions", {"stop_token_ids": [10 ** 9]}, "stop_token_ids"),
    ("completions", {"num_speculative_tokens": -1}, "num_speculative_tokens"),
    ("completions", {"seed": 2 ** 70}, "seed"),
    ("completions", {"logit_bias": {"1": 5}}, "logit_bias"),
    ("completions", {"temperature": "hot"}, "temperature"),
    ("completions", {"prompt": None}, "prompt"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": _LONG}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages"),
    ("chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat/completions", {"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ("chat/completions", {"tools": [{"type": "function"}]}, "tools"),
]


@pytest.mark.parametrize("path,override,param", _BAD, ids=[f"{p}-{param}" for p, _, param in _BAD])
def test_bad_input_is_400_naming_the_parameter(server, path, override, param):
    body = {"model": MODEL, "max_tokens": 4}
    body.update({"prompt": PROMPT} if path == "completions" else {"messages": CHAT})
    body.update(override)
    # json.dumps escapes lone surrogates as \\udXXX (httpx's json= would fail to encode them)
    r = httpx.post(f"{server.url}/v1/{path}", content=json.dumps(body), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_invalid_json_and_client_error_class(server, client):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x",', timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, top_p=2.0)
    assert info.value.body["param"] == "top_p"
    # still serving
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0).choices[0].text


# ------------------------------------------------------------------------------------------- disconnects, metrics


def test_disconnect_mid_stream_aborts_and_frees_kv_blocks(server):
    idle = metric(scrape(server.url), "specserve:kv_cache_usage_perc")
    idle_blocks = metric(scrape(server.url), "specserve:kv_cache_blocks_in_use")
    aborted = metric(scrape(server.url), "specserve:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        busy = scrape(server.url)
        assert metric(busy, "specserve:kv_cache_usage_perc") > idle
        in_use, pool = metric(busy, "specserve:kv_cache_blocks_in_use"), metric(busy, "specserve:kv_cache_blocks")
        assert in_use > idle_blocks and in_use / pool == pytest.approx(metric(busy, "specserve:kv_cache_usage_perc"))
    wait_for_metric(server.url, "specserve:request_success_total", lambda v: v == aborted + 1,
                    finished_reason="abort")
    wait_for_metric(server.url, "specserve:kv_cache_usage_perc", lambda v: v == idle)
    wait_for_metric(server.url, "specserve:kv_cache_blocks_in_use", lambda v: v == idle_blocks)
    wait_for_metric(server.url, "specserve:num_requests_running", lambda v: v == 0)


def test_metrics_report_the_kv_cache_configuration(server, reference):
    """Bytes a token of KV takes (ngram drafts from no KV of its own: the target's, as the offline engine
    without speculation has it), the pool's blocks, and the KV dtype as a label."""
    samples = scrape(server.url)
    engine = reference.llm_engine
    config = engine.hf_config
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4  # fp32
    assert engine.kv_bytes_per_token == per_token
    assert metric(samples, "specserve:kv_cache_bytes_per_token") == per_token
    assert metric(samples, "specserve:kv_cache_blocks") > 0
    assert metric(samples, "specserve:cache_config_info", kv_cache_dtype="auto") == 1


def test_disconnect_while_waiting_for_whole_response_aborts(server):
    aborted = metric(scrape(server.url), "specserve:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
    wait_for_metric(server.url, "specserve:request_success_total", lambda v: v == aborted + 1,
                    finished_reason="abort")
    wait_for_metric(server.url, "specserve:kv_cache_usage_perc", lambda v: v == 0)


def test_metrics_counters_move(server, client):
    before = scrape(server.url)
    client.completions.create(model=MODEL, prompt=REPETITIVE, max_tokens=12, temperature=0,
                              extra_body={"ignore_eos": True})
    after = scrape(server.url)

    def grew(name, by=None, **labels):
        delta = metric(after, name, **labels) - metric(before, name, **labels)
        assert delta == by if by is not None else delta > 0, (name, labels, delta)

    grew("specserve:request_success_total", 1, finished_reason="length")
    grew("specserve:prompt_tokens_total")
    grew("specserve:generation_tokens_total", 12)
    grew("specserve:time_to_first_token_seconds_count", 1)
    grew("specserve:inter_token_latency_seconds_count", 11)
    grew("specserve:e2e_request_latency_seconds_count", 1)
    grew("specserve:spec_decode_num_drafts_total")
    grew("specserve:spec_decode_num_draft_tokens_total")
    grew("specserve:spec_decode_num_accepted_tokens_total")
    grew("specserve:spec_decode_num_accepted_tokens_per_pos_total", position="0")
    assert metric(after, "specserve:num_requests_running") == 0
    assert metric(after, "specserve:num_requests_waiting") == 0
