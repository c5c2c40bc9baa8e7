"""ops/heap.py: while a model is built, freeing a large buffer returns its pages to the system at once."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from specserve.ops import heap

pytestmark = pytest.mark.skipif(heap._libc() is None, reason="needs glibc's mallopt")


def resident_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def churn() -> float:
    """Resident MiB that 64 freed buffers of 3 MiB (each between two kept small ones) leave behind."""
    kept, freed = [], []
    for _ in range(64):
        freed.append(np.ones(3 << 18, np.float32))  # 3 MiB, touched
        kept.append(np.ones(1 << 14, np.float32))  # 64 KiB after it: the heap cannot shrink past it
    before = resident_mib()
    freed.clear()
    return before - resident_mib()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_building_returns_freed_buffers_at_once():
    with heap.mapped_large_allocations():
        returned = churn()
    assert returned > 150  # of 192 MiB freed
    kept_in_heap = churn()  # after building: served from the heap and kept for the next steps' buffers
    assert kept_in_heap < 50

