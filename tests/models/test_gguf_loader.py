"""GGUF loading: the default SmolLM2 GGUF against transformers' own GGUF conversion, and small
synthetic GGUFs written with gguf.GGUFWriter against gguf's dequantize."""

from __future__ import annotations

from pathlib import Path

import gguf  # a dependency of specserve, not optional: its absence is a failure, not a skip
import numpy as np
import pytest
import torch

from specserve.models.gguf_cache import CachedTensors
from specserve.models.gguf_loader import load_gguf, unpermute_rotary_rows
from specserve.models.gguf_quant import QuantizedWeight
from specserve.models.loader import ModelLoadError, load_model_weights

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def ours(default_gguf_path):
    """Our conversion of the default GGUF, bypassing the cache (caching is tested on a small file)."""
    config, state_dict = load_gguf(default_gguf_path, use_cache=False)
    return config, state_dict


@pytest.fixture(scope="module")
def transformers_gguf(default_gguf_path, ours):
    """transformers' parse of the same GGUF: {"config": ..., "tensors": ...}.

    Calls the function its from_pretrained(gguf_file=...) uses, which (unlike from_pretrained)
    does not need `accelerate`. The model passed in only provides parameter names.
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    layers = ours[0]["num_hidden_layers"]
    with torch.device("meta"):
        names_only = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers))
    return load_gguf_checkpoint(default_gguf_path, return_tensors=True, model_to_load=names_only)


def test_default_gguf_tensors_equal_transformers(ours, transformers_gguf):
    reference = transformers_gguf["tensors"]
    state_dict = ours[1]
    assert set(state_dict) == set(reference) - {"lm_head.weight"}  # tied: no lm_head
    for name, tensor in state_dict.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, reference[name]), name


def test_default_gguf_config_matches_transformers(ours, transformers_gguf):
    config, reference = ours[0], transformers_gguf["config"]
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rope_theta", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert config[key] == reference[key], key
    # GGUF stores 1e-5 as float32; we give back the decimal the original config.json had.
    assert config["rms_norm_eps"] == pytest.approx(reference["rms_norm_eps"], rel=1e-6)
    assert config["rope_scaling"] is None and config["architectures"] == ["LlamaForCausalLM"]


# ---------------------------------------------------------------- synthetic GGUFs

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 64, 96, 4, 2, 40
HEAD_DIM = HIDDEN // HEADS


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row reordering llama.cpp's convert_hf_to_gguf applies to llama q/k weights (from its description)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(rng: np.random.Generator, bias: bool = False) -> dict[str, np.ndarray]:
    """A random one-layer llama-shaped state dict, HF names, float32 [out, in] weights."""
    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    w = {
        "model.embed_tokens.weight": rand(VOCAB, HIDDEN),
        "model.norm.weight": rand(HIDDEN),
        "lm_head.weight": rand(VOCAB, HIDDEN),
        "model.layers.0.input_layernorm.weight": rand(HIDDEN),
        "model.layers.0.post_attention_layernorm.weight": rand(HIDDEN),
        "model.layers.0.self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
        "model.layers.0.mlp.gate_proj.weight": rand(FFN, HIDDEN),
        "model.layers.0.mlp.up_proj.weight": rand(FFN, HIDDEN),
        "model.layers.0.mlp.down_proj.weight": rand(HIDDEN, FFN),
    }
    if bias:
        for proj, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
            w[f"model.layers.0.self_attn.{proj}_proj.bias"] = rand(rows * HEAD_DIM)
    return w


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
    "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "model.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "model.layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "model.layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "model.layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "model.layers.0.self_attn.q_proj.bias": "blk.0.attn_q.bias",
    "model.layers.0.self_attn.k_proj.bias": "blk.0.attn_k.bias",
    "model.layers.0.self_attn.v_proj.bias": "blk.0.attn_v.bias",
}


def write_gguf(path, arch: str, weights: dict[str, np.ndarray], qtype) -> dict[str, np.ndarray]:
    """Write `weights` as a GGUF the way llama.cpp would (llama q/k rows permuted, 2-D weights in
    `qtype`, 1-D ones in F32). Returns what each HF tensor should load as: dequantize(quantize(w))."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(1)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    expected = {}
    for hf_name, w in weights.items():
        stored = w
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            stored = llama_cpp_permute(w, HEADS if ".q_proj." in hf_name else KV_HEADS)
        kind = qtype if w.ndim == 2 else Q.F32
        data = stored.astype(np.float16) if kind == Q.F16 else gguf.quants.quantize(stored, kind)
        writer.add_tensor(GGUF_NAMES[hf_name], data, raw_dtype=kind)
        round_trip = gguf.quants.dequantize(data, kind).reshape(w.shape)
        if stored is not w:  # what a correct loader gives back: the HF row order
            round_trip = unpermute_rotary_rows(round_trip, HEADS if ".q_proj." in hf_name else KV_HEADS)
        expected[hf_name] = round_trip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize("qtype, tolerance", [(Q.F16, 2e-3), (Q.Q8_0, 0.05), (Q.Q4_0, 0.6)])
def test_synthetic_llama_round_trip(tmp_path, qtype, tolerance):
    weights = hf_weights(np.random.default_rng(0))
    expected = write_gguf(tmp_path / "tiny.gguf", "llama", weights, qtype)
    config, state_dict = load_gguf(str(tmp_path / "tiny.gguf"), use_cache=False)
    assert set(state_dict) == set(weights)
    for name, w in weights.items():
        np.testing.assert_array_equal(state_dict[name].numpy(), expected[name], err_msg=name)
        np.testing.assert_allclose(state_dict[name].numpy(), w, atol=tolerance, err_msg=name)  # vs HF original
    # llama.cpp's q/k row order really differs from HF's, so the undo is not a no-op.
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(llama_cpp_permute(q, HEADS), q)
    assert config["tie_word_embeddings"] is False and config["head_dim"] == HEAD_DIM
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (HEADS, KV_HEADS)


def test_synthetic_qwen2_is_not_unpermuted_and_has_bias(tmp_path):
    weights = hf_weights(np.random.default_rng(1), bias=True)
    del weights["lm_head.weight"]
    write_gguf(tmp_path / "qwen.gguf", "qwen2", weights, Q.F16)
    config, state_dict = load_gguf(str(tmp_path / "qwen.gguf"), use_cache=False)
    assert config["model_type"] == "qwen2" and config["attention_bias"] and config["tie_word_embeddings"]
    for name, w in weights.items():
        np.testing.assert_allclose(state_dict[name].numpy(), w, atol=2e-3, err_msg=name)


def test_cache_is_reused_keyed_by_file_and_cast(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", hf_weights(np.random.default_rng(2)), Q.Q8_0)
    _, fresh = load_gguf(str(path), use_cache=False)
    config, first = load_gguf(str(path))
    assert len(list((tmp_path / "cache").rglob("model.safetensors"))) == 1
    assert sorted(first) == sorted(fresh) and all(torch.equal(first[k], fresh[k]) for k in fresh)
    cached_config, again = load_gguf(str(path))
    assert cached_config == config
    assert all(torch.equal(first[k], again[k]) for k in first)
    _, half = load_gguf(str(path), dtype=torch.bfloat16)
    assert all(half[k].dtype == torch.bfloat16 and torch.equal(half[k], first[k].bfloat16()) for k in first)
    write_gguf(path, "llama", hf_weights(np.random.default_rng(3)), Q.Q8_0)  # new content -> new key
    _, changed = load_gguf(str(path))
    assert not torch.equal(changed["model.norm.weight"], first["model.norm.weight"])


def _blocks_equal(a, b) -> bool:
    return (isinstance(a, QuantizedWeight) and isinstance(b, QuantizedWeight) and torch.equal(a.packed, b.packed)
            and (a.format, a.group, a.shape, a.qtype) == (b.format, b.group, b.shape, b.qtype))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.F16])
def test_cache_keeps_the_blocks_and_reads_them_unmapped(tmp_path, monkeypatch, qtype):
    """The cache written a tensor at a time holds the in-memory conversion's blocks; its state dict reads each
    tensor into memory of its own when asked (the file is not left mapped), the same object while it lives."""
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", hf_weights(np.random.default_rng(4)), qtype)
    _, fresh = load_gguf(str(path), use_cache=False, keep_quantized=True)
    for _ in range(2):  # converted into the cache, then read back from it
        _, cached = load_gguf(str(path), keep_quantized=True)
        assert isinstance(cached, CachedTensors) and sorted(cached) == sorted(fresh)
        for name, value in fresh.items():
            assert (_blocks_equal(cached[name], value) if isinstance(value, QuantizedWeight)
                    else torch.equal(cached[name], value)), name
    embed = cached["model.embed_tokens.weight"]
    assert cached["model.embed_tokens.weight"] is embed
    cache_file = str(next((tmp_path / "cache").rglob("model.safetensors")))
    assert cache_file not in Path("/proc/self/maps").read_text()


def test_damaged_cache_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", hf_weights(np.random.default_rng(6)), Q.Q8_0)
    _, first = load_gguf(str(path))
    cache_file = next((tmp_path / "cache").rglob("model.safetensors"))
    whole = cache_file.read_bytes()
    cache_file.write_bytes(whole[:-100])  # cut short
    _, again = load_gguf(str(path))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert cache_file.read_bytes() == whole  # written again


@pytest.mark.parametrize("keep", [0.5, 0.98])
def test_truncated_gguf_names_the_file(tmp_path, keep):
    path = tmp_path / "cut.gguf"
    write_gguf(path, "llama", hf_weights(np.random.default_rng(5)), Q.Q8_0)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match="cut.gguf.*truncated"):
        load_model_weights(str(path))


def test_not_a_gguf_and_unknown_arch(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="bogus.gguf.*GGUF"):
        load_model_weights(str(bogus))
    weights = hf_weights(np.random.default_rng(4))
    write_gguf(tmp_path / "gpt.gguf", "gpt2", weights, Q.F16)
    with pytest.raises(ModelLoadError, match="gpt.gguf.*'gpt2'.*supported"):
        load_gguf(str(tmp_path / "gpt.gguf"), use_cache=False)
