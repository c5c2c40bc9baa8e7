"""Qwen2-VL-family text decoder: M-RoPE cos/sin against a direct reference, logits parity with transformers."""
import copy

import pytest
import torch

from specserve.models.qwen2_vl import MRotaryEmbedding, Qwen2VLForCausalLM, text_mrope_positions
from specserve.models.registry import build_model
from specserve.ops.attention import build_attention_metadata, kv_caches
from specserve.worker.model_runner import ModelRunner
from tests.paged_harness import max_logit_errors
from tests.tiny_models import hf_config_dict, hf_state_dict, perturb_norms_and_biases, tiny_hf_model

# head_dim 16 → 8 rotary frequencies split t/h/w as 2/3/3.
TEXT = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, bos_token_id=1, eos_token_id=2,
            initializer_range=0.2)  # large weights, so a wrong section moves logits visibly
VISION = {
    "qwen2_vl": dict(depth=1, embed_dim=16, hidden_size=64, num_heads=2, mlp_ratio=1, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2),
    "qwen2_5_vl": dict(depth=1, hidden_size=16, intermediate_size=16, out_hidden_size=64, num_heads=2,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0]),
}
IDS = dict(image_token_id=150, video_token_id=151, vision_start_token_id=152, vision_end_token_id=153)


def tiny_qwen2_vl(kind: str = "qwen2_vl", tie: bool = False):
    """A random transformers Qwen2-VL / Qwen2.5-VL with a tiny vision tower, norms and biases perturbed."""
    import transformers

    cls_cfg, cls_model = {
        "qwen2_vl": (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration),
        "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration),
    }[kind]
    torch.manual_seed(1234)
    # Deep copies: building a config writes rope_theta/rope_type into the rope dict it is given.
    config = cls_cfg(text_config=copy.deepcopy(TEXT), vision_config=copy.deepcopy(VISION[kind]),
                     tie_word_embeddings=tie, **IDS)
    config._attn_implementation = "eager"
    return perturb_norms_and_biases(cls_model(config).eval().float())


def _hf_logits(hf, tokens: list[int], position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[len(tokens), vocab]; position_ids [3, len(tokens)] or None (transformers computes them for text)."""
    pos = None if position_ids is None else position_ids[:, None, :]
    with torch.no_grad():
        return hf(input_ids=torch.tensor([tokens]), position_ids=pos).logits[0].float()


def _mrope_positions(runner: ModelRunner, out, batch) -> torch.Tensor:
    """[3, N] text M-RoPE positions of a scheduled step, in the runner's flattened-batch order."""
    positions = torch.cat([text_mrope_positions(runner.requests[rid].num_computed_tokens,
                                                out.num_scheduled_tokens[rid]) for rid in out.req_ids], dim=1)
    assert torch.equal(positions, batch.positions.expand(3, -1))  # the runner's [N] or [3, N]
    return positions


def _prefill_logits(model, tokens: list[int], positions: torch.Tensor) -> torch.Tensor:
    """Logits [len(tokens), vocab] of one prompt run in one step through a fresh paged cache."""
    n, block_size = len(tokens), 4
    blocks = list(range(-(-n // block_size)))
    meta = build_attention_metadata([n], [n], [blocks], block_size, torch.arange(n))
    caches = kv_caches(model.kv_cache_shape(len(blocks), block_size), torch.float32, model.num_layers)
    with torch.inference_mode():
        hidden, _ = model.forward(torch.tensor(tokens), positions, meta, caches)
        return model.compute_logits(hidden)


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("kind,tie", [("qwen2_vl", False), ("qwen2_vl", True), ("qwen2_5_vl", False)])
def test_prefill_and_decode_match_transformers(kind, tie):
    hf = tiny_qwen2_vl(kind, tie=tie)
    model = build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32)
    assert isinstance(model, Qwen2VLForCausalLM) and model.mrope_section == [2, 3, 3]
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 150, (n,), generator=g).tolist() for n in (13, 5, 22)]
    # Token budget 7: prompts are prefilled in chunks, decodes ride along with other prefills.
    worst = max_logit_errors(model, prompts, 10, 7, lambda tokens: _hf_logits(hf, tokens)[-1],
                             positions=_mrope_positions)
    assert max(worst.values()) < 1e-4, worst


def test_distinct_position_rows_match_transformers():
    """Image-like positions (rows differ) exercise each section against transformers' own M-RoPE."""
    hf = tiny_qwen2_vl()
    model = build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32)
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 150, (20,), generator=g).tolist()  # > 16 tokens: the unbatched prefill path
    positions = torch.stack([torch.arange(20), torch.arange(20) * 3 % 17, torch.arange(20) * 5 % 23 + 40])
    ours = _prefill_logits(model, tokens, positions)
    assert (ours - _hf_logits(hf, tokens, positions)).abs().max().item() < 1e-4
    # The rows really matter: equal rows give different logits.
    assert (ours - _prefill_logits(model, tokens, positions[0])).abs().max().item() > 1e-2


def test_one_row_and_three_equal_rows_give_identical_logits():
    hf = tiny_qwen2_vl()
    model = build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32)
    tokens = list(range(3, 24))
    one_row = _prefill_logits(model, tokens, torch.arange(len(tokens)))
    assert torch.equal(one_row, _prefill_logits(model, tokens, text_mrope_positions(0, len(tokens))))


def test_hub_layout_config_and_weight_names_load_the_same_model():
    """Hub checkpoints: text fields at the top level, rope_scaling "mrope", weights `model.layers.*` + `visual.*`."""
    hf = tiny_qwen2_vl()
    config = hf_config_dict(hf)
    flat = {k: v for k, v in config.items() if k != "text_config"}
    flat.update({k: v for k, v in config["text_config"].items() if k not in ("model_type", "rope_parameters")})
    flat.update(model_type="qwen2_vl", rope_theta=10000.0, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    weights = {k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
               for k, v in hf_state_dict(hf).items()}
    assert any(k.startswith("visual.") for k in weights)
    hub = build_model(flat, weights, dtype=torch.float32)
    v5 = build_model(config, hf_state_dict(hf), dtype=torch.float32)
    tokens = list(range(5, 25))
    positions = text_mrope_positions(0, len(tokens))
    assert torch.equal(_prefill_logits(hub, tokens, positions), _prefill_logits(v5, tokens, positions))


def test_only_qwen2_vl_models_use_mrope():
    hf = tiny_qwen2_vl()
    assert build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32).uses_mrope is True
    llama = tiny_hf_model("llama")
    assert getattr(build_model(hf_config_dict(llama), hf_state_dict(llama), dtype=torch.float32),
                   "uses_mrope", False) is False


# ---------------------------------------------------------------- M-RoPE cos/sin


def _reference_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, section: list[int]):
    """Direct M-RoPE: frequency j reads the row whose section contains j; both halves alike. [N, 1, head_dim]."""
    half = head_dim // 2
    inv_freq = [theta ** (-2.0 * j / head_dim) for j in range(half)]
    bounds = [section[0], section[0] + section[1]]
    cos = torch.empty(positions.shape[1], head_dim, dtype=torch.float64)
    sin = torch.empty_like(cos)
    for n in range(positions.shape[1]):
        for j in range(half):
            row = 0 if j < bounds[0] else 1 if j < bounds[1] else 2
            angle = torch.tensor(float(positions[row, n]) * inv_freq[j], dtype=torch.float64)
            cos[n, j] = cos[n, j + half] = angle.cos()
            sin[n, j] = sin[n, j + half] = angle.sin()
    return cos.float().unsqueeze(1), sin.float().unsqueeze(1)


@pytest.mark.parametrize("head_dim,section", [(16, [2, 3, 3]), (128, [16, 24, 24]), (16, [0, 4, 4])])
def test_cos_sin_follow_the_sections(head_dim, section):
    rope = MRotaryEmbedding(head_dim, 512, 10000.0, section)
    g = torch.Generator().manual_seed(5)
    distinct = torch.randint(0, 512, (3, 9), generator=g)
    cos, sin = rope.cos_sin(distinct)
    ref_cos, ref_sin = _reference_cos_sin(distinct, head_dim, 10000.0, section)
    assert cos.shape == (9, 1, head_dim)
    assert torch.allclose(cos, ref_cos, atol=1e-4) and torch.allclose(sin, ref_sin, atol=1e-4)
    equal_cos, equal_sin = rope.cos_sin(distinct[0].expand(3, -1))
    assert not torch.allclose(cos, equal_cos, atol=1e-3) and not torch.allclose(sin, equal_sin, atol=1e-3)


def test_one_row_positions_equal_three_equal_rows():
    rope = MRotaryEmbedding(16, 256, 10000.0, [2, 3, 3])
    positions = torch.tensor([0, 7, 3, 100, 255])
    one = rope.cos_sin(positions)
    three = rope.cos_sin(positions.expand(3, -1))
    assert torch.equal(one[0], three[0]) and torch.equal(one[1], three[1])


def test_text_mrope_positions():
    assert torch.equal(text_mrope_positions(4, 3), torch.tensor([[4, 5, 6]] * 3))
    assert torch.equal(text_mrope_positions(4, 3, delta=-2), torch.tensor([[2, 3, 4]] * 3))
    assert text_mrope_positions(0, 0).shape == (3, 0)


@pytest.mark.parametrize("section", [[2, 3, 2], [4, 4], [-1, 5, 4]])
def test_bad_sections_are_rejected(section):
    with pytest.raises(ValueError, match="mrope_section"):
        MRotaryEmbedding(16, 64, 10000.0, section)


def test_bad_position_shapes_are_rejected():
    rope = MRotaryEmbedding(16, 64, 10000.0, [2, 3, 3])
    with pytest.raises(ValueError, match=r"\[3, N\]"):
        rope.cos_sin(torch.zeros(2, 4, dtype=torch.long))
