"""Ties at the top-k / top-p edge are decided by value, the same way whichever selection path the batch takes (the
1024-candidate partial selection, or all V when a batch-mate needs more), so a row's distribution, and a seeded
request's tokens, do not depend on its batch-mates (ARCHITECTURE.md invariant 5)."""
import numpy as np
import pytest
import torch

from specserve.sample.metadata import SamplingMetadata
from specserve.sample.sampler import Sampler, compute_probs
from specserve.sampling_params import SamplingParams
from tests.sample.reference import ref_probs

V = 2048  # more than the 1024 candidates, so a row alone takes the partial selection
TOP, TIED = 40, [10, 20, 30]


def tied_logits() -> torch.Tensor:
    """[V]: token TOP with probability 0.4 and TIED with 0.2 each, the rest negligible. With top_p = 0.75 the
    smallest set reaching p ends inside the tie (mass before the tied tokens: 0.4, 0.6, 0.8)."""
    logits = torch.full((V,), -40.0)
    logits[TOP] = float(np.log(0.4))
    logits[TIED] = float(np.log(0.2))
    return logits


def batch_mates() -> dict[str, list[SamplingParams]]:
    flat = SamplingParams(temperature=1.0, top_p=0.999)  # on flat logits its kept set spans all V
    return {
        "alone": [],
        "top_k=5": [SamplingParams(temperature=1.0, top_k=5)],
        "full sort": [flat],
        "top_k=1500": [SamplingParams(temperature=1.0, top_k=1500)],  # more candidates than 1024
        "both": [SamplingParams(temperature=1.0, top_k=5), flat],
    }


def probs_in_batch(mine: SamplingParams, mates: list[SamplingParams], seed: int | None = None):
    params = [mine] + mates
    logits = torch.zeros(len(params), V)  # batch-mates see flat logits
    logits[0] = tied_logits()
    meta = SamplingMetadata.build(params, [[]] * len(params), [[1]] * len(params),
                                  [seed] + [None] * len(mates), set(), V)
    return compute_probs(logits, meta)[0], Sampler()(logits, meta).sampled_token_ids[0].item()


@pytest.mark.parametrize("mine", [SamplingParams(temperature=1.0, top_p=0.75),
                                  SamplingParams(temperature=1.0, top_k=2, top_p=0.75),
                                  SamplingParams(temperature=1.0, top_k=3)],
                         ids=["top_p", "top_k+top_p", "top_k"])
def test_tied_tokens_are_kept_the_same_way_whatever_the_batch(mine):
    expected = ref_probs(tied_logits().numpy(), mine)
    assert set(np.flatnonzero(expected)) == {TOP, *TIED}  # the reference keeps every tied token
    alone = probs_in_batch(mine, [])[0]
    for name, mates in batch_mates().items():
        probs = probs_in_batch(mine, mates)[0]
        assert torch.equal(probs, alone), name
        np.testing.assert_allclose(probs.numpy(), expected, atol=1e-6, err_msg=name)


def test_a_seeded_request_draws_the_same_tokens_whatever_the_batch():
    mine = SamplingParams(temperature=1.0, top_p=0.75)
    for seed in range(40):
        draws = {name: probs_in_batch(mine, mates, seed)[1] for name, mates in batch_mates().items()}
        assert len(set(draws.values())) == 1, (seed, draws)
