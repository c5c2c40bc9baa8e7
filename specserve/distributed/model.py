"""The model the engine drives when tensor_parallel_size > 1: rank 0's shard, started with its workers."""
from __future__ import annotations

import torch

from specserve.distributed.executor import TensorParallelExecutor, make_workers, threads_per_rank
from specserve.distributed.sharding import TensorShard
from specserve.distributed.torchrun import TorchrunWorkers, serve_driver, torchrun_launch
from specserve.distributed.worker import (ARGMAX, FORWARD, LOGITS, ShardSpec, build_shard, decoder_config,
                                          load_for_sharding)

# Drafters that run on the target's own embedding and LM head, which tensor parallelism splits over ranks.
_SHARED_WEIGHT_DRAFTERS = ("eagle", "eagle3", "medusa")


class TensorParallelModel:
    """The driver's shard, called like any model. A call that computes (forward, logits, greedy argmax) is
    broadcast to the workers first, so every rank runs it on its shard; the results exist on the driver.
    Everything else (config, dtype, kv_cache_shape: this rank's KV heads, the vision tower) is the shard's."""

    def __init__(self, local, executor: TensorParallelExecutor) -> None:
        self.local, self.executor = local, executor

    @property
    def tensor_parallel_size(self) -> int:
        return self.executor.spec.size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, kv_caches, mm_embeds=None):
        """As LlamaForCausalLM.forward; the workers get the same inputs and use their own caches of this
        cache (same blocks, their heads)."""
        num_blocks, block_size = kv_caches[0][1].shape[:2]
        args = (kv_caches[0][1].data_ptr(), num_blocks, block_size, kv_caches[0][1].dtype, input_ids, positions, meta,
                mm_embeds)
        return self.executor.run(FORWARD, args,
                                 lambda: self.local.forward(input_ids, positions, meta, kv_caches, mm_embeds))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [M, hidden] → [M, vocab], gathered from every rank's vocabulary slice."""
        hidden = hidden.contiguous()
        return self.executor.run(LOGITS, (hidden,), lambda: self.local.compute_logits(hidden))

    def greedy_tokens(self, hidden: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [M, hidden] → [M] int64, the argmax of the whole vocabulary's logits."""
        hidden = hidden.contiguous()
        return self.executor.run(ARGMAX, (hidden, allowed), lambda: self.local.greedy_tokens(hidden, allowed))

    def shutdown(self) -> None:
        self.executor.shutdown()

    def __getattr__(self, name: str):
        if name in ("local", "executor"):  # not set yet (unpickling, a failed __init__)
            raise AttributeError(name)
        return getattr(self.local, name)


def check_speculative_config(speculative_config: dict | None, size: int) -> None:
    """ValueError for a drafter that cannot run beside a split target. ngram and suffix read token ids only;
    a draft model runs whole on the driver with its own KV cache (a self-draft too: the target's KV heads
    are spread over ranks)."""
    if not speculative_config:
        return
    method = speculative_config.get("method")
    name = method if method in _SHARED_WEIGHT_DRAFTERS else (
        speculative_config.get("drafter") if method == "auto" else None)
    if name in _SHARED_WEIGHT_DRAFTERS:
        raise ValueError(
            f"speculative method {name!r} runs on the target's embedding and LM head, which "
            f"tensor_parallel_size={size} splits across ranks: it is not supported with tensor parallelism "
            "(supported: ngram, suffix, draft_model, and auto with drafter 'draft_model' or 'none')")


def start_tensor_parallel(config, loaded) -> TensorParallelModel:
    """Start tensor_parallel_size - 1 workers (config.distributed_executor_backend), build the driver's
    shard from `loaded` (the checkpoint, as the engine loaded it) while they build theirs, and connect.

    Under torchrun (its variables set, no backend chosen) the launch's processes are the ranks: RANK 0 goes on
    as the driver, and any other rank serves it from here as a worker and ends its process with it."""
    size = config.tensor_parallel_size
    launch = torchrun_launch(config.distributed_executor_backend, size)
    check_speculative_config(config.speculative_config, size)
    TensorShard.create(decoder_config(loaded.config), 0, size)  # sizes that do not split fail before any start
    threads = threads_per_rank(launch.local_world_size if launch else size)
    spec = ShardSpec(config.model, config.torch_dtype, config.linear_weight_dtype, size, threads)
    if not all(isinstance(t, torch.Tensor) for t in loaded.state_dict.values()):
        loaded = load_for_sharding(spec)  # shards are slices of plain tensors, not of quantized blocks
    if launch is not None and launch.rank > 0:
        serve_driver(launch, spec, loaded)  # does not return
    workers = (TorchrunWorkers(spec, launch) if launch is not None
               else make_workers(config.distributed_executor_backend or "mp", spec))
    executor = TensorParallelExecutor(spec, workers)
    try:
        local = build_shard(loaded, spec, executor.group)
        executor.connect()
    except BaseException:
        executor.shutdown(graceful=False)
        raise
    return TensorParallelModel(local, executor)
