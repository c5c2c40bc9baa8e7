"""Acceptance draws have float64 resolution. torch.rand's float32 draws lie on a 2^-24 grid (checked here), so a
draft with p/q far below 2^-24 would be accepted whenever the draw rounds down to 0: probability 2^-24 instead of
p/q. The test replaces torch's generator with one that returns a chosen quantile of U[0, 1), rounded down to the
grid of the dtype asked for, as torch's is, and compares each decision with the exact rule u < p/q. Seeded
requests do not use torch's generator at all: their draws are keyed by (seed, position)."""
import math

import pytest
import torch

from specserve.sample.metadata import SamplingMetadata
from specserve.sample.rejection_sampler import RejectionSampler
from specserve.sample.sampler import compute_probs
from specserve.sample.spec_metadata import build_spec_decode_metadata
from specserve.sample.tree_verify import trees_of, verify_tree_random
from specserve.sampling_params import SamplingParams

V = 10
DRAFT = 3


def grid_step(dtype: torch.dtype) -> float:
    """Spacing of torch.rand's values for dtype: 2^-24 for float32, 2^-53 for float64."""
    return torch.finfo(dtype).eps / 2


def test_torch_rand_lies_on_the_dtype_grid():
    for dtype in (torch.float32, torch.float64):
        scaled = torch.rand(100_000, dtype=dtype) / grid_step(dtype)
        assert torch.equal(scaled, scaled.floor())


def rand_at_quantile(quantile: float):
    """A torch.rand that returns `quantile` rounded down to the grid of the requested dtype."""
    def rand(*size, dtype=None, **_):
        if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
            size = tuple(size[0])
        dtype = dtype or torch.get_default_dtype()
        step = grid_step(dtype)
        return torch.full(size, math.floor(quantile / step) * step, dtype=dtype)
    return rand


def meta_for(params: SamplingParams) -> SamplingMetadata:
    return SamplingMetadata.build([params], [[]], [[1]], [params.seed], set(), V)


def tiny_ratio_logits() -> torch.Tensor:
    """[2, V]: the draft's target probability p is ~1e-13 on the row verifying it (q is one-hot: p/q = p)."""
    logits = torch.zeros(2, V)
    logits[0, DRAFT] = -30.0
    return logits


def chain_verify(logits, params):
    out = RejectionSampler()(build_spec_decode_metadata([[DRAFT]], [5]), logits, meta_for(params))
    return out.num_accepted[0] == 1, out.token_ids[0]


def tree_verify(logits, params):
    out = verify_tree_random(trees_of([[DRAFT]], [None]), logits, meta_for(params))
    return out.accepted[0] == [0], out.token_ids[0]


@pytest.mark.parametrize("verify", [chain_verify, tree_verify], ids=["chain", "tree"])
def test_a_tiny_ratio_is_accepted_exactly_when_u_is_below_it(verify, monkeypatch):
    logits = tiny_ratio_logits()
    ratio = compute_probs(logits[:1], meta_for(SamplingParams(temperature=1.0)))[0, DRAFT].item()
    assert 0 < ratio < 2.0 ** -40
    for quantile in (ratio * 1e3, ratio / 1e3, 2.0 ** -30, 0.5):
        monkeypatch.setattr(torch, "rand", rand_at_quantile(quantile))
        accepted, _ = verify(logits, SamplingParams(temperature=1.0))
        assert accepted == (quantile < ratio), quantile


@pytest.mark.parametrize("verify", [chain_verify, tree_verify], ids=["chain", "tree"])
def test_seeded_draws_ignore_torchs_generator(verify, monkeypatch):
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(0))
    for seed in range(20):
        params = SamplingParams(temperature=1.0, seed=seed)
        tokens = set()
        for quantile in (0.0, 0.3, 0.999):
            monkeypatch.setattr(torch, "rand", rand_at_quantile(quantile))
            tokens.add(tuple(verify(logits, params)[1]))
        assert len(tokens) == 1, seed
