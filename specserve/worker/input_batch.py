"""The runner's per-step and per-request records: what it remembers of a request between steps, one step's
flattened inputs, and what a step hands back to the engine."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.models.qwen2_vl import MRopePositions
from specserve.ops.attention import AttentionMetadata, build_attention_metadata
from specserve.sample.spec_metadata import SpecDecodeMetadata
from specserve.types import RequestFailure


def positions_at(positions: torch.Tensor, index: torch.Tensor | slice) -> torch.Tensor:
    """The one accessor for positions: [N] → [T] and [3, N] → [3, T], always on the token axis."""
    return positions[..., index]


def with_image_positions(positions: torch.Tensor, image_positions: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """positions [3, N] with the columns of requests whose prompts hold images replaced by their own
    M-RoPE positions: (first column, [3, n])."""
    if not image_positions:
        return positions
    positions = positions.clone()
    for first, rows in image_positions:
        positions[:, first:first + rows.shape[1]] = rows
    return positions


@dataclass
class CachedRequestState:
    """What the runner remembers of a request between steps (tokens exclude drafts)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: object
    block_ids: list[int]
    num_computed_tokens: int
    seed: int | None  # a seeded request's draws are keyed by (seed, position): sample/keyed.py
    token_ids: list[int] = field(default_factory=list)
    mm_features: list = field(default_factory=list)  # types.MultiModalFeature per image of the prompt
    mrope: MRopePositions | None = None  # M-RoPE positions of a prompt with images (None: the index)
    encoder_outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # image → [length, hidden], until prefilled
    # the sliding-window layers' own block table (HybridKVCacheManager), None when every layer reads block_ids
    window_block_ids: list[int] | None = None

    def __post_init__(self) -> None:
        self.token_ids = self.prompt_token_ids + self.output_token_ids

    def append(self, tokens: list[int]) -> None:
        self.output_token_ids.extend(tokens)
        self.token_ids.extend(tokens)


@dataclass
class StepRows:
    """One step's rows as prepare_inputs gathers them request by request, and the attention sequences over
    them (one per request, or one per draft tree path)."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # token indices (M-RoPE rows go in image_positions)
    slots: list[int] = field(default_factory=list)  # per row, where its K/V is written
    image_positions: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    image_rows: list[int] = field(default_factory=list)
    image_embeds: list[torch.Tensor] = field(default_factory=list)
    window_slots: list[int] = field(default_factory=list)  # the windowed layers' own pool (hybrid models)
    window_tables: list[list[int]] = field(default_factory=list)
    extra_writes: list[tuple[int, int]] = field(default_factory=list)  # (row, slot): a tree row's other paths
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (block, scratch block) before the step
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    starts: list[int] = field(default_factory=lambda: [0])  # per request, its first row

    def add_sequence(self, query_len: int, context_len: int, table: list[int]) -> None:
        self.query_lens.append(query_len)
        self.context_lens.append(context_len)
        self.tables.append(table)

    def attention(self, block_size: int, use_kernel: bool, windows: tuple[int, ...]) -> AttentionMetadata:
        """The step's attention metadata; `windows`: the windows of the layers with tables of their own."""
        slot_mapping = torch.tensor(self.slots + [slot for _, slot in self.extra_writes], dtype=torch.long)
        attn = build_attention_metadata(self.query_lens, self.context_lens, self.tables, block_size, slot_mapping,
                                        use_kernel)
        if self.extra_writes:
            attn.slot_rows = torch.tensor(list(range(len(self.slots))) + [row for row, _ in self.extra_writes],
                                          dtype=torch.long)
        if self.window_tables:  # the sliding-window layers' own tables
            window = build_attention_metadata(self.query_lens, self.context_lens, self.window_tables, block_size,
                                              torch.tensor(self.window_slots, dtype=torch.long), use_kernel)
            attn.window_groups.update(dict.fromkeys(windows, window))
        return attn


@dataclass
class InputBatch:
    """One step's flattened inputs. Requests appear in `req_ids` order; `sample_req_ids` subset samples."""

    req_ids: list[str]
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N] (or [3, N] under M-RoPE)
    mm_embeds: tuple[torch.Tensor, torch.Tensor] | None  # (rows [R], image embeddings [R, hidden]) or None
    attn: AttentionMetadata
    query_start_loc: list[int]  # [B + 1]
    logits_indices: torch.Tensor  # [M] rows of hidden states the LM head sees
    sample_req_ids: list[str]  # requests that get tokens this step (prompt complete)
    draft_token_ids: list[list[int]]  # [len(sample_req_ids)] drafts verified this step (may be empty)
    spec_decode_metadata: SpecDecodeMetadata | None  # None when no request verifies drafts
    # [len(sample_req_ids)] each request's draft tree (None: its drafts are a chain); None when all are chains
    draft_trees: list | None = None


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    sampled_token_ids: dict[str, list[int]]  # empty list for a partial prefill
    spec_token_ids: dict[str, list[int]] | None
    logprobs: dict[str, list[dict]] = field(default_factory=dict)  # per output token: {id: (logprob, rank)}
    draft_source_names: dict[str, str] = field(default_factory=dict)  # the drafter of each of spec_token_ids
    # requests that failed alone this step (their tokens are meaningless): the engine ends them with the error
    failed: dict[str, RequestFailure] = field(default_factory=dict)
