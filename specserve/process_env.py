"""The OpenMP settings specserve wants in a process it owns (the command line, the server, its worker
processes): applied before torch loads libgomp, and only where the user has not chosen values. Importing
specserve as a library changes nothing in its host's environment.

OpenMP workers that spin while they wait take the cores from other processes on a shared machine, and
workers that sleep at once pay a wake-up at each of the ~150 parallel regions of a decode step: a short
spin (GOMP_SPINCOUNT 2000, tens of microseconds, the gap between two regions of one step) then sleep is
the balance (docs/performance.md has the measurement).
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping

OMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "2000"}


def apply(environ: MutableMapping[str, str] = os.environ) -> MutableMapping[str, str]:
    """Set the defaults in `environ` (this process's by default) where unset; returns it."""
    for name, value in OMP_DEFAULTS.items():
        environ.setdefault(name, value)
    return environ
