"""Targets shared by the EAGLE and Medusa end-to-end tests (built once per test module), and the step costs
every engine here starts from."""
import pytest

from specserve.worker.calibration import StepCalibrator
from tests.spec_decode.test_eagle_e2e import Target, llama_target, qwen_target


@pytest.fixture(autouse=True)
def memory_bound_calibration(monkeypatch):
    """The engine's calibration before the first request reads a memory-bound step (20 ms, 0.5 ms a token:
    a draft costs ~2.5% of a step, as for a model whose weights dominate a step) instead of timing the tiny
    test models, whose steps are Python overhead: the drafters' tests see drafting pay from the first step
    on every machine. Live steps are still timed; tests that fix the costs replace those too."""
    monkeypatch.setattr(StepCalibrator, "timed_step",
                        lambda self, num_requests, num_tokens, context, blocks, repeats=3:
                        0.02 + 0.0005 * num_requests * num_tokens)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Target:
    """A tiny Llama that counts x -> x + 1 until its layers make it jump (drafters accept often, not always)."""
    return llama_target(tmp_path_factory)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Target:
    """A tiny Qwen2-VL text decoder (M-RoPE)."""
    return qwen_target(tmp_path_factory)
