"""Logits parity with transformers for tiny random Llama-family models through the paged KV cache."""
import pytest
import torch

from specserve.models.registry import build_model
from specserve.ops import kernels
from tests.paged_harness import max_logit_errors
from tests.tiny_models import hf_config_dict, hf_state_dict, tiny_hf_model

CASES = [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True), ("qwen3", False),
         ("qwen3", True), ("mistral", False)]


def _reference_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1].float()


@pytest.mark.parametrize("ops", ["c", "torch"])  # specserve's C kernels, and the PyTorch fallback
@pytest.mark.parametrize("kind,tie", CASES)
def test_prefill_and_decode_match_transformers(kind, tie, ops, monkeypatch):
    if ops == "c" and kernels.load_kernel() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv(kernels.ENV_VAR, ops)
    hf = tiny_hf_model(kind, tie=tie)
    model = build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32)
    assert model.layers[0].c_ops == (ops == "c")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (13, 5, 22)]
    # Token budget 7: prompts are prefetched in chunks, decodes ride along with other prefills.
    worst = max_logit_errors(model, prompts, 10, 7, lambda tokens: _reference_logits(hf, tokens))
    assert max(worst.values()) < 1e-4, worst


def test_long_prefill_through_sdpa_per_request(monkeypatch):
    # the PyTorch attention path runs queries over 16 tokens one request at a time (the C kernel takes
    # every request; the test above covers it)
    monkeypatch.setenv(kernels.ENV_VAR, "torch")
    hf = tiny_hf_model("llama")
    model = build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (40, 3)]
    worst = max_logit_errors(model, prompts, 3, 64, lambda tokens: _reference_logits(hf, tokens))
    assert max(worst.values()) < 1e-4, worst
