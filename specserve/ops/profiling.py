"""Measuring the machine and the C kernels, for the benchmarks (benchmarks/step_rows.py): the rates a
step's bound is made of (csrc/probe.c) and the fused decoder stack's profile counters (csrc/decoder.c)."""
from __future__ import annotations

import ctypes
import time

import torch

from specserve.ops.kernels import _lib


def machine_rates(read_bytes: int, repeats: int = 20) -> tuple[float, float]:
    """(bytes read per second from memory over a buffer of `read_bytes`, 512-bit int8 dot products per second
    (AVX512-VNNI; 0 where the CPU has none)), each the best of `repeats`, on the kernels' threads
    (csrc/probe.c). For benchmarks' bounds."""
    buf = torch.ones(-(-read_bytes // 256) * 256, dtype=torch.uint8)
    lib, best_read, best_dot = _lib(), float("inf"), float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        lib.probe_read(buf.data_ptr(), buf.numel())
        best_read = min(best_read, time.perf_counter() - start)
        start = time.perf_counter()
        done = lib.probe_dot_products(200_000)
        best_dot = min(best_dot, time.perf_counter() - start)
    return buf.numel() / best_read, done / best_dot


DECODER_PROFILE_PARTS = ("projections", "attention", "other_ops")


def decoder_profile(reset: bool = False) -> dict[str, float]:
    """Profiling of the fused decoder stack (benchmarks only): seconds per part since the last call, and
    profiling on from now on (`reset` starts it without reading)."""
    out = (ctypes.c_double * len(DECODER_PROFILE_PARTS))()
    _lib().decoder_profile_f32(1, None if reset else out)
    return {} if reset else dict(zip(DECODER_PROFILE_PARTS, out))


def stop_decoder_profile() -> None:
    """Profiling of the fused decoder stack off (the counters reset)."""
    _lib().decoder_profile_f32(0, None)
