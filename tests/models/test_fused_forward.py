"""The fused C decoder stack (ops/csrc/decoder.c) against the same kernels called layer by layer."""
import pytest
import torch

from specserve.models.registry import build_model
from specserve.ops import kernels
from specserve.ops.attention import build_attention_metadata, kv_caches
from tests.kernel_support import requires_c_kernels
from tests.models.test_qwen2_vl_parity import tiny_qwen2_vl
from tests.tiny_models import hf_config_dict, hf_state_dict, tiny_hf_model

pytestmark = requires_c_kernels

BLOCK = 16
# (request, first position, query length) per step: a prefill chunk, then a batch of two requests with
# another's prefill, decodes and 1 + k verification queries.
STEPS = [[(0, 0, 37)], [(0, 37, 1), (1, 0, 20)], [(0, 38, 9), (1, 20, 1)], [(1, 21, 4), (0, 47, 1)]]


def _run(model, fused: bool, mrope: bool):
    """Hidden states (and aux states, when the model is asked for them) of every step, and the KV caches."""
    model.fused_forward = fused
    shape = model.kv_cache_shape(16, BLOCK)
    caches = kv_caches(shape, torch.float32, model.num_layers)
    tables = {0: [3, 0, 5, 7], 1: [1, 2]}
    g = torch.Generator().manual_seed(5)
    tokens = {r: torch.randint(0, model.config.vocab_size, (60,), generator=g) for r in tables}
    outputs = []
    with torch.inference_mode():
        for step in STEPS:
            ids, positions, slots = [], [], []
            for r, start, q in step:
                ids.append(tokens[r][start:start + q])
                positions.extend(range(start, start + q))
                slots.extend(tables[r][p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + q))
            meta = build_attention_metadata([q for _, _, q in step], [s + q for _, s, q in step],
                                            [tables[r] for r, _, _ in step], BLOCK, torch.tensor(slots), True)
            pos = torch.tensor(positions)
            hidden, aux = model.forward(torch.cat(ids), pos.expand(3, -1) if mrope else pos, meta, caches)
            outputs.append(hidden.clone())
            outputs.extend(aux or [])
    return outputs, caches


def _build(kind: str, weight_dtype):
    hf = tiny_qwen2_vl() if kind == "qwen2_vl" else tiny_hf_model(kind)
    return build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32, weight_dtype=weight_dtype)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen2_vl"])  # qwen2: qkv biases; qwen2_vl: M-RoPE
@pytest.mark.parametrize("weight_dtype", [None, "int8"])
@pytest.mark.parametrize("aux_layers", [(), (1, 0)])  # EAGLE-3's aux states, in the order asked for
def test_fused_stack_is_bitwise_the_layer_by_layer_kernels(kind, weight_dtype, aux_layers):
    model = _build(kind, weight_dtype)
    model.set_aux_hidden_layers(aux_layers)
    assert model.fused_forward
    fused, fused_caches = _run(model, True, kind == "qwen2_vl")
    layered, layered_caches = _run(model, False, kind == "qwen2_vl")
    assert len(fused) == len(layered) == len(STEPS) * (1 + len(aux_layers))
    for a, b in zip(fused, layered):
        assert torch.equal(a, b)
    for (k1, v1), (k2, v2) in zip(fused_caches, layered_caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_fused_stack_is_off_where_it_does_not_apply(monkeypatch):
    assert not _build("qwen3", None).fused_forward  # q/k norms run in Python
    monkeypatch.setenv(kernels.ENV_VAR, "torch")
    assert not _build("llama", None).fused_forward
