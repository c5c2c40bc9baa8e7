"""Verifies draft tokens against the target model's logits, so speculation never changes what is sampled.

Speculative sampling from Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding" (arXiv 2211.17192). For a request with drafts d_0..d_{n-1} the target model gives n + 1
logits rows: row j verifies d_j, row n gives the bonus token. p_j is the Sampler's own distribution at
row j (`compute_probs` with history output + d_0..d_{j-1}, so penalties and min_tokens stay exact); q_j is
the drafter's distribution, one-hot at d_j when the drafter reports no probabilities.

- accepted: draft d_j kept with probability min(1, p_j(d_j) / q_j(d_j)); greedy rows keep it iff it is
  the argmax of the penalised logits. Verification stops at the first draft not accepted.
- recovered: the token emitted at the first rejected position j, drawn from normalize(max(p_j - q_j, 0))
  (from p_j when that is all zero, i.e. p_j == q_j); greedy rows emit the argmax.
- bonus: the token emitted after all n drafts are accepted, drawn from p_n (greedy: its argmax).
Each request emits its accepted drafts plus one recovered or bonus token: 1 to n + 1 tokens, each
distributed exactly as the target alone would sample it (the paper's Theorem 1).

Seeded requests are verified by coupling instead: the target's own draw at each output position, the
`tree_sample` of p_j with the uniforms keyed by (seed, position), is what the Sampler would emit there, and a
draft is accepted exactly when it equals that draw; the first draw that differs, or the bonus
draw, is emitted. A fixed draft d is then accepted with probability p_j(d), as with q one-hot above, and the
tokens are the ones plain decoding emits with the same seed, whatever the drafter, its drafts or the batch
(a model drafter draws its drafts from the same uniforms, so a good one still agrees often).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.sample.metadata import SamplingMetadata
from specserve.ops.kernels import argmax_rows
from specserve.sample.sampler import (LogprobsTensors, apply_penalties_and_masks, gather_logprobs,
                                      invalid_logits_errors, invalid_rows, random_sample, target_probs)
from specserve.sample.spec_metadata import SpecDecodeMetadata


@dataclass
class RejectionOutput:
    token_ids: list[list[int]]  # per request: accepted drafts + one recovered or bonus token
    logprobs: LogprobsTensors | None  # one row per emitted token, requests in order
    num_accepted: list[int]  # per request: how many drafts were accepted
    # request -> why nothing could be drawn at one of its emitting rows (its tokens are then meaningless)
    errors: dict[int, Exception] = field(default_factory=dict)


@dataclass(frozen=True)
class _Layout:
    """Request-major rows: request i owns rows row_starts[i] .. row_starts[i] + n_i (the last is bonus)."""

    num_drafts: torch.Tensor  # [B] int64
    draft_starts: torch.Tensor  # [B] int64, request i's first draft in the flattened drafts
    row_starts: torch.Tensor  # [B] int64, request i's first row (draft_starts[i] + i)
    draft_req: torch.Tensor  # [T_d] int64, request of each draft
    draft_pos: torch.Tensor  # [T_d] int64, position of each draft within its request
    draft_rows: torch.Tensor  # [T_d] int64, row verifying each draft

    @classmethod
    def of(cls, spec: SpecDecodeMetadata) -> _Layout:
        num_drafts = torch.tensor(spec.num_draft_tokens, dtype=torch.int64)
        draft_starts = num_drafts.cumsum(0) - num_drafts
        draft_req = _segment_of(num_drafts)
        draft_pos = torch.arange(len(draft_req)) - draft_starts[draft_req]
        return cls(num_drafts, draft_starts, draft_starts + torch.arange(len(num_drafts)),
                   draft_req, draft_pos, torch.arange(len(draft_req)) + draft_req)


class RejectionSampler:
    """Accepts or rejects each request's drafts and emits one more token, for greedy and random rows."""

    def __call__(self, spec: SpecDecodeMetadata, logits: torch.Tensor, meta: SamplingMetadata,
                 draft_probs: list[torch.Tensor | None] | None = None) -> RejectionOutput:
        """logits: [T_d + B, V] raw target logits, row r at spec.logits_indices[r]; meta: one row per
        request (not expanded); draft_probs: per request [n_i, V] or None (q one-hot at the draft)."""
        _check_inputs(spec, logits, meta, draft_probs)
        if meta.argmax_only:
            return verify_argmax_targets(spec, argmax_rows(logits))
        layout = _Layout.of(spec)
        if not _is_request_major(spec, layout):
            logits = logits[_request_major_order(spec, layout)]
        drafts = spec.draft_token_ids.long()  # [T_d]
        per_request = _split(drafts.tolist(), spec.num_draft_tokens)
        expanded = meta.expand_for_verification(per_request)
        if expanded.all_greedy:
            num_accepted, final, invalid = _verify_greedy(logits, expanded, drafts, layout)
        else:
            num_accepted, final, invalid = _verify_random(logits, expanded, drafts, draft_probs, layout)
        accepted = num_accepted.tolist()
        token_ids = [d[:a] + [t] for d, a, t in zip(per_request, accepted, final.tolist())]
        logprobs = None
        if meta.max_num_logprobs is not None:
            rows = _emitting_rows(layout.row_starts, num_accepted)  # [sum(a_i + 1)]
            emitted = torch.tensor([t for toks in token_ids for t in toks], dtype=torch.int64)
            logprobs = gather_logprobs(logits[rows], emitted, meta.max_num_logprobs)
        return RejectionOutput(token_ids=token_ids, logprobs=logprobs, num_accepted=accepted,
                               errors=_emitting_row_errors(invalid, num_accepted, layout, expanded))


def verify_argmax_targets(spec: SpecDecodeMetadata, targets: torch.Tensor) -> RejectionOutput:
    """Verification when every row's target token is the argmax of its raw logits (SamplingMetadata's
    `argmax_only`: greedy, no penalties or min_tokens, no logprobs). targets: [T_d + B] int64, the argmax
    of each logits row. One scan of the drafts, without expanding the sampling metadata per position
    (the general path's ~0.4 ms) or needing the logits themselves."""
    target = targets.tolist()  # [T_d + B]
    drafts = spec.draft_token_ids.tolist()
    draft_rows, bonus_rows = spec.target_logits_indices.tolist(), spec.bonus_logits_indices.tolist()
    token_ids, accepted, start = [], [], 0
    for n, bonus_row in zip(spec.num_draft_tokens, bonus_rows):
        a = 0
        while a < n and drafts[start + a] == target[draft_rows[start + a]]:
            a += 1
        token_ids.append(drafts[start:start + a] + [target[draft_rows[start + a]] if a < n else target[bonus_row]])
        accepted.append(a)
        start += n
    return RejectionOutput(token_ids=token_ids, logprobs=None, num_accepted=accepted)


def _verify_greedy(logits: torch.Tensor, expanded: SamplingMetadata, drafts: torch.Tensor,
                   layout: _Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(num_accepted [B], final token [B], invalid rows [T_d + B] bool): accept while the draft is the argmax,
    then emit the argmax.

    Argmax of the penalised logits only, exactly what the Sampler picks; no softmax.
    """
    penalised = apply_penalties_and_masks(logits, expanded)  # [T_d + B, V]
    target = argmax_rows(penalised)  # [T_d + B]
    num_accepted = _count_accepted(drafts == target[layout.draft_rows], layout)
    return num_accepted, target[layout.row_starts + num_accepted], invalid_rows(penalised)


def _verify_random(logits: torch.Tensor, expanded: SamplingMetadata, drafts: torch.Tensor,
                   draft_probs: list[torch.Tensor | None] | None,
                   layout: _Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(num_accepted [B], final token [B], invalid rows [T_d + B] bool) by speculative sampling, and by
    coupling for seeded requests.

    Greedy rows need no special case: their p is one-hot at the argmax, so a draft is accepted iff it
    is the argmax, and the recovered and bonus draws both return the argmax.
    """
    probs, invalid = target_probs(logits, expanded)  # [T_d + B, V], [T_d + B]
    p_draft = probs[layout.draft_rows, drafts]  # [T_d]
    q_draft = _q_at_drafts(draft_probs, drafts, layout.num_drafts.tolist())  # [T_d]
    # u < p/q, written without the division: q(d) >= p(d) accepts with probability p/q, q(d) < p(d)
    # always accepts, and p(d) == 0 (a draft outside top-k/top-p) never does. The uniforms are float64:
    # float32 ones lie on a 2^-24 grid, so any p/q below 2^-24 would still be accepted with probability 2^-24.
    accept = torch.rand(len(drafts), dtype=torch.float64) * q_draft.double() < p_draft.double()  # [T_d]
    seeded_draw = _seeded_draws(probs, expanded)  # [T_d + B], -1 on rows of unseeded requests
    at_draft = seeded_draw[layout.draft_rows]
    accept = torch.where(at_draft >= 0, drafts == at_draft, accept)
    num_accepted = _count_accepted(accept, layout)
    final_rows = layout.row_starts + num_accepted  # [B], the bonus row unless a draft was rejected
    final_dist = probs[final_rows]  # [B, V]
    _turn_into_recovery(final_dist, num_accepted, layout, drafts, draft_probs)
    final = random_sample(final_dist, {})
    return num_accepted, torch.where(seeded_draw[final_rows] >= 0, seeded_draw[final_rows], final), invalid


def _emitting_row_errors(invalid: torch.Tensor, num_accepted: torch.Tensor, layout: _Layout,
                         expanded: SamplingMetadata) -> dict[int, Exception]:
    """{request: error} for the requests with an invalid row (invalid: [T_d + B] bool) among the rows they emit
    from. Rows past a rejection saw a rejected draft, which plain decoding never feeds the model, so they decide
    nothing."""
    if not bool(invalid.any()):
        return {}
    rows = _emitting_rows(layout.row_starts, num_accepted)  # [sum(a_i + 1)]
    row_request = _segment_of(layout.num_drafts + 1)  # [T_d + B]
    emitting = torch.zeros_like(invalid)
    emitting[rows] = True
    return invalid_logits_errors(invalid & emitting, expanded.params, row_request.tolist())


def _seeded_draws(probs: torch.Tensor, expanded: SamplingMetadata) -> torch.Tensor:
    """[rows] int64: on each seeded row the token the Sampler draws there (its keyed uniform), else -1."""
    draws = torch.full((probs.shape[0],), -1, dtype=torch.int64)
    uniforms = expanded.seeded_uniforms()
    if uniforms:
        rows = torch.tensor(list(uniforms), dtype=torch.int64)
        draws[rows] = random_sample(probs[rows], dict(enumerate(uniforms.values())))
    return draws


def _q_at_drafts(draft_probs: list[torch.Tensor | None] | None, drafts: torch.Tensor,
                 num_drafts: list[int]) -> torch.Tensor:
    """[T_d] f32 q(d) of each draft d; 1 where the drafter gave no probabilities (q one-hot)."""
    if draft_probs is None:
        return torch.ones(len(drafts))
    return torch.cat([torch.ones(len(d)) if q is None else q.gather(1, d[:, None]).squeeze(1).float()
                      for q, d in zip(draft_probs, drafts.split(num_drafts))])


def _turn_into_recovery(final_dist: torch.Tensor, num_accepted: torch.Tensor, layout: _Layout,
                        drafts: torch.Tensor, draft_probs: list[torch.Tensor | None] | None) -> None:
    """In place, the rows of final_dist [B, V] (p at the next position) of requests that rejected a
    draft become max(p - q, 0) at that draft. Left unnormalised: random_sample scales by each row's total mass."""
    rejected = (num_accepted < layout.num_drafts).nonzero().squeeze(1)  # [R] requests
    if not len(rejected):
        return
    rejected_draft = layout.draft_starts[rejected] + num_accepted[rejected]  # [R] index into drafts
    has_q = torch.tensor([draft_probs is not None and draft_probs[i] is not None
                          for i in rejected.tolist()], dtype=torch.bool)  # [R]
    # q one-hot at d: max(p - q, 0) is p with p[d] = 0. It has mass left, since rejecting d needs p(d) < 1.
    final_dist[rejected[~has_q], drafts[rejected_draft[~has_q]]] = 0.0
    if has_q.any():
        rows = rejected[has_q]
        q = torch.stack([draft_probs[i][j] for i, j in
                         zip(rows.tolist(), num_accepted[rows].tolist())]).float()  # [R_q, V]
        p = final_dist[rows]
        residual = (p - q).clamp_min(0.0)
        # All zero only when p == q up to rounding; p itself is then the right law.
        final_dist[rows] = torch.where((residual.sum(dim=-1) > 0)[:, None], residual, p)


def _count_accepted(accept: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """[B] int64: length of each request's leading run of accepted drafts, accept: [T_d] bool."""
    num_requests = len(layout.num_drafts)
    width = int(layout.num_drafts.max()) if num_requests else 0
    grid = torch.zeros(num_requests, width, dtype=torch.int64)  # positions past n_i stay 0
    grid[layout.draft_req, layout.draft_pos] = accept.long()
    return grid.cumprod(dim=1).sum(dim=1)


def _emitting_rows(row_starts: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """Row of each emitted token: request i emits from rows row_starts[i] .. row_starts[i] + a_i."""
    counts = num_accepted + 1  # [B]
    request = _segment_of(counts)  # [sum(counts)]
    offsets = torch.arange(len(request)) - (counts.cumsum(0) - counts)[request]
    return row_starts[request] + offsets


def _segment_of(lengths: torch.Tensor) -> torch.Tensor:
    """[sum(lengths)] int64: which segment each position of back-to-back segments of `lengths` [B] is in.

    Equals torch.repeat_interleave(arange(B), lengths), which went through the thread pool and cost
    milliseconds even for tiny inputs on a busy CPU.
    """
    ends = lengths.cumsum(0)
    return torch.searchsorted(ends, torch.arange(int(ends[-1]) if len(ends) else 0), right=True)


def _request_major_order(spec: SpecDecodeMetadata, layout: _Layout) -> torch.Tensor:
    """[T_d + B] logits row for each request-major row (request i's draft rows, then its bonus row)."""
    order = torch.empty(len(spec.logits_indices), dtype=torch.int64)
    order[layout.draft_rows] = spec.target_logits_indices.long()
    order[layout.row_starts + layout.num_drafts] = spec.bonus_logits_indices.long()
    return order


def _is_request_major(spec: SpecDecodeMetadata, layout: _Layout) -> bool:
    """True when logits rows are already request-major (as build_spec_decode_metadata lays them out)."""
    total = len(spec.logits_indices)
    return (torch.equal(spec.target_logits_indices.long(), layout.draft_rows)
            and torch.equal(spec.bonus_logits_indices.long(), layout.row_starts + layout.num_drafts)
            and total == len(layout.draft_rows) + len(layout.num_drafts))


def _split(flat: list[int], counts: list[int]) -> list[list[int]]:
    out, start = [], 0
    for n in counts:
        out.append(flat[start:start + n])
        start += n
    return out


def _check_inputs(spec: SpecDecodeMetadata, logits: torch.Tensor, meta: SamplingMetadata,
                  draft_probs: list[torch.Tensor | None] | None) -> None:
    num_requests, num_drafts = len(spec.num_draft_tokens), sum(spec.num_draft_tokens)
    if meta.num_rows != num_requests or meta.num_rows_per_request is not None:
        raise ValueError(f"meta must be the unexpanded metadata with one row per request "
                         f"({num_requests}), got {meta.num_rows} rows")
    if len(spec.draft_token_ids) != num_drafts:
        raise ValueError(f"spec holds {len(spec.draft_token_ids)} draft ids but counts sum to {num_drafts}")
    if num_drafts and not 0 <= int(spec.draft_token_ids.min()) <= int(spec.draft_token_ids.max()) \
            < meta.vocab_size:
        raise ValueError(f"draft token ids must lie in [0, {meta.vocab_size}), got "
                         f"{spec.draft_token_ids.min().item()}..{spec.draft_token_ids.max().item()}")
    if tuple(logits.shape) != (num_drafts + num_requests, meta.vocab_size):
        raise ValueError(f"logits must have shape ({num_drafts + num_requests}, {meta.vocab_size}) "
                         f"(drafts + requests, vocab), got {tuple(logits.shape)}")
    if draft_probs is None:
        return
    if len(draft_probs) != num_requests:
        raise ValueError(f"draft_probs needs one entry per request ({num_requests}), got {len(draft_probs)}")
    for i, (probs, n) in enumerate(zip(draft_probs, spec.num_draft_tokens)):
        if probs is not None and tuple(probs.shape) != (n, meta.vocab_size):
            raise ValueError(f"draft_probs[{i}] must have shape ({n}, {meta.vocab_size}) or be None, "
                             f"got {tuple(probs.shape)}")
