"""Sampling under speculation, end to end: the target's distribution survives a sampling drafter (tiny
random models, exact reference), and penalties, logprobs, seeds and per-request control on SmolLM2."""
import copy
import dataclasses

import numpy as np
import pytest
import torch

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from tests.sample.reference import ref_probs
from tests.tiny_models import save_hf_folder, tiny_hf_model

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


# ---- distribution preservation with a drafter that samples ----------------------------------------
VOCAB = 16
DIST_PROMPT = [3, 7, 2, 9, 4]
DEPTH = 3  # the joint distribution of the first 3 output tokens is tested: 16**3 outcomes
NUM_SAMPLES = 4000
# A correct sampler fails the distribution check with probability about ALPHA per test (Pearson's
# chi-square approximation, every bin expecting >= 5 samples); the seeds are fixed, so every run of a
# given build gives the same verdict.
ALPHA = 1e-4


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A target over a 16-token vocabulary and a drafter of its weights plus noise: far enough from it
    that most drafts are rejected, close enough that runs of drafts are accepted, so the probabilities
    of later draft positions are used too. A wide init keeps both distributions far from uniform."""
    target = tiny_hf_model("llama", seed=1, vocab_size=VOCAB, initializer_range=0.2)
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for weight in draft.parameters():
            weight.add_(torch.randn(weight.shape, generator=g) * weight.std() * 0.2)
    folder = tmp_path_factory.mktemp("tiny_pair")
    return target, save_hf_folder(target, folder / "target"), save_hf_folder(draft, folder / "draft")


def exact_distribution(hf, params: SamplingParams) -> np.ndarray:
    """P(first DEPTH output tokens) under `params`, from transformers' logits: [VOCAB ** DEPTH]."""
    contexts = torch.cartesian_prod(*[torch.arange(VOCAB)] * (DEPTH - 1))  # every prefix of DEPTH - 1 tokens
    with torch.no_grad():
        logits = hf(torch.cat([torch.tensor(DIST_PROMPT).expand(len(contexts), -1), contexts], 1)).logits
    logits = logits[:, len(DIST_PROMPT) - 1:].double().numpy()  # [V ** (DEPTH - 1), DEPTH, V]
    joint = np.ones(1)
    for depth in range(DEPTH):  # rows of equal prefixes share logits at `depth`: take every V ** (D-1-d)-th
        rows = logits[::VOCAB ** (DEPTH - 1 - depth), depth]
        step = np.stack([ref_probs(row, params) for row in rows])  # [V ** depth, V]
        joint = (joint[:, None] * step).ravel()
    return joint


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test of `counts` against `probs`; outcomes expected fewer than 5 times share one bin.
    A sample of a zero-probability outcome (outside top-k/top-p) rejects outright: p = 0."""
    if counts[probs == 0].any():
        return 0.0
    expected = probs * counts.sum()
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum()).astype(np.float64)
    expected = np.append(expected[big], expected[~big].sum())
    if expected[-1] < 5:  # too little to stand alone: fold the pooled bin into the least likely one
        least = np.argmin(expected[:-1])
        observed[least] += observed[-1]
        expected[least] += expected[-1]
        observed, expected = observed[:-1], expected[:-1]
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(observed) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(statistic / 2, dtype=torch.float64)))


@pytest.mark.parametrize("sampling,seeded", [
    (dict(temperature=1.0), False),  # the batch's shared generator
    (dict(temperature=0.8, top_k=10, top_p=0.9), True),  # each request its own generator
], ids=["temperature", "top_k_top_p_seeded"])
def test_a_sampling_drafter_keeps_the_target_distribution(tiny_pair, sampling, seeded):
    """The draft model samples its drafts, so their probabilities are stored, sliced per request,
    verified (accept with min(1, p/q), else a recovered token from max(p - q, 0)) and dropped, across
    steps in which requests of different lengths finish and others are preempted and recomputed."""
    hf, target, draft = tiny_pair
    m = check_first_tokens_follow_the_target(hf, target, {"method": "draft_model", "model": draft,
                                                          "num_speculative_tokens": 3}, sampling, seeded)
    assert m.num_accepted_tokens < 0.8 * m.num_draft_tokens  # rejections: recovered tokens


def check_first_tokens_follow_the_target(hf, target: str, spec: dict, sampling: dict, seeded: bool,
                                        every_position: bool = True):
    """NUM_SAMPLES requests with speculation `spec`, finishing at different steps, with preemption: their
    first DEPTH tokens pass a chi-square test against the exact target distribution at false-alarm rate
    ALPHA (seeds fixed: each run gives the same verdict), while the same counts reject a 25% hotter
    target, so the check is not vacuous. every_position: check that drafts at every position were accepted
    at times (chains; a tree's later nodes are siblings, not deeper positions). Returns the engine's metrics."""
    llm = LLM(model=target, max_model_len=64, block_size=4, num_kv_blocks=48, max_num_seqs=32, seed=0,
              speculative_config=dict(spec, adaptive_draft_length=False))
    max_tokens = [3, 5, 9, 14]  # requests finish at different steps while the others continue
    params = [SamplingParams(**sampling, max_tokens=max_tokens[i % 4], ignore_eos=True, seed=i if seeded else None)
              for i in range(NUM_SAMPLES)]
    outs = llm.generate([{"prompt_token_ids": DIST_PROMPT}] * NUM_SAMPLES, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    m = llm.get_metrics()
    assert m.num_preemptions > 0
    assert m.accepted_per_position[-1] > 0 or not every_position  # every position accepted at times
    firsts = np.array([o.outputs[0].token_ids[:DEPTH] for o in outs])  # [NUM_SAMPLES, DEPTH]
    counts = np.bincount(firsts @ VOCAB ** np.arange(DEPTH - 1, -1, -1), minlength=VOCAB ** DEPTH)
    base = SamplingParams(**sampling)
    p_value = chi_square_p_value(counts, exact_distribution(hf, base))
    assert p_value > ALPHA, f"the first {DEPTH} tokens are not distributed as the target's (p = {p_value:.2g})"
    wrong = dataclasses.replace(base, temperature=base.temperature * 1.25)
    p_value = chi_square_p_value(counts, exact_distribution(hf, wrong))
    assert p_value < ALPHA, f"the test cannot tell the target from a 25% hotter one (p = {p_value:.2g})"
    return m


def test_draft_probabilities_belong_to_their_drafts(tiny_pair, monkeypatch):
    """A model drafter's drafts (with q) are dropped by the scheduler in a step that verifies nothing; the
    drafts of that step come without q (as a lookup's or a grammar's do). Their verification must see q
    one-hot, never the old drafts' q."""
    _, target, draft = tiny_pair
    llm = LLM(model=target, speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
                                                "adaptive_draft_length": False}, max_model_len=128, block_size=8)
    engine = llm.llm_engine
    schedule, propose, verify = engine.scheduler.schedule, engine.runner.proposer.propose, engine.runner.rejection_sampler
    steps, seen = [], []

    def dropping_schedule():
        steps.append(None)
        if len(steps) == 4:  # the drafts of step 3 (with q) are dropped: nothing is verified in step 4
            for request in engine.scheduler.running:
                request.spec_token_ids = []
        return schedule()

    def proposing(inputs):
        drafts = propose(inputs)
        if len(steps) == 4:  # step 4's drafts come without probabilities, as a lookup's do
            drafts = dataclasses.replace(drafts, probs=None)
        return drafts

    def recording(spec, logits, meta, draft_probs=None):
        seen.append((len(steps), draft_probs))
        return verify(spec, logits, meta, draft_probs)

    monkeypatch.setattr(engine.scheduler, "schedule", dropping_schedule)
    monkeypatch.setattr(engine.runner.proposer, "propose", proposing)
    monkeypatch.setattr(engine.runner, "rejection_sampler", recording)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True,
                                                                     seed=0), use_tqdm=False)
    by_step = dict(seen)
    assert 4 not in by_step and by_step[3] is not None  # step 3 verified with q; step 4 verified nothing
    assert by_step[5] is None  # step 5 verifies step 4's drafts, which came without q
