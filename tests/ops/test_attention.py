"""paged_attention against dense causal attention computed from each request's own K/V."""
import math

import pytest
import torch

from specserve.ops.attention import (build_attention_metadata, context_blocks, kernel_key_layout, kv_caches,
                                        paged_attention)
from tests.kernel_support import requires_c_kernels

BLOCK_SIZE, NUM_BLOCKS, H, HKV, D = 16, 64, 6, 2, 64


def _dense(q, k, v, scale, window=0):
    """q: [Q, H, D] at the last Q positions of k, v: [L, Hkv, D]; window: each query sees its last `window`
    keys (itself included), 0 for all."""
    q_len, c_len = q.shape[0], k.shape[0]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.einsum("qhd,lhd->hql", q, k) * scale
    query_pos = torch.arange(c_len - q_len, c_len)[:, None]
    allowed = torch.arange(c_len)[None, :] <= query_pos
    if window:
        allowed &= torch.arange(c_len)[None, :] > query_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hql,lhd->qhd", scores.softmax(-1), v).reshape(q_len, -1)


PATHS = [False, pytest.param(True, marks=requires_c_kernels)]


def _run(query_lens, context_lens, block_tables, use_kernel=False, seed=0, head_dim=D, block_size=BLOCK_SIZE,
         heads=(H, HKV), num_blocks=NUM_BLOCKS, window=0, poison_outside_window=False):
    """Fill each request's earlier context into the cache, run one step, compare every token's output.

    poison_outside_window: NaN in every block wholly before the request's first query's window (blocks the
    cache manager may have freed and given to another request): the output must not read them."""
    num_heads, num_kv_heads = heads
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    full_k, full_v, slots = [], [], []
    for q_len, c_len, table in zip(query_lens, context_lens, block_tables):
        ctx_slots = [table[t // block_size] * block_size + t % block_size for t in range(c_len)]
        k = torch.randn(c_len, num_kv_heads, head_dim, generator=g)
        v = torch.randn(c_len, num_kv_heads, head_dim, generator=g)
        k_cache.view(-1, num_kv_heads, head_dim)[ctx_slots[: c_len - q_len]] = k[: c_len - q_len]
        v_cache.view(-1, num_kv_heads, head_dim)[ctx_slots[: c_len - q_len]] = v[: c_len - q_len]
        full_k.append(k)
        full_v.append(v)
        slots += ctx_slots[c_len - q_len:]
        if poison_outside_window:
            dead = max(0, c_len - q_len + 1 - window) // block_size
            k_cache[table[:dead]] = float("nan")
            v_cache[table[:dead]] = float("nan")
    k_cache = kernel_key_layout(k_cache)  # as the engine stores keys (both paths read it)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=g)
    step_k = torch.cat([k[c - n:] for k, n, c in zip(full_k, query_lens, context_lens)])
    step_v = torch.cat([v[c - n:] for v, n, c in zip(full_v, query_lens, context_lens)])
    meta = build_attention_metadata(query_lens, context_lens, block_tables, block_size,
                                    torch.tensor(slots, dtype=torch.long), use_kernel)
    assert (meta.kernel is not None) == use_kernel and (not use_kernel or not meta.prefills)
    scale = 1 / math.sqrt(head_dim)
    out = paged_attention(q, step_k, step_v, k_cache, v_cache, meta, scale, window)
    start = 0
    for i, (q_len, c_len) in enumerate(zip(query_lens, context_lens)):
        ref = _dense(q[start:start + q_len], full_k[i], full_v[i], scale, window)
        torch.testing.assert_close(out[start:start + q_len], ref, atol=1e-5, rtol=1e-5)
        start += q_len
    return out


def _scattered_tables(context_lens, seed=1, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS):
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for c_len in context_lens:
        n = -(-c_len // block_size)
        tables.append(perm[used:used + n])
        used += n
    return tables


# (16, 64): the kernel's vector path; other block sizes and head dims take its scalar path.
# (16, 256): Gemma 3's heads, the vector path's widest
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (16, 32), (4, 64), (16, 8), (16, 256)])
@pytest.mark.parametrize("use_kernel", PATHS)
def test_mixed_batch_with_scattered_blocks(use_kernel, block_size, head_dim):
    # decode, 1 + k verification, a prefill chunk over cached context, a fresh prefill; lengths in
    # different buckets; blocks scattered over the pool in no particular order.
    query_lens = [1, 5, 1, 20, 17, 3, 16]
    context_lens = [9, 14, 130, 33, 17, 4, 16]
    tables = _scattered_tables(context_lens, block_size=block_size)
    _run(query_lens, context_lens, tables, use_kernel, head_dim=head_dim, block_size=block_size)


@pytest.mark.parametrize("use_kernel", PATHS)
def test_wide_heads_and_large_groups(use_kernel):
    # head_dim 128 (the widest vector path) and 7 query heads per kv head (Qwen2-0.5B's 14 / 2), with a
    # 20-token chunk: 140 rows per kv head, past the kernel's on-stack work buffer.
    query_lens, context_lens = [1, 20, 4], [37, 52, 9]
    tables = _scattered_tables(context_lens)
    _run(query_lens, context_lens, tables, use_kernel, head_dim=128, heads=(14, 2))


@pytest.mark.parametrize("use_kernel", PATHS)
@pytest.mark.parametrize("query_lens,context_lens", [
    ([1], [700]),  # one decoding request: the kernel splits its context over the threads
    ([6, 1], [523, 260]),  # verification next to a decode
    ([1, 6, 40, 1, 3], [300, 211, 400, 129, 128]),  # a long chunk: chunks one after another
])
def test_long_contexts_across_key_chunks(use_kernel, query_lens, context_lens):
    # contexts over many of the kernel's 128-key chunks, ending inside one and on an edge
    num_blocks = 256
    tables = _scattered_tables(context_lens, num_blocks=num_blocks)
    _run(query_lens, context_lens, tables, use_kernel, num_blocks=num_blocks)


WINDOW_CASES = [
    ([1], [700]),  # one decode, split over the threads, most chunks before the window
    ([6, 1], [523, 260]),  # verification next to a decode
    ([1, 5, 20, 17, 3, 16], [9, 14, 133, 33, 17, 16]),  # windows longer than some contexts, a fresh prefill
    ([40, 1, 3], [400, 129, 128]),  # a chunk whose rows' windows start in different blocks
]


@pytest.mark.parametrize("use_kernel", PATHS)
@pytest.mark.parametrize("window", [1, 16, 21, 200])
@pytest.mark.parametrize("query_lens,context_lens", WINDOW_CASES)
def test_sliding_window_sees_the_last_window_keys(use_kernel, window, query_lens, context_lens):
    num_blocks = 256
    tables = _scattered_tables(context_lens, num_blocks=num_blocks)
    _run(query_lens, context_lens, tables, use_kernel, num_blocks=num_blocks, window=window)


@requires_c_kernels
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (4, 64), (16, 256), (16, 192)])  # vector, scalar
@pytest.mark.parametrize("query_lens,context_lens", WINDOW_CASES)
def test_kernel_never_reads_blocks_before_the_window(block_size, head_dim, query_lens, context_lens):
    num_blocks = 1024 // block_size * 4
    tables = _scattered_tables(context_lens, block_size=block_size, num_blocks=num_blocks)
    _run(query_lens, context_lens, tables, True, block_size=block_size, head_dim=head_dim, num_blocks=num_blocks,
         window=37, poison_outside_window=True)


@requires_c_kernels
@pytest.mark.parametrize("dim", [D, 256])
def test_windowed_kernel_rows_are_bitwise_the_same_however_scheduled(dim):
    """A windowed row's output is the same bits in a decode (split over threads), a verification step and a
    long chunk: rows whose windows start later see the earlier blocks as exact zeros."""
    num_blocks, window = 256, 150
    g = torch.Generator().manual_seed(6)
    k_cache = kernel_key_layout(torch.randn(num_blocks, BLOCK_SIZE, HKV, dim, generator=g))
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, HKV, dim, generator=g)
    context_lens = [700, 300]
    tables = _scattered_tables(context_lens, num_blocks=num_blocks)
    q_all = [torch.randn(c, H, dim, generator=g) for c in context_lens]

    def attend(i, n):
        c, t = context_lens[i], tables[i]
        flat = torch.tensor([t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c - n, c)])
        k, v = k_cache.reshape(-1, HKV, dim)[flat], v_cache.view(-1, HKV, dim)[flat]
        meta = build_attention_metadata([n], [c], [t], BLOCK_SIZE, flat, use_kernel=True)
        return paged_attention(q_all[i][c - n:], k, v, k_cache, v_cache, meta, 0.125, window)[-1:]

    for i in range(2):
        alone = attend(i, 1)
        assert all(torch.equal(attend(i, n), alone) for n in (2, 6, 17, 40, 200))


@requires_c_kernels
def test_kernel_rows_do_not_depend_on_the_batch_thread_count_or_query_length():
    """Decode rows (context split over the threads) and rows inside long chunks or big batches (chunks one
    after another) take the same arithmetic: a token's output is bitwise the same however it is scheduled."""
    num_blocks = 256
    g = torch.Generator().manual_seed(5)
    k_cache = kernel_key_layout(torch.randn(num_blocks, BLOCK_SIZE, HKV, D, generator=g))
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, HKV, D, generator=g)
    context_lens = [700, 300, 260, 129, 40]
    tables = _scattered_tables(context_lens, num_blocks=num_blocks)
    q_all = [torch.randn(c, H, D, generator=g) for c in context_lens]  # a query for every position

    def attend(reqs):
        """reqs: (request, query_len); returns each request's output rows."""
        slots, q_rows = [], []
        for i, n in reqs:
            c, t = context_lens[i], tables[i]
            slots += [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c - n, c)]
            q_rows.append(q_all[i][c - n:])
        flat = torch.tensor(slots, dtype=torch.long)
        k, v = k_cache.reshape(-1, HKV, D)[flat], v_cache.view(-1, HKV, D)[flat]  # rewrite what is there
        meta = build_attention_metadata([n for _, n in reqs], [context_lens[i] for i, _ in reqs],
                                        [tables[i] for i, _ in reqs], BLOCK_SIZE, flat, use_kernel=True)
        out = paged_attention(torch.cat(q_rows), k, v, k_cache, v_cache, meta, 0.125)
        return out.split([n for _, n in reqs])

    threads = torch.get_num_threads()
    alone = [attend([(i, 1)])[0] for i in range(len(context_lens))]  # decode, split over the threads
    try:
        torch.set_num_threads(1)
        assert all(torch.equal(attend([(i, 1)])[0], alone[i]) for i in range(len(context_lens)))
    finally:
        torch.set_num_threads(threads)
    big = attend([(i, 1) for i in range(5)] * 4)  # 20 requests: chunks one after another
    assert all(torch.equal(big[i], alone[i % 5]) for i in range(20))
    for i, n in [(0, 6), (1, 40), (2, 17)]:  # verification and prefill chunks: their last row
        assert torch.equal(attend([(i, n)])[0][-1:], alone[i])


@requires_c_kernels
def test_kernel_rows_are_bitwise_the_same_alone_and_in_a_batch():
    g = torch.Generator().manual_seed(3)
    k_cache = kernel_key_layout(torch.randn(NUM_BLOCKS, BLOCK_SIZE, HKV, D, generator=g))
    v_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, HKV, D, generator=g)
    query_lens, context_lens = [1, 5, 1, 3], [9, 14, 130, 40]
    tables = _scattered_tables(context_lens)
    slots = [[t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c - n, c)]
             for n, c, t in zip(query_lens, context_lens, tables)]
    q = torch.randn(sum(query_lens), H, D, generator=g)

    def attend(rows):
        flat = torch.tensor([s for i in rows for s in slots[i]], dtype=torch.long)
        k, v = k_cache.reshape(-1, HKV, D)[flat], v_cache.view(-1, HKV, D)[flat]  # rewrite what is there
        meta = build_attention_metadata([query_lens[i] for i in rows], [context_lens[i] for i in rows],
                                        [tables[i] for i in rows], BLOCK_SIZE, flat, use_kernel=True)
        starts = [sum(query_lens[:i]) for i in rows]
        q_rows = torch.cat([q[s:s + query_lens[i]] for s, i in zip(starts, rows)])
        return paged_attention(q_rows, k, v, k_cache, v_cache, meta, 0.3)

    together = attend([0, 1, 2, 3])
    start = 0
    for i, n in enumerate(query_lens):
        assert torch.equal(attend([i]), together[start:start + n])
        start += n


@pytest.mark.parametrize("use_kernel", PATHS)
@pytest.mark.parametrize("q_len", [1, 4, 24])
def test_single_request_on_consecutive_blocks_reads_a_view(q_len, use_kernel):
    c_len = 38
    table = list(range(7, 7 + -(-c_len // BLOCK_SIZE)))
    ctx = context_blocks([table], [c_len], BLOCK_SIZE)
    assert ctx.block_ids is None and ctx.first_block == 7 and ctx.length == c_len
    cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, HKV, D)
    assert ctx.read(cache).data_ptr() == cache[7].data_ptr()  # no copy
    assert torch.equal(ctx.read(kernel_key_layout(cache)), ctx.read(cache))  # keys as the engine stores them
    _run([q_len], [c_len], [table], use_kernel)


def test_gathered_context_pads_to_whole_blocks_and_masks_the_rest():
    ctx = context_blocks([[5, 3], [9, 10, 11]], [6, 10], 4)
    assert ctx.block_ids.tolist() == [[5, 3, 0], [9, 10, 11]] and ctx.length == 12
    cache = torch.arange(NUM_BLOCKS * 4, dtype=torch.float32).view(NUM_BLOCKS, 4, 1, 1)
    read = ctx.read(cache).view(2, -1)
    assert read[0, :6].tolist() == [20, 21, 22, 23, 12, 13]
    assert read[1, :10].tolist() == list(range(36, 46))
    keys = torch.arange(NUM_BLOCKS * 4 * 2 * 3, dtype=torch.float32).view(NUM_BLOCKS, 4, 2, 3)
    assert torch.equal(ctx.read(kernel_key_layout(keys)), ctx.read(keys))
    _run([1, 2], [6, 10], [[5, 3], [9, 10, 11]], block_size=4)


def test_kv_caches_store_values_by_token_and_keys_transposed_within_blocks():
    caches = kv_caches((4, 16, 3, 64), torch.float32, num_layers=3)
    assert len(caches) == 3 and all(k.shape == v.shape == (4, 16, 3, 64) for k, v in caches)
    assert len({t.data_ptr() for pair in caches for t in pair}) == 6
    k, v = caches[0]
    assert v.is_contiguous() and k.permute(0, 2, 3, 1).is_contiguous() and not (k.any() or v.any())
    assert k.stride() == (16 * 3 * 64, 1, 64 * 16, 16)  # [block][head][dim][slot]


@requires_c_kernels
def test_kernel_refuses_keys_stored_by_token():
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HKV, D)
    meta = build_attention_metadata([1], [5], [[0]], BLOCK_SIZE, torch.tensor([4]), use_kernel=True)
    with pytest.raises(ValueError, match="k_cache"):
        paged_attention(torch.zeros(1, H, D), torch.zeros(1, HKV, D), torch.zeros(1, HKV, D), k_cache,
                        torch.zeros_like(k_cache), meta, 0.125)
