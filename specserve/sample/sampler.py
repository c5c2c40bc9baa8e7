"""Turns one logits row per request into one token: penalties, temperature, min-p, top-k, top-p, draw.

Logprobs follow vLLM: log_softmax of the raw logits, before any penalty or temperature.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.sample.metadata import SamplingMetadata
from specserve.ops.kernels import argmax_rows

_TOP_CANDIDATES = 1024  # partial selection size for top-k / top-p
_NEG_INF = float("-inf")


@dataclass
class LogprobsTensors:
    """Top logprobs per row; column 0 is the sampled token, columns 1.. the top-n tokens."""

    token_ids: torch.Tensor  # [B, 1 + n] int64
    logprobs: torch.Tensor  # [B, 1 + n] f32
    ranks: torch.Tensor  # [B] int64, rank of the sampled token (1 = most likely)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None
    errors: dict[int, Exception] = field(default_factory=dict)  # row -> why nothing could be drawn there


class Sampler:
    """Samples one token per logits row as described by a SamplingMetadata."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [B, V] raw model logits; greedy rows take the argmax of the penalised logits."""
        _check_shape(logits, meta)
        penalised = apply_penalties_and_masks(logits, meta)  # [B, V]
        if meta.all_greedy:
            sampled, invalid = argmax_rows(penalised), invalid_rows(penalised)
        else:
            # Greedy rows come out one-hot, so the race returns their argmax too.
            probs, invalid = _probs_from_penalised(penalised, meta)
            sampled = random_sample(probs, meta.seeded_uniforms())
        logprobs = None
        if meta.max_num_logprobs is not None:
            logprobs = gather_logprobs(logits, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs,
                             errors=invalid_logits_errors(invalid, meta.params))


class InvalidLogitsError(ValueError):
    """A row's logits hold NaN or +inf, or forbid every token, after its penalties and temperature."""


def invalid_rows(logits: torch.Tensor) -> torch.Tensor:
    """[B] bool: rows of logits [B, V] that no token can be drawn from: a NaN or +inf logit (softmax gives NaN),
    or every logit -inf. One max per row: it is NaN, +inf or -inf exactly then."""
    return ~torch.isfinite(logits.amax(dim=-1))


def invalid_logits_errors(invalid: torch.Tensor, params: list, report_as: list[int] | None = None
                          ) -> dict[int, Exception]:
    """{index: InvalidLogitsError} for the rows flagged in invalid [B] bool, row r sampled with params[r] and
    reported under report_as[r] (default r itself)."""
    if not bool(invalid.any()):
        return {}
    errors = {}
    for row in invalid.nonzero().flatten().tolist():
        p = params[row]
        errors.setdefault(row if report_as is None else report_as[row], InvalidLogitsError(
            f"the logits hold NaN or infinity, or allow no token, after penalties and temperature "
            f"(repetition_penalty={p.repetition_penalty}, frequency_penalty={p.frequency_penalty}, "
            f"presence_penalty={p.presence_penalty}, temperature={p.temperature}): nothing can be sampled"))
    return errors


def apply_penalties_and_masks(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """[B, V] logits after min_tokens masking and repetition/presence/frequency penalties.

    Returns the input untouched when nothing applies, else a new f32 tensor (the input is never modified).
    """
    if meta.no_penalties and meta.min_tokens_rows is None:
        return logits
    logits = logits.to(torch.float32, copy=True)
    if meta.min_tokens_rows is not None:
        _mask_min_tokens(logits, meta.min_tokens_rows, meta.min_tokens_token_ids)
    if not meta.no_penalties:
        logits = _apply_penalties(logits, meta)
    return logits


def _mask_min_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
    """In place on logits [B, V]: logits[rows[k], token_ids[k]] = -inf (EOS and stop ids before min_tokens),
    except on a row where those are the only tokens allowed (a grammar that has ended allows EOS alone): the
    stop wins there, since no other token may follow."""
    banned = logits[rows, token_ids]  # [K]
    logits[rows, token_ids] = _NEG_INF
    candidates = rows.unique()
    emptied = candidates[torch.isneginf(logits[candidates]).all(dim=-1)]
    if len(emptied):
        yields = torch.isin(rows, emptied)
        logits[rows[yields], token_ids[yields]] = banned[yields]


def compute_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """[B, V] f32: the exact distribution the Sampler draws each row from, given raw [B, V] logits.

    Greedy rows are one-hot at the argmax of their penalised logits.
    """
    return target_probs(logits, meta)[0]


def target_probs(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, invalid): `compute_probs`'s [B, V] and [B] bool flagging the rows nothing can be drawn from (see
    `invalid_rows`), whose probs are meaningless."""
    _check_shape(logits, meta)
    return _probs_from_penalised(apply_penalties_and_masks(logits, meta), meta)


def random_sample(probs: torch.Tensor, keyed: dict[int, list[float]]) -> torch.Tensor:
    """One token per row of probs [B, V] (unnormalised is fine): inverse-CDF sampling with one uniform from
    torch's generator (one draw per row instead of V: an exponential race over 49k tokens costs ~100x more),
    except for the rows in `keyed` (seeded requests), which descend the token tree with their own
    uniforms (`tree_sample`), so their tokens depend on nothing else.
    """
    num_rows = probs.shape[0]
    cdf = probs.double().cumsum(dim=-1)  # [B, V]; float64 so 49k additions keep their precision
    u = torch.rand(num_rows, dtype=torch.float64)
    target = (u * cdf[:, -1]).unsqueeze(1)  # [B, 1], strictly below each row's total mass
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
    if keyed:
        rows = torch.tensor(list(keyed), dtype=torch.int64)
        tokens[rows] = tree_sample(cdf[rows], torch.tensor(list(keyed.values()), dtype=torch.float64))
    return tokens


def tree_sample(cdf: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[R] tokens from cdf [R, V] (cumulative masses in token-id order) by descending the binary tree over
    token ids: at level l, go to the left half of the current range when uniforms[:, l] * its mass < the left
    half's mass. Exact, with independent uniforms [R, L] (L >= log2 V). Two close distributions with the same
    uniforms part only where a half's conditional mass differs across u, so a drafter's draw with these
    uniforms meets the target's far more often than one inverse-CDF uniform over 49k accumulated masses."""
    num_rows, vocab = cdf.shape
    below = torch.cat([torch.zeros(num_rows, 1, dtype=cdf.dtype), cdf], dim=1)  # [R, V + 1]: mass before id i
    lo = torch.zeros(num_rows, dtype=torch.int64)
    hi = torch.full((num_rows,), vocab, dtype=torch.int64)
    for level in range(uniforms.shape[1]):
        mid = (lo + hi) // 2
        base = below.gather(1, lo[:, None]).squeeze(1)
        left = below.gather(1, mid[:, None]).squeeze(1) - base
        total = below.gather(1, hi[:, None]).squeeze(1) - base
        go_left = uniforms[:, level] * total < left  # a half without mass is never entered
        lo, hi = torch.where(go_left, lo, mid), torch.where(go_left, mid, hi)
    return lo


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Logprob and rank of token_ids [B] plus the top-num_logprobs tokens, from raw logits [B, V].

    Rank counts tokens at least as likely as the chosen one (ties share the worse rank), as in vLLM.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    token_ids = token_ids.long()
    chosen = logprobs.gather(1, token_ids[:, None])  # [B, 1]
    ranks = (logprobs >= chosen).sum(dim=-1)  # [B]
    top_lp, top_ids = logprobs.topk(min(num_logprobs, logprobs.shape[-1]), dim=-1)  # [B, n]
    return LogprobsTensors(
        token_ids=torch.cat([token_ids[:, None], top_ids], dim=1),
        logprobs=torch.cat([chosen, top_lp], dim=1),
        ranks=ranks,
    )


def _check_shape(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    if tuple(logits.shape) != (meta.num_rows, meta.vocab_size):
        raise ValueError(f"logits must have shape ({meta.num_rows}, {meta.vocab_size}) "
                         f"to match the sampling metadata, got {tuple(logits.shape)}")


def _bin_counts(ids_padded: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] int64 occurrence counts of ids_padded [B, L] (padding value vocab_size is dropped)."""
    counts = torch.zeros(ids_padded.shape[0], vocab_size + 1, dtype=torch.int64)
    counts.scatter_add_(1, ids_padded, torch.ones_like(ids_padded))
    return counts[:, :vocab_size]


def _apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition over prompt + output (divide positive logits, multiply negative); presence and
    frequency over output only. logits: [B, V] f32."""
    vocab = meta.vocab_size
    out_counts = _bin_counts(meta.output_ids_padded, vocab)  # [B, V]
    seen = (_bin_counts(meta.prompt_ids_padded, vocab) > 0) | (out_counts > 0)
    rep = torch.where(seen, meta.repetition_penalties[:, None], 1.0)  # [B, V]
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits -= meta.frequency_penalties[:, None] * out_counts
    logits -= meta.presence_penalties[:, None] * (out_counts > 0)
    return logits


def _probs_from_penalised(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, V] f32 probabilities, [B] bool invalid rows) from penalised logits: temperature, min-p,
    top-k/top-p, softmax.

    min-p comes before top-k/top-p, in vLLM's order; greedy rows become one-hot. Rows are checked after the
    temperature (greedy rows keep 1.0), which can overflow logits that penalties made huge.
    """
    logits = logits.float()
    top = logits.amax(dim=-1)  # [B]: NaN, +inf or -inf exactly on the rows nothing can be drawn from
    argmax = logits.argmax(dim=-1) if not meta.all_random else None  # [B]
    if meta.temperature is not None:
        logits = logits / meta.temperature[:, None]
        top = top / meta.temperature
    invalid = ~torch.isfinite(top)
    if meta.min_p is not None:
        logits = _apply_min_p(logits, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        logits = _apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    probs = logits.softmax(dim=-1)
    if not meta.all_random:
        one_hot = torch.zeros_like(probs).scatter_(1, argmax[:, None], 1.0)
        probs = one_hot if meta.greedy_mask is None else torch.where(meta.greedy_mask[:, None],
                                                                     one_hot, probs)
    return probs, invalid


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p [B] times the row's top probability."""
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]  # [B, 1]
    return logits.masked_fill(probs < threshold, _NEG_INF)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                       top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep the k most likely tokens (k [B]), then the smallest set of them holding probability >= p [B];
    for both, every token tied with the least likely kept one stays too. Deciding by value, never by the order
    a sort leaves equal logits in, makes the kept set a function of the row alone, whatever the batch.

    Thresholds come from the top C = 1024 logits per row (C << V) when every row's kept set lies within them,
    else from all V: the same numbers either way (the candidates are a prefix of the full descending order).
    """
    vocab = logits.shape[-1]
    limited_k = top_k[top_k < vocab] if top_k is not None else torch.empty(0, dtype=torch.int64)  # rows with a k
    num_candidates = max(_TOP_CANDIDATES, int(limited_k.max()) if len(limited_k) else 0)
    if num_candidates < vocab:
        out = _mask_below_thresholds(logits, top_k, top_p, num_candidates)
        if out is not None:
            return out
    return _mask_below_thresholds(logits, top_k, top_p, vocab)


def _mask_below_thresholds(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                           num_candidates: int) -> torch.Tensor | None:
    """logits [B, V] with -inf below each row's top-k and top-p thresholds, found among the top num_candidates
    logits per row; None if some row's top-p set may extend past them. Rows with k = V or p = 1 keep all."""
    vocab = logits.shape[-1]
    values = logits.topk(num_candidates, dim=-1).values  # [B, C] descending
    if top_k is not None:
        kth = values.gather(1, (top_k - 1).clamp(0, num_candidates - 1)[:, None])  # [B, 1]
        kth = kth.masked_fill((top_k >= vocab)[:, None], _NEG_INF)
        logits = logits.masked_fill(logits < kth, _NEG_INF)
        values = values.masked_fill(values < kth, _NEG_INF)
    if top_p is None:
        return logits
    limited = top_p < 1.0  # [B]
    probs = (values - logits.logsumexp(dim=-1, keepdim=True)).exp()  # [B, C], of the top-k distribution
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above each candidate
    if num_candidates < vocab and bool((limited & (mass_before[:, -1] < top_p)).any()):
        return None  # the kept set may extend past the candidates
    # The most likely token always stays (also when p underflows to 0 or the logits hold inf/NaN).
    last_kept = ((mass_before < top_p[:, None]).sum(dim=-1, keepdim=True) - 1).clamp_(min=0)  # [B, 1]
    threshold = values.gather(1, last_kept).masked_fill(~limited[:, None], _NEG_INF)
    return logits.masked_fill(logits < threshold, _NEG_INF)
