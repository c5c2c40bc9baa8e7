"""Thread control for numpy's bundled OpenBLAS (ctypes into scipy-openblas; threadpoolctl is not a dependency).

FastLinear's numpy path runs OpenBLAS's own pthread pool next to torch's OpenMP pool; with both at 2
threads on 2 cores their spinning workers fight over the cores, so that path limits OpenBLAS to one
thread the first time it is used (see `ensure_single_thread`), unless the user set OPENBLAS_NUM_THREADS.
"""
from __future__ import annotations

import ctypes
import glob
import logging
import os
import threading
from typing import Optional

import numpy as np

logger = logging.getLogger(__name__)


def find_openblas():
    """(library, symbol prefix, symbol suffix) of numpy's bundled OpenBLAS, or None when not found."""
    libdir = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libdir, "*openblas*"))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in ("scipy_openblas", "openblas"):
            for suffix in ("64_", ""):
                names = (f"{prefix}_get_num_threads{suffix}", f"{prefix}_set_num_threads{suffix}")
                if all(hasattr(lib, name) for name in names):
                    return lib, prefix, suffix
    return None


def _find_setter():
    found = find_openblas()
    if found is None:
        return None, None
    lib, prefix, suffix = found
    return getattr(lib, f"{prefix}_get_num_threads{suffix}"), getattr(lib, f"{prefix}_set_num_threads{suffix}")


_get, _set = _find_setter()
_lock = threading.Lock()
_checked = False


def openblas_num_threads() -> Optional[int]:
    """Current OpenBLAS thread count of numpy's BLAS, or None if it cannot be queried."""
    return int(_get()) if _get is not None else None


def limit_openblas_threads(n: int = 1, *, force: bool = False) -> Optional[int]:
    """Set numpy's OpenBLAS thread count to ``n`` (process-wide) and return the old value.

    Without ``force`` this does nothing when the user set OPENBLAS_NUM_THREADS explicitly.
    Called automatically (n=1) the first time a FastLinear takes the numpy path.
    """
    if _set is None:
        return None
    if not force and "OPENBLAS_NUM_THREADS" in os.environ:
        return openblas_num_threads()
    old = openblas_num_threads()
    if old != n:
        _set(ctypes.c_int(n))
        logger.info("OpenBLAS threads %s -> %s (avoids OpenMP/OpenBLAS contention)", old, n)
    return old


def ensure_single_thread() -> None:
    """limit_openblas_threads(1), once per process."""
    global _checked
    if _checked:
        return
    with _lock:
        if not _checked:
            limit_openblas_threads(1)
            _checked = True
