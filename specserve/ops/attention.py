"""Paged attention on CPU over a flattened batch whose requests have queries of any length.

Every request in a step contributes `query_len` consecutive tokens at absolute positions
`[context_len - query_len, context_len)` and attends causally to its whole context in the paged cache, or,
in a layer with a sliding window w, to the last w tokens up to itself (`paged_attention(..., window=w)`: one
step's metadata serves layers of every window).
With the C kernel of `kernels.py` every request (decode, 1 + k verification, prefill chunks) is
computed from the block pool in place, faster than SDPA over gathered blocks (1.7x for a 128-token
prompt, and still ahead at 1024 tokens). Without it (no compiler, a model not in fp32,
SPECSERVE_KERNELS=torch), short queries are padded into batched SDPA calls by context length and long
queries (prefill chunks) run one request at a time through SDPA. Per layer: write the step's K/V into
the cache first, then attend, so a request may read blocks another request fills in the same step
(prefix-cache hits). The caches store K and V as fp32, bf16 or int8 rows with their scales (ops/kv_cache.py):
converted on write, read back as the query's dtype, by either path.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specserve.ops import hugepages
from specserve.ops.kernels import paged_attention_c
from specserve.ops.kv_cache import decode, encode, round_trip, row_width

# PyTorch path: queries up to this length are batched together with padding; longer ones run alone.
MAX_BATCHED_QUERY_LEN = 16
# A new length bucket starts past first_len * GROWTH + SLACK tokens of context.
BUCKET_GROWTH, BUCKET_SLACK = 1.5, 64


@dataclass
class ContextBlocks:
    """Where the cached context of B requests lives, and how to read it as [B, L, Hkv, D] keys or values.

    Reading copies whole blocks (`index_select` over the block axis moves block_size * Hkv * D contiguous
    values per index: ~7x faster than indexing token slots one by one). One request whose blocks are
    consecutive in the pool (the usual case when it runs alone) is read as a view, with no copy at all.
    """

    block_ids: torch.Tensor | None  # [B, num_blocks] (padding: block 0); None for a consecutive run
    first_block: int  # first block of the consecutive run when block_ids is None
    length: int  # L: keys per request once read (padded to whole blocks when gathered)

    def read(self, cache: torch.Tensor) -> torch.Tensor:
        """cache: [num_blocks, block_size, Hkv, R] (either layout of kv_caches) -> [B, L, Hkv, R], rows as stored."""
        block_size = cache.shape[1]
        if self.block_ids is None:
            count = -(-self.length // block_size)
            run = cache[self.first_block: self.first_block + count]
            return run.reshape(1, count * block_size, *cache.shape[2:])[:, : self.length]  # values: a view
        rows = cache.index_select(0, self.block_ids.view(-1))
        return rows.reshape(self.block_ids.shape[0], -1, *cache.shape[2:])[:, : self.length]


def context_blocks(block_tables: list[list[int]], context_lens: list[int], block_size: int) -> ContextBlocks:
    """The blocks holding tokens 0..context_len-1 of each request."""
    tables = [table[: -(-c_len // block_size)] for table, c_len in zip(block_tables, context_lens)]
    if len(tables) == 1 and _consecutive(tables[0]):
        return ContextBlocks(None, tables[0][0], context_lens[0])
    width = max(map(len, tables))
    block_ids = torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.long)
    return ContextBlocks(block_ids, 0, width * block_size)


def _consecutive(table: list[int]) -> bool:
    return all(b == a + 1 for a, b in zip(table, table[1:]))


@dataclass
class BatchedGroup:
    """Requests with short queries, padded to [B, Q] queries over [B, L] cached keys."""

    token_index: torch.Tensor  # [B, Q] flattened-batch token index (padding repeats a valid index)
    valid_index: torch.Tensor  # [T_g] positions in token_index.view(-1) that are real queries
    out_index: torch.Tensor  # [T_g] flattened-batch token index of each real query
    context: ContextBlocks  # each request's cached context (keys past its context_len are masked)
    mask: torch.Tensor | None  # [B, 1, Q, L] bool, True = may attend; None when nothing is masked
    query_pos: torch.Tensor  # [B, Q] absolute position of each (padded) query
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> mask, made once a step

    def mask_for(self, window: int) -> torch.Tensor | None:
        """The mask of a layer with this sliding window (0: none)."""
        if not window:
            return self.mask
        if window not in self.window_masks:
            keys = torch.arange(self.context.length)[None, None, :]
            seen = keys > self.query_pos[:, :, None] - window  # [B, Q, L]
            self.window_masks[window] = seen.unsqueeze(1) if self.mask is None else seen.unsqueeze(1) & self.mask
        return self.window_masks[window]


@dataclass
class PrefillChunk:
    """One request with a long query; attends to `context` (None: no cached context, causal only)."""

    start: int  # first flattened-batch token index
    end: int
    context: ContextBlocks | None  # L = context_len
    mask: torch.Tensor | None  # [Q, context_len] bool, None when context is None
    context_len: int = 0
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> mask, made once a step

    def mask_for(self, window: int) -> torch.Tensor | None:
        """The [Q, L] mask of a layer with this sliding window (0: none; None then means causal over the
        step's own keys)."""
        if not window:
            return self.mask
        if window not in self.window_masks:
            q_len = self.end - self.start
            query_pos = torch.arange(self.context_len - q_len, self.context_len)[:, None]
            keys = torch.arange(self.context_len if self.context is not None else q_len)[None, :]
            if self.context is None:  # keys are the query's own tokens
                keys = keys + self.context_len - q_len
            self.window_masks[window] = (keys <= query_pos) & (keys > query_pos - window)
        return self.window_masks[window]


@dataclass
class KernelBatch:
    """Requests for the C kernel: where their queries start, how long, and their blocks."""

    query_start: torch.Tensor  # [S] int64
    query_len: torch.Tensor  # [S] int64
    context_len: torch.Tensor  # [S] int64
    block_table: torch.Tensor  # [S, W] int64 (padding: block 0, never read)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [W] cache slot of each K/V write: one per new token, unless slot_rows
    num_tokens: int
    batched: list[BatchedGroup]  # short queries for SDPA, bucketed by context length
    prefills: list[PrefillChunk]
    kernel: KernelBatch | None = None  # every request, for the C kernel (then `batched`, `prefills` are empty)
    # window -> the metadata of the layers with that sliding window when they keep their own block tables
    # (HybridKVCacheManager's window group: other slots and blocks, the same queries)
    window_groups: dict[int, "AttentionMetadata"] = field(default_factory=dict)
    # [W] the token whose K/V write w stores (None: token w, W = num_tokens); a draft tree's node is written
    # once into each of its paths' blocks (worker/tree_step.py)
    slot_rows: torch.Tensor | None = None

    def for_window(self, window: int) -> "AttentionMetadata":
        """The metadata a layer with this sliding window (0: none) reads its cache by."""
        return self.window_groups.get(window, self) if window else self


def slot_ids(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of token indices [start, end) of a request whose blocks are `block_table`. Slots follow
    the absolute token index, never a (M-RoPE) position."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def paged_metadata(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                   block_size: int, use_kernel: bool = False) -> AttentionMetadata:
    """Attention metadata for queries that are the last query_lens[i] tokens of each request's context,
    with the slots they write."""
    slots = []
    for q_len, c_len, table in zip(query_lens, context_lens, block_tables):
        slots.extend(slot_ids(table, c_len - q_len, c_len, block_size))
    return build_attention_metadata(query_lens, context_lens, block_tables, block_size,
                                    torch.tensor(slots, dtype=torch.long), use_kernel)


def build_attention_metadata(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                             block_size: int, slot_mapping: torch.Tensor, use_kernel: bool = False
                             ) -> AttentionMetadata:
    """context_lens[i] counts the request's tokens including this step's query.

    use_kernel: hand every request to the C kernel (the caller checks `kernels.kernel_usable(cache dtype)`).
    """
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    if use_kernel:  # every request, prefill chunks included (faster than SDPA up to 1k-token chunks)
        kernel = _build_kernel_batch(range(len(query_lens)), starts, query_lens, context_lens, block_tables,
                                     block_size)
        return AttentionMetadata(slot_mapping, starts[-1], [], [], kernel)
    small = [i for i, q in enumerate(query_lens) if q <= MAX_BATCHED_QUERY_LEN]
    large = [i for i, q in enumerate(query_lens) if q > MAX_BATCHED_QUERY_LEN]
    prefills = [_build_prefill(i, starts, query_lens, context_lens, block_tables, block_size) for i in large]
    batched = [_build_batched(rows, starts, query_lens, context_lens, block_tables, block_size)
               for rows in _length_buckets(small, context_lens)]
    return AttentionMetadata(slot_mapping, starts[-1], batched, prefills)


def _build_kernel_batch(rows, starts, query_lens, context_lens, block_tables, block_size) -> KernelBatch | None:
    if not rows:
        return None
    tables = [block_tables[i][: -(-context_lens[i] // block_size)] for i in rows]
    width = max(map(len, tables))
    return KernelBatch(
        query_start=torch.tensor([starts[i] for i in rows], dtype=torch.long),
        query_len=torch.tensor([query_lens[i] for i in rows], dtype=torch.long),
        context_len=torch.tensor([context_lens[i] for i in rows], dtype=torch.long),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long))


def _length_buckets(rows: list[int], context_lens: list[int]) -> list[list[int]]:
    """Group rows of similar context length, so padding to the longest in a group wastes at most ~half.

    Padding every decode to the batch's longest context would make a 32-request step gather ~4x the keys
    it needs when contexts differ as much as Spec-Bench prompts do (30 to 950 tokens).
    """
    buckets: list[list[int]] = []
    first_len = 0
    for i in sorted(rows, key=context_lens.__getitem__):
        if not buckets or context_lens[i] > first_len * BUCKET_GROWTH + BUCKET_SLACK:
            buckets.append([])
            first_len = context_lens[i]
        buckets[-1].append(i)
    return buckets


def _build_batched(rows, starts, query_lens, context_lens, block_tables, block_size) -> BatchedGroup:
    q_max = max(query_lens[i] for i in rows)
    context = context_blocks([block_tables[i] for i in rows], [context_lens[i] for i in rows], block_size)
    qpos = torch.arange(q_max)
    token_index = torch.empty(len(rows), q_max, dtype=torch.long)
    q_lens = torch.tensor([query_lens[i] for i in rows])
    c_lens = torch.tensor([context_lens[i] for i in rows])
    for b, i in enumerate(rows):
        token_index[b] = starts[i] + qpos.clamp(max=query_lens[i] - 1)
    valid = qpos[None, :] < q_lens[:, None]  # [B, Q]
    mask = None
    if q_max > 1 or bool((c_lens != context.length).any()):
        # Query j of a request sits at absolute position context_len - query_len + j.
        abs_q = (c_lens - q_lens)[:, None] + qpos[None, :]  # [B, Q]
        mask = torch.arange(context.length)[None, None, :] <= abs_q[:, :, None]  # [B, Q, L]
        mask = mask.unsqueeze(1)
    flat_valid = valid.view(-1).nonzero().squeeze(1)
    query_pos = (c_lens - q_lens)[:, None] + qpos[None, :]
    return BatchedGroup(token_index, flat_valid, token_index.view(-1)[flat_valid], context, mask, query_pos)


def _build_prefill(i, starts, query_lens, context_lens, block_tables, block_size) -> PrefillChunk:
    q_len, c_len = query_lens[i], context_lens[i]
    if c_len == q_len:
        return PrefillChunk(starts[i], starts[i] + q_len, None, None, c_len)
    abs_q = torch.arange(c_len - q_len, c_len)
    mask = torch.arange(c_len)[None, :] <= abs_q[:, None]
    context = context_blocks([block_tables[i]], [c_len], block_size)
    if context.block_ids is not None:  # read exactly context_len keys, like the consecutive view
        context = ContextBlocks(context.block_ids, 0, c_len)
    return PrefillChunk(starts[i], starts[i] + q_len, context, mask, c_len)


def kv_caches(shape: tuple[int, ...], dtype: torch.dtype, num_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (key, value) pair of zeroed caches per layer for `shape` = [num_blocks, block_size, Hkv, D], on huge
    pages where available, each indexed [num_blocks, block_size, Hkv, R]: R = D, or for dtype torch.int8
    D + 4 * ceil(D / 32), each row's int8 numbers and then its scales' bytes (kv_cache.py). Values are stored in
    that order; keys as [num_blocks, Hkv, R, block_size] (the tensor is a permuted view of that), so the C
    kernel reads a block's 16 keys as one vector per dimension."""
    num_blocks, block_size, num_kv_heads, head_dim = shape
    row = row_width(head_dim, dtype)
    stored = (num_blocks, num_kv_heads, row, block_size)
    return [(hugepages.zeros(stored, dtype).permute(0, 3, 1, 2),
             hugepages.zeros((num_blocks, block_size, num_kv_heads, row), dtype))
            for _ in range(num_layers)]


def kernel_key_layout(k_cache: torch.Tensor) -> torch.Tensor:
    """A copy of a [num_blocks, block_size, Hkv, D] key cache stored as kv_caches stores keys."""
    return k_cache.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, slot_rows: torch.Tensor | None = None) -> None:
    """k_cache, v_cache: [num_blocks, block_size, Hkv, R] (kv_caches' layouts); k, v: [N, Hkv, D]; row
    slot_rows[w] (None: row w) goes to slot slot_mapping[w], converted to the caches' storage."""
    if slot_rows is not None:
        k, v = k[slot_rows], v[slot_rows]
    k, v = encode(k, k_cache.dtype), encode(v, v_cache.dtype)
    num_kv_heads, row, block_size = k.shape[1], k.shape[2], k_cache.shape[1]
    k_cache[slot_mapping // block_size, slot_mapping % block_size] = k
    v_cache.view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, v)


def copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
    """Block src into block dst, for (src, dst) in pairs, in every layer's keys and values."""
    if not pairs:
        return
    src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
    for k_cache, v_cache in kv_caches:
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]


def copy_slots(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]],
               block_size: int) -> None:
    """Slot src's K/V into slot dst, for (src, dst) in pairs in order, in every layer."""
    if not pairs:
        return
    src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
    for k_cache, v_cache in kv_caches:
        k_cache[dst // block_size, dst % block_size] = k_cache[src // block_size, src % block_size]
        v_cache[dst // block_size, dst % block_size] = v_cache[src // block_size, src % block_size]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
    """q: [N, H, D]; k, v: [N, Hkv, D] (this step's); returns [N, H * D]. window: 0, or the layer's sliding
    window (each query sees its last `window` tokens, itself included)."""
    meta = meta.for_window(window)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping, meta.slot_rows)
    num_tokens, num_heads, head_dim = q.shape
    out = q.new_empty(num_tokens, num_heads * head_dim)
    if meta.kernel is not None:
        kb = meta.kernel
        paged_attention_c(q.contiguous(), out, k_cache, v_cache, kb.block_table, kb.query_start, kb.query_len,
                              kb.context_len, scale, window)
    for g in meta.batched:
        o = _attend(q[g.token_index], decode(g.context.read(k_cache), head_dim, q.dtype),
                    decode(g.context.read(v_cache), head_dim, q.dtype), g.mask_for(window), scale)
        out.index_copy_(0, g.out_index, o.reshape(-1, num_heads * head_dim)[g.valid_index])
    for p in meta.prefills:
        mask = p.mask_for(window)
        if p.context is None:  # this step's keys and values, as the cache gives them back
            o = _attend(q[None, p.start:p.end], round_trip(k[None, p.start:p.end], k_cache.dtype),
                        round_trip(v[None, p.start:p.end], v_cache.dtype),
                        None if mask is None else mask[None, None], scale, causal=mask is None)
        else:
            o = _attend(q[None, p.start:p.end], decode(p.context.read(k_cache), head_dim, q.dtype),
                        decode(p.context.read(v_cache), head_dim, q.dtype), mask[None, None], scale)
        out[p.start:p.end] = o.reshape(-1, num_heads * head_dim)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            causal: bool = False) -> torch.Tensor:
    """q: [B, Q, H, D]; k, v: [B, L, Hkv, D]; mask: [B, 1, Q, L] or None; returns [B, Q, H, D].

    Grouped-query attention through SDPA's enable_gqa (no repeated K/V); a fresh prefill uses
    is_causal, which takes the flash kernel (~1.5x faster than an explicit mask).
    """
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                       is_causal=causal, scale=scale, enable_gqa=True)
    return o.transpose(1, 2)
