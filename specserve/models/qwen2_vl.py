"""Qwen2-VL / Qwen2.5-VL: the Qwen2 layers of llama.py with multimodal rotary positions (M-RoPE), the vision
tower of qwen2_vl_vision.py, and the positions of prompts with images.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.models.llama import DecoderConfig, LlamaForCausalLM
from specserve.models.rope import RotaryEmbedding

# transformers falls back to this split when a config names none; it fits head_dim 128.
DEFAULT_MROPE_SECTION = (16, 24, 24)
# Qwen2VLTextConfig's rope_theta when a config names none.
DEFAULT_ROPE_THETA = 1000000.0
_NON_TEXT_KEYS = ("text_config", "vision_config")
_VISION_PREFIXES = ("model.visual.", "visual.")
_TEXT_PREFIX = "model.language_model."  # transformers 5 names; checkpoints from 4.x say "model."


def text_mrope_positions(num_computed: int, num_tokens: int, delta: int = 0) -> torch.Tensor:
    """[3, num_tokens] M-RoPE positions of text tokens: every row is arange(num_computed, +num_tokens) + delta.

    delta is the request's constant offset (0 for text-only prompts; after images, the prompt's largest
    position + 1 - prompt length).
    """
    if num_computed < 0 or num_tokens < 0:
        raise ValueError(f"num_computed and num_tokens must be >= 0 (got {num_computed}, {num_tokens})")
    row = torch.arange(num_computed + delta, num_computed + delta + num_tokens, dtype=torch.long)
    return row.unsqueeze(0).repeat(3, 1)


def mrope_prompt_positions(num_prompt_tokens: int, features, merge_size: int) -> tuple[torch.Tensor, int]:
    """[3, P] M-RoPE positions of a prompt with images, and the request's delta.

    features: objects with offset, length and grid_thw (types.MultiModalFeature), by offset. Text tokens
    take a running counter on all three rows; an image's merged token (ti, r, c) takes (next + ti, next + r,
    next + c), after which the counter resumes at the image's largest position + 1. Positions of tokens past
    the prompt are index + delta, delta = largest prompt position + 1 - P (<= 0 with images).
    """
    pieces, next_pos, cursor = [], 0, 0
    for f in sorted(features, key=lambda f: f.offset):
        t, h, w = f.grid_thw
        rows, cols = h // merge_size, w // merge_size
        if f.offset < cursor or f.length != t * rows * cols:
            raise ValueError(f"image placeholders at {f.offset} (+{f.length}) do not fit grid {f.grid_thw} "
                             f"with merge size {merge_size} after token {cursor}")
        pieces.append(torch.arange(next_pos, next_pos + f.offset - cursor).expand(3, -1))
        next_pos += f.offset - cursor
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(rows), torch.arange(cols), indexing="ij"))
        pieces.append(grid.reshape(3, -1) + next_pos)
        next_pos += max(t, rows, cols)
        cursor = f.end
    if cursor > num_prompt_tokens:
        raise ValueError(f"image placeholders end at {cursor}, past the prompt's {num_prompt_tokens} tokens")
    pieces.append(torch.arange(next_pos, next_pos + num_prompt_tokens - cursor).expand(3, -1))
    next_pos += num_prompt_tokens - cursor
    return torch.cat(pieces, dim=1), next_pos - num_prompt_tokens


@dataclass(frozen=True)
class MRopePositions:
    """One request's M-RoPE positions: its prompt's [3, P] (from mrope_prompt_positions), then index + delta
    on all three rows for every later token (outputs, drafts)."""

    prompt: torch.Tensor  # [3, P]
    delta: int

    def range(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] positions of token indices start..end-1."""
        num_prompt = self.prompt.shape[1]
        if end <= num_prompt:
            return self.prompt[:, start:end]
        tail = torch.arange(max(start, num_prompt) + self.delta, end + self.delta).expand(3, -1)
        return tail if start >= num_prompt else torch.cat([self.prompt[:, start:], tail], dim=1)


class MRotaryEmbedding(RotaryEmbedding):
    """Rotary embedding whose frequencies are split in three sections read from the t, h and w position rows.

    `mrope_section` counts frequencies (units of head_dim / 2): the first s0 use row 0 (temporal), the
    next s1 row 1 (height), the last s2 row 2 (width). Frequency j rotates dims j and j + head_dim / 2
    (rotate-half), so both halves of cos/sin take the same row, as transformers' Qwen2-VL does.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, mrope_section: list[int] | tuple[int, ...],
                 dtype: torch.dtype = torch.float32) -> None:
        section = [int(s) for s in mrope_section]
        if len(section) != 3 or min(section) < 0 or sum(section) != head_dim // 2:
            raise ValueError(f"mrope_section must be 3 non-negative sizes summing to head_dim / 2 = "
                             f"{head_dim // 2} (got {list(mrope_section)})")
        super().__init__(head_dim, max_position, theta, None, dtype)
        self.mrope_section = tuple(section)
        half_axis = torch.repeat_interleave(torch.arange(3), torch.tensor(section))  # [head_dim // 2]
        self.axis = torch.cat([half_axis, half_axis])  # [head_dim] which position row each dim reads

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [N] (all three rows equal) or [3, N] → cos, sin: [N, 1, head_dim]."""
        if positions.dim() == 1:
            return super().cos_sin(positions)
        if positions.dim() != 2 or positions.shape[0] != 3:
            raise ValueError(f"M-RoPE positions must have shape [N] or [3, N] (got {list(positions.shape)})")
        return self._select(self.cos, positions), self._select(self.sin, positions)

    def _select(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """table: [max_position, head_dim]; positions: [3, N] → [N, 1, head_dim], dim d from row axis[d]."""
        per_row = table[positions]  # [3, N, head_dim]
        index = self.axis.view(1, 1, -1).expand(1, per_row.shape[1], -1)
        return per_row.gather(0, index).squeeze(0).unsqueeze(1)


def mrope_settings(text_config: dict) -> tuple[float, list[int]]:
    """(rope_theta, mrope_section) from `rope_scaling` (hub configs) or `rope_parameters` (transformers 5)."""
    params = text_config.get("rope_parameters") or {}
    scaling = text_config.get("rope_scaling") or {}
    # transformers 5 rewrites type "mrope" to rope_type "default"; older saves say either.
    kinds = {rope.get(key) for rope in (scaling, params) for key in ("type", "rope_type")}
    unsupported = kinds - {None, "default", "mrope"}
    if unsupported:
        raise ValueError(f"rope type {sorted(unsupported)} is not supported for Qwen2-VL (supported: default, mrope)")
    theta = params.get("rope_theta") or scaling.get("rope_theta") or text_config.get("rope_theta")
    section = (text_config.get("mrope_section") or scaling.get("mrope_section") or params.get("mrope_section")
               or DEFAULT_MROPE_SECTION)  # a top-level mrope_section is what text_decoder_config writes
    return float(theta or DEFAULT_ROPE_THETA), list(section)


def text_decoder_config(hf_config: dict) -> dict:
    """The flat Qwen2 config the Llama-family decoder reads, from a Qwen2-VL config of either layout.

    transformers 5 nests the language model's fields under `text_config`; hub checkpoints keep them at
    the top level. Either way the text fields win over top-level ones. M-RoPE is carried in `mrope_section`
    (frequencies per t/h/w row); `rope_scaling` is cleared so the base rotary sees plain RoPE.
    """
    text = hf_config.get("text_config") or {}
    merged = {k: v for k, v in hf_config.items() if k not in _NON_TEXT_KEYS}
    merged.update(text)
    if merged.get("use_sliding_window"):
        raise ValueError("use_sliding_window=True is not supported for Qwen2-VL (full attention only)")
    theta, section = mrope_settings(merged)
    merged.update(
        model_type=hf_config.get("model_type", "qwen2_vl"),
        # transformers' Qwen2-VL attention ignores any head_dim field.
        head_dim=merged["hidden_size"] // merged["num_attention_heads"],
        attention_bias=True,
        rope_theta=theta,
        rope_scaling=None,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        mrope_section=section,
        # Pre-5 saves kept the flag in text_config; transformers ties when either says so.
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings") or text.get("tie_word_embeddings")),
    )
    return merged


def text_decoder_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The language-model weights under the names llama.py reads (`model.layers.N...`, `lm_head.weight`)."""
    out = {}
    for name, tensor in weights.items():
        if name.startswith(_VISION_PREFIXES):
            continue
        if name.startswith(_TEXT_PREFIX):
            name = "model." + name[len(_TEXT_PREFIX):]
        out[name] = tensor
    return out


def vision_tower_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The vision tower's weights, under their checkpoint names."""
    return {name: tensor for name, tensor in weights.items() if name.startswith(_VISION_PREFIXES)}


class Qwen2VLForCausalLM(LlamaForCausalLM):
    """Qwen2-VL / Qwen2.5-VL language model; `forward` takes positions [N] or [3, N] (t, h, w rows)."""

    uses_mrope = True

    def __init__(self, hf_config: dict, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 aux_hidden_layers: tuple[int, ...] = (), weight_dtype=None, shard=None) -> None:
        """shard: one tensor-parallel rank's part of the text decoder (see LlamaForCausalLM); the vision tower
        is built whole where `weights` hold it."""
        from specserve.models.qwen2_vl_vision import build_vision_tower

        text = text_decoder_config(hf_config)
        self.mrope_section = text["mrope_section"]  # read by _make_rotary, which the base constructor calls
        self.vision = build_vision_tower(hf_config, weights)  # None for a checkpoint without the vision tower
        super().__init__(text, text_decoder_weights(weights), dtype=dtype, aux_hidden_layers=aux_hidden_layers,
                         weight_dtype=weight_dtype, shard=shard)
        if self.vision is not None and self.vision.out_hidden_size != self.config.hidden_size:
            raise ValueError(f"the vision tower's output width {self.vision.out_hidden_size} differs from the "
                             f"language model's hidden_size {self.config.hidden_size}")

    @property
    def spatial_merge_size(self) -> int:
        return self.vision.spatial_merge_size if self.vision is not None else 2

    def prompt_positions(self, num_prompt_tokens: int, mm_features) -> MRopePositions:
        positions, delta = mrope_prompt_positions(num_prompt_tokens, mm_features, self.spatial_merge_size)
        return MRopePositions(positions, delta)

    def encode_image(self, pixel_values, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """pixel_values: [t * h * w, patch_dim] (numpy or torch) → [t * h * w / merge**2, hidden] embeddings."""
        if self.vision is None:
            raise ValueError("this checkpoint has no vision tower: it takes text prompts only")
        pixels = torch.as_tensor(pixel_values, dtype=torch.float32)
        return self.vision.forward(pixels, [tuple(grid_thw)]).to(self.dtype)

    def _make_rotary(self, cfg: DecoderConfig, dtype: torch.dtype) -> MRotaryEmbedding:
        return MRotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, self.mrope_section,
                                dtype)
