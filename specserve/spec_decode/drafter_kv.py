"""The one KV cache a drafter keeps (a draft model's layers, EAGLE's one layer): paged like the target's,
with as many blocks, indexed by the target's own block tables.

Its blocks come from the engine's memory budget (the engine sizes the pool for target + drafter bytes per
block), so a drafter cannot silently double memory. Sharing the block tables means no allocator of its
own: a slot is where the target keeps the same token, and blocks freed with the request are freed for both.
A prefix-cached block carries the drafter's KV of its tokens only if the drafter wrote all of it (a request
that never drafted leaves the target's blocks without it): `valid_blocks` records which do, a new request
counts its hit as far as they go, and a drafter that needs the target's states has the engine stop the hit
there too (KVCacheManager's block_usable), so the target recomputes what the drafter lacks.
"""
from __future__ import annotations

from specserve.ops.attention import AttentionMetadata, kv_caches, paged_metadata
from specserve.ops.kernels import kernel_usable
from specserve.spec_decode.proposer import KVCacheSpec


class DrafterKVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int, window: int = 0) -> None:
        """window: the target's KV window (KVCacheManager's sliding_window), 0 for none: blocks wholly before
        it may already belong to other requests, so writes never mark them."""
        self.spec = spec
        self.block_size = block_size
        self.window = window
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.caches = kv_caches(shape, spec.dtype, spec.num_layers)  # per layer (k, v)
        self.use_kernel = kernel_usable(spec.compute_dtype)
        self.num_valid: dict[str, int] = {}  # per request: tokens [0, n) whose drafter KV is in place
        self.tree_scratch: list[int] = []  # blocks no request owns, for drafting trees (the runner's tree scratch)
        self.valid_blocks: set[int] = set()  # blocks whose every slot holds the drafter's KV of their tokens

    def start(self, req_id: str, block_ids: list[int], num_computed_tokens: int) -> None:
        """A request new to the runner, or resumed after preemption: its first num_computed_tokens tokens
        are a prefix-cache hit, its other blocks new allocations (no drafter KV in them yet). Its drafter
        KV is in place for the leading hit blocks the drafter had written."""
        hit = num_computed_tokens // self.block_size
        self.allocated(block_ids[hit:])
        valid = 0
        while valid < hit and block_ids[valid] in self.valid_blocks:
            valid += 1
        self.num_valid[req_id] = min(num_computed_tokens, valid * self.block_size)

    def allocated(self, block_ids: list[int]) -> None:
        """Blocks a request has just been given: whatever drafter KV they held belonged to other tokens."""
        self.valid_blocks.difference_update(block_ids)

    def written(self, req_id: str, end: int, block_table: list[int]) -> None:
        """The drafter's KV of the request's tokens [0, end) is in place."""
        self.num_valid[req_id] = end
        first = max(0, end - self.window) // self.block_size if self.window else 0
        self.valid_blocks.update(block_table[first:end // self.block_size])

    def has_block(self, block_id: int) -> bool:
        return block_id in self.valid_blocks

    def forget(self, req_id: str) -> None:
        self.num_valid.pop(req_id, None)

    def reset(self) -> None:
        self.num_valid.clear()
        self.valid_blocks.clear()

    def metadata(self, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]]
                 ) -> AttentionMetadata:
        """Attention over each request's first context_lens[i] tokens; the last query_lens[i] are written."""
        return paged_metadata(query_lens, context_lens, block_tables, self.block_size, self.use_kernel)
