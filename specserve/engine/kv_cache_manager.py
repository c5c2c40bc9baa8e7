"""Paged KV-cache bookkeeping: a block pool with a free list, reference counts and a prefix cache.

Pure Python (no torch). The runner owns the tensors; this module only decides which block ids a
request's tokens live in. A token at absolute index i of request r lives in slot
`block_ids(r)[i // block_size] * block_size + i % block_size`.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from specserve.engine.request import Request


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


def hash_block_tokens(parent_hash: bytes | None, token_ids: tuple[int, ...], extra_keys: tuple[str, ...] = ()) -> bytes:
    """Hash chain link: a block's identity is its tokens plus everything before it, plus the content
    hashes of the images whose placeholder tokens it holds (every image has the same placeholder ids).

    SHA-256 rather than Python's hash(): on a shared server a crafted prompt must not be able to
    collide with another user's cached prefix.
    """
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        digest.update(b"\x00mm:" + key.encode())
    return digest.digest()


def block_extra_keys(request: Request, start: int, end: int) -> tuple[str, ...]:
    """Hashes of the request's images whose placeholders overlap tokens [start, end)."""
    return tuple(f.hash for f in request.mm_features if f.offset < end and start < f.offset + f.length)


class BlockPool:
    """All KV blocks; unreferenced blocks sit in an LRU free queue and stay cached until reused.

    null_block: block 0 is kept out of use, as the placeholder of blocks a sliding window no longer needs (a
    prefix hit's blocks before the window): never allocated, freed, cached or read."""

    def __init__(self, num_blocks: int, enable_caching: bool, null_block: bool = False) -> None:
        if num_blocks < 1 + null_block:
            raise ValueError(f"num_blocks must be >= {1 + null_block}, got {num_blocks}")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        self.null_block = self.blocks[0] if null_block else None
        # Ordered oldest-freed first: allocation takes from the front, so the LRU cached block goes first.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(int(null_block), num_blocks))
        self.cached: dict[bytes, KVCacheBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on (cache-hit) blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > len(self.free_queue):
            raise RuntimeError(f"asked for {num_blocks} blocks, only {len(self.free_queue)} free")
        out = []
        for _ in range(num_blocks):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference per block; `blocks` is in eviction order (first freed, first reused)."""
        for block in blocks:
            if block is self.null_block:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = None

    def uncache(self, block: KVCacheBlock) -> None:
        """Take the block out of the prefix cache (its KV is not to be trusted); a request holding it keeps it."""
        self._evict(block)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        if block.block_hash is not None or block is self.null_block:
            return
        if block_hash in self.cached:
            return  # an identical block is already cached; this one stays private
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            self._evict(block)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up, counted once per admission (first allocation)
    hits: int = 0  # of those, tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Maps requests to blocks; prefix caching by a hash chain over full, verified blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 recompute_last_hit_block: bool = False, block_usable: Callable[[int], bool] | None = None,
                 sliding_window: int = 0, null_block: bool = False) -> None:
        """recompute_last_hit_block: a prefix hit leaves its last block to compute. For drafters whose KV
        slot p pairs the target's state of token p with token p + 1 (EAGLE), a cached block's last slot
        holds the token that followed it in the request that filled it; recomputing the block gives this
        request's own pairing (and the target's state of the last hit token, which the drafter needs).
        block_usable: block id -> whether a hit may use it (a drafter that needs the target's states of every
        token it lacks KV for: the hit stops at the first cached block without the drafter's KV).
        sliding_window: when every layer attends to at most this many tokens (0: some layer sees all), a
        request's blocks wholly before its next query's window are freed as it grows (kept in the prefix
        cache until reused): its KV stays within window / block_size + 2 blocks plus lookahead.
        null_block: reserve the pool's block 0 as the placeholder of a prefix hit's blocks before the window
        (HybridKVCacheManager's window group)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.recompute_last_hit_block = recompute_last_hit_block
        self.block_usable = block_usable
        self.pool = BlockPool(num_blocks, enable_caching, null_block)
        self.sliding_window = sliding_window
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.num_dropped_blocks: dict[str, int] = {}  # per request: its leading blocks freed past the window
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by some request (not free, nor only held by the prefix cache)."""
        return self.pool.num_blocks - self.pool.num_free_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table; blocks freed past the window keep their (stale) ids, never read."""
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def num_request_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (its table less the blocks freed past the window)."""
        return len(self.req_blocks.get(request_id, ())) - self.num_dropped_blocks.get(request_id, 0)

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend the request's hash chain to cover the full blocks among its first num_tokens tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        for i in range(len(hashes), min(num_tokens, len(tokens)) // bs):
            parent = hashes[i - 1] if i else None
            extra = block_extra_keys(request, i * bs, (i + 1) * bs) if request.mm_features else ()
            hashes.append(hash_block_tokens(parent, tuple(tokens[i * bs:(i + 1) * bs]), extra))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks; at least one token is always left to compute."""
        if not self.enable_caching:
            return [], 0
        max_hit_tokens = request.num_tokens - 1
        self._update_block_hashes(request, max_hit_tokens)
        blocks = []
        for block_hash in request.block_hashes[: max_hit_tokens // self.block_size]:
            block = self.pool.get_cached_block(block_hash)
            if block is None or (self.block_usable is not None and not self.block_usable(block.block_id)):
                break
            blocks.append(block)
        if self.recompute_last_hit_block and blocks:
            blocks.pop()
        # Counted in allocate_slots once the request is admitted, not here (see there).
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] = (),
        num_draft_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Reserve blocks for num_new_tokens more tokens (+ lookahead); None if there is no room.

        Returns the ids of the newly allocated blocks. The prefix cache commits only full blocks of
        verified tokens: the last num_draft_tokens of the new tokens are drafts and are never cached.
        """
        if not self.can_allocate(request, num_new_tokens, new_computed_blocks, num_lookahead_tokens):
            return None
        bs = self.block_size
        is_admission = request.request_id not in self.req_blocks
        num_needed = self._num_needed(request, num_new_tokens, new_computed_blocks, num_lookahead_tokens)
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * bs
        if self.enable_caching and is_admission:
            # Counted on admission only: a waiting request retried every step while the pool is full
            # must not count its lookup once per retry.
            self.stats.queries += request.num_tokens
            self.stats.hits += len(new_computed_blocks) * bs
        self.pool.touch(list(new_computed_blocks))
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.allocate(max(num_needed, 0))
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_verified_blocks(request, num_computed + num_new_tokens - num_draft_tokens)
        if self.sliding_window:
            self._drop_blocks_before_window(request.request_id, num_computed)
        return [b.block_id for b in new_blocks]

    def _drop_blocks_before_window(self, rid: str, first_query: int) -> None:
        """Free the blocks wholly before the window of the query at `first_query` (no later query of the request
        reaches back further); with prefix caching, only blocks already offered to the cache."""
        dead = max(0, first_query + 1 - self.sliding_window) // self.block_size
        if self.enable_caching:
            dead = min(dead, self.num_cached_blocks.get(rid, 0))
        start = self.num_dropped_blocks.get(rid, 0)
        if dead > start:
            self.pool.free(self.req_blocks[rid][start:dead])
            self.num_dropped_blocks[rid] = dead

    def _num_needed(self, request: Request, num_new_tokens: int, new_computed_blocks, num_lookahead_tokens: int) -> int:
        """Blocks to take from the pool for num_new_tokens more tokens (+ lookahead) after the hit blocks."""
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = -(-(num_computed + num_new_tokens + num_lookahead_tokens) // self.block_size)
        return num_required - len(self.req_blocks.get(request.request_id, ())) - len(new_computed_blocks)

    def can_allocate(self, request: Request, num_new_tokens: int, new_computed_blocks=(),
                     num_lookahead_tokens: int = 0) -> bool:
        """Whether allocate_slots with these arguments would find room."""
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and b is not self.pool.null_block)
        needed = self._num_needed(request, num_new_tokens, new_computed_blocks, num_lookahead_tokens)
        return needed <= self.pool.num_free_blocks - num_evictable_hits

    def window_hit(self, request: Request, num_blocks: int) -> list[KVCacheBlock] | None:
        """For a prefix hit of the request's first num_blocks full blocks (hashed already): the blocks a query
        after it reads in this pool, the null block for those before its window, or None when one of those it
        reads is not cached."""
        first = max(0, num_blocks * self.block_size + 1 - self.sliding_window) // self.block_size
        blocks = [self.pool.get_cached_block(h) for h in request.block_hashes[first:num_blocks]]
        if any(b is None for b in blocks):
            return None
        return [self.pool.null_block] * first + blocks

    def _cache_verified_blocks(self, request: Request, num_verified_tokens: int) -> None:
        rid = request.request_id
        num_full = min(num_verified_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request, num_full * self.block_size)
        blocks = self.req_blocks[rid]
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[rid] = num_full

    def uncache_from(self, request: Request, first_token: int) -> set[KVCacheBlock]:
        """Take the request's blocks that hold its tokens from first_token on out of the prefix cache, and return
        them: a step that wrote their KV failed for it. Its blocks before (an earlier step's KV, or a prefix hit)
        stay cached: their KV was complete before that step."""
        rid = request.request_id
        first_block = first_token // self.block_size
        untrusted = self.req_blocks.get(rid, [])[first_block:]
        for block in untrusted:
            self.pool.uncache(block)
        if rid in self.num_cached_blocks:
            self.num_cached_blocks[rid] = min(self.num_cached_blocks[rid], first_block)
        return set(untrusted)

    def holds_any(self, request_id: str, blocks: set[KVCacheBlock]) -> bool:
        """Whether the request holds (so its queries read) one of `blocks`."""
        held = self.req_blocks.get(request_id, [])[self.num_dropped_blocks.get(request_id, 0):]
        return any(block in blocks for block in held)

    def free(self, request: Request) -> None:
        """Release a finished or preempted request's blocks; its tail blocks are reused first."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        dropped = self.num_dropped_blocks.pop(request.request_id, 0)
        self.pool.free(list(reversed(blocks[dropped:])))

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()


class HybridKVCacheManager:
    """Block tables per group of layers, for models that mix full-attention layers with sliding-window ones
    (Gemma 3): two pools indexed by the same logical block numbers. The full group keeps all of a request's
    blocks; the window group frees those wholly before the window as the request grows, so its pool needs a
    window's blocks per running request, not a whole context's. A request's block ids are (full, window)
    pairs, which the runner splits into one table per group. Prefix caching runs in both pools with the same
    hash chain: a hit of n blocks needs all n in the full pool and, in the window pool, only those the next
    query's window reads (the null block stands for the others), so the hit is the longest n for which both
    hold."""

    def __init__(self, full: KVCacheManager, window: KVCacheManager) -> None:
        if not window.sliding_window or window.pool.null_block is None or full.sliding_window:
            raise ValueError("HybridKVCacheManager needs a full-attention manager and a sliding-window manager "
                             "with a null block")
        self.full, self.window = full, window
        self.block_size = full.block_size
        self.enable_caching = full.enable_caching
        self.sliding_window = 0  # the full group keeps every block of a request

    @property
    def stats(self) -> PrefixCacheStats:
        return self.full.stats

    @stats.setter
    def stats(self, stats: PrefixCacheStats) -> None:
        self.full.stats = stats

    @property
    def num_blocks(self) -> int:
        return self.full.num_blocks

    @property
    def usage(self) -> float:
        return max(self.full.usage, self.window.usage)

    @property
    def num_used_blocks(self) -> int:
        """The full-attention pool's (block numbers count tokens there; the window pool's are recycled)."""
        return self.full.num_used_blocks

    def get_block_ids(self, request_id: str) -> list[tuple[int, int]]:
        return list(zip(self.full.get_block_ids(request_id), self.window.get_block_ids(request_id)))

    def num_request_blocks(self, request_id: str) -> tuple[int, int]:
        """Blocks the request holds now in each pool: (full, window)."""
        return self.full.num_request_blocks(request_id), self.window.num_request_blocks(request_id)

    def get_computed_blocks(self, request: Request) -> tuple[tuple[list, list], int]:
        full_blocks, _ = self.full.get_computed_blocks(request)
        for n in range(len(full_blocks), 0, -1):
            window_blocks = self.window.window_hit(request, n)
            if window_blocks is not None:
                return (full_blocks[:n], window_blocks), n * self.block_size
        return ([], []), 0

    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks=((), ()),
                       num_draft_tokens: int = 0, num_lookahead_tokens: int = 0) -> list[tuple[int, int]] | None:
        full_hit, window_hit = new_computed_blocks or ((), ())
        if not (self.full.can_allocate(request, num_new_tokens, full_hit, num_lookahead_tokens)
                and self.window.can_allocate(request, num_new_tokens, window_hit, num_lookahead_tokens)):
            return None
        full_ids = self.full.allocate_slots(request, num_new_tokens, full_hit, num_draft_tokens, num_lookahead_tokens)
        window_ids = self.window.allocate_slots(request, num_new_tokens, window_hit, num_draft_tokens,
                                                num_lookahead_tokens)
        return list(zip(full_ids, window_ids))

    def uncache_from(self, request: Request, first_token: int) -> set[KVCacheBlock]:
        return self.full.uncache_from(request, first_token) | self.window.uncache_from(request, first_token)

    def holds_any(self, request_id: str, blocks: set[KVCacheBlock]) -> bool:
        return self.full.holds_any(request_id, blocks) or self.window.holds_any(request_id, blocks)

    def free(self, request: Request) -> None:
        self.full.free(request)
        self.window.free(request)

    def reset_prefix_cache(self) -> None:
        self.full.reset_prefix_cache()
        self.window.reset_prefix_cache()
