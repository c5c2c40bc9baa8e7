"""Targets shared by the EAGLE and Medusa end-to-end tests (built once per test module)."""
import pytest

from tests.spec_decode.test_eagle_e2e import Target, llama_target, qwen_target


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Target:
    """A tiny Llama that counts x -> x + 1 until its layers make it jump (drafters accept often, not always)."""
    return llama_target(tmp_path_factory)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Target:
    """A tiny Qwen2-VL text decoder (M-RoPE)."""
    return qwen_target(tmp_path_factory)
