"""Fixtures shared by the model tests."""
import pytest


@pytest.fixture(params=["default", "torch"])
def backend(request, monkeypatch):
    """SPECSERVE_KERNELS as the run sets it (the C kernels where they build; CI's "c" requires them), and
    the PyTorch fallback."""
    if request.param == "torch":
        monkeypatch.setenv("SPECSERVE_KERNELS", "torch")
    return request.param
