"""KVCacheManager and BlockPool: free-list accounting, reference counts, prefix caching, LRU eviction.

Pure Python: these tests build Requests from plain namespaces and never import torch.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from specserve.engine.kv_cache_manager import BlockPool, KVCacheManager, hash_block_tokens
from specserve.engine.request import Request

BS = 4  # block size used throughout


def make_request(rid: str, prompt: list[int], max_tokens: int | None = None) -> Request:
    params = SimpleNamespace(max_tokens=max_tokens, min_tokens=0, ignore_eos=True, stop_token_ids=None,
                             num_speculative_tokens=None)
    return Request(rid, prompt, params)


def admit(kv: KVCacheManager, request: Request) -> list[int] | None:
    """What the scheduler does for a waiting request whose whole prompt fits the budget."""
    blocks, num_hit = kv.get_computed_blocks(request)
    new_ids = kv.allocate_slots(request, request.num_tokens - num_hit, blocks)
    if new_ids is not None:
        request.num_computed_tokens = request.num_tokens
    return new_ids


def free_queue(kv: KVCacheManager) -> list[int]:
    return list(kv.pool.free_queue)


def check_pool_consistent(kv: KVCacheManager) -> None:
    """Free blocks have ref 0, referenced blocks are not free, refs match the requests' block lists."""
    refs = [0] * kv.num_blocks
    for blocks in kv.req_blocks.values():
        for b in blocks:
            refs[b.block_id] += 1
    free = set(kv.pool.free_queue)
    for block in kv.pool.blocks:
        assert block.ref_cnt == refs[block.block_id], block
        assert (block.ref_cnt == 0) == (block.block_id in free), block
    for block_hash, block in kv.pool.cached.items():
        assert block.block_hash == block_hash


def test_import_does_not_pull_in_torch():
    code = ("import specserve.engine.scheduler, specserve.engine.kv_cache_manager, "
            "specserve.engine.request, sys; assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_invalid_sizes_are_refused():
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(0, BS)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)


# ---- allocation and the free list ----------------------------------------------------------------

def test_allocate_and_free_accounting():
    kv = KVCacheManager(10, BS)
    assert kv.pool.num_free_blocks == 10 and kv.usage == 0.0
    req = make_request("a", list(range(10)))  # 10 tokens -> 3 blocks
    assert kv.allocate_slots(req, 10) == [0, 1, 2]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.pool.num_free_blocks == 7
    assert kv.usage == pytest.approx(0.3)
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [1, 1, 1]
    check_pool_consistent(kv)

    kv.free(req)
    assert kv.pool.num_free_blocks == 10 and kv.usage == 0.0
    assert kv.get_block_ids("a") == []
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    kv.free(req)  # freeing twice is harmless
    assert kv.pool.num_free_blocks == 10
    check_pool_consistent(kv)


def test_incremental_allocation_returns_only_new_blocks():
    kv = KVCacheManager(10, BS, enable_caching=False)
    req = make_request("a", list(range(7)))
    assert kv.allocate_slots(req, 7) == [0, 1]
    req.num_computed_tokens = 7
    req.append_output_token(100)  # 8 tokens: still fits in two blocks
    assert kv.allocate_slots(req, 1) == []
    req.num_computed_tokens = 8
    req.append_output_token(101)  # token 8 opens block 2
    assert kv.allocate_slots(req, 1) == [2]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.pool.num_free_blocks == 7
    check_pool_consistent(kv)


def test_lookahead_reserves_extra_blocks():
    kv = KVCacheManager(10, BS, enable_caching=False)
    req = make_request("a", list(range(4)))
    assert kv.allocate_slots(req, 4, num_lookahead_tokens=5) == [0, 1, 2]  # 9 slots
    assert kv.pool.num_free_blocks == 7


def test_blocks_are_freed_tail_first():
    kv = KVCacheManager(6, BS, enable_caching=False)
    a = make_request("a", list(range(12)))
    assert kv.allocate_slots(a, 12) == [0, 1, 2]
    kv.free(a)
    # Free queue: untouched blocks first, then a's blocks tail first.
    assert free_queue(kv) == [3, 4, 5, 2, 1, 0]
    b = make_request("b", list(range(50, 66)))  # 4 blocks: the 3 untouched ones, then a's tail
    assert kv.allocate_slots(b, 16) == [3, 4, 5, 2]


def test_allocate_returns_none_when_out_of_blocks_and_changes_nothing():
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(12)))
    assert admit(kv, a) == [0, 1, 2]
    before = (free_queue(kv), [b.ref_cnt for b in kv.pool.blocks], dict(kv.pool.cached))
    b = make_request("b", list(range(100, 108)))  # needs 2 blocks, 1 free
    assert kv.allocate_slots(b, 8) is None
    assert (free_queue(kv), [b.ref_cnt for b in kv.pool.blocks], dict(kv.pool.cached)) == before
    assert "b" not in kv.req_blocks and kv.get_block_ids("b") == []
    # A running request that cannot grow keeps what it had.
    a.append_output_token(7)
    assert kv.allocate_slots(a, 1 + 8) is None  # 13 + 8 tokens -> 6 blocks
    assert kv.get_block_ids("a") == [0, 1, 2]
    check_pool_consistent(kv)


def test_failed_allocation_with_prefix_hits_leaves_hit_blocks_free():
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(9)))  # blocks 0, 1 cached, block 2 partial
    admit(kv, a)
    kv.free(a)
    filler = make_request("f", list(range(200, 204)))
    admit(kv, filler)  # takes block 3, the only never-used block
    # b shares a's two full blocks but needs 20 tokens: 5 blocks, more than the pool.
    b = make_request("b", list(range(8)) + list(range(300, 312)))
    blocks, num_hit = kv.get_computed_blocks(b)
    assert [x.block_id for x in blocks] == [0, 1] and num_hit == 8
    before = (free_queue(kv), [x.ref_cnt for x in kv.pool.blocks])
    assert kv.allocate_slots(b, b.num_tokens - num_hit, blocks) is None
    assert (free_queue(kv), [x.ref_cnt for x in kv.pool.blocks]) == before
    assert kv.pool.get_cached_block(blocks[0].block_hash) is blocks[0]
    check_pool_consistent(kv)


def test_free_hits_count_against_free_blocks():
    """A hit on a free cached block uses up one free block, so it cannot also be allocated."""
    kv = KVCacheManager(3, BS)
    a = make_request("a", list(range(8)))
    admit(kv, a)  # blocks 0, 1 (both full and cached)
    kv.free(a)
    b = make_request("b", list(range(4)) + [90, 91, 92, 93, 94, 95, 96, 97, 98])  # 13 tokens, 4 blocks
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4
    # 3 more blocks needed; 3 are free, but one of them is the hit itself.
    assert kv.allocate_slots(b, b.num_tokens - num_hit, blocks) is None
    b2 = make_request("b2", list(range(4)) + [90, 91, 92, 93, 94, 95, 96, 97])  # 12 tokens: fits exactly
    blocks, num_hit = kv.get_computed_blocks(b2)
    assert kv.allocate_slots(b2, b2.num_tokens - num_hit, blocks) is not None
    assert kv.get_block_ids("b2")[0] == 0 and kv.pool.num_free_blocks == 0
    check_pool_consistent(kv)


# ---- prefix caching ------------------------------------------------------------------------------

def test_shared_prefix_shares_block_ids_and_ref_counts():
    kv = KVCacheManager(16, BS)
    prefix = list(range(1, 17))  # four full blocks
    a = make_request("a", prefix + [50])
    admit(kv, a)
    b = make_request("b", prefix + [60, 61])
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 16
    assert [x.block_id for x in blocks] == kv.get_block_ids("a")[:4]
    new_ids = kv.allocate_slots(b, b.num_tokens - num_hit, blocks)
    assert len(new_ids) == 1
    assert kv.get_block_ids("b")[:4] == kv.get_block_ids("a")[:4]
    assert kv.get_block_ids("b")[4] != kv.get_block_ids("a")[4]
    assert [x.ref_cnt for x in blocks] == [2, 2, 2, 2]
    check_pool_consistent(kv)

    kv.free(a)
    assert [x.ref_cnt for x in blocks] == [1, 1, 1, 1]
    assert all(x.block_id not in kv.pool.free_queue for x in blocks)
    kv.free(b)
    assert kv.pool.num_free_blocks == 16
    check_pool_consistent(kv)


@pytest.mark.parametrize("changed_index, expected_hits", [(0, 0), (3, 0), (4, 1), (9, 2), (15, 3)])
def test_a_differing_token_breaks_the_chain_for_all_later_blocks(changed_index, expected_hits):
    kv = KVCacheManager(16, BS)
    prompt = list(range(1, 21))  # five full blocks
    admit(kv, make_request("a", prompt))
    other = list(prompt)
    other[changed_index] = 999  # blocks after it are identical token-wise, yet must not hit
    blocks, num_hit = kv.get_computed_blocks(make_request("b", other))
    assert len(blocks) == expected_hits and num_hit == expected_hits * BS


def test_hash_chain_depends_on_the_parent():
    tokens = (1, 2, 3, 4)
    assert hash_block_tokens(None, tokens) != hash_block_tokens(hash_block_tokens(None, (9, 9, 9, 9)), tokens)


@pytest.mark.parametrize("num_full_blocks", [1, 2, 4])
def test_last_token_is_never_a_hit(num_full_blocks):
    kv = KVCacheManager(16, BS)
    prompt = list(range(1, 1 + num_full_blocks * BS))
    admit(kv, make_request("a", prompt))
    assert len(kv.pool.cached) == num_full_blocks  # all full blocks are cached...
    blocks, num_hit = kv.get_computed_blocks(make_request("b", prompt))
    assert len(blocks) == num_full_blocks - 1  # ...but the last token must be computed again
    assert num_hit == (num_full_blocks - 1) * BS
    one_more = make_request("c", prompt + [77])
    assert kv.get_computed_blocks(one_more)[1] == num_full_blocks * BS


def test_caching_disabled_never_hits():
    kv = KVCacheManager(16, BS, enable_caching=False)
    prompt = list(range(1, 18))
    admit(kv, make_request("a", prompt))
    assert kv.get_computed_blocks(make_request("b", prompt)) == ([], 0)
    assert kv.pool.cached == {}
    assert kv.stats.queries == 0 and kv.stats.hits == 0


def test_lru_eviction_of_cached_free_blocks():
    kv = KVCacheManager(3, BS)
    reqs = {name: make_request(name, [base + i for i in range(4)])
            for name, base in (("a", 10), ("b", 20), ("c", 30))}
    for name in "abc":
        admit(kv, reqs[name])  # a -> block 0, b -> block 1, c -> block 2; each full and cached
    hashes = {name: reqs[name].block_hashes[0] for name in "abc"}
    assert len(kv.pool.cached) == 3
    for name in "acb":  # free order: a first (least recently freed), then c, then b
        kv.free(reqs[name])
    assert free_queue(kv) == [0, 2, 1]
    assert len(kv.pool.cached) == 3  # free blocks stay cached until reused

    # A fresh request takes the least recently freed block and evicts its cache entry.
    x = make_request("x", [40, 41, 42, 43])
    assert admit(kv, x) == [0]
    assert kv.pool.get_cached_block(hashes["a"]) is None
    assert kv.get_computed_blocks(make_request("a2", [10, 11, 12, 13, 14])) == ([], 0)

    # A hit on a free cached block (c's) pulls it out of the free queue, so the next allocation
    # evicts b's block instead, although c's was freed earlier.
    d = make_request("d", [30, 31, 32, 33, 34])
    blocks, num_hit = kv.get_computed_blocks(d)
    assert [bl.block_id for bl in blocks] == [2] and num_hit == 4
    assert kv.allocate_slots(d, 1, blocks) == [1]
    assert kv.get_block_ids("d") == [2, 1]
    assert kv.pool.blocks[2].ref_cnt == 1
    assert kv.pool.get_cached_block(hashes["c"]) is kv.pool.blocks[2]
    assert kv.pool.get_cached_block(hashes["b"]) is None
    assert kv.pool.num_free_blocks == 0
    check_pool_consistent(kv)


def test_freed_blocks_keep_their_cache_entry_until_reused():
    kv = KVCacheManager(8, BS)
    prompt = list(range(1, 10))
    a = make_request("a", prompt)
    admit(kv, a)
    ids = kv.get_block_ids("a")
    kv.free(a)
    blocks, num_hit = kv.get_computed_blocks(make_request("b", prompt))
    assert [b.block_id for b in blocks] == ids[:2] and num_hit == 8


def test_prefix_cache_counters():
    kv = KVCacheManager(16, BS)
    prefix = list(range(1, 17))
    admit(kv, make_request("a", prefix + [1]))  # 17 tokens, no hits
    assert (kv.stats.queries, kv.stats.hits) == (17, 0)
    admit(kv, make_request("b", prefix + [2, 3]))  # 18 tokens, 16 hits
    assert (kv.stats.queries, kv.stats.hits) == (35, 16)
    assert kv.stats.hit_rate == pytest.approx(16 / 35)


def test_blocked_request_is_counted_once_in_prefix_cache_stats():
    """A waiting request retried while the pool is full must not inflate the counters every step."""
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(1, 13)))
    admit(kv, a)
    queries, hits = kv.stats.queries, kv.stats.hits
    b = make_request("b", list(range(1, 9)) + [50, 51, 52, 53, 54])  # 13 tokens: 8 hit, 2 more blocks
    for _ in range(5):  # the scheduler retries it each step until a frees its blocks
        assert admit(kv, b) is None
    kv.free(a)
    assert admit(kv, b) is not None
    assert (kv.stats.queries - queries, kv.stats.hits - hits) == (13, 8)


def test_drafts_are_never_committed_to_the_prefix_cache():
    kv = KVCacheManager(16, BS)
    a = make_request("a", [1, 2, 3])
    admit(kv, a)
    assert kv.pool.cached == {}  # no full block yet
    a.append_output_token(4)  # 4 verified tokens: block 0 complete
    # Step with 3 drafts (5, 6, 7): tokens 3..6 scheduled; 4..6 are drafts and fill most of block 1.
    a.spec_token_ids = [5, 6, 7]
    kv.allocate_slots(a, 1 + 3, num_draft_tokens=3)
    a.num_computed_tokens += 4
    assert len(kv.pool.cached) == 1
    assert kv.pool.blocks[kv.get_block_ids("a")[0]].block_hash == a.block_hashes[0]
    a.append_output_token(5)
    a.append_output_token(6)
    a.append_output_token(7)
    a.append_output_token(8)  # all drafts accepted + bonus: tokens are 1..8
    a.spec_token_ids = []
    # ... but the drafts' block was not cached when it was allocated:
    assert kv.pool.blocks[kv.get_block_ids("a")[1]].block_hash is None
    # Next step (no drafts) verifies tokens up to index 7: block 1 is now cached with the real tokens.
    a.num_computed_tokens = a.num_tokens - 1
    kv.allocate_slots(a, 1)
    assert kv.pool.blocks[kv.get_block_ids("a")[1]].block_hash == a.block_hashes[1]
    assert len(kv.pool.cached) == 2
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(b)[1] == 8
    check_pool_consistent(kv)


def test_rejected_drafts_never_become_prefix_hits():
    kv = KVCacheManager(16, BS)
    a = make_request("a", [1, 2, 3, 4])
    admit(kv, a)
    a.append_output_token(5)
    kv.allocate_slots(a, 1 + 3, num_draft_tokens=3)  # drafts 6, 7, 8 would complete block 1
    a.num_computed_tokens += 4
    a.append_output_token(60)  # the first draft was rejected: the target emitted 60
    a.num_computed_tokens -= 3
    assert a.num_computed_tokens == a.num_tokens - 1
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]))[1] == 4


def test_identical_blocks_computed_concurrently_keep_the_first_cache_entry():
    kv = KVCacheManager(8, BS)
    prompt = list(range(1, 10))
    a, b = make_request("a", prompt), make_request("b", prompt)
    # Both looked up before either was allocated (same step): neither hits.
    hits_a, hits_b = kv.get_computed_blocks(a), kv.get_computed_blocks(b)
    kv.allocate_slots(a, 9, hits_a[0])
    kv.allocate_slots(b, 9, hits_b[0])
    first = [kv.pool.blocks[i] for i in kv.get_block_ids("a")[:2]]
    assert [kv.pool.get_cached_block(h) for h in a.block_hashes[:2]] == first
    assert all(kv.pool.blocks[i].block_hash is None for i in kv.get_block_ids("b"))
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_free_blocks == 8
    check_pool_consistent(kv)


def test_reset_prefix_cache_forgets_every_hash():
    kv = KVCacheManager(8, BS)
    prompt = list(range(1, 10))
    a = make_request("a", prompt)
    admit(kv, a)
    kv.free(a)
    kv.reset_prefix_cache()
    assert kv.pool.cached == {}
    assert kv.get_computed_blocks(make_request("b", prompt)) == ([], 0)


def test_block_pool_refuses_to_over_allocate():
    pool = BlockPool(2, enable_caching=True)
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_usage_counts_referenced_blocks_only():
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(1, 13)))
    admit(kv, a)
    assert kv.usage == pytest.approx(3 / 8)
    kv.free(a)  # cached but free blocks do not count as used
    assert kv.usage == 0.0


@pytest.mark.parametrize("recompute_last", [False, True])
def test_a_drafter_reading_every_tokens_state_recomputes_the_last_hit_block(recompute_last):
    """With EAGLE a cached block's last drafter slot pairs its token with the next token of the request
    that filled it: the last hit block is computed again, so this request writes its own pairing."""
    kv = KVCacheManager(num_blocks=16, block_size=BS, recompute_last_hit_block=recompute_last)
    first = make_request("a", list(range(13)))  # three full blocks committed
    admit(kv, first)
    kv.free(first)
    second = make_request("b", list(range(12)) + [99, 98])  # the same three blocks, then other tokens
    blocks, num_hit = kv.get_computed_blocks(second)
    assert num_hit == (8 if recompute_last else 12) and len(blocks) == num_hit // BS


# ---------------------------------------------------------------- sliding windows


def decode(kv, request: Request, steps: int) -> None:
    """Append one token at a time, as the scheduler does for a decoding request."""
    for _ in range(steps):
        request.append_output_token(7)
        assert kv.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1


def test_window_blocks_are_freed_once_no_query_reads_them():
    """Window 6, blocks of 4: the query at position p reads p - 5 ..= p, so block b goes once p - 5 >= 4b + 4."""
    kv = KVCacheManager(16, BS, enable_caching=False, sliding_window=6)
    r = make_request("r", list(range(1, 11)))  # 10 tokens
    admit(kv, r)
    assert kv.num_request_blocks("r") == 3  # the prefill's first query (position 0) reads from block 0
    decode(kv, r, 1)  # the query at position 10 reads 5..10: block 0 (0..3) goes
    assert kv.num_request_blocks("r") == 2 and kv.pool.num_free_blocks == 16 - 2
    decode(kv, r, 20)
    assert kv.num_request_blocks("r") <= -(-6 // BS) + 1
    assert len(kv.get_block_ids("r")) == -(-r.num_tokens // BS)  # the table keeps its (stale) ids
    kv.free(r)
    assert kv.pool.num_free_blocks == 16
    check_pool_consistent(kv)


def _hybrid(num_full: int, num_window: int, window: int, caching: bool = True):
    from specserve.engine.kv_cache_manager import HybridKVCacheManager

    return HybridKVCacheManager(KVCacheManager(num_full, BS, caching),
                                KVCacheManager(num_window, BS, caching, sliding_window=window, null_block=True))


def test_hybrid_manager_keeps_full_blocks_and_frees_window_blocks():
    kv = _hybrid(32, 8, window=6)
    r = make_request("r", list(range(1, 11)))
    ids = admit(kv, r)
    assert len(ids) == 3 and all(isinstance(pair, tuple) for pair in ids)
    assert 0 not in [w for _, w in ids]  # the window pool's null block is never handed out
    decode(kv, r, 30)
    full, window = kv.num_request_blocks("r")
    assert full == -(-r.num_tokens // BS) and window <= -(-6 // BS) + 1
    assert kv.window.pool.num_free_blocks == 7 - window
    kv.free(r)
    assert kv.full.pool.num_free_blocks == 32 and kv.window.pool.num_free_blocks == 7
    check_pool_consistent(kv.full)


def test_hybrid_prefix_hit_needs_only_the_windows_blocks():
    """A second request with the first's 16-token prefix hits all four blocks: the full pool has them, and the
    window pool the ones the next query reads (block 3, from position 11 on); blocks 0-2, which the first
    request freed from the window pool, are the null block."""
    kv = _hybrid(32, 8, window=5)
    prefix = list(range(1, 17))
    a = make_request("a", prefix + [50])
    admit(kv, a)
    decode(kv, a, 12)  # a's window moves on: its first window blocks are freed (cached, not yet reused)
    b = make_request("b", prefix + [60, 61])
    (full_hit, window_hit), num_hit = kv.get_computed_blocks(b)
    assert num_hit == 16 and len(full_hit) == len(window_hit) == 4
    assert window_hit[:3] == [kv.window.pool.null_block] * 3 and window_hit[3] is not kv.window.pool.null_block
    assert kv.allocate_slots(b, b.num_tokens - num_hit, (full_hit, window_hit)) is not None
    kv.free(a)
    kv.free(b)
    assert kv.window.pool.num_free_blocks == 7 and kv.window.pool.null_block.ref_cnt == 0
    check_pool_consistent(kv.full)


def test_hybrid_prefix_hit_stops_where_the_window_pool_lost_a_block():
    kv = _hybrid(32, 8, window=5)
    prefix = list(range(1, 17))
    admit(kv, make_request("a", prefix + [50]))
    kv.window.pool.reset_prefix_cache()  # the window pool forgets every block: no hit can be read there
    b = make_request("b", prefix + [60])
    (full_hit, window_hit), num_hit = kv.get_computed_blocks(b)
    assert num_hit == 0 and full_hit == window_hit == []


def test_hybrid_allocation_fails_whole_when_either_pool_is_full():
    kv = _hybrid(32, 3, window=6)  # 2 usable window blocks
    r = make_request("r", list(range(1, 14)))  # 13 tokens: 4 blocks in each pool
    assert kv.allocate_slots(r, 13) is None
    assert kv.full.pool.num_free_blocks == 32 and kv.window.pool.num_free_blocks == 2
    assert kv.allocate_slots(r, 8) is not None  # 2 blocks each


# ---- KV a failed step wrote --------------------------------------------------------------------------------

def test_uncache_from_drops_the_blocks_from_that_token_on_and_keeps_those_before():
    kv = KVCacheManager(16, BS)
    prompt = list(range(1, 18))  # four full blocks and one token
    a = make_request("a", prompt)
    admit(kv, a)
    untrusted = kv.uncache_from(a, 6)  # tokens 6.. were written by a step that failed: blocks 1.. go
    assert untrusted == {kv.pool.blocks[i] for i in kv.get_block_ids("a")[1:]}
    blocks, num_hit = kv.get_computed_blocks(make_request("b", prompt))
    assert num_hit == BS and [x.block_id for x in blocks] == kv.get_block_ids("a")[:1]
    assert kv.holds_any("a", untrusted) and not kv.holds_any("b", untrusted)
    kv.free(a)
    assert kv.get_computed_blocks(make_request("c", prompt))[1] == BS
    check_pool_consistent(kv)


def test_uncache_from_leaves_an_identical_block_that_another_request_cached():
    kv = KVCacheManager(8, BS)
    prompt = list(range(1, 10))
    a, b = make_request("a", prompt), make_request("b", prompt)
    hits_a, hits_b = kv.get_computed_blocks(a), kv.get_computed_blocks(b)  # one step: neither hits
    kv.allocate_slots(a, 9, hits_a[0])
    kv.allocate_slots(b, 9, hits_b[0])  # b's blocks stay private: a's identical ones are cached
    kv.uncache_from(b, 0)
    assert kv.get_computed_blocks(make_request("c", prompt))[1] == 2 * BS


def test_hybrid_uncache_from_drops_the_blocks_in_both_pools():
    kv = _hybrid(32, 8, window=5)
    prompt = list(range(1, 18))
    a = make_request("a", prompt)
    admit(kv, a)
    untrusted = kv.uncache_from(a, 2 * BS)
    assert len(untrusted) == 2 * 3  # blocks 2, 3 and the partial 4 of each pool
    for pool in (kv.full.pool, kv.window.pool):
        assert [pool.get_cached_block(h) is None for h in a.block_hashes[:4]] == [False, False, True, True]
    (full_hit, _), num_hit = kv.get_computed_blocks(make_request("b", prompt))
    assert num_hit == 2 * BS and kv.holds_any("a", untrusted)
