"""The one KV cache a drafter keeps (a draft model's layers, EAGLE's one layer): paged like the target's,
with as many blocks, indexed by the target's own block tables.

Its blocks come from the engine's memory budget (the engine sizes the pool for target + drafter bytes per
block), so a drafter cannot silently double memory. Sharing the block tables means no allocator of its
own: a slot is where the target keeps the same token, blocks freed with the request are freed for both,
and prefix-cached blocks carry the drafter's KV of the same tokens along with the target's.
"""
from __future__ import annotations

from specserve.ops.attention import AttentionMetadata, kv_caches, paged_metadata
from specserve.ops.kernels import kernel_usable
from specserve.spec_decode.proposer import KVCacheSpec


class DrafterKVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int) -> None:
        self.spec = spec
        self.block_size = block_size
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.caches = kv_caches(shape, spec.dtype, spec.num_layers)  # per layer (k, v)
        self.use_kernel = kernel_usable(spec.dtype)
        # Per request: tokens [0, n) whose drafter KV is in place. A request (re)scheduled from scratch
        # starts at its target's num_computed_tokens: prefix-cache hits come with the drafter's KV.
        self.num_valid: dict[str, int] = {}

    def start(self, req_id: str, num_computed_tokens: int) -> None:
        """A request new to the runner, or resumed after preemption (its old blocks are gone)."""
        self.num_valid[req_id] = num_computed_tokens

    def forget(self, req_id: str) -> None:
        self.num_valid.pop(req_id, None)

    def metadata(self, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]]
                 ) -> AttentionMetadata:
        """Attention over each request's first context_lens[i] tokens; the last query_lens[i] are written."""
        return paged_metadata(query_lens, context_lens, block_tables, self.block_size, self.use_kernel)
