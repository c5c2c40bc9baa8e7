"""Sampler, SamplingMetadata and penalties checked against independent numpy / Python references."""

import numpy as np
import pytest
import torch

from specserve.sample.keyed import keyed_uniforms, tree_levels
from specserve.sample.metadata import SamplingMetadata
from specserve.sample.sampler import (Sampler, apply_penalties_and_masks, compute_probs,
                                      random_sample, tree_sample)
from specserve.sampling_params import SamplingParams
from tests.sample.reference import ref_probs

V = 8
EOS = 7
# Distinct, well-separated logits so no top-k / top-p / min-p boundary is a near tie.
BASE_LOGITS = np.array([2.0, 1.4, 1.0, 0.3, 0.0, -0.6, -1.2, -2.0])


def build(params, outputs=None, prompts=None, eos=frozenset({EOS}), vocab=V):
    n = len(params)
    return SamplingMetadata.build(params, outputs or [[] for _ in range(n)],
                                  prompts or [[] for _ in range(n)], [p.seed for p in params],
                                  set(eos), vocab)


# ---- numpy references -------------------------------------------------------------------------

def ref_penalties(row: np.ndarray, p: SamplingParams, prompt, output) -> np.ndarray:
    out = row.astype(np.float64).copy()
    for t in set(prompt) | set(output):
        r = p.repetition_penalty
        out[t] = out[t] / r if out[t] > 0 else out[t] * r
    for t in set(output):
        out[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return out


def empirical(params: SamplingParams, num_draws: int = 20000, seed: int = 0) -> np.ndarray:
    """Token frequencies from one batch holding num_draws copies of BASE_LOGITS."""
    torch.manual_seed(seed)
    logits = torch.tensor(BASE_LOGITS, dtype=torch.float32).repeat(num_draws, 1)
    out = Sampler()(logits, build([params] * num_draws))
    return np.bincount(out.sampled_token_ids.numpy(), minlength=V) / num_draws


# ---- greedy ---------------------------------------------------------------------------------

def test_all_greedy_is_argmax_and_allocates_nothing():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(1))
    meta = build([SamplingParams(temperature=0)] * 5)
    assert meta.all_greedy and not meta.all_random
    unused = (meta.temperature, meta.greedy_mask, meta.top_k, meta.top_p, meta.min_p,
              meta.repetition_penalties, meta.output_ids_padded, meta.min_tokens_rows)
    assert all(t is None for t in unused) and meta.no_penalties and meta.max_num_logprobs is None
    out = Sampler()(logits, meta)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1)) and out.logprobs is None


def test_greedy_rows_in_a_random_batch_take_argmax():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.5, top_k=3)] * 3
    meta = build(params)
    assert meta.greedy_mask.tolist() == [True, False] * 3
    for _ in range(20):
        sampled = Sampler()(logits, meta).sampled_token_ids
        assert torch.equal(sampled[::2], logits[::2].argmax(-1))
    probs = compute_probs(logits, meta)
    assert torch.equal(probs[::2], torch.nn.functional.one_hot(logits[::2].argmax(-1), V).float())


# ---- penalties ------------------------------------------------------------------------------

def test_penalties_match_python_reference():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, V)).astype(np.float32) * 2
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(temperature=0),  # no penalties in a batch that has some
              SamplingParams(repetition_penalty=0.7),
              SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5)]
    prompts = [[0, 1, 1], [2], [3, 4, 5], []]
    outputs = [[1, 2, 2, 6], [3], [5, 6], [0, 0, 0, 4]]
    meta = build(params, outputs, prompts)
    raw = torch.tensor(logits)
    got = apply_penalties_and_masks(raw, meta).numpy()
    for i in range(4):
        np.testing.assert_allclose(got[i], ref_penalties(logits[i], params[i], prompts[i], outputs[i]),
                                   rtol=1e-6, atol=1e-6)
    assert torch.equal(raw, torch.tensor(logits)), "input logits must not be modified"


def test_greedy_uses_penalised_logits():
    logits = torch.tensor([[3.0, 2.9] + [0.0] * (V - 2)])
    meta = build([SamplingParams(temperature=0, repetition_penalty=2.0)], outputs=[[0]])
    assert Sampler()(logits, meta).sampled_token_ids.item() == 1


# ---- distributions ----------------------------------------------------------------------------

@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(temperature=0.6),
    SamplingParams(top_k=3),
    SamplingParams(top_p=0.5),
    SamplingParams(min_p=0.1),
    SamplingParams(temperature=1.4, top_k=6, top_p=0.85, min_p=0.05),
], ids=["plain", "temperature", "top_k", "top_p", "min_p", "combined"])
def test_empirical_distribution_matches_reference(params):
    ref = ref_probs(BASE_LOGITS, params)
    freq = empirical(params)
    assert np.all(freq[ref == 0] == 0), f"sampled outside the kept set: {freq} vs {ref}"
    assert 0.5 * np.abs(freq - ref).sum() < 0.02, f"{freq} vs {ref}"
    probs = compute_probs(torch.tensor(BASE_LOGITS, dtype=torch.float32)[None], build([params]))
    np.testing.assert_allclose(probs[0].numpy(), ref, atol=1e-6)


def test_mixed_parameters_per_row():
    params = [SamplingParams(top_k=2), SamplingParams(temperature=0.5, top_p=0.5), SamplingParams()]
    logits = torch.tensor(BASE_LOGITS, dtype=torch.float32).repeat(3, 1)
    probs = compute_probs(logits, build(params)).numpy()
    for row, p in zip(probs, params):
        np.testing.assert_allclose(row, ref_probs(BASE_LOGITS, p), atol=1e-6)


# ---- seeds ----------------------------------------------------------------------------------

def _seeded_run(batch_params, seeded_row, num_steps=6):
    """Tokens of `seeded_row` over num_steps, its output growing by one token a step."""
    logits = torch.randn(len(batch_params), 64)  # batch-mates' logits differ from run to run
    logits[seeded_row] = torch.randn(64, generator=torch.Generator().manual_seed(9))
    outputs = [[] for _ in batch_params]
    for _ in range(num_steps):
        meta = SamplingMetadata.build(batch_params, [list(o) for o in outputs], [[]] * len(batch_params),
                                      [p.seed for p in batch_params], {0}, 64)
        for row, token in enumerate(Sampler()(logits, meta).sampled_token_ids.tolist()):
            outputs[row].append(token)
    return outputs[seeded_row]


def test_seeded_row_ignores_batch_mates():
    mine = SamplingParams(temperature=1.0, seed=1234)
    alone = _seeded_run([mine], 0)
    others = [SamplingParams(), SamplingParams(seed=7, top_k=5), SamplingParams(temperature=0)]
    torch.manual_seed(0)
    assert _seeded_run(others[:2] + [mine] + others[2:], 2) == alone
    torch.manual_seed(1)
    assert _seeded_run([others[0], mine], 1) == alone
    assert len(set(alone)) > 1, "a seeded row should still vary from step to step"


def test_random_sample_seeded_rows_are_reproducible():
    probs = torch.full((3, 16), 1 / 16)
    draw = lambda: random_sample(probs, {1: keyed_uniforms(5, 0, 4)})[1].item()
    assert len({draw() for _ in range(5)}) == 1
    assert random_sample(probs, {0: [0.0] * 4, 2: [1.0 - 2 ** -53] * 4}).tolist()[::2] == [0, 15]


def test_tree_sample_follows_the_distribution_and_skips_empty_halves():
    """Exact: each token's frequency over many uniforms is its probability; tokens without mass never come."""
    probs = torch.tensor([[0.0, 0.1, 0.0, 0.4, 0.25, 0.0, 0.05, 0.2, 0.0, 0.0, 0.0]], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    n = 40000
    tokens = tree_sample(probs.cumsum(-1).expand(n, -1), torch.rand(n, tree_levels(11), dtype=torch.float64,
                                                                      generator=g))
    freq = torch.bincount(tokens, minlength=11).double() / n
    assert freq[probs[0] == 0].sum() == 0
    assert (freq - probs[0]).abs().max() < 4 * (0.25 / n) ** 0.5


def test_close_distributions_meet_under_the_same_keyed_uniforms():
    """Coupling by the token tree: two distributions 2% apart (relative noise per token) over 49k tokens give
    the same token far more often than one inverse-CDF uniform does, and close to the 1 - TV optimum."""
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(49152, generator=g, dtype=torch.float64) * 2, -1)
    q = p * (1 + 0.02 * torch.randn(49152, generator=g, dtype=torch.float64))
    q = q / q.sum()
    tv = 0.5 * float((p - q).abs().sum())
    n, levels = 2000, tree_levels(49152)
    u = torch.rand(n, levels, dtype=torch.float64, generator=g)
    same_tree = (tree_sample(p.cumsum(-1).expand(n, -1), u) == tree_sample(q.cumsum(-1).expand(n, -1), u))
    one = u[:, :1].contiguous()
    same_cdf = torch.searchsorted(p.cumsum(-1), one) == torch.searchsorted(q.cumsum(-1), one)
    assert same_tree.double().mean() > 1 - 3 * tv and same_tree.double().mean() > same_cdf.double().mean() + 0.1
    one_hot = torch.nn.functional.one_hot(torch.tensor([3, 0, 15]), 16).float()
    assert random_sample(one_hot, {}).tolist() == [3, 0, 15]


# ---- min_tokens ------------------------------------------------------------------------------

def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.zeros(3, V)
    logits[:, EOS] = 10.0
    logits[:, 5] = 9.0
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5])
    meta = build([p, p, p.clone()], outputs=[[1], [1, 2, 3], [1, 2]])
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [0, EOS, 0]
    random_p = SamplingParams(min_tokens=2, ignore_eos=True)
    probs = compute_probs(logits[:1], build([random_p], outputs=[[1]]))
    assert probs[0, EOS] == 0 and probs[0, 5] > 0.9


# ---- logprobs --------------------------------------------------------------------------------

def test_logprobs_come_from_raw_logits_with_ranks():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(logprobs=3, temperature=0.3, repetition_penalty=1.8),
              SamplingParams(logprobs=0, temperature=0), SamplingParams(), SamplingParams(top_k=2)]
    out = Sampler()(logits, build(params, outputs=[[0, 1, 2]] * 4))
    lp = out.logprobs
    raw = torch.log_softmax(logits, -1)
    assert lp.token_ids.shape == (4, 4) and lp.logprobs.shape == (4, 4)
    assert torch.equal(lp.token_ids[:, 0], out.sampled_token_ids)
    torch.testing.assert_close(lp.logprobs, raw.gather(1, lp.token_ids))
    for i in range(4):
        order = np.argsort(-raw[i].numpy())
        assert lp.token_ids[i, 1:].tolist() == order[:3].tolist()
        assert lp.ranks[i].item() == order.tolist().index(out.sampled_token_ids[i].item()) + 1


# ---- speculative verification ---------------------------------------------------------------

def test_expand_for_verification_histories_and_rows():
    params = [SamplingParams(repetition_penalty=1.5, min_tokens=3, seed=11),
              SamplingParams(temperature=0, frequency_penalty=0.5)]
    outputs, prompts = [[4, 5], [6]], [[1], [2, 3]]
    meta = build(params, outputs, prompts)
    drafts = [[1, 2, 3], []]
    ex = meta.expand_for_verification(drafts)
    assert ex.num_rows == 5 and ex.num_rows_per_request == [4, 1]
    assert ex.output_token_ids == [[4, 5], [4, 5, 1], [4, 5, 1, 2], [4, 5, 1, 2, 3], [6]]
    assert ex.prompt_token_ids == [[1]] * 4 + [[2, 3]]
    assert ex.seeds == {0: 11, 1: 11, 2: 11, 3: 11}
    # row j of a request sits at output position len(output) + j: its keyed uniform is that position's
    assert ex.seeded_uniforms() == {r: keyed_uniforms(11, 2 + r, tree_levels(V)) for r in range(4)}
    assert ex.min_tokens_rows.tolist() == [0], "only row 0 has fewer than 3 outputs"
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(4))
    got = apply_penalties_and_masks(logits, ex)
    for r, (i, out) in enumerate(zip([0, 0, 0, 0, 1], ex.output_token_ids)):
        ref = ref_penalties(logits[r].numpy(), params[i], prompts[i], out)
        if r == 0:
            ref[EOS] = -np.inf
        np.testing.assert_allclose(got[r].numpy(), ref, rtol=1e-6)


def test_expand_rejects_wrong_number_of_requests():
    with pytest.raises(ValueError, match="need drafts for 1 requests, got 2"):
        build([SamplingParams()]).expand_for_verification([[1], [2]])


def test_logits_shape_must_match_metadata():
    with pytest.raises(ValueError, match="logits must have shape"):
        Sampler()(torch.zeros(2, V + 1), build([SamplingParams()] * 2))


def test_top_p_keeps_the_top_token_when_p_underflows_or_logits_overflow():
    from specserve.sample.sampler import _apply_top_k_top_p

    logits = torch.randn(2, 4096)
    logits[1, 7] = float("inf")
    out = _apply_top_k_top_p(logits, None, torch.tensor([5e-324, 0.5]))
    assert torch.isfinite(out[0]).sum() >= 1 and out[0].argmax() == logits[0].argmax()
