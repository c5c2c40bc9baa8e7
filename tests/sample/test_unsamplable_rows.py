"""Rows where nothing can be drawn under the request's own rules. A row whose only allowed tokens are the stop tokens
min_tokens holds back (a grammar that has ended allows EOS alone) emits the stop: it wins over min_tokens. A row
whose logits become NaN or +inf (extreme penalties) is that request's error, reported for it alone, while the
batch-mates get the tokens they get without it. References: the only allowed token; each batch-mate sampled or
verified alone."""
import pytest
import torch

from specserve.sample.metadata import SamplingMetadata
from specserve.sample.rejection_sampler import RejectionSampler
from specserve.sample.sampler import InvalidLogitsError, Sampler
from specserve.sample.spec_metadata import build_spec_decode_metadata
from specserve.sampling_params import SamplingParams

V = 64
EOS = 2
GREEDY = SamplingParams(temperature=0.0, min_tokens=5)
RANDOM = SamplingParams(temperature=1.0, min_tokens=5)
SEEDED = SamplingParams(temperature=0.8, min_tokens=5, seed=11)


def build(params, outputs=None, prompts=None):
    n = len(params)
    return SamplingMetadata.build(params, outputs or [[] for _ in range(n)], prompts or [[1] for _ in range(n)],
                                  [p.seed for p in params], {EOS}, V)


def only_eos_allowed(num_rows: int = 1) -> torch.Tensor:
    """[num_rows, V] logits as an ended grammar's mask leaves them: EOS alone is finite."""
    logits = torch.full((num_rows, V), float("-inf"))
    logits[:, EOS] = 0.5
    return logits


def verify(drafts, logits, params, outputs=None, prompts=None):
    ends = torch.tensor([len(d) + 4 for d in drafts]).cumsum(0).tolist()
    return RejectionSampler()(build_spec_decode_metadata(drafts, ends), logits, build(params, outputs, prompts))


def random_logits(num_rows: int, seed: int) -> torch.Tensor:
    return torch.randn(num_rows, V, generator=torch.Generator().manual_seed(seed)) * 3


# ---- the stop wins over min_tokens when it is all that is allowed --------------------------------

@pytest.mark.parametrize("params", [GREEDY, RANDOM, SEEDED], ids=["greedy", "random", "seeded"])
def test_eos_is_drawn_where_it_is_the_only_allowed_token(params):
    others = random_logits(2, 0)
    logits = torch.cat([only_eos_allowed(), others])
    out = Sampler()(logits, build([params, params, params]))
    assert out.sampled_token_ids[0].item() == EOS and not out.errors
    assert EOS not in out.sampled_token_ids[1:].tolist()  # min_tokens still holds EOS back where others are allowed


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_eos_drafts_are_verified_where_eos_is_the_only_allowed_token(params):
    out = verify([[EOS, EOS]], only_eos_allowed(3), [params])
    assert out.token_ids == [[EOS, EOS, EOS]] and not out.errors


# ---- NaN / inf logits are the request's error --------------------------------------------------

def extreme(base: SamplingParams, kind: str) -> SamplingParams:
    """Penalties that make the prompt tokens' logits non-finite: a repetition penalty of 1e-40 divides a positive
    logit into +inf; an infinite one multiplies a zero logit into NaN."""
    penalty = {"inf": 1e-40, "nan": float("inf")}[kind]
    return SamplingParams(temperature=base.temperature, seed=base.seed, repetition_penalty=penalty)


def poisoned_logits(seed: int) -> torch.Tensor:
    """[1, V] logits whose prompt tokens (1 and 3) sit at +4 and 0."""
    logits = random_logits(1, seed)
    logits[0, 1], logits[0, 3] = 4.0, 0.0
    return logits


MATES = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=5)]


@pytest.mark.parametrize("kind", ["inf", "nan"])
@pytest.mark.parametrize("base", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3),
                                  SamplingParams(temperature=0.7)], ids=["greedy", "seeded", "random"])
def test_non_finite_logits_fail_their_row_alone(kind, base):
    mates = random_logits(len(MATES), 1)
    prompts = [[1, 3]] + [[1]] * len(MATES)
    out = Sampler()(torch.cat([poisoned_logits(0), mates]), build([extreme(base, kind)] + MATES, prompts=prompts))
    assert list(out.errors) == [0] and isinstance(out.errors[0], InvalidLogitsError)
    assert "repetition_penalty" in str(out.errors[0])
    alone = Sampler()(mates, build(MATES, prompts=prompts[1:]))
    assert out.sampled_token_ids[1:].tolist() == alone.sampled_token_ids.tolist()


def test_all_greedy_batches_report_non_finite_rows_too():
    out = Sampler()(torch.cat([poisoned_logits(0), random_logits(1, 1)]),
                    build([extreme(SamplingParams(temperature=0.0), "nan"), SamplingParams(temperature=0.0)],
                          prompts=[[1, 3], [1]]))
    assert list(out.errors) == [0]


@pytest.mark.parametrize("base", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3)],
                         ids=["greedy", "seeded"])
def test_verification_fails_the_request_with_non_finite_logits_alone(base):
    bad = torch.cat([poisoned_logits(0), poisoned_logits(1)])  # its draft row and its bonus row
    mates = random_logits(3, 2)  # the mates' drafts [7, 8]: two draft rows and a bonus row
    params = [extreme(base, "nan"), SamplingParams(temperature=0.9, seed=5)]
    out = verify([[5], [7, 8]], torch.cat([bad, mates]), params, prompts=[[1, 3], [1]])
    assert list(out.errors) == [0] and isinstance(out.errors[0], InvalidLogitsError)
    alone = verify([[7, 8]], mates, params[1:], prompts=[[1]])
    assert out.token_ids[1] == alone.token_ids[0] and not alone.errors


def test_a_non_finite_row_past_a_rejected_draft_decides_nothing():
    """Row 1 sees draft 3 in its history, and its NaN comes from the penalty on that draft: plain decoding never
    feeds the rejected draft, so the request is not failed for it."""
    params = [SamplingParams(temperature=0.0, repetition_penalty=float("inf"))]
    logits = random_logits(2, 4)
    logits[:, 1] = -1.0  # the prompt token: negative, so the infinite penalty makes it -inf, not NaN
    logits[0, 9] = 50.0  # row 0's argmax is 9, so draft 3 is rejected there
    logits[1, 3] = 0.0  # 0 * inf = NaN on row 1, which only a history holding 3 penalises
    out = verify([[3]], logits, params, prompts=[[1]])
    assert out.token_ids == [[9]] and not out.errors
    accepted = verify([[9]], logits, params, prompts=[[1]])  # the same row 1 after an accepted draft 9: fine
    assert accepted.token_ids[0][0] == 9 and not accepted.errors
