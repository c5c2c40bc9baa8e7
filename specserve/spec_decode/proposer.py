"""The one drafting interface: `Proposer.propose(DraftInputs) -> Drafts`, and the factory.

Everything any method needs is in DraftInputs, so the runner never branches on the method's name;
`make_proposer` is the only place that knows the names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class DraftInputs:
    """Inputs for one drafting call, B = the requests that got tokens this step, in batch order."""

    req_ids: list[str]  # [B]
    sampled_token_ids: list[list[int]]  # [B] tokens accepted this step (1..n+1 each)
    next_token_ids: list[int]  # [B] last accepted token: the next input of each request
    token_ids: list[list[int]]  # [B] full history (prompt + outputs incl. this step's); do not mutate
    num_prompt_tokens: list[int]  # [B]
    num_drafts: list[int]  # [B] drafts wanted per request (0: none for this request)
    # Target states of the accepted tokens this step (rejected draft tails dropped), flattened; no rows
    # (and cu_num_tokens all 0) for a proposer whose `uses_target_states` attribute is False:
    target_token_ids: torch.Tensor  # [T]
    target_positions: torch.Tensor  # [T] or [3, T] (M-RoPE): exactly the positions the target saw
    target_hidden_states: torch.Tensor  # [T, hidden] final hidden states (before the LM head norm? no: after)
    aux_hidden_states: list[torch.Tensor] | None  # each [T, hidden], layers chosen by the drafter; else None
    cu_num_tokens: list[int]  # [B + 1] offsets of each request's rows in the target_* tensors
    sampling_params: list  # [B] SamplingParams
    generators: list[torch.Generator | None]  # [B] seeded requests' generators
    max_model_len: int
    finished_req_ids: set[str] = field(default_factory=set)  # forget their drafter state
    # Where the target's KV lives: per layer (k, v) [num_blocks, block_size, Hkv, D], and each request's
    # blocks; positions < len(token_ids[i]) - 1 hold verified KV. A drafter running the target's own
    # weights copies it instead of recomputing it.
    target_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    block_ids: list[list[int]] = field(default_factory=list)  # [B]


@dataclass
class Drafts:
    token_ids: list[list[int]]  # [B] 0..num_drafts[i] tokens each
    # [B] draft probabilities [n_i, vocab] of sampling drafters; None: drafts are deterministic (one-hot q).
    probs: list[torch.Tensor | None] | None = None


class Proposer(Protocol):
    # False for proposers that read token ids only: the runner then skips gathering hidden states
    uses_target_states: bool

    def propose(self, inputs: DraftInputs) -> Drafts: ...


def make_proposer(spec_config, target_model, runner_context: dict):
    """Build the proposer named by spec_config.method."""
    method = spec_config.method
    if method == "ngram":
        from specserve.spec_decode.ngram import NgramProposer

        return NgramProposer(spec_config)
    if method == "suffix":
        from specserve.spec_decode.suffix import SuffixProposer

        return SuffixProposer(spec_config)
    if method == "draft_model":
        from specserve.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(spec_config, target_model, runner_context)
    raise ValueError(f"speculative method {method!r} is not supported")
