"""Building, caching and falling back from the C paged-attention kernel."""
import pytest
import torch

from specserve.worker import paged_kernel


@pytest.fixture
def fresh_kernel_state(monkeypatch, tmp_path):
    """An empty kernel cache and no loaded library; the real state comes back afterwards."""
    saved = dict(paged_kernel._loaded)
    paged_kernel._loaded.clear()
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    yield tmp_path
    paged_kernel._loaded.clear()
    paged_kernel._loaded.update(saved)


def test_unknown_backend_is_refused(monkeypatch):
    monkeypatch.setenv(paged_kernel.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="SPECSERVE_ATTENTION_BACKEND must be one of"):
        paged_kernel.kernel_enabled()


def test_torch_backend_never_builds(monkeypatch, fresh_kernel_state):
    monkeypatch.setenv(paged_kernel.ENV_VAR, "torch")
    assert not paged_kernel.kernel_enabled()
    assert "lib" not in paged_kernel._loaded


def test_a_failing_compiler_falls_back_to_pytorch(monkeypatch, fresh_kernel_state):
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv(paged_kernel.ENV_VAR, "auto")
    assert not paged_kernel.kernel_enabled()
    assert not paged_kernel.kernel_usable(torch.float32)
    monkeypatch.setenv(paged_kernel.ENV_VAR, "kernel")
    with pytest.raises(RuntimeError, match="did not build"):
        paged_kernel.kernel_enabled()


@pytest.mark.skipif(paged_kernel.load_kernel() is None, reason="no C compiler")
def test_built_once_then_loaded_from_the_cache(fresh_kernel_state):
    assert paged_kernel.load_kernel() is not None
    built = list((fresh_kernel_state / "kernels").glob("paged_attention-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    paged_kernel._loaded.clear()
    assert paged_kernel.load_kernel() is not None
    assert built[0].stat().st_mtime_ns == mtime  # not rebuilt


def test_only_fp32_caches_use_the_kernel():
    assert not paged_kernel.kernel_usable(torch.bfloat16)
