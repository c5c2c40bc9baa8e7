"""How a model drafter turns its outputs into drafts: argmax for greedy requests, and for sampling requests
a sample from its own distribution q, shaped by the request's sampling parameters exactly as the target's
p is, so the rejection sampler can verify it losslessly."""
from __future__ import annotations

from typing import Callable

import torch

from specserve.ops.kernels import argmax_rows
from specserve.sample.metadata import SamplingMetadata
from specserve.sample.sampler import compute_probs, random_sample
from specserve.spec_decode.proposer import DraftInputs, Drafts


def draft_sampling_metadata(inputs: DraftInputs, rows: list[int], vocab_size: int) -> SamplingMetadata:
    """Sampling metadata of requests `rows` (indices into inputs.req_ids); no EOS handling for drafts."""
    return SamplingMetadata.build(
        params=[inputs.sampling_params[i] for i in rows],
        output_token_ids=[inputs.token_ids[i][inputs.num_prompt_tokens[i]:] for i in rows],
        prompt_token_ids=[inputs.token_ids[i][: inputs.num_prompt_tokens[i]] for i in rows],
        seeds=[inputs.seeds[i] for i in rows],
        eos_token_ids=set(),
        vocab_size=vocab_size,
    )


def draw(meta: SamplingMetadata, argmax: Callable[[], torch.Tensor], logits: Callable[[], torch.Tensor],
         allowed: torch.Tensor | None = None, step: int = 0) -> tuple[list[int], torch.Tensor | None]:
    """argmax() -> [rows] token ids; logits() -> [rows, vocab] over the target vocabulary; allowed: None, or
    [rows, vocab] bool (structured output: drafts only where the grammar allows, q renormalised there);
    step: the draft's index in its chain. A seeded row draws with the uniform the target will draw with at
    the same position, so the draft is the target's own draw wherever q is close to p.
    Returns the drafts and, unless every row is greedy, q [rows, vocab] (greedy rows one-hot)."""
    if allowed is None and meta.all_greedy:
        return argmax().tolist(), None
    scores = logits() if allowed is None else logits().masked_fill(~allowed, float("-inf"))
    if meta.all_greedy:
        return argmax_rows(scores).tolist(), None
    probs = compute_probs(scores, meta)
    return random_sample(probs, meta.seeded_uniforms(step)).tolist(), probs


def draft_chains(inputs: DraftInputs, rows: list[int], state: torch.Tensor,
                 draw_rows: Callable[[list[int], torch.Tensor, torch.Tensor | None, int],
                                     tuple[list[int], torch.Tensor | None]],
                 advance: Callable[[list[int], list[int], int], torch.Tensor]) -> Drafts:
    """Up to num_drafts[i] drafts for each request i in `rows`, one token a step.

    state: [len(rows), ...] what the first draft is drawn from (logits, or a head's hidden states);
    draw_rows(live, state, allowed, step) -> (one token per live row, q or None), allowed being None or the
    grammar's [len(live), vocab] mask after each row's drafts so far; advance(live, last tokens, step) -> the
    next state of the live rows, after feeding each its newest draft.
    """
    drafts: list[list[int]] = [[] for _ in inputs.req_ids]
    step_probs: dict[int, list[torch.Tensor]] = {i: [] for i in rows}
    live, step = rows, 0
    while live:
        tokens, p = draw_rows(live, state, _allowed(inputs, live, drafts), step)
        for j, i in enumerate(live):
            drafts[i].append(tokens[j])
            if p is not None:
                step_probs[i].append(p[j])
        live = [i for i in live if len(drafts[i]) < inputs.num_drafts[i]]
        if live:
            state = advance(live, [drafts[i][-1] for i in live], step)
        step += 1
    probs: list[torch.Tensor | None] = [None] * len(inputs.req_ids)
    for i in rows:
        if step_probs[i] and not inputs.sampling_params[i].is_greedy:
            probs[i] = torch.stack(step_probs[i])
    return Drafts(drafts, probs)


def _allowed(inputs: DraftInputs, live: list[int], drafts: list[list[int]]) -> torch.Tensor | None:
    """[len(live), vocab] bool: each live row's grammar mask after its drafts so far (all True for a row
    without one); None when no live row has a grammar."""
    if inputs.allowed_next is None:
        return None
    masks = [inputs.allowed_next(i, drafts[i]) for i in live]
    if all(m is None for m in masks):
        return None
    vocab = next(m for m in masks if m is not None).shape[0]
    return torch.stack([m if m is not None else torch.ones(vocab, dtype=torch.bool) for m in masks])
