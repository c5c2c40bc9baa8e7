"""The C paged-attention kernel (csrc/paged_attention.c): compiled on first use, loaded with ctypes.

The kernel is built with the machine's C compiler (`cc -O3 -march=native -fopenmp`) into
`~/.cache/specserve/kernels/` (or `$SPECSERVE_CACHE_DIR/kernels`), keyed by the source, the flags and the
CPU, so later starts load it in milliseconds. Its OpenMP calls resolve to the libgomp that PyTorch has
already loaded, so it runs on torch's thread pool and follows `torch.set_num_threads`.

`SPECSERVE_ATTENTION_BACKEND`: `auto` (default: the kernel when it builds, else PyTorch), `kernel` (fail if
it does not build), `torch` (never use it).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV_VAR = "SPECSERVE_ATTENTION_BACKEND"
BACKENDS = ("auto", "kernel", "torch")
SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]

_lock = threading.Lock()
_loaded: dict[str, object] = {}


def attention_backend() -> str:
    name = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"{ENV_VAR} must be one of {BACKENDS}, got {name!r}")
    return name


def kernel_enabled() -> bool:
    """Whether paged attention should call the C kernel (building it on the first call)."""
    backend = attention_backend()
    if backend == "torch":
        return False
    lib = load_kernel()
    if lib is None and backend == "kernel":
        raise RuntimeError(f"{ENV_VAR}=kernel but the C kernel did not build: {_loaded.get('error')}")
    return lib is not None


def kernel_usable(cache_dtype: torch.dtype) -> bool:
    """Whether a runner whose KV cache has `cache_dtype` should build metadata for the kernel (fp32 only)."""
    return cache_dtype == torch.float32 and kernel_enabled()


def load_kernel():
    """The loaded library, or None when it cannot be built here (the reason is logged once)."""
    with _lock:
        if "lib" not in _loaded:
            try:
                _loaded["lib"] = _bind(ctypes.CDLL(str(_build())))
            except (OSError, subprocess.SubprocessError, RuntimeError) as e:
                _loaded["lib"], _loaded["error"] = None, str(e)
                logger.warning("paged-attention C kernel unavailable, using PyTorch attention: %s", e)
        return _loaded["lib"]


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    return cc


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    return line
    except OSError:
        pass
    return os.uname().machine


def _build() -> Path:
    from specserve.models.gguf_loader import cache_root

    cc = _compiler()
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([cc, *FLAGS, _cpu_model()]).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"paged_attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(out), "-lm"], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed on {SOURCE.name}: {proc.stderr.strip()[:500]}")
        os.replace(out, target)  # atomic: a concurrent process sees the old state or the whole file
    logger.info("built the paged-attention kernel: %s", target)
    return target


def _bind(lib):
    fn = lib.paged_attention_f32
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float]
    fn.restype = ctypes.c_int
    return lib


def paged_attention_short(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_table: torch.Tensor, query_start: torch.Tensor, query_len: torch.Tensor,
                          context_len: torch.Tensor, scale: float) -> None:
    """Write the attention output of the listed requests' query tokens into `out` ([N, H * D]).

    q: [N, H, D]; caches: [num_blocks, block_size, Hkv, D]; block_table: [S, W] int64;
    query_start, query_len, context_len: [S] int64. All fp32/int64 and contiguous.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    for name, t, dtype in (("q", q, torch.float32), ("out", out, torch.float32), ("k_cache", k_cache, torch.float32),
                           ("v_cache", v_cache, torch.float32), ("block_table", block_table, torch.int64),
                           ("query_start", query_start, torch.int64), ("query_len", query_len, torch.int64),
                           ("context_len", context_len, torch.int64)):
        if t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"paged kernel: {name} must be contiguous {dtype}, got {t.dtype}")
    lib = _loaded.get("lib") or load_kernel()
    if lib is None:
        raise RuntimeError(f"the paged-attention C kernel is unavailable: {_loaded.get('error')}")
    failed = lib.paged_attention_f32(
        q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(),
        block_table.shape[1], query_start.data_ptr(), query_len.data_ptr(), context_len.data_ptr(),
        len(query_start), num_heads, num_kv_heads, head_dim, block_size, float(scale))
    if failed:
        raise MemoryError("paged kernel: out of memory for its work buffer")
