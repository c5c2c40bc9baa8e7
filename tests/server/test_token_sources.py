"""How each output token was produced: the scheduler's record per token, CompletionOutput.token_sources offline,
and the server's opt-in stream extension (stream_options.include_token_sources), checked against the
engine's own speculation counters (usage.speculation, RequestMetrics) and the streamed text."""
from __future__ import annotations

import json

import httpx
import pytest

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from tests.engine.test_scheduler import make_request, make_scheduler
from tests.server.helpers import ServerProcess

MAX_MODEL_LEN = 1024
# auto drafting every step: whether the policy finds drafts worth their price depends on this host's step
# costs (and on what else loads it), and these tests need drafted tokens to check their record.
SPEC = {"method": "auto", "adaptive_draft_length": False}
CHAT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
PROMPT = "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,"
DRAFTED = {"accepted", "bonus", "correction"}


def check_against_counters(sources: list[str], num_drafts: int, num_accepted: int) -> None:
    """One verification step ends each run of accepted drafts with a bonus or a correction."""
    assert sources.count("accepted") == num_accepted
    assert sources.count("bonus") + sources.count("correction") == num_drafts


# ------------------------------------------------------------------------------------------- scheduler


def test_the_scheduler_records_each_tokens_source_and_drafter():
    sched = make_scheduler()
    sched.add_request(make_request("r", 6))
    out = sched.schedule()  # the prompt: the target samples one token
    sched.update_from_output(out, {"r": [10]}, {"r": [11, 12, 13]}, {"r": "suffix"})
    out = sched.schedule()  # verifies 11, 12, 13: accepts 11, the target corrects 12 to 20
    assert out.scheduled_spec_decode_tokens == {"r": [11, 12, 13]}
    sched.update_from_output(out, {"r": [11, 20]}, {"r": [21, 22]}, {"r": "ngram"})
    out = sched.schedule()  # verifies 21, 22: both accepted, plus the bonus 23
    sched.update_from_output(out, {"r": [21, 22, 23]})
    out = sched.schedule()  # no drafts: a plain step
    sched.update_from_output(out, {"r": [24]})
    request = sched.requests["r"]
    assert request.output_token_ids == [10, 11, 20, 21, 22, 23, 24]
    assert request.token_sources == ["target", "accepted", "correction", "accepted", "accepted", "bonus", "target"]
    assert request.token_drafters == [None, "suffix", "suffix", "ngram", "ngram", "ngram", None]


# ------------------------------------------------------------------------------------------- offline


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=MAX_MODEL_LEN, speculative_config=SPEC)


def test_offline_outputs_carry_token_sources(llm):
    names = {option.name for option in llm.llm_engine.runner.draft_policy.options}
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                       use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.token_sources) == len(c.token_drafters) == len(c.token_ids) == 40
    assert "accepted" in c.token_sources
    check_against_counters(c.token_sources, out.metrics.num_drafts, out.metrics.num_accepted_tokens)
    for source, drafter in zip(c.token_sources, c.token_drafters):
        assert (drafter in names) if source in DRAFTED else (drafter is None)

    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, num_speculative_tokens=0),
                         use_tqdm=False)[0].outputs[0]
    assert plain.token_sources == ["target"] * len(plain.token_ids)
    assert plain.token_drafters == [None] * len(plain.token_ids)


def test_offline_token_sources_per_choice_and_after_a_stop_string(llm):
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=30, n=2, stop=["5, 1"])
    for c in llm.generate(PROMPT, params, use_tqdm=False)[0].outputs:
        assert len(c.token_sources) == len(c.token_drafters) == len(c.token_ids)


# ------------------------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--max-model-len", str(MAX_MODEL_LEN), "--speculative-config", json.dumps(SPEC))
    yield proc
    proc.stop()


def stream(server, path: str, body: dict) -> list[dict]:
    """The stream's JSON events (without [DONE])."""
    events = []
    with httpx.stream("POST", server.url + path, json={"stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events


def test_chat_stream_carries_token_sources_on_request(server):
    body = {"messages": CHAT, "temperature": 0, "max_tokens": 80,
            "stream_options": {"include_usage": True, "include_token_sources": True}}
    events = stream(server, "/v1/chat/completions", body)
    tokens = [t for e in events for c in e["choices"] for t in c.get("token_sources", ())]
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    usage = events[-1]["usage"]
    assert len(tokens) == usage["completion_tokens"]
    assert "".join(t["text"] for t in tokens) == text
    sources = [t["source"] for t in tokens]
    assert "accepted" in sources
    check_against_counters(sources, usage["speculation"]["num_drafts"], usage["speculation"]["num_accepted_tokens"])
    assert all(("drafter" in t) == (t["source"] in DRAFTED) for t in tokens)


def test_no_token_sources_without_the_opt_in(server):
    events = stream(server, "/v1/chat/completions", {"messages": CHAT, "temperature": 0, "max_tokens": 20})
    assert events and not any("token_sources" in c for e in events for c in e["choices"])
    whole = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": CHAT, "max_tokens": 8, "stream_options": {"include_token_sources": True}}).json()
    assert "token_sources" not in whole["choices"][0]  # a stream-only extension


def test_token_sources_without_speculation_are_the_targets(server):
    body = {"messages": CHAT, "temperature": 0, "max_tokens": 20, "num_speculative_tokens": 0,
            "stream_options": {"include_token_sources": True}}
    tokens = [t for e in stream(server, "/v1/chat/completions", body) for c in e["choices"]
              for t in c.get("token_sources", ())]
    assert len(tokens) == 20 and {t["source"] for t in tokens} == {"target"}


def test_completion_stream_carries_token_sources_per_choice(server):
    body = {"prompt": PROMPT, "temperature": 0.7, "seed": 1, "n": 2, "max_tokens": 24, "ignore_eos": True,
            "stream_options": {"include_usage": True, "include_token_sources": True}}
    events = stream(server, "/v1/completions", body)
    for index in (0, 1):
        choices = [c for e in events for c in e["choices"] if c["index"] == index]
        tokens = [t for c in choices for t in c.get("token_sources", ())]
        assert len(tokens) == 24
        assert "".join(t["text"] for t in tokens) == "".join(c["text"] for c in choices)
    assert events[-1]["usage"]["completion_tokens"] == 48
