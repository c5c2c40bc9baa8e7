"""The layers the EAGLE trainers (eagle.py, eagle3.py) share: a draft decoder layer's attention, unrolled over
training-time draft steps with the engine's RoPE (models/rope.py), its MLP and RMSNorm.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from specserve.models.rope import apply_rotary, inverse_frequencies


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # written out rather than F.rms_norm, which has no fused path for bfloat16 inputs (autocast) and
        # float32 weights
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Rotary(nn.Module):
    """cos/sin at any positions, computed as the engine's RotaryEmbedding tabulates them (rope_scaling
    included), so the trained head meets the RoPE it is served with."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        inv_freq, self.attn_scale = inverse_frequencies(head_dim, theta, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> cos, sin: [T, 1, D] (broadcast over heads)."""
        freqs = torch.outer(positions.float(), self.inv_freq)
        emb = torch.cat([freqs, freqs], -1)
        return (emb.cos() * self.attn_scale)[:, None], (emb.sin() * self.attn_scale)[:, None]


class DraftAttention(nn.Module):
    """A draft layer's self-attention over `in_features`-wide inputs (H for EAGLE-1, 2H for EAGLE-3), unrolled
    over draft steps: at step i, row t attends causally to step 0's keys and to its own row's keys of steps
    1..i, as the engine's single-token draft steps after a prefill of rows 0..t do.

    cfg: the layer's Llama fields (hidden_size, num_attention_heads, num_key_value_heads, head_dim, rope_theta,
    rope_scaling), as DecoderConfig and eagle3.Eagle3HeadConfig name them.
    """

    def __init__(self, cfg, in_features: int) -> None:
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(in_features, self.heads * D, bias=False)
        self.k_proj = nn.Linear(in_features, self.kv_heads * D, bias=False)
        self.v_proj = nn.Linear(in_features, self.kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.heads * D, H, bias=False)
        self.rotary = Rotary(D, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: list) -> torch.Tensor:
        """x: [B, T, in_features]; positions: [T] this step's RoPE positions; cache: the (k, v)
        [B, heads, T, D] of earlier steps, appended to -> [B, T, H]."""
        B, T, _ = x.shape
        cos, sin = self.rotary(positions)
        rep = self.heads // self.kv_heads
        q = apply_rotary(self.q_proj(x).view(B, T, self.heads, -1), cos, sin).transpose(1, 2)
        k = apply_rotary(self.k_proj(x).view(B, T, self.kv_heads, -1), cos, sin).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, -1).transpose(1, 2)
        cache.append((k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
        keys = torch.cat([kj for kj, _ in cache], 2)  # [B, heads, (i + 1) T, D]
        values = torch.cat([vj for _, vj in cache], 2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=_draft_steps_mask(T, len(cache), x.device))
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


def _draft_steps_mask(T: int, steps: int, device) -> torch.Tensor:
    """[T, steps * T] bool, True where row t may attend: step 0's keys causally, each later step's key at
    row t only."""
    eye = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([torch.ones(T, T, dtype=torch.bool, device=device).tril()] + [eye] * (steps - 1), 1)
