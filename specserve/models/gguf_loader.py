"""Turns a GGUF checkpoint into a Hugging Face-style config dict and state dict.

Weight matrices in a supported block type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16) become
`QuantizedWeight`s, repacked for the C GEMM, which reads them as they are (specserve.models.gguf_quant);
other types are dequantized to float32 at load, with a log line. Repacking takes seconds, so the result
is cached as safetensors (the packed blocks, not fp32), keyed by the GGUF file's path, size and mtime
(specserve.models.gguf_cache).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specserve.models.gguf_cache import atomic_write, gguf_cache_dir, read_cache, write_safetensors
from specserve.models.gguf_quant import BLOCK_TYPES, QuantizedWeight
from specserve.models.loader import ModelLoadError, check_state_dict

logger = logging.getLogger(__name__)

# GGUF `general.architecture` -> Hugging Face `architectures[0]`.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# GGUF architectures whose `{arch}.expert_count` makes them MoE -> (model_type, architectures[0]); llama.cpp
# writes Mixtral as arch llama with experts
_MOE_ARCHITECTURES = {
    "llama": ("mixtral", "MixtralForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}

_GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the MoE router
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# 3-D [experts, rows, cols] tensors, split into one weight per expert (split_experts)
_EXPERT_TENSOR_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}

# Gemma 3's four norms a layer: its ffn_norm comes before the MLP, not after attention as in the Llama family
_GEMMA3_TENSOR_NAMES = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                        "post_ffw_norm": "post_feedforward_layernorm"}
# llama.cpp's gemma3 constants that its GGUFs do not store: one full-attention layer in six (the sixth), the
# local layers' RoPE base
_GEMMA3_SLIDING_PATTERN, _GEMMA3_LOCAL_ROPE_BASE = 6, 10000.0

_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


# ---------------------------------------------------------------- reading the file


def open_gguf(path: str):
    """A `gguf.GGUFReader` on `path`, or a ModelLoadError naming the file if it is not a whole GGUF."""
    import gguf

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (expected the magic bytes b'GGUF', found {magic!r})")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader fails with assorted numpy errors on short files
        raise ModelLoadError(
            f"{path}: cannot parse GGUF file, it is probably truncated or corrupt "
            f"(expected a complete GGUF v2/v3 file; reader said: {e})"
        ) from e
    size = os.path.getsize(path)
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size or tensor.data.nbytes != tensor.n_bytes:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name!r} runs past the end of the file ({size} bytes); "
                "the GGUF file is truncated"
            )
    return reader


def read_metadata(reader) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as Python values (strings, numbers, lists)."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _f32(value: float) -> float:
    """The shortest decimal that rounds to the same float32, e.g. 9.99999974e-06 -> 1e-05.

    GGUF stores float metadata as float32; the original config.json said 1e-05.
    """
    return float(str(np.float32(value)))


# ---------------------------------------------------------------- config


def gguf_config(meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]], path: str) -> dict:
    """A transformers-style config.json dict from GGUF metadata.

    `tensor_shapes` maps GGUF tensor names to their numpy shapes (rows first), used for the
    vocabulary size, tied embeddings and attention bias, which the metadata does not state.
    """
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    if "token_embd.weight" not in tensor_shapes:
        raise ModelLoadError(f"{path}: no 'token_embd.weight' tensor; expected a decoder-only LM checkpoint")
    if "rope_freqs.weight" in tensor_shapes:
        raise ModelLoadError(
            f"{path}: has a 'rope_freqs' tensor (Llama 3.1-style RoPE scaling), which cannot be "
            "expressed as a Hugging Face rope_scaling config; use the model's safetensors folder instead"
        )

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    def required(name: str) -> int:
        if key(name) is None:
            raise ModelLoadError(f"{path}: missing metadata key '{arch}.{name}'")
        return int(key(name))

    hidden = required("embedding_length")
    num_heads = required("attention.head_count")
    head_dim = key("attention.key_length") or (key("rope.dimension_count") if arch == "llama" else None)
    config = {
        "model_type": arch,
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "intermediate_size": required("feed_forward_length"),
        "num_hidden_layers": required("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(key("attention.head_count_kv", num_heads)),
        "head_dim": int(head_dim or hidden // num_heads),
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, arch),
        "max_position_embeddings": required("context_length"),
        "vocab_size": tensor_shapes["token_embd.weight"][0],  # the model's truth; = len(tokens) normally
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "attention_bias": "blk.0.attn_q.bias" in tensor_shapes,
        "mlp_bias": False,
        "hidden_act": "silu",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "gemma3":
        config |= _gemma3_fields(meta, config)
    return config | _moe_fields(meta, arch, tensor_shapes, config["num_hidden_layers"], path)


def _gemma3_fields(meta: dict[str, Any], config: dict) -> dict:
    """Gemma 3's config.json fields (transformers' Gemma3TextConfig) from gemma3.* metadata and llama.cpp's
    constants: every sixth layer full attention, the others sliding; local RoPE base 10000; attention
    scaled by head_dim ** -0.5 (hidden / heads for the 62-layer 27B, as llama.cpp does)."""
    layers = config["num_hidden_layers"]
    pattern = int(meta.get("gemma3.attention.sliding_window_pattern") or _GEMMA3_SLIDING_PATTERN)
    scalar = config["hidden_size"] // config["num_attention_heads"] if layers == 62 else config["head_dim"]
    return {
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "sliding_window": int(meta["gemma3.attention.sliding_window"]),
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)],
        "query_pre_attn_scalar": scalar,
        "rope_local_base_freq": _GEMMA3_LOCAL_ROPE_BASE,
        "final_logit_softcapping": meta.get("gemma3.final_logit_softcapping"),
        "attn_logit_softcapping": meta.get("gemma3.attn_logit_softcapping"),
    }


def _moe_fields(meta: dict[str, Any], arch: str, tensor_shapes: dict[str, tuple[int, ...]], num_layers: int,
                path: str) -> dict:
    """The config.json fields of an MoE model from `{arch}.expert_*` metadata; {} for a dense one.

    Which layers are MoE shows in the tensors (a router, `ffn_gate_inp`, per MoE layer). Renormalising the
    top-k weights follows llama.cpp: on for Mixtral and Qwen3-MoE, off for Qwen2-MoE, unless
    `{arch}.expert_weights_norm` says otherwise."""
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    if not experts:
        return {}
    if arch not in _MOE_ARCHITECTURES:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} with experts is not supported; supported: "
                             f"{sorted(_MOE_ARCHITECTURES)}")
    model_type, architecture = _MOE_ARCHITECTURES[arch]
    fields = {"model_type": model_type, "architectures": [architecture],
              "num_experts_per_tok": int(meta.get(f"{arch}.expert_used_count") or 0)}
    if model_type == "mixtral":
        return fields | {"num_local_experts": experts}  # every layer MoE, each expert of feed_forward_length
    moe_layers = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_shapes]
    first = moe_layers[0] if moe_layers else 0
    fields.update(
        num_experts=experts,
        moe_intermediate_size=int(meta.get(f"{arch}.expert_feed_forward_length")
                                  or tensor_shapes.get(f"blk.{first}.ffn_gate_exps.weight", (0, 0))[1]),
        norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", model_type == "qwen3_moe")),
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(num_layers) if i not in moe_layers])
    if model_type == "qwen2_moe":
        fields["qkv_bias"] = "blk.0.attn_q.bias" in tensor_shapes
        fields["shared_expert_intermediate_size"] = int(
            meta.get(f"{arch}.expert_shared_feed_forward_length")
            or tensor_shapes.get(f"blk.{first}.ffn_up_shexp.weight", (0,))[0])
    return fields


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict | None:
    """HF `rope_scaling` from `{arch}.rope.scaling.*` keys; None when absent or type 'none'."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or not factor:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _f32(factor)}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    attn_factor = meta.get(f"{arch}.rope.scaling.attn_factor")
    if attn_factor:
        scaling["attention_factor"] = _f32(attn_factor)
    return scaling


# ---------------------------------------------------------------- tensors


def hf_tensor_name(gguf_name: str, model_type: str | None = None) -> str | None:
    """The transformers parameter name for a GGUF tensor name (of a model of `model_type`); None for tensors
    HF has no use for."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSOR_NAMES:
        return f"{_GLOBAL_TENSOR_NAMES[base]}.{suffix}"
    match = _LAYER_TENSOR_RE.fullmatch(gguf_name)
    if match and model_type == "gemma3_text" and match[2] in _GEMMA3_TENSOR_NAMES:
        return f"model.layers.{match[1]}.{_GEMMA3_TENSOR_NAMES[match[2]]}.{match[3]}"
    if match and match[2] in _LAYER_TENSOR_NAMES:
        return f"model.layers.{match[1]}.{_LAYER_TENSOR_NAMES[match[2]]}.{match[3]}"
    return None


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q_proj/k_proj output rows.

    weight: [num_heads * head_dim, ...] (a weight [out, in] or a bias [out]).
    llama.cpp's converter stores each head's rows as interleaved pairs (x0, x_half, x1, x_half+1,
    ...) for its GPT-J-style RoPE; HF's rotate_half wants the two halves contiguous. Per head, the
    stored rows are [head_dim/2, 2]; transposing them to [2, head_dim/2] restores HF's order.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    per_head = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)


def _dequantize(tensor, path: str) -> np.ndarray:
    """A GGUF tensor as float32 numpy, shaped like the HF weight: GGUF's dims reversed."""
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape))
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name!r} uses quantization {tensor.tensor_type.name}, "
            f"which gguf cannot dequantize ({e})"
        ) from e
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
    return values if values.flags.writeable else values.copy()  # F32/F16 tensors are views of the mmap


def _keeps_blocks(tensor) -> bool:
    """Whether a GGUF tensor stays in its blocks: a weight matrix of a type the C GEMM reads."""
    return len(tensor.shape) == 2 and (tensor.tensor_type.name in BLOCK_TYPES or tensor.tensor_type.name == "F16")


def convert_tensors(reader, config: dict, path: str) -> dict[str, torch.Tensor | QuantizedWeight]:
    """All model tensors of an open GGUF file, named as in transformers: weight matrices of the block types
    the kernels read as QuantizedWeights, the rest (norms, biases, other types) dequantized to float32."""
    return dict(iter_tensors(reader, config, path))


def iter_tensors(reader, config: dict, path: str) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """convert_tensors' (name, tensor) pairs one at a time, in the file's order."""
    arch = config["model_type"]
    heads_for = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for tensor in reader.tensors:
        expert = _LAYER_TENSOR_RE.fullmatch(tensor.name)
        if expert and expert[2] in _EXPERT_TENSOR_NAMES:
            yield from split_experts(tensor, f"model.layers.{expert[1]}.", expert[2], path).items()
            continue
        name = hf_tensor_name(tensor.name, arch)
        if name is None:
            logger.info("%s: skipping tensor %s", path, tensor.name)
            continue
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        permuted = arch in ("llama", "mixtral") and kind in heads_for  # qwen GGUFs are not permuted
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if _keeps_blocks(tensor):
            order = unpermute_rotary_rows(np.arange(shape[0]), heads_for[kind]) if permuted else None
            yield name, QuantizedWeight.from_gguf(tensor.data, tensor.tensor_type.name, shape, order)
            continue
        if len(shape) == 2 and tensor.tensor_type.name != "F32":
            logger.info("%s: tensor %s is %s, which the kernels do not read in blocks: dequantized to float32",
                        path, tensor.name, tensor.tensor_type.name)
        values = _dequantize(tensor, path)
        if arch == "gemma3_text" and name.endswith("norm.weight"):
            values = values - np.float32(1.0)  # llama.cpp stores Gemma's 1 + w; transformers' weights are w
        if permuted:
            values = unpermute_rotary_rows(values, heads_for[kind])
        yield name, torch.from_numpy(np.ascontiguousarray(values))  # [out, in] or [n]


def split_experts(tensor, prefix: str, kind: str, path: str) -> dict[str, torch.Tensor | QuantizedWeight]:
    """A 3-D expert tensor (`ffn_gate_exps`, ... : [experts, rows, cols], each expert's blocks contiguous) as
    one weight per expert, `{prefix}mlp.experts.{e}.gate_proj.weight` etc.: QuantizedWeights for the block
    types the kernels read, float32 otherwise."""
    experts, rows, cols = (int(d) for d in reversed(tensor.shape))
    names = [f"{prefix}mlp.experts.{e}.{_EXPERT_TENSOR_NAMES[kind]}.weight" for e in range(experts)]
    type_name = tensor.tensor_type.name
    if type_name in BLOCK_TYPES or type_name == "F16":
        raw = np.asarray(tensor.data).reshape(experts, -1)
        return {name: QuantizedWeight.from_gguf(raw[e], type_name, (rows, cols)) for e, name in enumerate(names)}
    if type_name != "F32":
        logger.info("%s: tensor %s is %s, which the kernels do not read in blocks: dequantized to float32",
                    path, tensor.name, type_name)
    values = _dequantize(tensor, path)  # [experts, rows, cols]
    return {name: torch.from_numpy(np.ascontiguousarray(values[e])) for e, name in enumerate(names)}


def dequantized(state_dict: dict) -> dict[str, torch.Tensor]:
    """The state dict with every QuantizedWeight as its fp32 tensor (the same values)."""
    return {name: t.dequantize() if isinstance(t, QuantizedWeight) else t for name, t in state_dict.items()}


# ---------------------------------------------------------------- cache


def _convert_into_cache(folder: Path, reader, config: dict, path: str) -> tuple[dict, Mapping] | None:
    """Convert the file's tensors one at a time into the cache folder (the config, written last, marks it
    complete) and return (config, the cache's state dict); None when the folder cannot be written, for the
    caller to convert in memory."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        names = write_safetensors(folder / "model.safetensors", iter_tensors(reader, config, path))
        check_state_dict(config, dict.fromkeys(names), path)
        atomic_write(folder / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2)))
    except OSError as e:
        logger.warning("could not cache converted GGUF in %s: %s", folder, e)
        return None
    return read_cache(folder)


# ---------------------------------------------------------------- entry point


def load_gguf(path: str, dtype: torch.dtype = torch.float32, use_cache: bool = True,
              keep_quantized: bool = False) -> tuple[dict, Mapping]:
    """(HF config dict, HF-named state dict) for a llama/qwen2/qwen3 GGUF file, or their MoE kin (Mixtral,
    qwen2moe, qwen3moe).

    keep_quantized (with dtype float32): weight matrices stay QuantizedWeights in the file's blocks, and the
    state dict is the cache's, read a tensor at a time as it is asked for (CachedTensors); else every tensor
    is a `dtype` tensor (QuantizedWeights dequantized: exactly the gguf package's values)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    folder = gguf_cache_dir(path) if use_cache else None
    cached = read_cache(folder) if folder else None
    if cached is None:
        start = time.perf_counter()
        reader = open_gguf(path)
        shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
        config = gguf_config(read_metadata(reader), shapes, path)
        cached = _convert_into_cache(folder, reader, config, path) if folder else None
        if cached is None:
            state_dict = convert_tensors(reader, config, path)
            check_state_dict(config, state_dict, path)
        else:
            state_dict = cached[1]
        logger.info("converted %s in %.1f s", path, time.perf_counter() - start)
    else:
        config, state_dict = cached
    if keep_quantized and dtype == torch.float32:
        return config, state_dict
    return config, {name: t.to(dtype) for name, t in dequantized(state_dict).items()}
