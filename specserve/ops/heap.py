"""The C heap while a model is built, and its free pages once it is.

Repacking and fusing a model's weights allocates and frees tensors of a few to tens of MB. glibc serves those
from its heap once its mmap threshold has risen (it does after the first large free, up to 32 MB) and keeps the
freed space: a 1.5B model's build left ~180 MB of free heap in the resident set after building and peaked
0.3 GB above it while building, by as much as the order of frees happened to leave. While a model is built
(`mapped_large_allocations`), every allocation of 1 MiB or more is mapped on its own, so each free returns its
pages at once and the peak is what the model holds (Qwen2.5-Coder-1.5B, 64 MiB KV cache: 1.74 GB in each of
three runs, against 1.73-2.08 GB); afterwards the threshold stays at 32 MB, where glibc's own adjustment ends
up, so steps reuse their buffers from the heap as before. `trim_heap` returns what is left free. Elsewhere
(another C library, another OS) nothing is done.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys
from contextlib import contextmanager

_M_MMAP_THRESHOLD = -3  # mallopt's parameter
BUILD_MMAP_THRESHOLD = 1 << 20
RUN_MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit hosts


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


def trim_heap() -> bool:
    """Return the heap's free pages to the system; whether the C library could."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


@contextmanager
def mapped_large_allocations():
    """Within: allocations of BUILD_MMAP_THRESHOLD bytes and more are mapped one by one (their frees return
    their pages); after: a fixed threshold of RUN_MMAP_THRESHOLD."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, BUILD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(_M_MMAP_THRESHOLD, RUN_MMAP_THRESHOLD)
