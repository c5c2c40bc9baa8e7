"""Qwen2-VL / Qwen2.5-VL vision encoders: the processor's patch rows in, merged image tokens at LLM width out.

Plain-torch inference over the checkpoint's `visual.*` (hub) or `model.visual.*` (transformers 5) tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

_VISION_PREFIXES = ("model.visual.", "visual.")  # most specific first: "visual." is a suffix of the other
NORM_EPS = 1e-6  # both towers hard-code it; configs do not carry it
DEFAULT_ROPE_THETA = 10000.0
SUPPORTED_ROPE_TYPES = (None, "axial", "default")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": _quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
}


@dataclass(frozen=True)
class VisionConfig:
    """The `vision_config` fields the tower needs, under one name for both families, checked once."""

    model_type: str  # "qwen2_vl" or "qwen2_5_vl"
    depth: int
    width: int  # block hidden size: Qwen2-VL's `embed_dim`, Qwen2.5-VL's `hidden_size`
    num_heads: int
    mlp_hidden: int
    out_hidden_size: int  # the LLM's hidden size: Qwen2-VL's `hidden_size`, Qwen2.5-VL's `out_hidden_size`
    hidden_act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    rope_theta: float
    window_side: int | None  # window side in merged tokens; None: every block attends to whole frames
    fullatt_block_indexes: tuple[int, ...]  # blocks that attend to whole frames when windowed

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def gated_mlp(self) -> bool:
        return self.model_type == "qwen2_5_vl"

    def __post_init__(self) -> None:
        sizes = dict(depth=self.depth, width=self.width, num_heads=self.num_heads, mlp_hidden=self.mlp_hidden,
                     out_hidden_size=self.out_hidden_size, in_channels=self.in_channels,
                     patch_size=self.patch_size, temporal_patch_size=self.temporal_patch_size,
                     spatial_merge_size=self.spatial_merge_size)
        bad = {name: value for name, value in sizes.items() if not isinstance(value, int) or value < 1}
        if bad:
            raise ValueError(f"vision_config sizes must be positive integers (got {bad})")
        if self.width % self.num_heads or self.head_dim % 4:
            raise ValueError(f"vision width {self.width} must split into {self.num_heads} heads of a size "
                             f"divisible by 4 (2-D rotary halves each head between rows and columns)")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision hidden_act {self.hidden_act!r} is not supported "
                             f"(supported: {', '.join(sorted(ACTIVATIONS))})")
        if self.window_side is not None and self.window_side < 1:
            raise ValueError(f"vision window_size must cover at least one merged token, i.e. be >= "
                             f"spatial_merge_size * patch_size = {self.spatial_merge_size * self.patch_size}")

    @classmethod
    def from_hf(cls, hf_config: dict) -> "VisionConfig":
        """From a full Qwen2-VL / Qwen2.5-VL config dict; missing fields take transformers' defaults."""
        model_type = hf_config.get("model_type")
        if model_type not in ("qwen2_vl", "qwen2_5_vl"):
            raise ValueError(f"model_type {model_type!r} has no Qwen2-VL vision tower (supported: qwen2_vl, "
                             f"qwen2_5_vl)")
        vc = hf_config.get("vision_config")
        if not isinstance(vc, dict):
            raise ValueError(f"a {model_type} config needs a vision_config dict to build the vision tower")
        rope = vc.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"vision rope type {rope_type!r} is not supported (supported: axial)")
        merge, patch = vc.get("spatial_merge_size", 2), vc.get("patch_size", 14)
        common = dict(model_type=model_type, depth=vc.get("depth", 32), num_heads=vc.get("num_heads", 16),
                      in_channels=vc.get("in_channels", vc.get("in_chans", 3)), patch_size=patch,
                      temporal_patch_size=vc.get("temporal_patch_size", 2), spatial_merge_size=merge,
                      rope_theta=float(rope.get("rope_theta", vc.get("rope_theta", DEFAULT_ROPE_THETA))))
        if model_type == "qwen2_vl":
            width = vc.get("embed_dim", 1280)
            return cls(**common, width=width, mlp_hidden=int(width * vc.get("mlp_ratio", 4)),
                       out_hidden_size=vc.get("hidden_size", 3584), hidden_act=vc.get("hidden_act", "quick_gelu"),
                       window_side=None, fullatt_block_indexes=())
        return cls(**common, width=vc.get("hidden_size", 3584), mlp_hidden=vc.get("intermediate_size", 3420),
                   out_hidden_size=vc.get("out_hidden_size", 3584), hidden_act=vc.get("hidden_act", "silu"),
                   window_side=vc.get("window_size", 112) // merge // patch,
                   fullatt_block_indexes=tuple(vc.get("fullatt_block_indexes", (7, 15, 23, 31))))


class _WeightReader:
    """Takes one tower's tensors out of a whole checkpoint, checking each shape against the config."""

    def __init__(self, weights: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype) -> None:
        self.weights, self.prefix, self.dtype = weights, prefix, dtype

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        key = self.prefix + name
        if key not in self.weights:
            raise ValueError(f"vision weight {key!r} is missing from the checkpoint")
        tensor = self.weights[key]
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"vision weight {key!r} has shape {list(tensor.shape)}; the config implies "
                             f"{list(shape)}")
        return tensor.detach().to(self.dtype)


@dataclass
class Norm:
    """LayerNorm when it has a bias (Qwen2-VL), RMSNorm otherwise (Qwen2.5-VL); eps 1e-6."""

    weight: torch.Tensor  # [dim]
    bias: torch.Tensor | None  # [dim]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, NORM_EPS)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + NORM_EPS)
        return self.weight * x32.to(x.dtype)

    @classmethod
    def read(cls, reader: _WeightReader, name: str, dim: int, with_bias: bool) -> "Norm":
        return cls(reader.take(f"{name}.weight", (dim,)),
                   reader.take(f"{name}.bias", (dim,)) if with_bias else None)


@dataclass
class Mlp:
    """act(up(x)) → down (Qwen2-VL fc1/fc2), or act(gate(x)) * up(x) → down with gate|up fused (Qwen2.5-VL)."""

    up_weight: torch.Tensor  # [hidden, width], or [2 * hidden, width] (gate rows, then up rows) when gated
    up_bias: torch.Tensor
    down_weight: torch.Tensor  # [width, hidden]
    down_bias: torch.Tensor
    act: Callable[[torch.Tensor], torch.Tensor]
    gated: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.up_weight, self.up_bias)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return F.linear(h, self.down_weight, self.down_bias)

    @classmethod
    def read(cls, reader: _WeightReader, name: str, config: VisionConfig) -> "Mlp":
        width, hidden, act = config.width, config.mlp_hidden, ACTIVATIONS[config.hidden_act]
        if not config.gated_mlp:
            return cls(reader.take(f"{name}.fc1.weight", (hidden, width)), reader.take(f"{name}.fc1.bias", (hidden,)),
                       reader.take(f"{name}.fc2.weight", (width, hidden)), reader.take(f"{name}.fc2.bias", (width,)),
                       act, gated=False)
        up = [reader.take(f"{name}.{proj}.weight", (hidden, width)) for proj in ("gate_proj", "up_proj")]
        up_bias = [reader.take(f"{name}.{proj}.bias", (hidden,)) for proj in ("gate_proj", "up_proj")]
        return cls(torch.cat(up), torch.cat(up_bias), reader.take(f"{name}.down_proj.weight", (width, hidden)),
                   reader.take(f"{name}.down_proj.bias", (width,)), act, gated=True)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, head_dim]; cos, sin: [N, 1, head_dim] (fp32) → x rotated rotate-half style, in fp32."""
    x = x.float()
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: list[torch.Tensor]) -> torch.Tensor:
    """q, k, v: [N, heads, head_dim]; groups: index tensors [num_segments, length] that partition the N rows
    → [N, heads, head_dim], each row attending (bidirectionally) only to the rows of its own segment."""
    out = torch.empty_like(q)
    for index in groups:  # segments of one length run as one batch
        qs, ks, vs = (t[index].transpose(1, 2) for t in (q, k, v))  # [num_segments, heads, length, head_dim]
        out[index] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
    return out


class VisionBlock:
    """Pre-norm transformer block: fused-qkv attention with 2-D rotary over segments, then the MLP."""

    def __init__(self, reader: _WeightReader, index: int, config: VisionConfig) -> None:
        name, width, layer_norm = f"blocks.{index}", config.width, config.model_type == "qwen2_vl"
        self.num_heads = config.num_heads
        self.full_attention = config.window_side is None or index in config.fullatt_block_indexes
        self.norm1 = Norm.read(reader, f"{name}.norm1", width, with_bias=layer_norm)
        self.norm2 = Norm.read(reader, f"{name}.norm2", width, with_bias=layer_norm)
        self.qkv_weight = reader.take(f"{name}.attn.qkv.weight", (3 * width, width))
        self.qkv_bias = reader.take(f"{name}.attn.qkv.bias", (3 * width,))
        self.proj_weight = reader.take(f"{name}.attn.proj.weight", (width, width))
        self.proj_bias = reader.take(f"{name}.attn.proj.bias", (width,))
        self.mlp = Mlp.read(reader, f"{name}.mlp", config)

    def forward(self, x: torch.Tensor, layout: "PatchLayout") -> torch.Tensor:
        """x: [N, width] → [N, width]."""
        qkv = F.linear(self.norm1(x), self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.view(x.shape[0], 3, self.num_heads, -1).unbind(1)  # [N, heads, head_dim] each
        q = apply_rotary(q, layout.cos, layout.sin).to(x.dtype)
        k = apply_rotary(k, layout.cos, layout.sin).to(x.dtype)
        groups = layout.frame_groups if self.full_attention else layout.window_groups
        attn = segment_attention(q, k, v, groups).reshape(x.shape[0], -1)
        x = x + F.linear(attn, self.proj_weight, self.proj_bias)
        return x + self.mlp(self.norm2(x))


def segment_groups(segment_ids: torch.Tensor) -> list[torch.Tensor]:
    """segment_ids: [N] any integer labels → index tensors [num_segments, length], one per distinct segment
    length; each row lists one segment's positions in increasing order."""
    _, dense = torch.unique(segment_ids, return_inverse=True)
    order = torch.argsort(dense, stable=True)
    counts = torch.bincount(dense)
    starts = torch.cumsum(counts, 0) - counts
    return [order[starts[counts == length].unsqueeze(1) + torch.arange(length)]
            for length in torch.unique(counts).tolist()]


@dataclass
class PatchLayout:
    """Where each patch row of a batch of images sits, as the blocks need it."""

    cos: torch.Tensor  # [N, 1, head_dim] fp32 2-D rotary
    sin: torch.Tensor  # [N, 1, head_dim]
    frame_groups: list[torch.Tensor]  # segments = one temporal patch of one image
    window_groups: list[torch.Tensor]  # segments = one window of one frame (Qwen2.5-VL); frames otherwise

    @classmethod
    def build(cls, grid_thw: list[tuple[int, int, int]], config: VisionConfig) -> "PatchLayout":
        frame, row, col = patch_coordinates(grid_thw, config.spatial_merge_size)
        cos, sin = rotary_cos_sin(row, col, config.head_dim, config.rope_theta)
        frames = segment_groups(frame)
        if config.window_side is None:
            return cls(cos, sin, frames, frames)
        span = config.window_side * config.spatial_merge_size  # window side in patches
        win_row, win_col = row // span, col // span
        num_rows, num_cols = int(win_row.max()) + 1, int(win_col.max()) + 1
        windows = segment_groups((frame * num_rows + win_row) * num_cols + win_col)
        return cls(cos, sin, frames, windows)


def patch_coordinates(grid_thw: list[tuple[int, int, int]], merge: int) -> tuple[torch.Tensor, ...]:
    """→ (frame, row, col), each [sum(t*h*w)]: the global frame index (one per temporal patch of each image)
    and the patch's row/column in its frame, in the processor's row order: per frame, merge blocks in raster
    order, the patches of each block in raster order."""
    frames, rows, cols = [], [], []
    first_frame = 0
    for t, h, w in grid_thw:
        block_row, block_col, in_row, in_col = torch.meshgrid(
            torch.arange(h // merge), torch.arange(w // merge), torch.arange(merge), torch.arange(merge),
            indexing="ij")
        rows.append((block_row * merge + in_row).flatten().repeat(t))
        cols.append((block_col * merge + in_col).flatten().repeat(t))
        frames.append(torch.arange(first_frame, first_frame + t).repeat_interleave(h * w))
        first_frame += t
    return torch.cat(frames), torch.cat(rows), torch.cat(cols)


def rotary_cos_sin(row: torch.Tensor, col: torch.Tensor, head_dim: int,
                   theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """row, col: [N] → cos, sin [N, 1, head_dim]: the first head_dim/4 frequencies turn with the row, the next
    head_dim/4 with the column, and the second half of the head repeats the first (rotate-half pairs)."""
    quarter = head_dim // 4
    inv_freq = 1.0 / (theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float) / (2 * quarter)))
    angles = torch.cat([row.float().unsqueeze(1) * inv_freq, col.float().unsqueeze(1) * inv_freq], dim=1)
    angles = torch.cat([angles, angles], dim=1).unsqueeze(1)
    return angles.cos(), angles.sin()


class VisionTower:
    """Patch embed → blocks → PatchMerger (norm, 2x2 blocks concatenated, Linear → exact GELU → Linear)."""

    def __init__(self, config: VisionConfig, reader: _WeightReader) -> None:
        self.config = config
        self.spatial_merge_size = config.spatial_merge_size
        self.patch_size = config.patch_size
        self.temporal_patch_size = config.temporal_patch_size
        self.out_hidden_size = config.out_hidden_size
        self.patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
        patch_shape = (config.width, config.in_channels, config.temporal_patch_size, config.patch_size,
                       config.patch_size)
        # Conv3d with kernel = stride = patch is a linear map of each flattened (c, t, y, x) row.
        self.patch_weight = reader.take("patch_embed.proj.weight", patch_shape).reshape(config.width, -1)
        self.blocks = [VisionBlock(reader, i, config) for i in range(config.depth)]
        merged = config.width * config.spatial_merge_size ** 2
        self.merger_norm = Norm.read(reader, "merger.ln_q", config.width,
                                     with_bias=config.model_type == "qwen2_vl")
        self.merger_fc1 = (reader.take("merger.mlp.0.weight", (merged, merged)),
                           reader.take("merger.mlp.0.bias", (merged,)))
        self.merger_fc2 = (reader.take("merger.mlp.2.weight", (config.out_hidden_size, merged)),
                           reader.take("merger.mlp.2.bias", (config.out_hidden_size,)))
        self.dtype = self.patch_weight.dtype

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values: [sum(t*h*w), in_channels*temporal_patch*patch*patch] (the processor's layout: rows in
        merge-block order), grid_thw: one (t, h, w) in patches per image → [sum(t*h*w // merge**2),
        out_hidden_size], images in order, each image's merged tokens in raster order."""
        grid_thw = self._check_inputs(pixel_values, grid_thw)
        if not grid_thw:
            return torch.empty(0, self.out_hidden_size, dtype=self.dtype)
        layout = PatchLayout.build(grid_thw, self.config)
        x = F.linear(pixel_values.to(self.dtype), self.patch_weight)  # [N, width]
        for block in self.blocks:
            x = block.forward(x, layout)
        x = self.merger_norm(x).reshape(-1, self.merger_fc1[0].shape[1])  # one row per 2x2 block
        x = F.gelu(F.linear(x, *self.merger_fc1))
        return F.linear(x, *self.merger_fc2)

    __call__ = forward

    def _check_inputs(self, pixel_values: torch.Tensor,
                      grid_thw: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        grid = [tuple(int(n) for n in thw) for thw in grid_thw]
        merge = self.spatial_merge_size
        for thw in grid:
            if len(thw) != 3 or min(thw) < 1 or thw[1] % merge or thw[2] % merge:
                raise ValueError(f"grid_thw entries must be (t, h, w) with t >= 1 and h, w positive multiples "
                                 f"of spatial_merge_size {merge} (got {thw})")
        rows = sum(t * h * w for t, h, w in grid)
        if pixel_values.dim() != 2 or tuple(pixel_values.shape) != (rows, self.patch_dim):
            raise ValueError(f"pixel_values must have shape [sum(t*h*w), {self.patch_dim}] = [{rows}, "
                             f"{self.patch_dim}] for grid_thw {grid} (got {list(pixel_values.shape)})")
        return grid


def vision_weight_prefix(weights: dict[str, torch.Tensor]) -> str | None:
    """'model.visual.' (transformers 5 saves), 'visual.' (hub checkpoints), or None without vision weights."""
    for prefix in _VISION_PREFIXES:
        if any(key.startswith(prefix) for key in weights):
            return prefix
    return None


def build_vision_tower(hf_config: dict, weights: dict[str, torch.Tensor],
                       dtype: torch.dtype = torch.float32) -> VisionTower | None:
    """The vision tower of a Qwen2-VL / Qwen2.5-VL checkpoint, or None when `weights` holds no vision weights.

    hf_config: the full model config dict (with `vision_config`); weights: the whole checkpoint state dict,
    which is only read. Raises ValueError for unsupported settings, missing tensors or mismatched shapes.
    """
    prefix = vision_weight_prefix(weights)
    if prefix is None:
        return None
    config = VisionConfig.from_hf(hf_config)
    return VisionTower(config, _WeightReader(weights, prefix, dtype))
