"""The model runner's step-cost calibration: the draft policy prices drafts from timed steps before the first
request."""
from __future__ import annotations

import pytest

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.step_pricing import StepCosts
from specserve.worker.calibration import StepCalibrator
from tests.tiny_models import save_hf_folder, tiny_hf_model

ENGINE = dict(max_model_len=256, block_size=8, max_num_seqs=8, kv_cache_memory_bytes=64 << 20)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_hf_folder(tiny_hf_model("llama", seed=3), tmp_path_factory.mktemp("target"))


def test_calibration_times_every_verification_size_and_the_batched_step_before_any_request(folder):
    llm = LLM(model=folder, speculative_config={"method": "ngram", "num_speculative_tokens": 5}, **ENGINE)
    policy = llm.llm_engine.runner.draft_policy
    assert sorted(policy.step_costs.seconds) == list(range(1, 7))  # 1 + 0..5 drafts
    assert all(policy.step_costs.samples[n] >= StepCosts.MIN_SAMPLES for n in range(1, 7))
    assert all(v > 0 for v in policy.step_costs.seconds.values())
    # batches of 2, 4 and 8 requests (max_num_seqs 8), one and two tokens each: priced from the first step
    assert sorted(policy.batch_fit.calibrated) == [2, 4, 8] and policy.batch_fit.fit is None
    # a draft row's share of a step never smaller at more requests (on a tiny model two tokens a request may
    # time as fast as one: the share is then that of fewer requests, or zero)
    shares = [(two - one) / one for one, two in policy.batch_fit.calibrated.values()]
    assert all(one > 0 for one, _ in policy.batch_fit.calibrated.values())
    assert all(later >= earlier - 1e-12 for earlier, later in zip(shares, shares[1:])) and shares[0] >= 0
    assert policy.batch_fit.draft_cost(4) is not None and policy.batch_fit.share(4) > 0
    assert policy.drafts_this_step(1)  # no plain steps needed to time a one-token step


def test_calibrated_costs_decide_the_draft_length(folder, monkeypatch):
    """Verification priced from the calibration, not the prior: with each extra token timed at a whole
    one-token step, a 60%-accepted request does not draft; at 3% of a step it drafts the most it may."""
    def fake_step(seconds_per_extra_token):
        def timed(self, num_requests, num_tokens, context, blocks, repeats=3):
            return 0.01 * (1 + seconds_per_extra_token * (num_requests * num_tokens - 1))
        return timed

    spec = {"method": "ngram", "num_speculative_tokens": 4}
    monkeypatch.setattr(StepCalibrator, "timed_step", fake_step(1.0))
    dear = LLM(model=folder, speculative_config=spec, **ENGINE).llm_engine.runner.draft_policy
    assert dear.step_costs.relative(2) == pytest.approx(3.0)
    assert dear.num_drafts("r", 4) == 0
    monkeypatch.setattr(StepCalibrator, "timed_step", fake_step(0.03))
    cheap = LLM(model=folder, speculative_config=spec, **ENGINE).llm_engine.runner.draft_policy
    assert cheap.num_drafts("r", 4) == 4


def test_no_calibration_without_adaptive_speculation(folder, monkeypatch):
    calls = []
    monkeypatch.setattr(StepCalibrator, "timed_step", lambda *a: calls.append(a) or 0.01)
    LLM(model=folder, **ENGINE)
    LLM(model=folder, speculative_config={"method": "ngram", "adaptive_draft_length": False}, **ENGINE)
    assert calls == []


def test_output_after_calibration_is_plain_decoding(folder):
    """The dummy steps write KV into blocks that requests then own: each request writes before it reads."""
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 30, 17)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(model=folder, **ENGINE).generate(prompts, params, use_tqdm=False)]
    spec = LLM(model=folder, speculative_config={"method": "suffix"}, **ENGINE)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == plain
