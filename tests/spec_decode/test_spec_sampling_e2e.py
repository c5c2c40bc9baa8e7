"""Penalties, logprobs, seeds and per-request control under speculation, end to end on SmolLM2."""
import pytest

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

PROMPTS = ["List the days of the week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. "
           "Again: Monday, Tuesday,",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"]
# A fixed draft length, so every test has drafts to verify; the adaptive one gets its own seeded test below.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4,
        "adaptive_draft_length": False}


@pytest.fixture(scope="module")
def engines():
    return LLM(max_model_len=512), LLM(max_model_len=512, speculative_config=SPEC)


def test_penalised_greedy_output_is_unchanged_by_speculation(engines):
    plain, spec = engines
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.4, presence_penalty=0.2)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert sum(o.metrics.num_drafts for o in got) > 0


def test_logprobs_under_speculation_match_plain_decoding(engines):
    plain, spec = engines
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lw.keys() == lg.keys()
            for tid in lw:
                assert abs(lw[tid].logprob - lg[tid].logprob) < 1e-3 and lw[tid].rank == lg[tid].rank


@pytest.mark.parametrize("adaptive", [False, True])
def test_seeded_sampling_with_speculation_is_reproducible_in_any_batch(engines, adaptive):
    spec = engines[1]
    if adaptive:  # drafts per step then depend on acceptance; a seeded request's draws must not
        spec = LLM(max_model_len=512, speculative_config=dict(SPEC, adaptive_draft_length=True))
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=32, ignore_eos=True)
    alone = spec.generate([PROMPTS[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = spec.generate([PROMPTS[1], PROMPTS[0]], [other, seeded], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


def test_num_speculative_tokens_zero_turns_speculation_off_for_one_request(engines):
    _, spec = engines
    on = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    off = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, num_speculative_tokens=0)
    outs = spec.generate([PROMPTS[0], PROMPTS[0]], [on, off], use_tqdm=False)
    assert outs[0].metrics.num_drafts > 0 and outs[1].metrics.num_drafts == 0
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    capped = spec.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                        num_speculative_tokens=1), use_tqdm=False)[0]
    assert capped.metrics.num_draft_tokens == capped.metrics.num_drafts  # never more than 1 per step
