"""The drafting contract: what a drafter declares it needs, `Proposer.propose(DraftInputs) -> Drafts`, and
the factory.

A drafter declares what it reads (`DrafterNeeds`); the runner provides exactly that in one DraftInputs and
never asks a drafter who it is. `make_proposer` is the only place that knows the method names.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from specserve.ops.kv_cache import row_bytes
from specserve.spec_decode.policy import DraftOption

if TYPE_CHECKING:
    from specserve.spec_decode.drafter_kv import DrafterKVCache


class TargetStates(enum.Enum):
    """Which of the target's final hidden states a drafter reads."""

    NONE = "none"  # token ids only (prompt lookup, suffix trees, a draft model)
    ACCEPTED = "accepted"  # states of the tokens accepted this step by requests that sample (Medusa)
    ALL = "all"  # states of every processed token, partial prompt chunks included (EAGLE builds its KV)


@dataclass(frozen=True)
class KVCacheSpec:
    """A paged KV cache's layers and their shape (the target's, or a drafter's in blocks that follow the
    target's block tables)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32  # the caches' storage (torch.int8: int8 rows with scales, ops/kv_cache.py)
    compute_dtype: torch.dtype = torch.float32  # the queries' (the C kernel attends fp32 ones)

    def bytes_per_block(self, block_size: int) -> int:
        return 2 * self.num_layers * block_size * self.num_kv_heads * row_bytes(self.head_dim, self.dtype)


@dataclass(frozen=True)
class DrafterNeeds:
    target_states: TargetStates = TargetStates.NONE
    # Target layers whose inputs (the residual stream entering layer i) the drafter reads, in this order.
    aux_layers: tuple[int, ...] = ()
    kv: KVCacheSpec | None = None  # the drafter's own paged KV, from the engine's memory budget
    # KV slots written ahead of the verified history (a drafter that feeds its k - 1 drafts back to itself).
    num_lookahead_tokens: int = 0
    reads_target_kv: bool = False  # copies the target's verified KV (a self-draft)
    # Drafting time per draft token in target steps, until measured: what the policy prices a first draft at.
    drafting_cost: float = 0.0
    # The drafters a combined proposer (auto) chooses between per request, in the order of
    # Drafts.sources; empty for a proposer that drafts one way.
    options: tuple[DraftOption, ...] = ()


_EMPTY = torch.zeros(0, dtype=torch.long)


@dataclass
class DraftInputs:
    """Inputs for one drafting call. B = the requests that got tokens this step, in batch order; R = the
    requests whose target states are given (B for ACCEPTED; every request of the step for ALL)."""

    req_ids: list[str]  # [B]
    sampled_token_ids: list[list[int]]  # [B] tokens accepted this step (1..n+1 each)
    next_token_ids: list[int]  # [B] last accepted token: the next input of each request
    token_ids: list[list[int]]  # [B] full history (prompt + outputs incl. this step's); do not mutate
    num_prompt_tokens: list[int]  # [B]
    # [B] drafts wanted per request (0: none for this request); history + drafts + the bonus token already
    # fit in max_model_len.
    num_drafts: list[int]
    sampling_params: list  # [B] SamplingParams
    seeds: list[int | None]  # [B] seeded requests' seeds (their draws: sample.keyed.keyed_uniform)
    max_model_len: int
    # Target states of the processed tokens (rejected draft tails dropped), flattened over R requests;
    # empty for a drafter that declares TargetStates.NONE:
    target_req_ids: list[str] = field(default_factory=list)  # [R]
    target_start: list[int] = field(default_factory=list)  # [R] token index of each request's first row
    cu_num_tokens: list[int] = field(default_factory=lambda: [0])  # [R + 1] offsets of the rows
    # [R] the token after each request's last row: its newest sampled token, or for a partial prompt
    # chunk the next prompt token.
    target_next_token_ids: list[int] = field(default_factory=list)
    target_token_ids: torch.Tensor = _EMPTY  # [T]
    target_positions: torch.Tensor = _EMPTY  # [T] or [3, T] (M-RoPE): exactly the positions the target saw
    target_hidden_states: torch.Tensor | None = None  # [T, hidden] final (post-norm) hidden states
    aux_hidden_states: list[torch.Tensor] | None = None  # each [T, hidden], the declared aux layers' inputs
    # [B] or [3, B]: the position of each request's next input token; draft step j is at + j (the rule
    # the target uses for text).
    next_positions: torch.Tensor = _EMPTY
    finished_req_ids: set[str] = field(default_factory=set)  # finished requests: forget their state
    # every request of the step's blocks, for a drafter that keeps KV (its slots follow the target's)
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    drafter_kv: DrafterKVCache | None = None  # the drafter's own KV, when it declares one
    # The target's per-layer (k, v) caches, for a drafter that reads the target's KV; positions
    # < len(token_ids[i]) - 1 hold verified KV.
    target_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # [B] for a proposer with options: [(option, number of drafts)], best first; num_drafts[i] is the
    # first entry's count (0 for an empty plan).
    draft_plans: list[list[tuple[int, int]]] = field(default_factory=list)
    # [B] (empty when no request has images) each request's M-RoPE positions when its prompt has images
    # (models.qwen2_vl.MRopePositions), else None: see positions().
    mrope_positions: list = field(default_factory=list)
    # Structured output: allowed_next(i, drafts so far) -> [vocab] bool, the tokens request i's grammar
    # allows after its history and those drafts, or None for a request without one (None: no request has).
    allowed_next: Callable[[int, list[int]], torch.Tensor | None] | None = None
    # Draft trees (speculative_config.draft_tree): None for chains only; else tree_costs(option, n) -> cost(k)
    # for k = 0..n drafts of that option in plain steps (drafting and verifying), which a tree drafter sizes
    # its trees by (spec_decode/tree.py best_size), up to max_tree_nodes nodes.
    tree_costs: Callable[[int, int], list[float]] | None = None
    max_tree_nodes: int = 0
    # A static tree shape (spec_decode/tree.py parse_token_tree) to draft instead of sized trees, or None.
    tree_shape: tuple[tuple[int, ...], ...] | None = None

    def asking(self, num_drafts: list[int]) -> DraftInputs:
        """The same inputs asking for other draft counts (no plans): a shallow copy that shares the rest."""
        copy = object.__new__(DraftInputs)
        copy.__dict__.update(self.__dict__)
        copy.num_drafts, copy.draft_plans = num_drafts, []
        return copy

    def wants_tree(self, i: int) -> bool:
        """Whether request i may get a draft tree: trees are on (tree_costs), its grammar (if any) checks chains
        only, and its SamplingParams do not ask for chains."""
        return (self.tree_costs is not None and getattr(self.sampling_params[i], "draft_tree", None) != "chain"
                and (self.allowed_next is None or self.allowed_next(i, []) is None))

    def positions(self, i: int, start: int, end: int, mrope: bool) -> torch.Tensor:
        """Positions of request i's token indices start..end-1 (history, then drafts) as the target would
        place them: [n] indices, or with mrope [3, n] (a prompt's images, then index + delta)."""
        if not mrope:
            return torch.arange(start, end)
        request = self.mrope_positions[i] if self.mrope_positions else None
        return request.range(start, end) if request is not None else torch.arange(start, end).expand(3, -1)


@dataclass
class Drafts:
    token_ids: list[list[int]]  # [B] 0..num_drafts[i] tokens each
    # [B] draft probabilities [n_i, vocab] of sampling drafters; None: drafts are deterministic (one-hot q).
    probs: list[torch.Tensor | None] | None = None
    # A proposer with options: [B] the option that drafted each request (None: no drafts), and
    # [(option, draft tokens, seconds)] of each option's work this call.
    sources: list[int | None] | None = None
    timings: list[tuple[int, int, float]] | None = None
    # (request, option, drafts, accepted) of drafts an option made but did not submit, scored against the
    # tokens the request emitted after them: acceptance the policy learns as if they had been verified.
    shadow_records: list[tuple[str, int, int, int]] | None = None
    # [B] a request's drafts as a tree (token_ids[i] == trees[i].tokens), None for a chain; None: all chains
    trees: list | None = None


class Proposer(Protocol):
    needs: DrafterNeeds

    def propose(self, inputs: DraftInputs) -> Drafts: ...


@dataclass(frozen=True)
class TargetInfo:
    """What a drafter may know of the target when it is built."""

    model: object  # the target model (its config, embeddings, LM head, rotary rule)
    dtype: torch.dtype
    weight_dtype: object
    max_model_len: int
    # how the target multiplies GGUF blocks it keeps (EngineConfig.gguf_compute: "int8", "q8" or "fp32"); None when
    # its weights are tensors
    gguf_compute: str | None = None
    kv_dtype: torch.dtype = torch.float32  # how the target's KV cache stores K/V; a drafter's own KV follows it


def make_proposer(spec_config, target: TargetInfo) -> Proposer:
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

        return DraftModelProposer(spec_config, target)
    if method in ("eagle", "eagle3"):
        from specserve.spec_decode.eagle import EagleProposer

        return EagleProposer(spec_config, target)
    if method == "medusa":
        from specserve.spec_decode.medusa import MedusaProposer

        return MedusaProposer(spec_config, target)
    if method == "auto":
        from specserve.spec_decode.auto import AutoProposer

        return AutoProposer(spec_config, target)
    raise ValueError(f"speculative method {method!r} is not supported")
