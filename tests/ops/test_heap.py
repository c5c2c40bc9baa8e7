"""ops/heap.py: while a model is built, freeing a large buffer returns its pages to the system at once."""
from __future__ import annotations

import subprocess
import sys

import pytest

from specserve.ops import heap

pytestmark = pytest.mark.skipif(heap._libc() is None or not sys.platform.startswith("linux"),
                                reason="needs glibc's mallopt and /proc")

# In a fresh interpreter, as an engine's build starts: resident MiB that 64 freed buffers of 3 MiB (each before
# a kept small one, so the heap cannot shrink past it) leave behind, within the context and then after it.
CHURN = """
import numpy as np
from specserve.ops import heap

def resident_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

def churn():
    kept, freed = [], []
    for _ in range(64):
        freed.append(np.ones(3 << 18, np.float32))
        kept.append(np.ones(1 << 14, np.float32))
    before = resident_mib()
    freed.clear()
    return before - resident_mib()

with heap.mapped_large_allocations():
    during = churn()
print(during, churn())
"""


def test_building_returns_freed_buffers_at_once():
    out = subprocess.run([sys.executable, "-c", CHURN], capture_output=True, text=True, check=True).stdout
    during, after = map(float, out.split())
    assert during > 150  # of 192 MiB freed: every buffer mapped on its own
    assert after < 50  # after building: served from the heap and kept for the next steps' buffers
