"""Tests that need specserve's C kernels: skipped where they do not build, failed where they must build.

CI runs with SPECSERVE_KERNELS=c, so a .c file that stops compiling fails these tests with the compiler's
error instead of turning them into skips and a green run.
"""
from __future__ import annotations

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
