"""Peak resident memory of an engine: load a model, run one greedy request, and report the process's peak
resident set (VmHWM, Linux), the bytes of the model's own tensors (weights, their packed and screen copies,
RoPE tables; not the KV cache) and the KV cache's. Run it in a process of its own per figure: the peak is the
process's whole life.

    .venv/bin/python benchmarks/peak_memory.py --model qwen2.5-coder-1.5b-instruct [--kv-cache-memory-bytes N]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from specserve.llm import LLM
from specserve.models.gguf_quant import QuantizedWeight
from specserve.sampling_params import SamplingParams

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def status_mib(field: str) -> float:
    """A /proc/self/status memory field (VmHWM, VmRSS, ...) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def tensor_bytes(root, skip: set[int]) -> int:
    """Bytes of the distinct tensor storages reachable from `root` through specserve objects' attributes,
    lists, tuples and dicts (QuantizedWeights through their packed bytes), except the storages in `skip`."""
    seen, total, stack = set(skip), 0, [root]
    visited: set[int] = set()
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            ptr = obj.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += obj.untyped_storage().nbytes()
            continue
        if id(obj) in visited:
            continue
        visited.add(id(obj))
        if isinstance(obj, QuantizedWeight):
            stack.append(obj.packed)
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif type(obj).__module__.startswith("specserve") and hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a catalog name or a path (default: the default model)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    base = status_mib("VmRSS")
    start = time.perf_counter()
    llm = LLM(model=args.model, kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    load_s = time.perf_counter() - start
    llm.generate([PROMPT], SamplingParams(max_tokens=args.max_tokens, temperature=0), use_tqdm=False)
    engine = llm.llm_engine
    kv = [t for pair in engine.runner.kv_caches for t in pair]
    kv_ptrs = {t.untyped_storage().data_ptr() for t in kv}
    kv_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kv}.values())
    result = {
        "model": args.model or "default",
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "load_s": round(load_s, 1),
        "peak_rss_mb": round(status_mib("VmHWM") * 2**20 / 1e6, 1),
        "rss_mb": round(status_mib("VmRSS") * 2**20 / 1e6, 1),
        "before_load_rss_mb": round(base * 2**20 / 1e6, 1),
        "model_tensors_mb": round(tensor_bytes(engine.model, kv_ptrs) / 1e6, 1),
        "kv_cache_mb": round(kv_bytes / 1e6, 1),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
