"""Paged attention on CPU over a flattened batch whose requests have queries of any length.

Every request in a step contributes `query_len` consecutive tokens at absolute positions
`[context_len - query_len, context_len)` and attends causally to its whole context in the paged cache.
Short queries (decode, 1 + k verification) are padded into one batched SDPA call; long queries
(prefill chunks) run one request at a time. Per layer: write the step's K/V into the cache first, then
attend, so a request may read blocks another request fills in the same step (prefix-cache hits).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Queries up to this length are batched together with padding; longer ones run alone.
MAX_BATCHED_QUERY_LEN = 16
# A new length bucket starts past first_len * GROWTH + SLACK tokens of context.
BUCKET_GROWTH, BUCKET_SLACK = 1.5, 64


@dataclass
class BatchedGroup:
    """Requests with short queries, padded to [B, Q] queries over [B, L] cached keys."""

    token_index: torch.Tensor  # [B, Q] flattened-batch token index (padding repeats a valid index)
    valid_index: torch.Tensor  # [T_g] positions in token_index.view(-1) that are real queries
    out_index: torch.Tensor  # [T_g] flattened-batch token index of each real query
    kv_slots: torch.Tensor  # [B, L] cache slots of each request's context (padding: slot 0)
    mask: torch.Tensor | None  # [B, 1, Q, L] bool, True = may attend; None when nothing is masked


@dataclass
class PrefillChunk:
    """One request with a long query; attends to `kv_slots` (None: no cached context, causal only)."""

    start: int  # first flattened-batch token index
    end: int
    kv_slots: torch.Tensor | None  # [context_len]
    mask: torch.Tensor | None  # [Q, context_len] bool, None when kv_slots is None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot each new token's K/V is written to
    num_tokens: int
    batched: list[BatchedGroup]  # short queries, bucketed by context length
    prefills: list[PrefillChunk]


def build_attention_metadata(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                             block_size: int, slot_mapping: torch.Tensor) -> AttentionMetadata:
    """context_lens[i] counts the request's tokens including this step's query."""
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    small = [i for i, q in enumerate(query_lens) if q <= MAX_BATCHED_QUERY_LEN]
    large = [i for i, q in enumerate(query_lens) if q > MAX_BATCHED_QUERY_LEN]
    batched = [_build_batched(rows, starts, query_lens, context_lens, block_tables, block_size)
               for rows in _length_buckets(small, context_lens)]
    prefills = [_build_prefill(i, starts, query_lens, context_lens, block_tables, block_size) for i in large]
    return AttentionMetadata(slot_mapping, starts[-1], batched, prefills)


def _length_buckets(rows: list[int], context_lens: list[int]) -> list[list[int]]:
    """Group rows of similar context length, so padding to the longest in a group wastes at most ~half.

    Padding every decode to the batch's longest context made a 32-request step gather 4x the keys it
    needed (Spec-Bench prompts of 30 to 950 tokens).
    """
    buckets: list[list[int]] = []
    first_len = 0
    for i in sorted(rows, key=context_lens.__getitem__):
        if not buckets or context_lens[i] > first_len * BUCKET_GROWTH + BUCKET_SLACK:
            buckets.append([])
            first_len = context_lens[i]
        buckets[-1].append(i)
    return buckets


def _context_slots(block_table: list[int], context_len: int, block_size: int) -> torch.Tensor:
    """[context_len] cache slots of tokens 0..context_len-1 of one request."""
    blocks = torch.tensor(block_table[: -(-context_len // block_size)], dtype=torch.long)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).view(-1)
    return slots[:context_len]


def _build_batched(rows, starts, query_lens, context_lens, block_tables, block_size) -> BatchedGroup:
    q_max = max(query_lens[i] for i in rows)
    l_max = max(context_lens[i] for i in rows)
    qpos = torch.arange(q_max)
    token_index = torch.empty(len(rows), q_max, dtype=torch.long)
    kv_slots = torch.zeros(len(rows), l_max, dtype=torch.long)
    q_lens = torch.tensor([query_lens[i] for i in rows])
    c_lens = torch.tensor([context_lens[i] for i in rows])
    for b, i in enumerate(rows):
        token_index[b] = starts[i] + qpos.clamp(max=query_lens[i] - 1)
        kv_slots[b, : context_lens[i]] = _context_slots(block_tables[i], context_lens[i], block_size)
    valid = qpos[None, :] < q_lens[:, None]  # [B, Q]
    mask = None
    if q_max > 1 or bool((c_lens != l_max).any()):
        # Query j of a request sits at absolute position context_len - query_len + j.
        abs_q = (c_lens - q_lens)[:, None] + qpos[None, :]  # [B, Q]
        mask = torch.arange(l_max)[None, None, :] <= abs_q[:, :, None]  # [B, Q, L]
        mask = mask.unsqueeze(1)
    flat_valid = valid.view(-1).nonzero().squeeze(1)
    return BatchedGroup(token_index, flat_valid, token_index.view(-1)[flat_valid], kv_slots, mask)


def _build_prefill(i, starts, query_lens, context_lens, block_tables, block_size) -> PrefillChunk:
    q_len, c_len = query_lens[i], context_lens[i]
    if c_len == q_len:
        return PrefillChunk(starts[i], starts[i] + q_len, None, None)
    abs_q = torch.arange(c_len - q_len, c_len)
    mask = torch.arange(c_len)[None, :] <= abs_q[:, None]
    return PrefillChunk(starts[i], starts[i] + q_len, _context_slots(block_tables[i], c_len, block_size), mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache, v_cache: [num_blocks, block_size, Hkv, D]; k, v: [N, Hkv, D]."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [N, H, D]; k, v: [N, Hkv, D] (this step's); returns [N, H * D]."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    out = q.new_empty(num_tokens, num_heads * head_dim)
    for g in meta.batched:
        o = _attend(q[g.token_index], k_flat[g.kv_slots], v_flat[g.kv_slots], g.mask, scale)
        out.index_copy_(0, g.out_index, o.reshape(-1, num_heads * head_dim)[g.valid_index])
    for p in meta.prefills:
        if p.kv_slots is None:
            o = _attend(q[None, p.start:p.end], k[None, p.start:p.end], v[None, p.start:p.end], None, scale,
                        causal=True)
        else:
            o = _attend(q[None, p.start:p.end], k_flat[p.kv_slots][None], v_flat[p.kv_slots][None],
                        p.mask[None, None], scale)
        out[p.start:p.end] = o.reshape(-1, num_heads * head_dim)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            causal: bool = False) -> torch.Tensor:
    """q: [B, Q, H, D]; k, v: [B, L, Hkv, D]; mask: [B, 1, Q, L] or None; returns [B, Q, H, D].

    Grouped-query attention through SDPA's enable_gqa (no repeated K/V); a fresh prefill uses
    is_causal, which takes the flash kernel (1.5x faster here than an explicit mask).
    """
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                       is_causal=causal, scale=scale, enable_gqa=True)
    return o.transpose(1, 2)
