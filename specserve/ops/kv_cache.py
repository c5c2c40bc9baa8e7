"""How a paged KV cache stores its keys and values (EngineConfig.kv_cache_dtype): fp32, bfloat16, or int8 with
one fp32 scale per token and kv head; the bytes each takes, and the conversions on write and read.

Each kv head's key or value of one token is a "row" of head_dim numbers. An int8 row is stored as head_dim
int8s q and then its scale's 4 bytes, [..., head_dim + 4] (csrc/kv_format.h is the C side). The scale is
max|x| / 127 of that row alone: a token's stored bits are a function of its own key or value, so a
verification step writes what a one-token step would and speculation stays lossless. (A scale per block
would change as later tokens join the block, and with it what earlier tokens read back.)
"""
from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "bfloat16", "int8")  # EngineConfig.kv_cache_dtype; auto: the model's dtype
INT8_SCALE_BYTES = 4
KV_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # kv_format.h's KV_F32, KV_BF16, KV_I8
_TINY = torch.finfo(torch.float32).tiny  # an all-zero row's scale: its q are 0


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a cache of this kind is allocated in (torch.int8: int8 rows with their scales)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                         f"got {kv_cache_dtype!r}")
    return {"auto": model_dtype, "bfloat16": torch.bfloat16, "int8": torch.int8}[kv_cache_dtype]


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one stored row: head_dim, and for int8 its scale's bytes."""
    return head_dim + (INT8_SCALE_BYTES if dtype == torch.int8 else 0)


def row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one kv head's key (or value) of one token: 256 in fp32 at head_dim 64, 128 in bf16, 68 in int8."""
    return row_width(head_dim, dtype) * dtype.itemsize


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x: [..., head_dim] -> its rows as stored in a cache of `dtype`: [..., row_width]."""
    if dtype != torch.int8:
        return x.to(dtype)
    q, scale = quantize_int8(x.float())
    return torch.cat([q, scale.unsqueeze(-1).view(torch.int8)], dim=-1)


def decode(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows [..., row_width] -> [..., head_dim] in `dtype` (int8: q * scale, computed in fp32)."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    scale = rows[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :head_dim].float() * scale).to(dtype)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] fp32 -> (q [..., D] int8, scale [...] fp32): q = round(x / scale) (ties to even), scale =
    max|x| / 127 per row; bitwise what csrc/kv_format.h's kv_encode_row stores."""
    scale = (x.abs().amax(dim=-1) / 127.0).clamp_min(_TINY)
    q = torch.round(x / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def round_trip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a cache of `dtype` gives back for x ([..., head_dim]): x itself when it stores x's dtype."""
    if dtype == x.dtype:
        return x
    return decode(encode(x, dtype), x.shape[-1], x.dtype)
