"""Mixture-of-experts MLPs (Qwen3-MoE, Qwen2-MoE, Mixtral): a router picks each row's top-k experts, and a
step's rows are grouped by expert, so an expert no row picked costs nothing and one picked by several reads
its weights once. Also the MoE fields of a config.json and the names experts' weights go by."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from specserve.models.gguf_quant import QuantizedWeight, cat_rows
from specserve.ops import fused, kernels

MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral")

# (gate, up, down) of expert e under layer prefix p, as checkpoints on the Hub name them
_QWEN_EXPERT = ("{p}mlp.experts.{e}.gate_proj.weight", "{p}mlp.experts.{e}.up_proj.weight",
                "{p}mlp.experts.{e}.down_proj.weight")
_MIXTRAL_EXPERT = ("{p}block_sparse_moe.experts.{e}.w1.weight", "{p}block_sparse_moe.experts.{e}.w3.weight",
                   "{p}block_sparse_moe.experts.{e}.w2.weight")
# transformers 5 in memory: every expert in two 3-D tensors, gate_up_proj [E, 2I, H] and down_proj [E, H, I]
_FUSED_EXPERTS = ("{p}mlp.experts.gate_up_proj", "{p}mlp.experts.down_proj")
_ROUTER = ("{p}mlp.gate.weight", "{p}block_sparse_moe.gate.weight")  # [E, H]
_SHARED_EXPERT = ("{p}mlp.shared_expert.gate_proj.weight", "{p}mlp.shared_expert.up_proj.weight",
                  "{p}mlp.shared_expert.down_proj.weight")
_SHARED_EXPERT_GATE = "{p}mlp.shared_expert_gate.weight"  # [1, H]


@dataclass(frozen=True)
class MoEConfig:
    """The MoE fields of a config.json, checked once.

    A layer i is MoE when num_experts > 0, i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0;
    the others are dense MLPs of the config's intermediate_size.
    """

    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # each expert's (moe_intermediate_size; Mixtral's intermediate_size)
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0 for none
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict) -> "MoEConfig | None":
        """The MoE fields of a config.json dict; None for a dense model_type. ValueError naming a bad field."""
        model_type = cfg.get("model_type")
        if model_type not in MOE_MODEL_TYPES:
            return None
        # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (Mixtral's name)
        num_experts = _field(cfg, "num_local_experts", "num_experts")
        if model_type == "mixtral":
            return cls(num_experts=num_experts, top_k=_field(cfg, "num_experts_per_tok"),
                       intermediate_size=_field(cfg, "intermediate_size"), norm_topk_prob=True)
        shared = int(cfg.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
        return cls(num_experts=num_experts, top_k=_field(cfg, "num_experts_per_tok"),
                   intermediate_size=_field(cfg, "moe_intermediate_size"),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), shared_intermediate_size=shared,
                   decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
                   mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()))

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0


def _field(cfg: dict, *names: str) -> int:
    """The first of `names` the config sets (spellings of one field)."""
    for name in names:
        if cfg.get(name) is not None:
            return int(cfg[name])
    raise ValueError(f"config field {' or '.join(map(repr, names))} is required for model_type "
                     f"{cfg.get('model_type')!r}")


# ---------------------------------------------------------------- weight names


def _names(forms: tuple[str, ...], prefix: str, **fields) -> list[str]:
    return [form.format(p=prefix, **fields) for form in forms]


def expected_moe_weights(state_dict: dict, prefix: str, moe: MoEConfig) -> list[str]:
    """The names an MoE layer under `prefix` ("model.layers.3.") needs, in the form its router's name (or the
    fused experts' presence) shows the checkpoint uses: Qwen's per-expert names, Mixtral's w1/w3/w2 or
    transformers 5's fused 3-D tensors."""
    router = next((name for name in _names(_ROUTER, prefix) if name in state_dict), _ROUTER[0].format(p=prefix))
    if _FUSED_EXPERTS[0].format(p=prefix) in state_dict:
        names = _names(_FUSED_EXPERTS, prefix)
    else:
        forms = _MIXTRAL_EXPERT if "block_sparse_moe" in router else _QWEN_EXPERT
        names = [name for e in range(moe.num_experts) for name in _names(forms, prefix, e=e)]
    if moe.shared_intermediate_size:
        names += _names(_SHARED_EXPERT, prefix) + [_SHARED_EXPERT_GATE.format(p=prefix)]
    return [router] + names


def expert_weights(weights: dict, prefix: str, moe: MoEConfig) -> list[tuple]:
    """Per expert, (gate_up [2I, H], down [H, I]) from any of the forms expected_moe_weights names; tensors or
    QuantizedWeights (gate and up fused with cat_rows)."""
    if _FUSED_EXPERTS[0].format(p=prefix) in weights:
        gate_up, down = (weights[name] for name in _names(_FUSED_EXPERTS, prefix))
        return [(gate_up[e].contiguous(), down[e].contiguous()) for e in range(moe.num_experts)]
    forms = _MIXTRAL_EXPERT if _ROUTER[1].format(p=prefix) in weights else _QWEN_EXPERT
    experts = []
    for e in range(moe.num_experts):
        gate, up, down = (weights[name] for name in _names(forms, prefix, e=e))
        experts.append((cat_rows([gate, up]), down))
    return experts


def _dense(weight) -> torch.Tensor:
    """A small weight read with F.linear (router, shared-expert gate) as a tensor."""
    return weight.as_exact().dequantize() if isinstance(weight, QuantizedWeight) else weight


# ---------------------------------------------------------------- the MLP


class MoEMLP:
    """One layer's mixture-of-experts MLP, in transformers' arithmetic order: router logits, softmax in fp32,
    top-k, renormalised if norm_topk_prob, each expert's output times its weight summed over experts in
    ascending order, plus sigmoid(shared_expert_gate) times the shared expert's output where there is one."""

    def __init__(self, moe: MoEConfig, weights: dict, prefix: str, make: Callable, c_ops: bool) -> None:
        """make: weight -> linear (llama.make_linear with the model's weight_dtype); c_ops: SiLU-and-mul in C."""
        self.num_experts, self.top_k, self.norm_topk_prob = moe.num_experts, moe.top_k, moe.norm_topk_prob
        self.router = _dense(next(weights[name] for name in _names(_ROUTER, prefix) if name in weights))  # [E, H]
        self.experts = [(make(gate_up), make(down)) for gate_up, down in expert_weights(weights, prefix, moe)]
        self.shared = None
        if moe.shared_intermediate_size:
            gate, up, down = (weights[name] for name in _names(_SHARED_EXPERT, prefix))
            self.shared = (make(cat_rows([gate, up])), make(down))
            self.shared_gate = _dense(weights[_SHARED_EXPERT_GATE.format(p=prefix)]).reshape(1, -1)  # [1, H]
        self.c_ops = c_ops
        self.inter = moe.intermediate_size
        # Every expert's C operands, for the one-call path (fused.moe_experts), when each expert is on the C GEMM
        operands = [(gate_up.c_operands(), down.c_operands()) for gate_up, down in self.experts] if c_ops else []
        self._c_experts = None
        if operands and all(a is not None and b is not None for a, b in operands):
            linears = fused.LinearC * self.num_experts
            self._c_experts = (linears(*(fused.linear_c(a) for a, _ in operands)),
                               linears(*(fused.linear_c(b) for _, b in operands)))

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [N, H] -> (weights [N, k] in h's dtype, experts [N, k] int64)."""
        probs = torch.softmax(F.linear(h, self.router), dim=-1, dtype=torch.float32)
        top, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top /= top.sum(dim=-1, keepdim=True)
        return top.to(h.dtype), experts

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h: [N, H] (the post-attention norm's output) -> [N, H]."""
        top, experts = self.route(h)
        used, offsets, rows, weights = _grouped_by_expert(top, experts, self.num_experts)
        if self._c_experts is not None and h.dtype == torch.float32:  # the same kernels in one C call
            out = fused.moe_experts(h.contiguous(), *self._c_experts, self.inter, used, offsets, rows, weights)
        else:
            out = torch.zeros_like(h)
            for i, e in enumerate(used.tolist()):
                gate_up, down = self.experts[e]
                group, weight = rows[offsets[i]:offsets[i + 1]], weights[offsets[i]:offsets[i + 1]]
                out.index_add_(0, group, down(self._silu_mul(gate_up(h[group]))) * weight[:, None])
        if self.shared is not None:
            gate_up, down = self.shared
            out = out + torch.sigmoid(F.linear(h, self.shared_gate)) * down(self._silu_mul(gate_up(h)))
        return out

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.c_ops:
            return kernels.silu_mul(gate_up)
        inter = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]

    def step_weight_bytes(self, measure: Callable) -> tuple[int, int]:
        """(bytes, weights) a one-token step reads on average: the router, the shared expert and top_k of the
        experts' share. measure: linear -> (bytes, weights)."""
        nbytes = self.router.numel() * self.router.element_size()
        numel = self.router.numel()
        for linear in (lin for pair in self.experts for lin in pair):
            b, n = measure(linear)
            nbytes, numel = nbytes + b * self.top_k / self.num_experts, numel + n * self.top_k / self.num_experts
        for linear in self.shared or ():
            b, n = measure(linear)
            nbytes, numel = nbytes + b, numel + n
        return round(nbytes), round(numel)


def _grouped_by_expert(top: torch.Tensor, experts: torch.Tensor, num_experts: int):
    """top, experts: [N, k] -> the experts some row picked, ascending (used [U] int64), and for used expert i its
    rows rows[offsets[i]:offsets[i + 1]] (ascending) with their routing weights: (used, offsets [U + 1], rows [N k],
    weights [N k])."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # rows ascending within each expert
    counts = torch.bincount(flat, minlength=num_experts)
    used = counts.nonzero().squeeze(1)
    offsets = torch.zeros(len(used) + 1, dtype=torch.long)
    offsets[1:] = counts[used].cumsum(0)
    return used, offsets, order // experts.shape[1], top.reshape(-1)[order].contiguous()
