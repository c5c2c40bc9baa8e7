"""Which decoder class serves which `model_type`; the only place that knows the names."""
from __future__ import annotations

from specserve.models.gemma3 import Gemma3ForCausalLM
from specserve.models.llama import LlamaForCausalLM
from specserve.models.qwen2_vl import Qwen2VLForCausalLM

_MODELS = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen2_moe": LlamaForCausalLM, "qwen3_moe": LlamaForCausalLM, "mixtral": LlamaForCausalLM,  # MoE MLPs
    "gemma3_text": Gemma3ForCausalLM,
    "qwen2_vl": Qwen2VLForCausalLM, "qwen2_5_vl": Qwen2VLForCausalLM,  # text decoder only
}


def register_model(model_type: str, cls) -> None:
    _MODELS[model_type] = cls


def supported_model_types() -> list[str]:
    return sorted(_MODELS)


def model_class(hf_config: dict):
    model_type = hf_config.get("model_type")
    if model_type not in _MODELS:
        raise ValueError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(supported_model_types())})")
    return _MODELS[model_type]


def build_model(hf_config: dict, weights: dict, dtype, **kwargs):
    return model_class(hf_config)(hf_config, weights, dtype=dtype, **kwargs)
