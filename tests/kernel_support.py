"""Tests that need specserve's C kernels: skipped where they do not build, failed where they must build.

CI runs with SPECSERVE_KERNELS=c, so a .c file that stops compiling fails these tests with the compiler's
error instead of turning them into skips and a green run.
"""
from __future__ import annotations

import contextlib

import pytest

from specserve.ops import kernels

# Mark a test (or a pytest.param) with this; tests/conftest.py calls require_c_kernels() before it runs.
requires_c_kernels = pytest.mark.requires_c_kernels


def require_c_kernels() -> None:
    """Return when the C kernels load; otherwise fail under SPECSERVE_KERNELS=c, else skip."""
    if kernels.kernels_backend() == "torch":
        pytest.skip(f"{kernels.ENV_VAR}=torch turns the C kernels off")
    if kernels.load_kernel() is not None:
        return
    error = kernels._loaded.get("error")
    if kernels.kernels_backend() == "c":
        pytest.fail(f"{kernels.ENV_VAR}=c but the C kernels did not build: {error}", pytrace=False)
    pytest.skip(f"the C kernels do not build here ({kernels.ENV_VAR}=c would fail instead): {error}")


def int8_paths_to_test() -> list[str]:
    """The int8 kernels' instruction-set paths this CPU runs, and the AMX path's code on emulated tiles where
    the VNNI path runs (so the AMX code is checked on CPUs without AMX too)."""
    paths = kernels.int8_paths()
    return paths + ([kernels.AMX_EMULATED] if "avx512_vnni" in paths else [])


@contextlib.contextmanager
def int8_path(name: str):
    """The int8 kernels on path `name` inside the block, the default after it."""
    kernels.set_int8_path(name)
    try:
        yield
    finally:
        kernels.set_int8_path(None)
