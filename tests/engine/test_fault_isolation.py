"""A request's fault is that request's problem: on the default model, a request whose grammar, output text or
drafter fails ends alone (or decodes without drafts) while the others keep plain decoding's tokens, and a step
that fails in a way no request owns resets the engine to a new engine's state and serving goes on."""
from __future__ import annotations

import pytest

from specserve.engine.output_processor import OutputProcessor
from specserve.engine.request import RequestStatus
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams, StructuredOutputsParams
from specserve.spec_decode.suffix import SuffixProposer
from specserve.structured.grammar import GrammarError, GrammarMatcher

ENGINE = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256, kv_cache_memory_bytes=64 << 20)
# A fixed draft length, so every step drafts where the suffix tree has a match, whatever this host's timings.
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "adaptive_draft_length": False}
PROMPTS = ["The capital of France is", "List three colors: red, green,", "def fibonacci(n):",
           "Count from one to ten: one, two, three,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Plain decoding's tokens for PROMPTS."""
    return [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _assert_fresh(engine) -> None:
    """The block pool, prefix cache, scheduler and runner hold nothing of any request."""
    pool = engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks and not pool.cached
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in pool.blocks)
    assert not engine.scheduler.running and not engine.scheduler.requests and not engine.kv_cache_manager.req_blocks
    runner = engine.runner
    assert not runner.requests and not runner.draft_probs and not runner.undrafted
    assert not runner.grammars and not runner.draft_policy.stats


def test_unsatisfiable_grammars_are_refused_at_admission_and_the_batch_goes_on(reference):
    llm = LLM(speculative_config=SUFFIX, **ENGINE)
    hostile = [StructuredOutputsParams(json={"$ref": "#"}), StructuredOutputsParams(regex="[^\\x00-\\U0010FFFF]")]
    params = [GREEDY] * len(PROMPTS) + [SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=s)
                                        for s in hostile]
    outputs = llm.generate(PROMPTS + PROMPTS[:2], params, use_tqdm=False)
    assert _tokens(outputs[:len(PROMPTS)]) == reference
    for out in outputs[len(PROMPTS):]:
        assert out.finished and out.outputs[0].finish_reason == "error"
        assert "no string matches it" in out.error, out.error


def test_a_grammar_that_fails_mid_output_fails_its_request_alone(reference, monkeypatch):
    fill = GrammarMatcher._fill

    def failing_fill(self, words):
        if self._num_accepted >= 3:
            raise GrammarError("injected")
        fill(self, words)

    monkeypatch.setattr(GrammarMatcher, "_fill", failing_fill)
    llm = LLM(speculative_config=SUFFIX, **ENGINE)
    constrained = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(
        regex="[A-Za-z ,.]+"))
    outputs = llm.generate(PROMPTS + ["Name a fruit:"], [GREEDY] * len(PROMPTS) + [constrained], use_tqdm=False)
    assert _tokens(outputs[:-1]) == reference
    failed = outputs[-1]
    assert failed.outputs[0].finish_reason == "error" and failed.error_from_input
    assert "structured output" in failed.error and "injected" in failed.error
    assert 3 <= len(failed.outputs[0].token_ids) < 24
    metrics = llm.get_metrics()
    assert metrics.num_requests_failed == 1 and metrics.num_engine_restarts == 0
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference  # and it serves on


def test_one_failed_sequence_fails_its_whole_request_of_n(reference, monkeypatch):
    """n = 2 under a grammar that fails mid-output for one sequence: the request ends with the error (both of
    its sequences), the batch-mates keep their tokens."""
    fill, failing = GrammarMatcher._fill, []

    def failing_fill(self, words):  # the first matcher to reach 3 tokens fails, and only that one
        if self._num_accepted >= 3 and (not failing or self is failing[0]):
            failing[:] = [self]
            raise GrammarError("injected")
        fill(self, words)

    monkeypatch.setattr(GrammarMatcher, "_fill", failing_fill)
    llm = LLM(**ENGINE)
    pair = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=24, ignore_eos=True,
                          structured_outputs=StructuredOutputsParams(regex="[A-Za-z ,.]+"))
    outputs = llm.generate(PROMPTS + ["Name a fruit:"], [GREEDY] * len(PROMPTS) + [pair], use_tqdm=False)
    assert _tokens(outputs[:-1]) == reference
    assert [c.finish_reason for c in outputs[-1].outputs] == ["error", "error"] and "injected" in outputs[-1].error
    assert llm.get_metrics().num_requests_failed == 1 and not llm.llm_engine.has_unfinished_requests()


def test_output_text_that_fails_fails_its_request_alone(reference, monkeypatch):
    detokenize = OutputProcessor._detokenize

    def failing(self, child, new_ids):
        if child.params.stop == ["never-seen"] and len(child.completion.token_ids) >= 5:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return detokenize(self, child, new_ids)

    monkeypatch.setattr(OutputProcessor, "_detokenize", failing)
    llm = LLM(**ENGINE)
    odd = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=["never-seen"])
    outputs = llm.generate(PROMPTS + PROMPTS[:1], [GREEDY] * len(PROMPTS) + [odd], use_tqdm=False)
    assert _tokens(outputs[:-1]) == reference
    assert outputs[-1].outputs[0].finish_reason == "error" and not outputs[-1].error_from_input
    assert "injected" in outputs[-1].error
    assert llm.get_metrics().num_requests_failed == 1


def test_a_failing_drafter_drops_its_drafts_and_its_requests_decode_plainly(reference, monkeypatch):
    propose, calls = SuffixProposer.propose, []

    def failing_propose(self, inputs):
        calls.append(list(inputs.req_ids))
        if len(calls) == 3:
            raise RuntimeError("injected drafter fault")
        return propose(self, inputs)

    monkeypatch.setattr(SuffixProposer, "propose", failing_propose)
    llm = LLM(speculative_config=SUFFIX, **ENGINE)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _tokens(outputs) == reference and all(o.error is None for o in outputs)
    failed_on = set(calls[2])
    assert failed_on and not any(failed_on & set(later) for later in calls[3:])  # its requests draft no more
    metrics = llm.get_metrics()
    assert metrics.num_requests_failed == 0 and metrics.num_engine_restarts == 0
    drafts_before = metrics.num_drafts
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # new requests draft again, losslessly
    assert _tokens(again) == reference and llm.get_metrics().num_drafts > drafts_before


def test_a_failed_step_resets_the_engine_keeps_waiting_requests_and_serves_on(reference, monkeypatch):
    llm = LLM(speculative_config=SUFFIX, **dict(ENGINE, max_num_seqs=2))
    engine = llm.llm_engine
    warm = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)  # its output is now in the suffix tree
    assert _tokens(warm) == reference[:1]

    forward, steps = engine.model.forward, []

    def failing_forward(*args, **kwargs):
        steps.append(None)
        if len(steps) == 3:
            raise RuntimeError("injected step fault")
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", failing_forward)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    outputs = []
    while not steps or len(steps) < 3:
        outputs += engine.step()
    # Right after the reset: the two requests in flight failed, the two waiting ones are kept.
    failed = [o for o in outputs if o.finished]
    assert sorted(o.request_id for o in failed) == ["0", "1"]
    assert all(o.outputs[0].finish_reason == "error" and "injected step fault" in o.error for o in failed)
    assert [r.request_id for r in engine.scheduler.waiting] == ["2", "3"]
    assert all(r.status == RequestStatus.WAITING for r in engine.scheduler.waiting)
    pool = engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks and not pool.cached and not engine.runner.requests
    assert engine.metrics.num_engine_restarts == 1

    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [finished[r].outputs[0].token_ids for r in ("2", "3")] == reference[2:]
    assert pool.num_free_blocks == pool.num_blocks and not engine.scheduler.requests


def test_the_drafter_after_a_reset_is_a_new_engines(monkeypatch):
    """A request after the reset drafts exactly as on a new engine: the suffix tree of earlier outputs is gone."""
    prompt, params = PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    fresh = LLM(speculative_config=SUFFIX, **ENGINE)
    expected = fresh.generate([prompt], params, use_tqdm=False)[0]

    llm = LLM(speculative_config=SUFFIX, **ENGINE)
    engine = llm.llm_engine
    llm.generate([prompt], params, use_tqdm=False)
    llm.generate(PROMPTS[:1], params, use_tqdm=False)  # the drafter's next call puts the output above in its tree
    forward = engine.model.forward
    monkeypatch.setattr(engine.model, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("fault")))
    engine.add_request("doomed", prompt, params)
    assert engine.step()[0].error is not None
    monkeypatch.setattr(engine.model, "forward", forward)
    _assert_fresh(engine)
    after = llm.generate([prompt], params, use_tqdm=False)[0]
    assert after.outputs[0].token_ids == expected.outputs[0].token_ids
    assert (after.metrics.num_drafts, after.metrics.num_draft_tokens, after.metrics.num_accepted_tokens) == (
        expected.metrics.num_drafts, expected.metrics.num_draft_tokens, expected.metrics.num_accepted_tokens)


def test_a_failure_with_nothing_in_flight_fails_the_waiting_requests(reference, monkeypatch):
    """No crash loop: a step that fails before any request starts blames the requests it was given."""
    llm = LLM(**ENGINE)
    engine = llm.llm_engine
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: (_ for _ in ()).throw(RuntimeError("fault")))
    engine.add_request("a", PROMPTS[0], GREEDY)
    outputs = engine.step()
    assert [o.request_id for o in outputs] == ["a"] and outputs[0].error is not None
    assert not engine.has_unfinished_requests()  # the reset scheduler is not the patched one
    assert _tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)) == reference[:1]
