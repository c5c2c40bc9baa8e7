"""Speculation that never costs: the pricing turns drafting off and on from the measured step costs, and
`auto` picks per request the drafter that is accepted, with greedy output unchanged throughout.

The drafters here are stand-ins that know plain decoding's output, so how often they are right is set by
the test; the target is a tiny random Llama and the step costs come from a cost model the test controls.
"""
from __future__ import annotations

import pytest
import torch

from specserve.config import SpeculativeConfig
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.auto import AutoProposer
from specserve.spec_decode.proposer import DraftInputs, DrafterNeeds, Drafts
from tests.tiny_models import save_hf_folder, tiny_hf_model

ENGINE = dict(max_model_len=256, block_size=8, max_num_seqs=8, kv_cache_memory_bytes=64 << 20)
VOCAB = 160


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = save_hf_folder(tiny_hf_model("llama", seed=5), tmp_path_factory.mktemp("target"))
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 150, (n,), generator=g).tolist()} for n in (9, 14, 6, 11)]
    return folder, prompts


def plain_outputs(folder, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in LLM(model=folder, **ENGINE).generate(prompts, params, use_tqdm=False)]


class Oracle:
    """Drafts plain decoding's continuation of the history; `right(index)` says whether the draft for token
    index is kept right (otherwise it is replaced by a wrong token)."""

    needs = DrafterNeeds()

    def __init__(self, sequences: list[list[int]], right=lambda index: True, vary: bool = False) -> None:
        self.sequences, self.right, self.vary = sequences, right, vary  # vary: draft lengths vary by step
        self.calls = 0

    def propose(self, inputs: DraftInputs) -> Drafts:
        self.calls += 1
        drafts = []
        for history, n in zip(inputs.token_ids, inputs.num_drafts):
            (seq,) = [s for s in self.sequences if s[: len(history)] == history]
            length = max(1, len(history) % (n + 1)) if self.vary else n
            true = seq[len(history): len(history) + length]
            drafts.append([t if self.right(len(history) + j) else (t + 1) % VOCAB for j, t in enumerate(true)])
        return Drafts(drafts)


class StepCostModel:
    """Replaces the measured time of every decode step by fixed + per_token * tokens, set per phase."""

    def __init__(self, runner) -> None:
        self.fixed, self.per_token, self.steps = 0.02, 0.0005, 0
        observe = runner.draft_policy.observe_step

        def modelled(num_requests, num_tokens, seconds):
            self.steps += 1
            observe(num_requests, num_tokens, self.fixed + self.per_token * num_tokens)

        runner.draft_policy.observe_step = modelled


def test_pricing_turns_drafting_off_when_a_step_costs_more_than_it_returns_and_back_on(target):
    """Four requests whose drafts are right half the time. While the step is memory-bound (a large fixed
    cost, 0.5 ms a token) drafts are nearly free and pay; when it turns compute-bound (2 ms a token, no
    fixed part) a draft costs a whole request's share of a step for half a token, so drafting stops and
    the proposer is not called at all; when the step is cheap again drafting comes back."""
    folder, prompts = target
    params = SamplingParams(temperature=0, max_tokens=236, ignore_eos=True)
    plain = plain_outputs(folder, prompts, params)
    # (the engine's calibration before the first request reads the first phase's costs: conftest.py)
    llm = LLM(model=folder, speculative_config={"method": "ngram", "num_speculative_tokens": 4}, **ENGINE)
    runner = llm.llm_engine.runner
    oracle = Oracle([p["prompt_token_ids"] + out for p, out in zip(prompts, plain)],
                    right=lambda index: (index * 2654435761) % 7 < 4, vary=True)  # ~57% of draft tokens right
    runner.proposer = oracle
    costs = StepCostModel(runner)
    phase_of_call: list[int] = []
    propose = oracle.propose

    def phased(inputs):
        phase_of_call.append(phase(costs.steps))
        return propose(inputs)

    def phase(step: int) -> int:
        return 0 if step < 30 else 1 if step < 70 else 2

    def set_phase(step: int) -> None:
        costs.fixed, costs.per_token = ((0.02, 0.0005), (0.0, 0.002), (0.02, 0.0005))[phase(step)]

    oracle.propose = phased
    step = llm.llm_engine.step

    def stepped():
        set_phase(costs.steps)
        return step()

    llm.llm_engine.step = stepped
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert costs.steps > 100
    calls = [phase_of_call.count(p) for p in range(3)]
    assert calls[0] > 24  # drafting nearly every step while it pays
    late_phase_1 = [p for p in phase_of_call if p == 1]
    assert len(late_phase_1) < 25  # it stops within the first steps of the compute-bound phase...
    first_busy = phase_of_call.index(1) if 1 in phase_of_call else len(phase_of_call)
    assert all(p != 1 for p in phase_of_call[first_busy + 25:])  # ...and stays off
    assert calls[2] > 5  # and comes back once drafts pay again


def auto_llm(folder, drafter: str = "none", **spec) -> LLM:
    return LLM(model=folder, speculative_config={"method": "auto", "drafter": drafter, **spec}, **ENGINE)


def test_auto_switches_drafter_per_request_when_one_stops_being_accepted(target):
    """Two drafters that both draft plain decoding's tokens, until the first turns wrong for one request
    (after its 40th token): that request moves to the second within a few steps, the others keep the
    first (they may use either: both are right for them), and every output stays plain decoding's."""
    folder, prompts = target
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    plain = plain_outputs(folder, prompts, params)
    sequences = [p["prompt_token_ids"] + out for p, out in zip(prompts, plain)]
    turns = len(prompts[1]["prompt_token_ids"]) + 40
    first_ok = lambda history_len, seq: not (seq is sequences[1] and history_len >= turns)  # noqa: E731

    class TurnsWrong(Oracle):
        def propose(self, inputs):
            drafts = super().propose(inputs)
            for i, history in enumerate(inputs.token_ids):
                (seq,) = [s for s in self.sequences if s[: len(history)] == history]
                if not first_ok(len(history), seq):
                    drafts.token_ids[i] = [(t + 1) % VOCAB for t in drafts.token_ids[i]]
            return drafts

    llm = auto_llm(folder, num_speculative_tokens=4)  # both options asked for the same number of drafts
    proposer = llm.llm_engine.runner.proposer
    assert isinstance(proposer, AutoProposer) and [o.name for o in proposer.needs.options] == ["suffix", "ngram"]
    proposer.proposers = [TurnsWrong(sequences), Oracle(sequences)]
    sources: dict[str, list[tuple[int, int]]] = {}  # request -> [(history length, option)]
    propose = proposer.propose

    def recorded(inputs):
        out = propose(inputs)
        for rid, history, src in zip(inputs.req_ids, inputs.token_ids, out.sources):
            if src is not None:
                sources.setdefault(rid, []).append((len(history), src))
        return out

    proposer.propose = recorded
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    rids = [o.request_id for o in outs]
    switched = sources[rids[1]]
    before = [src for n, src in switched if n < turns]
    after = [src for n, src in switched if n >= turns]
    assert before and set(before) == {0}
    assert after[-1] == 1 and after.count(0) <= 8 < after.count(1)  # a few rejections and retries, then the second
    for i in (0, 2, 3):  # the first is still right for the others: they keep using it (both are perfect there)
        used = [src for _, src in sources[rids[i]]]
        assert used.count(0) > 0.5 * len(used)


def test_auto_hands_a_request_to_the_next_option_when_a_lookup_finds_nothing(target):
    """suffix first by default: where it has no draft the same step falls through to ngram's."""
    folder, _ = target
    llm = auto_llm(folder, adaptive_draft_length=False)
    proposer = llm.llm_engine.runner.proposer

    class Fixed:
        def __init__(self, drafts):
            self.drafts, self.calls = drafts, []

        def propose(self, inputs):
            self.calls.append((list(inputs.num_drafts), set(inputs.finished_req_ids)))
            return Drafts([list(self.drafts[rid]) if n else [] for rid, n in zip(inputs.req_ids, inputs.num_drafts)])

    suffix, ngram = Fixed({"a": [5, 6], "b": []}), Fixed({"a": [7], "b": [8, 9]})
    proposer.proposers = [suffix, ngram]
    inputs = DraftInputs(req_ids=["a", "b"], sampled_token_ids=[[1], [2]], next_token_ids=[1, 2],
                         token_ids=[[3, 1], [4, 2]], num_prompt_tokens=[1, 1], num_drafts=[5, 5],
                         sampling_params=[SamplingParams(temperature=0)] * 2, seeds=[None, None],
                         max_model_len=64, draft_plans=[[(0, 5), (1, 8)], [(0, 5), (1, 8)]],
                         finished_req_ids={"gone"})
    out = proposer.propose(inputs)
    assert out.token_ids == [[5, 6], [8, 9]] and out.sources == [0, 1]
    # a new request's first step is a shadow round: every lookup is asked for it, and what ngram found for
    # "a" (not used: suffix had a draft) waits for the tokens that score it
    assert suffix.calls == [([5, 5], {"gone"})] and ngram.calls == [([8, 8], {"gone"})]
    assert out.shadow_records == [] and proposer._shadows == {"a": {1: (2, [7])}}
    suffix.calls.clear()
    ngram.calls.clear()
    later = DraftInputs(req_ids=["a", "b"], sampled_token_ids=[[5, 6, 9], [8, 9, 4]], next_token_ids=[9, 4],
                        token_ids=[[3, 1, 5, 6, 9], [4, 2, 8, 9, 4]], num_prompt_tokens=[1, 1], num_drafts=[5, 5],
                        sampling_params=[SamplingParams(temperature=0)] * 2, seeds=[None, None],
                        max_model_len=64, draft_plans=[[(0, 5), (1, 8)], [(0, 5), (1, 8)]])
    out = proposer.propose(later)
    assert out.token_ids == [[5, 6], [8, 9]] and out.sources == [0, 1]
    # ngram's [7] met a 5: a shadow draft of one token, none accepted; no round is due, so ngram now
    # searches only for the request suffix found nothing for (every lookup still sees every request)
    assert out.shadow_records == [("a", 1, 1, 0)]
    assert suffix.calls == [([5, 5], set())] and ngram.calls == [([0, 0], set()), ([0, 8], set())]


def test_auto_config_defaults_and_errors():
    cfg = SpeculativeConfig.from_dict({"method": "auto"})
    assert cfg.drafter == "draft_model" and cfg.quantization == "int8" and cfg.model  # the target in int8
    assert [cfg.num_tokens_for(p) for p in ("suffix", "ngram", "model")] == [5, 8, 4]
    capped = SpeculativeConfig.from_dict({"method": "auto", "num_speculative_tokens": 3, "drafter": "none"})
    assert [capped.num_tokens_for(p) for p in ("suffix", "ngram", "model")] == [3, 3, 3]
    with pytest.raises(ValueError, match="drafter must name the method"):
        SpeculativeConfig.from_dict({"method": "auto", "model": "/some/head"})
    with pytest.raises(ValueError, match="drafter must be one of"):
        SpeculativeConfig.from_dict({"method": "auto", "drafter": "medusa2"})
    with pytest.raises(ValueError, match="applies to method 'auto' only"):
        SpeculativeConfig.from_dict({"method": "ngram", "drafter": "eagle"})


def test_auto_takes_back_a_drafter_that_turns_right_again(target):
    """One request; the first drafter is wrong for its first 40 tokens, then right, the second is right
    about half the time. The request moves to the second and back to the first once it turns right: the
    first, though not used, is still measured on the request (shadow drafts), where without that its rate
    (and the engine's, from this request alone) would stay where the wrong stretch left it. Output stays
    plain decoding's."""
    folder, prompts = target
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    prompt = prompts[0]
    (plain,) = plain_outputs(folder, [prompt], params)
    sequence = prompt["prompt_token_ids"] + plain
    start = len(prompt["prompt_token_ids"])
    wrong = range(start, start + 40)
    llm = auto_llm(folder, num_speculative_tokens=4)
    proposer = llm.llm_engine.runner.proposer
    proposer.proposers = [Oracle([sequence], right=lambda index: index not in wrong),
                          Oracle([sequence], right=lambda index: (index * 2654435761) % 7 < 4)]
    used: list[tuple[int, int]] = []  # (history length, option)
    propose = proposer.propose

    def recorded(inputs):
        out = propose(inputs)
        used.extend((len(h), src) for h, src in zip(inputs.token_ids, out.sources) if src is not None)
        return out

    proposer.propose = recorded
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert out.outputs[0].token_ids == plain
    during = [src for n, src in used if wrong.start + 10 <= n < wrong.stop]
    after = [src for n, src in used if n >= wrong.stop + 15]
    assert during and during.count(1) > 0.7 * len(during)
    assert after and after.count(0) > 0.7 * len(after)
