"""Gemma 3 text decoder (transformers' Gemma3ForCausalLM, `model_type` "gemma3_text").

It differs from the Llama family in: four RMSNorms per layer (before and after attention, before and after the
MLP), each scaling by (1 + w) in fp32; q/k RMSNorm over each head; GeGLU with tanh GELU; embeddings scaled by
sqrt(hidden_size); attention scaled by query_pre_attn_scalar ** -0.5; and interleaved layer types, sliding-window
layers ("sliding_attention", local RoPE base) between full-attention ones (global RoPE base and scaling).
Weights keep transformers' names and meaning (norm weights w, not 1 + w; the GGUF loader converts).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.models.gguf_quant import cat_rows
from specserve.models.llama import DecoderConfig, LlamaForCausalLM, linear_bytes, make_linear, sliding_windows
from specserve.models.rope import RotaryEmbedding, apply_rotary
from specserve.ops import kernels
from specserve.ops.attention import AttentionMetadata, paged_attention

GEMMA3_MODEL_TYPES = ("gemma3_text",)
_SUPPORTED_ACTIVATIONS = ("gelu_pytorch_tanh",)
# Where the multimodal checkpoints (model_type "gemma3": Gemma 3 4B and up) keep the text decoder: the Hub's
# files, and transformers 5's in-memory names
_TEXT_DECODER_PREFIXES = ("language_model.model.", "model.language_model.")
_TEXT_LM_HEAD_PREFIXES = ("language_model.lm_head.", "lm_head.")


def text_decoder_config(cfg: dict) -> dict:
    """The text decoder's config.json fields of a multimodal Gemma 3 checkpoint (`text_config`, as
    gemma3_text), with the top level's token ids and embedding tying where the text config leaves them out."""
    out = dict(cfg.get("text_config") or {}, model_type="gemma3_text")
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        if out.get(key) is None and cfg.get(key) is not None:
            out[key] = cfg[key]
    return out


def text_decoder_weights(state_dict: dict) -> dict:
    """A multimodal Gemma 3 checkpoint's text decoder weights under gemma3_text's names; the vision tower and
    the projector are left out (images are not read)."""
    out = {}
    for name, tensor in state_dict.items():
        for prefix in _TEXT_DECODER_PREFIXES:
            if name.startswith(prefix):
                out["model." + name[len(prefix):]] = tensor
        for prefix in _TEXT_LM_HEAD_PREFIXES:
            if name.startswith(prefix):
                out["lm_head." + name[len(prefix):]] = tensor
    return out


def gemma_norm(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float, c_ops: bool = False) -> torch.Tensor:
    """Gemma's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32 (`weight_plus_one` is 1 + w), over the
    last dimension; with `c_ops` the C kernel (one call instead of PyTorch's several ops)."""
    if c_ops:
        return kernels.add_rms_norm(None, x.reshape(-1, x.shape[-1]).contiguous(), weight_plus_one,
                                    eps).view(x.shape)
    return F.rms_norm(x, (x.shape[-1],), weight_plus_one, eps)


def plus_one(weight: torch.Tensor) -> torch.Tensor:
    """1 + w as transformers' Gemma3RMSNorm computes it (fp32)."""
    return 1.0 + weight.float()


def rope_settings(cfg: dict) -> dict[str, tuple[float, dict | None]]:
    """Per layer type, (rope theta, scaling or None), from either transformers layout: `rope_parameters`
    keyed by layer type (transformers 5), or rope_theta/rope_scaling plus rope_local_base_freq (4.x)."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        out = {}
        for kind in ("full_attention", "sliding_attention"):
            p = dict(params.get(kind) or {"rope_type": "default"})
            theta = float(p.pop("rope_theta", 10000.0))
            out[kind] = (theta, p if p.get("rope_type", "default") != "default" else None)
        return out
    scaling = cfg.get("rope_scaling")
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return {"full_attention": (float(cfg.get("rope_theta", 1_000_000.0)), scaling),
            "sliding_attention": (float(cfg.get("rope_local_base_freq", 10000.0)), None)}


class Gemma3Layer:
    """One layer; `forward` returns the new residual stream."""

    def __init__(self, cfg: DecoderConfig, weights: dict, prefix: str, window: int, scale: float,
                 weight_dtype=None, c_ops: bool = False) -> None:
        """c_ops: norms and RoPE on the C kernels (fp32 with the kernels built), else PyTorch ops."""
        w = lambda name: weights[prefix + name]  # noqa: E731
        make = lambda weight: make_linear(weight, None, weight_dtype)  # noqa: E731
        self.cfg, self.window, self.scale, self.c_ops = cfg, window, scale, c_ops
        self.qkv = make(cat_rows([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"),
                                  w("self_attn.v_proj.weight")]))
        self.o_proj = make(w("self_attn.o_proj.weight"))
        self.gate_up = make(cat_rows([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]))
        self.down = make(w("mlp.down_proj.weight"))
        self.input_norm = plus_one(w("input_layernorm.weight"))
        self.post_attention_norm = plus_one(w("post_attention_layernorm.weight"))
        self.pre_mlp_norm = plus_one(w("pre_feedforward_layernorm.weight"))
        self.post_mlp_norm = plus_one(w("post_feedforward_layernorm.weight"))
        self.q_norm = plus_one(w("self_attn.q_norm.weight"))
        self.k_norm = plus_one(w("self_attn.k_norm.weight"))
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        self.kv_size = cfg.num_key_value_heads * cfg.head_dim

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        cfg, eps, c = self.cfg, self.cfg.rms_norm_eps, self.c_ops
        qkv = self.qkv(gemma_norm(x, self.input_norm, eps, c))
        n, heads, kv_heads, dim = qkv.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = gemma_norm(qkv[:, : self.q_size].view(n, heads, dim), self.q_norm, eps, c)
        k = gemma_norm(qkv[:, self.q_size: self.q_size + self.kv_size].view(n, kv_heads, dim), self.k_norm, eps, c)
        v = qkv[:, self.q_size + self.kv_size:].view(n, kv_heads, dim)
        if c:  # rotate q and k together in place
            qk = torch.cat([q.view(n, -1), k.view(n, -1)], dim=1)
            kernels.rope_qk(qk, cos.reshape(n, -1), sin.reshape(n, -1), heads + kv_heads, dim)
            q, k = qk[:, : self.q_size].view(n, heads, dim), qk[:, self.q_size:].view(n, kv_heads, dim)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attn = paged_attention(q, k, v.contiguous(), kv_cache[0], kv_cache[1], meta, self.scale, self.window)
        x = x + gemma_norm(self.o_proj(attn), self.post_attention_norm, eps, c)
        gate_up = self.gate_up(gemma_norm(x, self.pre_mlp_norm, eps, c))
        inter = gate_up.shape[-1] // 2
        mlp = self.down(F.gelu(gate_up[:, :inter], approximate="tanh") * gate_up[:, inter:])
        return x + gemma_norm(mlp, self.post_mlp_norm, eps, c)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text decoder behind the Llama family's interface (forward, compute_logits, greedy_tokens,
    aux hidden states, KV cache shape). Layers run as Python over the C GEMMs and attention kernel; the
    fused C stack (Llama layers only) does not apply; norms and RoPE take the C kernels where Llama layers do."""

    def __init__(self, hf_config: dict, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 aux_hidden_layers: tuple[int, ...] = (), weight_dtype=None, shard=None) -> None:
        if shard is not None:
            raise ValueError("tensor parallelism is not supported for Gemma 3 (tensor_parallel_size must be 1)")
        act = hf_config.get("hidden_activation") or hf_config.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_activation {act!r} is not supported for Gemma 3 "
                             f"(supported: {', '.join(_SUPPORTED_ACTIVATIONS)})")
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if hf_config.get(key) is not None:
                raise ValueError(f"{key} {hf_config[key]!r} is not supported for Gemma 3 (supported: null)")
        cfg = DecoderConfig.from_hf({**hf_config, "hidden_act": "gelu_pytorch_tanh"})
        self.config = self.layer_config = cfg
        self.dtype = dtype
        self.c_ops = kernels.kernel_usable(dtype)
        self.layer_types = hf_config.get("layer_types") or ["full_attention"] * cfg.num_hidden_layers
        self.embed_tokens = weights["model.embed_tokens.weight"]
        # transformers multiplies the looked-up rows by sqrt(hidden) held in the embedding's dtype
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32).to(dtype)
        scale = float(hf_config.get("query_pre_attn_scalar") or cfg.head_dim) ** -0.5
        windows = sliding_windows(hf_config) or (0,) * cfg.num_hidden_layers
        self.layers = [Gemma3Layer(cfg, weights, f"model.layers.{i}.", windows[i], scale, weight_dtype, self.c_ops)
                       for i in range(cfg.num_hidden_layers)]
        self.norm = plus_one(weights["model.norm.weight"])
        lm_head = self.embed_tokens if cfg.tie_word_embeddings else weights.get("lm_head.weight", self.embed_tokens)
        self.lm_head = make_linear(lm_head, None, weight_dtype)
        self.exact_argmax = getattr(self.lm_head, "enable_exact_argmax", lambda: False)()
        self.rotaries = {kind: RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, theta, scaling, dtype)
                         for kind, (theta, scaling) in rope_settings(hf_config).items()}
        self.rotary = self.rotaries["full_attention"]
        self.aux_hidden_layers = ()
        self.set_aux_hidden_layers(aux_hidden_layers)
        self.fused_forward = False

    def linear_weight_bytes(self) -> tuple[int, int]:
        sizes = [linear_bytes(linear) for layer in self.layers
                 for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
        return sum(b for b, _ in sizes), sum(n for _, n in sizes)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings as the first layer reads them (scaled by sqrt(hidden))."""
        return self.embed_tokens[input_ids] * self.embed_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], mm_embeds=None):
        """As LlamaForCausalLM.forward; aux hidden states are the residual stream entering each listed layer."""
        if mm_embeds is not None:
            raise ValueError("Gemma 3 here is text only: requests with images are not supported")
        x = self.embed(input_ids)
        cos_sin = {kind: rotary.cos_sin(positions) for kind, rotary in self.rotaries.items()}
        aux = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_hidden_layers:
                aux[i] = x
            x = layer.forward(x, *cos_sin[self.layer_types[i]], kv_caches[i], meta)
        aux_states = [aux[i] for i in self.aux_hidden_layers] if aux else None
        return gemma_norm(x, self.norm, self.config.rms_norm_eps, self.c_ops), aux_states
