"""SpecDecodeMetadata: where each request's drafts and verifying logits sit in the flattened batch."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SpecDecodeMetadata:
    draft_token_ids: torch.Tensor  # [T_d] all drafts, flattened in request order
    num_draft_tokens: list[int]  # [B] drafts per request (0 allowed)
    cu_num_draft_tokens: torch.Tensor  # [B] inclusive cumulative draft counts
    target_logits_indices: torch.Tensor  # [T_d] rows of `logits` that verify each draft
    bonus_logits_indices: torch.Tensor  # [B] row of `logits` giving each request's bonus token
    logits_indices: torch.Tensor  # [T_d + B] rows of the hidden states the LM head sees

    @property
    def max_spec_len(self) -> int:
        return max(self.num_draft_tokens, default=0)


def logits_indices(num_draft_tokens: list[int], cu_num_scheduled_tokens: list[int]) -> torch.Tensor:
    """Rows the LM head sees: a request with n drafts whose tokens end at cu_num_scheduled_tokens[i] needs
    its last n + 1 (logit j verifies draft j; the last gives the bonus token, or the next token)."""
    rows = []
    for n, end in zip(num_draft_tokens, cu_num_scheduled_tokens):
        rows.extend(range(end - n - 1, end))
    return torch.tensor(rows, dtype=torch.long)


def build_spec_decode_metadata(draft_token_ids: list[list[int]], cu_num_scheduled_tokens: list[int]
                               ) -> SpecDecodeMetadata:
    """Each request with n drafts needs logits at its last n + 1 tokens: logit j verifies draft j and the
    last one gives the bonus token. cu_num_scheduled_tokens[i] is the end of request i's tokens.
    """
    num_draft = [len(d) for d in draft_token_ids]
    target, bonus, first = [], [], 0
    for n in num_draft:
        target.extend(range(first, first + n))
        bonus.append(first + n)
        first += n + 1
    as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    cu = torch.tensor(num_draft, dtype=torch.long).cumsum(0) if num_draft else torch.zeros(0, dtype=torch.long)
    return SpecDecodeMetadata(
        draft_token_ids=as_long([t for d in draft_token_ids for t in d]),
        num_draft_tokens=num_draft,
        cu_num_draft_tokens=cu,
        target_logits_indices=as_long(target),
        bonus_logits_indices=as_long(bonus),
        logits_indices=logits_indices(num_draft, cu_num_scheduled_tokens),
    )
