"""Logits parity with transformers for tiny random Llama-family models through the paged KV cache."""
import pytest
import torch

from specserve.models.registry import build_model
from specserve.ops import kernels
from tests.kernel_support import require_c_kernels
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
    if ops == "c":
        require_c_kernels()
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


@pytest.mark.parametrize("ops", ["c", "torch"])
def test_aux_hidden_states_are_transformers_hidden_states(ops, monkeypatch):
    """Aux state i is the residual stream entering layer i: transformers' hidden_states[i]."""
    if ops == "c":
        require_c_kernels()
    monkeypatch.setenv(kernels.ENV_VAR, ops)
    hf = tiny_hf_model("llama", num_hidden_layers=4)
    model = build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32)
    model.set_aux_hidden_layers((3, 0, 2))
    tokens = torch.randint(0, 160, (11,), generator=torch.Generator().manual_seed(2))
    from specserve.ops.attention import build_attention_metadata, kv_caches

    caches = kv_caches(model.kv_cache_shape(2, 16), torch.float32, model.num_layers)
    meta = build_attention_metadata([11], [11], [[1]], 16, torch.arange(16, 27), ops == "c")
    with torch.inference_mode():
        _, aux = model.forward(tokens, torch.arange(11), meta, caches)
        expected = hf(tokens[None], output_hidden_states=True).hidden_states
    assert len(aux) == 3
    for state, layer in zip(aux, (3, 0, 2)):
        torch.testing.assert_close(state, expected[layer][0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="aux hidden layers"):
        model.set_aux_hidden_layers((4,))
