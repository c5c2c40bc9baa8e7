"""Turns one logits row per request into one token: penalties, temperature, min-p, top-k, top-p, draw.

Logprobs follow vLLM: log_softmax of the raw logits, before any penalty or temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

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


class Sampler:
    """Samples one token per logits row as described by a SamplingMetadata."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [B, V] raw model logits; greedy rows take the argmax of the penalised logits."""
        _check_shape(logits, meta)
        penalised = apply_penalties_and_masks(logits, meta)  # [B, V]
        if meta.all_greedy:
            sampled = argmax_rows(penalised)
        else:
            # Greedy rows come out one-hot, so the race returns their argmax too.
            sampled = random_sample(_probs_from_penalised(penalised, meta), meta.seeded_uniforms())
        logprobs = None
        if meta.max_num_logprobs is not None:
            logprobs = gather_logprobs(logits, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def apply_penalties_and_masks(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """[B, V] logits after min_tokens masking and repetition/presence/frequency penalties.

    Returns the input untouched when nothing applies, else a new f32 tensor (the input is never modified).
    """
    if meta.no_penalties and meta.min_tokens_rows is None:
        return logits
    logits = logits.to(torch.float32, copy=True)
    if meta.min_tokens_rows is not None:
        logits[meta.min_tokens_rows, meta.min_tokens_token_ids] = _NEG_INF
    if not meta.no_penalties:
        logits = _apply_penalties(logits, meta)
    return logits


def compute_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """[B, V] f32: the exact distribution the Sampler draws each row from, given raw [B, V] logits.

    Greedy rows are one-hot at the argmax of their penalised logits.
    """
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


def _probs_from_penalised(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """[B, V] f32 probabilities from penalised logits: temperature, min-p, top-k/top-p, softmax.

    min-p comes before top-k/top-p, in vLLM's order; greedy rows become one-hot.
    """
    logits = logits.float()
    argmax = logits.argmax(dim=-1) if not meta.all_random else None  # [B]
    if meta.temperature is not None:
        logits = logits / meta.temperature[:, None]
    if meta.min_p is not None:
        logits = _apply_min_p(logits, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        logits = _apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    probs = logits.softmax(dim=-1)
    if argmax is not None:
        one_hot = torch.zeros_like(probs).scatter_(1, argmax[:, None], 1.0)
        probs = one_hot if meta.greedy_mask is None else torch.where(meta.greedy_mask[:, None],
                                                                     one_hot, probs)
    return probs


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p [B] times the row's top probability."""
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]  # [B, 1]
    return logits.masked_fill(probs < threshold, _NEG_INF)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                       top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep the k most likely tokens (k [B], ties at the k-th kept), then the smallest set of
    them holding probability >= p [B].

    A partial top-C selection usually suffices (C = 1024 << V); the full sort is the fallback when
    some row's kept set may reach past the candidates.
    """
    vocab = logits.shape[-1]
    num_candidates = _TOP_CANDIDATES if top_k is None else max(_TOP_CANDIDATES, int(top_k.max()))
    if num_candidates < vocab:
        out = _top_k_top_p_partial(logits, top_k, top_p, num_candidates)
        if out is not None:
            return out
    return _top_k_top_p_sorted(logits, top_k, top_p)


def _top_k_top_p_partial(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                         num_candidates: int) -> torch.Tensor | None:
    """Thresholds from the top num_candidates logits per row; None if a row needs more candidates."""
    values = logits.topk(num_candidates, dim=-1).values  # [B, C] descending
    if top_k is not None:
        kth = values.gather(1, (top_k - 1).clamp(0, num_candidates - 1)[:, None])  # [B, 1]
        logits = logits.masked_fill(logits < kth, _NEG_INF)
        values = values.masked_fill(values < kth, _NEG_INF)
    if top_p is None:
        return logits
    probs = (values - logits.logsumexp(dim=-1, keepdim=True)).exp()  # [B, C], of the full distribution
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above each candidate
    if bool((mass_before[:, -1] < top_p).any()):
        return None  # the kept set may extend past the candidates
    # The most likely token always stays (also when p underflows to 0 or the logits hold inf/NaN).
    last_kept = ((mass_before < top_p[:, None]).sum(dim=-1, keepdim=True) - 1).clamp_(min=0)  # [B, 1]
    threshold = values.gather(1, last_kept)
    return logits.masked_fill(logits < threshold, _NEG_INF)


def _top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor | None,
                        top_p: torch.Tensor | None) -> torch.Tensor:
    """The reference: one full sort per row serves both filters."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending, [B, V]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(0, vocab - 1)[:, None])  # [B, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V], mass from the bottom up
        drop = cum <= 1 - top_p[:, None]
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)