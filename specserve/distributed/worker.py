"""A tensor-parallel rank's model shard, and the worker loop that runs the driver's commands on it.

Every rank builds its shard from the checkpoint itself (sharding.py, layers.py). A worker then waits for
the driver's broadcast commands: a forward over the step's inputs, the LM head's logits or greedy argmax
over given hidden states, or shutdown. The driver runs each command on its own shard right after sending
it, so all ranks meet in the same collectives in the same order.
"""
from __future__ import annotations

import os
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NoReturn

import torch

from specserve.distributed.group import TensorParallelGroup, worker_store
from specserve.distributed.layers import parallelize
from specserve.distributed.sharding import TensorShard, shard_state_dict
from specserve.models.llama import DecoderConfig
from specserve.models.loader import LoadedModel, load_model_weights
from specserve.models.qwen2_vl import text_decoder_config
from specserve.models.registry import build_model, model_class
from specserve.ops.attention import kv_caches

FORWARD, LOGITS, ARGMAX, SHUTDOWN = "forward", "logits", "argmax", "shutdown"


class DriverGone(Exception):
    """The driver's connection closed while a worker waited for its next command: the driver's process ended
    without the shutdown command (killed, or a signal that skips exit handlers)."""


@dataclass(frozen=True)
class ShardSpec:
    """What every rank needs to build its shard (sent to each worker when it starts)."""

    model: str | None  # HF folder or .gguf file; None: the default model (it must exist on every host)
    dtype: torch.dtype
    weight_dtype: object  # as EngineConfig.linear_weight_dtype
    size: int  # tensor_parallel_size
    threads: int  # torch threads per rank


def ready_key(rank: int) -> str:
    return f"specserve/tp/ready/{rank}"


def error_key(rank: int) -> str:
    return f"specserve/tp/error/{rank}"


def decoder_config(hf_config: dict) -> DecoderConfig:
    """The text decoder's config of a checkpoint (a Qwen2-VL config's language-model part)."""
    if model_class(hf_config).uses_mrope:
        hf_config = text_decoder_config(hf_config)
    return DecoderConfig.from_hf(hf_config)


def load_for_sharding(spec: ShardSpec) -> LoadedModel:
    """The whole checkpoint in plain tensors (a GGUF file dequantized): the shards are slices of it."""
    return load_model_weights(spec.model, dtype=spec.dtype, keep_quantized=False)


def build_shard(loaded: LoadedModel, spec: ShardSpec, group: TensorParallelGroup):
    """This rank's model: its slices of the weights, with the collectives of `group` (connected later)."""
    shard = TensorShard.create(decoder_config(loaded.config), group.rank, spec.size)
    weights, row_biases = shard_state_dict(loaded.state_dict, shard, keep_vision=group.is_driver)
    model = build_model(loaded.config, weights, dtype=spec.dtype, weight_dtype=spec.weight_dtype, shard=shard)
    parallelize(model, shard, group, row_biases)
    return model


class ShardWorker:
    """A worker rank's shard and KV caches, serving the driver's commands until shutdown."""

    def __init__(self, model, group: TensorParallelGroup) -> None:
        self.model, self.group = model, group
        # The KV caches of each driver cache (cache id → this rank's heads of it), allocated on first use.
        self.kv_caches: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @torch.inference_mode()
    def serve(self) -> None:
        handlers = {FORWARD: self.forward, LOGITS: self.model.lm_head, ARGMAX: self.model.lm_head.argmax}
        while True:
            try:
                name, args = self.group.broadcast_object()
            except RuntimeError as exc:
                raise DriverGone(str(exc).splitlines()[0]) from None
            if name == SHUTDOWN:
                return
            handlers[name](*args)

    def forward(self, cache_id: int, num_blocks: int, block_size: int, kv_dtype, input_ids, positions, meta,
                mm_embeds):
        """kv_dtype: how the driver's cache stores K/V (ops/kv_cache.py); this rank's heads are stored the same."""
        caches = self.kv_caches.get(cache_id)
        if caches is None or caches[0][1].shape[:2] != (num_blocks, block_size) or caches[0][1].dtype != kv_dtype:
            caches = self.kv_caches[cache_id] = kv_caches(self.model.kv_cache_shape(num_blocks, block_size),
                                                          kv_dtype, self.model.num_layers)
        self.model.forward(input_ids, positions, meta, caches, mm_embeds)


def run_worker(spec: ShardSpec, rank: int, store, host: str | None, loaded: LoadedModel | None = None) -> None:
    """A worker's life: build its shard (from `loaded`, else from the checkpoint), tell the driver (store key),
    join the group, serve. A failure is posted to the store (the driver reports it) and re-raised."""
    with failure_posted(store, rank):
        torch.set_num_threads(spec.threads)
        group = TensorParallelGroup(rank, spec.size)
        model = build_shard(loaded or load_for_sharding(spec), spec, group)
        store.set(ready_key(rank), "1")
        group.connect(store, host)
        ShardWorker(model, group).serve()
        group.close()


@contextmanager
def failure_posted(store, rank: int):
    """Post the traceback of a failure inside the block to the store, for the driver to report; re-raise it."""
    try:
        yield
    except DriverGone:
        raise
    except BaseException:
        try:
            store.set(error_key(rank), traceback.format_exc())
        except Exception:  # the driver (and its store) may be gone
            pass
        raise


def process_main() -> None:
    """Entry point of a local worker process: (ShardSpec, rank, host, port, sys.path) arrive pickled on stdin."""
    spec, rank, host, port, path = pickle.load(sys.stdin.buffer)
    sys.path[:0] = [p for p in path if p not in sys.path]
    _exit_with_parent()
    serve_and_exit(rank, lambda: run_worker(spec, rank, worker_store(host, port, spec.size), host))


def serve_and_exit(rank: int, serve: Callable[[], None]) -> NoReturn:
    """Run a worker's life, then end its process: 0 after the driver's shutdown or when the driver is gone,
    1 after a failure (its traceback printed)."""
    try:
        serve()
    except DriverGone:
        print(f"specserve tensor-parallel worker rank {rank}: the driver is gone; exiting", file=sys.stderr)
        code = 0
    except BaseException:
        traceback.print_exc()
        code = 1
    else:
        code = 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # gloo's threads must not keep the process alive


def _exit_with_parent() -> None:
    """Exit when the driver's process is gone, even while loading weights (no collective to fail then)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="specserve-tp-parent-watch", daemon=True).start()
