"""Giving the C heap's free pages back to the system once a model is built.

Repacking and fusing a model's weights allocates and frees tensors of a few to tens of MB; glibc serves
those from its heap (its mmap threshold rises to 32 MB after the first large free) and keeps the freed
space, so a 1.5B model's build leaves ~180 MB of free heap in the resident set, before the KV cache is
allocated beside it. `malloc_trim(0)` returns it. Elsewhere (another C library, another OS) nothing is done.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys


def trim_heap() -> bool:
    """Return the heap's free pages to the system; whether the C library could."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):  # not glibc
        return False
