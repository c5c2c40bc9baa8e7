"""Llama-family decoder: Llama, Mistral, Qwen2 (QKV bias), Qwen3 (q/k RMSNorm), SmolLM2, and their
mixture-of-experts kin Qwen2-MoE, Qwen3-MoE and Mixtral (MLPs in specserve.models.moe).

Inference only, over a flattened batch of tokens with a paged KV cache. Weights use transformers'
parameter names; q/k/v and gate/up are fused on load so each layer runs few, wide matmuls.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.models.gguf_quant import cat_rows
from specserve.models.moe import MoEConfig, MoEMLP
from specserve.models.rope import RotaryEmbedding, apply_rotary, rope_parameters
from specserve.ops import fused, kernels
from specserve.ops.attention import AttentionMetadata, paged_attention
from specserve.ops.kv_cache import KV_CODES


@dataclass
class DecoderConfig:
    """The fields of a transformers config.json the decoder needs, checked once."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    hidden_act: str = "silu"
    moe: MoEConfig | None = None  # Qwen3-MoE, Qwen2-MoE, Mixtral
    layer_windows: tuple[int, ...] = ()  # per layer its sliding attention window, 0 for full attention

    @classmethod
    def from_hf(cls, cfg: dict) -> "DecoderConfig":
        model_type = cfg.get("model_type", "llama")
        heads = cfg["num_attention_heads"]
        theta, scaling = rope_parameters(cfg)
        return cls(
            model_type=model_type,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=(model_type == "qwen2" or (model_type == "qwen2_moe" and cfg.get("qkv_bias", True))
                            or cfg.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            hidden_act=cfg.get("hidden_act", "silu"),
            moe=MoEConfig.from_hf(cfg),
            layer_windows=sliding_windows(cfg),
        )

    def window(self, i: int) -> int:
        """Layer i's sliding attention window (0: it attends to the whole context)."""
        return self.layer_windows[i] if self.layer_windows else 0

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is a mixture of experts (else dense, of intermediate_size)."""
        return self.moe is not None and self.moe.is_moe_layer(i)


def sliding_windows(cfg: dict) -> tuple[int, ...]:
    """Per layer of a transformers config, its sliding attention window (0: full attention), as transformers
    applies them: `layer_types` where the config lists them ("sliding_attention" layers get `sliding_window`);
    else Qwen2's `use_sliding_window` for layers from `max_window_layers` on, or, for the other families, every
    layer when `sliding_window` is set (Mistral). () when no layer has a window."""
    num_layers, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ValueError(f"layer_types lists {len(types)} layers, the model has {num_layers}")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"layer_types {sorted(unknown)} are not supported "
                             "(supported: sliding_attention, full_attention)")
        sliding = [t == "sliding_attention" for t in types]
    elif cfg.get("model_type", "").startswith("qwen2"):
        first = cfg.get("max_window_layers", num_layers) if cfg.get("use_sliding_window") else num_layers
        sliding = [i >= first for i in range(num_layers)]
    else:
        sliding = [window is not None] * num_layers
    if any(sliding) and not (isinstance(window, int) and window >= 1):
        raise ValueError(f"sliding_window must be a positive number of tokens for sliding layers, got {window!r}")
    windows = tuple(window if s else 0 for s in sliding)
    return windows if any(windows) else ()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class TorchLinear:
    """Plain F.linear, for weights in reduced precision (bf16/fp16), where FastLinear's fp32 paths don't apply."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def make_linear(weight, bias: torch.Tensor | None = None, weight_dtype=None):
    """The linear-layer implementation used for every projection (the fastest measured on the host).

    weight: a tensor, or a QuantizedWeight (GGUF blocks, which the C GEMM reads as they are: exact).
    weight_dtype None keeps exact fp32; torch.bfloat16 or "int8" store the weight that way (oneDNN bf16,
    int8 with per-channel scales) with fp32 activations, "q4" as 4-bit groups of 32 (gguf_quant.quantize_q4)
    multiplied with int8 activations (the default path's 4-bit GEMM; "int8" where the C kernels are off):
    fewer bytes per decode step, approximate results.
    """
    from specserve.models.linear import FastLinear

    if isinstance(weight, torch.Tensor) and weight.dtype != torch.float32:
        return TorchLinear(weight, bias)
    if weight_dtype == "q4":
        from specserve.models.gguf_quant import quantize_q4
        from specserve.ops import kernels

        if not (kernels.kernel_enabled() and isinstance(weight, torch.Tensor) and weight.shape[1] % 32 == 0):
            return FastLinear(weight, bias, weight_dtype="int8")
        return FastLinear(quantize_q4(weight).for_int8_activations(2), bias)
    return FastLinear(weight, bias, weight_dtype=weight_dtype)


def linear_bytes(linear) -> tuple[int, int]:
    """(bytes, weights) of one projection's weight."""
    linear = getattr(linear, "local", linear)  # a tensor-parallel wrapper's own shard
    weight = getattr(linear, "weight", None)
    if isinstance(weight, torch.Tensor):  # TorchLinear
        return weight.numel() * weight.element_size(), weight.numel()
    return linear.weight_nbytes, linear.out_features * linear.in_features


class DecoderLayer:
    """One layer. With `c_ops` (fp32 and the C kernels built) the residual add + RMSNorm, RoPE and
    SiLU-and-mul run as fused C kernels (ops/csrc/layer_ops.c); otherwise as PyTorch ops."""

    def __init__(self, cfg: DecoderConfig, weights: dict[str, torch.Tensor], prefix: str,
                 weight_dtype=None, c_ops: bool = False, moe: bool = False, window: int = 0) -> None:
        """moe: the MLP is cfg.moe's mixture of experts (self.moe) instead of gate_up/down; window: the
        layer's sliding attention window (0: none)."""
        w = lambda name: weights[prefix + name]  # noqa: E731
        b = lambda name: weights.get(prefix + name)  # noqa: E731
        make = lambda weight, bias=None: make_linear(weight, bias, weight_dtype)  # noqa: E731
        self.cfg = cfg
        qkv_bias = None
        if cfg.attention_bias:
            qkv_bias = torch.cat([b("self_attn.q_proj.bias"), b("self_attn.k_proj.bias"), b("self_attn.v_proj.bias")])
        self.qkv = make(
            cat_rows([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")]),
            qkv_bias)
        self.o_proj = make(w("self_attn.o_proj.weight"), b("self_attn.o_proj.bias"))
        self.moe = MoEMLP(cfg.moe, weights, prefix, make, c_ops) if moe else None
        if self.moe is None:
            self.gate_up = make(cat_rows([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]))
            self.down = make(w("mlp.down_proj.weight"))
        self.input_norm = w("input_layernorm.weight")
        self.post_norm = w("post_attention_layernorm.weight")
        self.q_norm = b("self_attn.q_norm.weight")
        self.k_norm = b("self_attn.k_norm.weight")
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        self.kv_size = cfg.num_key_value_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.window = window
        self.c_ops = c_ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        """x: [N, hidden] (this layer's input before its norm); returns (output, residual)."""
        if self.c_ops:
            return self._forward_c(x, residual, cos, sin, kv_cache, meta)
        cfg = self.cfg
        residual = x if residual is None else x + residual
        h = rms_norm(residual, self.input_norm, cfg.rms_norm_eps)
        qkv = self.qkv(h)
        n = qkv.shape[0]
        q = qkv[:, : self.q_size].view(n, cfg.num_attention_heads, cfg.head_dim)
        k = qkv[:, self.q_size: self.q_size + self.kv_size].view(n, cfg.num_key_value_heads, cfg.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(n, cfg.num_key_value_heads, cfg.head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, self.k_norm, cfg.rms_norm_eps)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        attn = paged_attention(q, k, v.contiguous(), kv_cache[0], kv_cache[1], meta, self.scale, self.window)
        residual = self.o_proj(attn) + residual
        h = rms_norm(residual, self.post_norm, cfg.rms_norm_eps)
        if self.moe is not None:
            return self.moe(h), residual
        gate_up = self.gate_up(h)
        inter = gate_up.shape[-1] // 2
        return self.down(F.silu(gate_up[:, :inter]) * gate_up[:, inter:]), residual

    def _forward_c(self, x, residual, cos, sin, kv_cache, meta):
        """The same computation with fused C steps; `residual` is updated in place (x is then not needed)."""
        cfg = self.cfg
        if residual is None:
            residual, x = x, None  # the first layer's input (a fresh embedding lookup) becomes the residual
        h = kernels.add_rms_norm(x, residual, self.input_norm, cfg.rms_norm_eps)
        qkv = self.qkv(h)
        n = qkv.shape[0]
        if self.q_norm is None:
            kernels.rope_qk(qkv, cos.reshape(n, -1), sin.reshape(n, -1),
                            cfg.num_attention_heads + cfg.num_key_value_heads, cfg.head_dim)
        q = qkv[:, : self.q_size].view(n, cfg.num_attention_heads, cfg.head_dim)
        k = qkv[:, self.q_size: self.q_size + self.kv_size].view(n, cfg.num_key_value_heads, cfg.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(n, cfg.num_key_value_heads, cfg.head_dim)
        if self.q_norm is not None:
            q = apply_rotary(rms_norm(q, self.q_norm, cfg.rms_norm_eps), cos, sin)
            k = apply_rotary(rms_norm(k, self.k_norm, cfg.rms_norm_eps), cos, sin)
        attn = paged_attention(q, k, v.contiguous(), kv_cache[0], kv_cache[1], meta, self.scale, self.window)
        h = kernels.add_rms_norm(self.o_proj(attn), residual, self.post_norm, cfg.rms_norm_eps)
        if self.moe is not None:
            return self.moe(h), residual
        return self.down(kernels.silu_mul(self.gate_up(h))), residual


class LlamaForCausalLM:
    """The decoder plus its LM head; `forward` returns final hidden states, `compute_logits` the logits."""

    uses_mrope = False  # positions are [N]; the Qwen2-VL family takes [3, N]

    def __init__(self, hf_config: dict, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 aux_hidden_layers: tuple[int, ...] = (), weight_dtype=None, shard=None) -> None:
        """dtype: activations and KV cache; weight_dtype: how linear weights are stored (see make_linear).

        shard: None, or one tensor-parallel rank's part (specserve.distributed.sharding.TensorShard): `weights`
        are then that rank's slices, and `shard.layer_config(config)` gives its layers' head counts."""
        cfg = DecoderConfig.from_hf(hf_config)
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (supported: silu)")
        self.config = cfg
        self.dtype = dtype
        self.embed_tokens = weights["model.embed_tokens.weight"]
        self.c_ops = kernels.kernel_usable(dtype)  # fused C layer steps (fp32 only)
        self.layer_config = cfg if shard is None else shard.layer_config(cfg)  # this rank's heads
        # The head first: the largest weight, whose conversion (a repacked copy, or its screen) briefly holds
        # it twice, before the layers are in memory rather than on top of them (Qwen2.5-Coder-1.5B, 64 MiB KV
        # cache: peak resident 2.37-2.54 GB with the head built after the layers, 1.90-1.91 GB before).
        lm_head = self.embed_tokens if cfg.tie_word_embeddings else weights.get("lm_head.weight", self.embed_tokens)
        self.lm_head = make_linear(lm_head, None, weight_dtype)
        # Greedy steps need only the argmax: screened through an int8 copy of the head (+28 MB for
        # SmolLM2), exact (see greedy_tokens); False where the head is not on the fp32 C GEMM.
        self.exact_argmax = getattr(self.lm_head, "enable_exact_argmax", lambda: False)()
        self.layers = [DecoderLayer(self.layer_config, weights, f"model.layers.{i}.", weight_dtype, self.c_ops,
                                    cfg.is_moe_layer(i), cfg.window(i))
                       for i in range(cfg.num_hidden_layers)]
        self.norm = weights["model.norm.weight"]
        self.rotary = self._make_rotary(cfg, dtype)
        self.aux_hidden_layers: tuple[int, ...] = ()
        self.set_aux_hidden_layers(aux_hidden_layers)
        # The whole stack in one C call (ops/csrc/decoder.c, which also copies out the aux states) when
        # every layer runs on C kernels; tests turn it off to compare the two.
        # (not when windowed layers mix with full-attention ones: those keep block tables of their own)
        self.fused_forward = self._fused_operands() is not None and not self.mixed_windows
        self._fused_layers = fused.TensorKeyed(self._build_layers_c)  # keyed by the KV cache tensors

    def set_aux_hidden_layers(self, layers) -> None:
        """Which layers' inputs (the residual stream entering layer i, before its norm; HF's
        hidden_states[i]) forward returns as aux hidden states, in this order; () for none."""
        layers = tuple(int(i) for i in layers)
        bad = [i for i in layers if not 0 <= i < self.config.num_hidden_layers]
        if bad or len(set(layers)) != len(layers):
            raise ValueError(f"aux hidden layers must be distinct layer indices in [0, "
                             f"{self.config.num_hidden_layers}), got {list(layers)}")
        self.aux_hidden_layers = layers

    def _make_rotary(self, cfg: DecoderConfig, dtype: torch.dtype) -> RotaryEmbedding:
        return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, dtype)

    def linear_weight_bytes(self) -> tuple[int, int]:
        """(bytes, weights) of the decoder's projections: what a one-token step mostly reads (of an MoE
        layer's experts, top_k of them on average; see MoEMLP.step_weight_bytes)."""
        nbytes = numel = 0
        for layer in self.layers:
            mlp = () if layer.moe is not None else (layer.gate_up, layer.down)
            for linear in (layer.qkv, layer.o_proj, *mlp):
                b, n = linear_bytes(linear)
                nbytes, numel = nbytes + b, numel + n
            if layer.moe is not None:
                b, n = layer.moe.step_weight_bytes(linear_bytes)
                nbytes, numel = nbytes + b, numel + n
        return nbytes, numel

    def linear_bytes_per_weight(self) -> float:
        """Mean bytes the decoder's projections keep per weight (4 in fp32, ~1 in int8, ~0.75 in Q4_1 blocks)."""
        nbytes, numel = self.linear_weight_bytes()
        return nbytes / max(numel, 1)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def kv_window(self) -> int:
        """The tokens of KV a query needs when every layer has a sliding window (the widest), else 0: the
        cache manager frees a request's blocks that fall wholly before it, and drafters that read the same
        block tables keep within it."""
        windows = [layer.window for layer in self.layers]
        return max(windows) if windows and all(windows) else 0

    @property
    def mixed_windows(self) -> tuple[int, ...]:
        """The sliding windows of a model that mixes them with full-attention layers, whose windowed layers
        then keep block tables of their own (HybridKVCacheManager); () otherwise."""
        windows = [layer.window for layer in self.layers]
        return tuple(sorted({w for w in windows if w})) if any(windows) and not all(windows) else ()

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.layer_config.num_key_value_heads, self.config.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], mm_embeds=None):
        """input_ids: [N]; positions: [N] (or [3, N] for M-RoPE); mm_embeds: None, or (rows [R], embeddings
        [R, hidden]) that replace those rows' token embeddings (image placeholders); returns (hidden [N,
        hidden], aux or None)."""
        x = self.embed_tokens[input_ids]
        if mm_embeds is not None:
            rows, values = mm_embeds
            x[rows] = values.to(x.dtype)
        cos, sin = self.rotary.cos_sin(positions)
        if self.fused_forward and meta.kernel is not None:  # the kernel then serves every request
            return self._forward_fused(x, cos, sin, meta, kv_caches)
        residual = None
        aux = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_hidden_layers:
                aux[i] = x.clone() if residual is None else x + residual  # C layers update residual in place
            x, residual = layer.forward(x, residual, cos, sin, kv_caches[i], meta)
        aux_states = [aux[i] for i in self.aux_hidden_layers] if aux else None
        if self.c_ops:
            return kernels.add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps), aux_states
        return rms_norm(x + residual, self.norm, self.config.rms_norm_eps), aux_states

    def _fused_operands(self) -> list[tuple] | None:
        """Per layer the C operands of (qkv, o_proj, gate_up, down), or None when a layer cannot run fused
        (no C kernels, weights off the C GEMM, q/k norms or mixture-of-experts MLPs, which the fused stack
        does not have)."""
        if not self.c_ops or any(layer.moe is not None for layer in self.layers):
            return None
        operands = []
        for layer in self.layers:
            linears = [getattr(lin, "c_operands", lambda: None)()
                       for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
            if layer.q_norm is not None or any(op is None for op in linears):
                return None
            operands.append(linears)
        return operands

    def _build_layers_c(self, cache_tensors: tuple[torch.Tensor, ...]):
        """The ctypes layer array over these (key, value, key, value, ...) cache tensors."""
        layers = (fused.DecoderLayerC * len(self.layers))()
        for i, (layer, ops) in enumerate(zip(self.layers, self._fused_operands())):
            k_cache, v_cache = cache_tensors[2 * i], cache_tensors[2 * i + 1]
            layers[i] = fused.DecoderLayerC(*map(fused.linear_c, ops), layer.input_norm.data_ptr(),
                                              layer.post_norm.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                              layer.window, KV_CODES[k_cache.dtype])
        return layers

    def _forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        cfg, n = self.config, x.shape[0]
        dims = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                cfg.intermediate_size)
        order = sorted(self.aux_hidden_layers)  # the kernel copies them out as it reaches them
        out, aux = fused.decoder_forward(
            self._fused_layers.get(tuple(t for pair in kv_caches for t in pair)), x.contiguous(), self.norm,
            cos.reshape(n, -1).contiguous(), sin.reshape(n, -1).contiguous(), meta.slot_mapping, meta.kernel, dims,
            kv_caches[0][0].shape[1], cfg.rms_norm_eps, self.layers[0].scale if self.layers else 1.0, tuple(order),
            meta.slot_rows)
        if aux is not None:
            aux = [aux[order.index(i)] for i in self.aux_hidden_layers]
        return out, aux

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [M, hidden] → logits [M, vocab] (float32)."""
        return self.lm_head(hidden).float()

    def greedy_tokens(self, hidden: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [M, hidden] → [M] int64, exactly argmax(compute_logits(hidden)) row by row (the first
        maximum), without the full logits where the head screens through its int8 copy: ~0.42 vs 2.3 ms
        for SmolLM2's head at one row, ~1.0 at nine (csrc/greedy.c). allowed: None, or [M, vocab] bool
        (structured output): the argmax with the other logits at -inf."""
        if self.exact_argmax:
            return self.lm_head.argmax(hidden, allowed)
        logits = self.compute_logits(hidden)
        return kernels.argmax_rows(logits if allowed is None else logits.masked_fill(~allowed, float("-inf")))
