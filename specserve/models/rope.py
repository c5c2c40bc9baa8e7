"""Rotary position embeddings (rotate-half convention, as transformers), with the scalings configs use.

`RotaryEmbedding.cos_sin(positions)` is the one accessor for positions: `[num_tokens]` for ordinary
RoPE; M-RoPE models subclass it to accept `[3, num_tokens]`.
"""
from __future__ import annotations

import math

import torch


def rope_parameters(config: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from either config layout (transformers 4 or 5)."""
    params = config.get("rope_parameters") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), scaling


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """[head_dim // 2] inverse frequencies and the attention scaling factor for cos/sin."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).double() / head_dim))
    if scaling is None:
        return inv_freq.float(), 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float(), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling).float(), 1.0
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype = torch.float32) -> None:
        inv_freq, attn_scale = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_position, head_dim]
        self.cos = (emb.cos() * attn_scale).to(dtype)
        self.sin = (emb.sin() * attn_scale).to(dtype)
        self.max_position = max_position

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [N] → cos, sin: [N, 1, head_dim] (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, H, D] rotated by the rotate-half convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
