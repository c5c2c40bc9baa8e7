"""Throughput of the int8-activation GEMMs on k-quant blocks against the row count, at Qwen2.5-Coder-1.5B's
shapes (an MLP's gate/up and down projections in Q4_K, and its Q6_K blocks): ms a call and billions of int8
products a second (one per weight, row and activation digit), the kernel path the routes pick. Random blocks
with sane scales: the arithmetic does not depend on the values.

    .venv/bin/python benchmarks/gemm_rows.py --rows 1,9,33,128 [--digits 2] [--path avx2]

What these compare with: benchmarks/maddubs_peak.c, the products a second of a loop of nothing but the AVX2
int8 dot-product instruction and its adds.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from specserve.models.gguf_quant import QuantizedWeight
from specserve.ops import kernels

SHAPES = (("Q4_K", 8960, 1536), ("Q4_K", 1536, 8960), ("Q6_K", 8960, 1536))  # (qtype, out, in)


def random_blocks(rng: np.random.Generator, qtype: str, n: int, k: int) -> np.ndarray:
    """Raw blocks of a k-quant tensor [n, k]: random bytes, the fp16 super-block scales in a sane range."""
    per_block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, size=(n * k // per_block, nbytes), dtype=np.uint8)
    for at in ((208,) if qtype == "Q6_K" else (0, 2)):
        scales = rng.uniform(1e-4, 2e-3, raw.shape[0]) * rng.choice([-1, 1], raw.shape[0])
        raw[:, at:at + 2] = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


def best_ms(fn, calls: int, rounds: int = 9) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return min(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,9,33,128", help="comma-separated row counts")
    p.add_argument("--digits", type=int, default=2, choices=(1, 2), help="int8 digits an activation")
    p.add_argument("--path", default=None, help="force an int8 path (see `specserve kernels`)")
    args = p.parse_args()
    if args.path:
        kernels.set_int8_path(args.path)
    rng = np.random.default_rng(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"torch threads {torch.get_num_threads()}, {args.digits} digit(s) an activation")
    for qtype, n, k in SHAPES:
        w = QuantizedWeight.from_gguf(random_blocks(rng, qtype, n, k), qtype, (n, k))
        w = w.for_int8_activations(args.digits)
        x = torch.from_numpy(rng.standard_normal((max(rows_list), k)).astype(np.float32))
        for rows in rows_list:
            xs = x[:rows].contiguous()
            ms = best_ms(lambda: kernels.gemm_weight(xs, w.packed, w.weight_format, None, n), max(1, 40 // rows))
            kernel = "gemm" if qtype == "Q4_K" else "gemm_q8"
            print(f"{qtype} {n}x{k} rows {rows:4d} ({kernels.int8_route(kernel, rows)}): {ms:8.2f} ms, "
                  f"{rows * n * k * args.digits / ms / 1e6:6.1f} G products/s", flush=True)


if __name__ == "__main__":
    main()
