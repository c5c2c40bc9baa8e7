"""How a paged KV cache stores its keys and values (EngineConfig.kv_cache_dtype): fp32, bfloat16, or int8 with
an fp32 scale per 16 numbers; the bytes each takes, and the conversions on write and read.

Each kv head's key or value of one token is a "row" of head_dim numbers. An int8 row is stored as head_dim
int8s q and then its groups' scales, 4 bytes each: [..., head_dim + 4 * ceil(head_dim / 16)] (csrc/kv_format.h
is the C side). Group g is the numbers 16g .. 16g + 15 (the last group may be shorter), and its scale is
max|x| / 127 over them. A token's stored bits are a function of its own key or value, so a verification step
writes what a one-token step would and speculation stays lossless. (A scale per block would change as later
tokens join the block, and with it what earlier tokens read back.) Small groups round rows whose magnitudes
differ across dimensions (as keys' do, Qwen2's most) more finely: on Qwen2.5-Coder-1.5B the mean KL from the
fp32 cache's next-token distributions is 9.0e-4 with groups of 16 against 1.5e-3 with groups of 32
(docs/performance.md).
"""
from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "bfloat16", "int8")  # EngineConfig.kv_cache_dtype; auto: the model's dtype
INT8_SCALE_BYTES = 4
INT8_GROUP = 16  # numbers of a row that share one scale
KV_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # kv_format.h's KV_F32, KV_BF16, KV_I8
_TINY = torch.finfo(torch.float32).tiny  # an all-zero row's scale: its q are 0


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a cache of this kind is allocated in (torch.int8: int8 rows with their scales)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                         f"got {kv_cache_dtype!r}")
    return {"auto": model_dtype, "bfloat16": torch.bfloat16, "int8": torch.int8}[kv_cache_dtype]


def int8_groups(head_dim: int) -> int:
    """Scales of an int8 row: one per INT8_GROUP numbers, the last group possibly shorter."""
    return -(-head_dim // INT8_GROUP)


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one stored row: head_dim, and for int8 its scales' bytes."""
    return head_dim + (INT8_SCALE_BYTES * int8_groups(head_dim) if dtype == torch.int8 else 0)


def row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one kv head's key (or value) of one token: 256 in fp32 at head_dim 64, 128 in bf16, 80 in int8."""
    return row_width(head_dim, dtype) * dtype.itemsize


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x: [..., head_dim] -> its rows as stored in a cache of `dtype`: [..., row_width]."""
    if dtype != torch.int8:
        return x.to(dtype)
    q, scale = quantize_int8(x.float())
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)


def decode(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows [..., row_width] -> [..., head_dim] in `dtype` (int8: q * its group's scale, in fp32)."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    scale = rows[..., head_dim:].contiguous().view(torch.float32)  # [..., groups]
    return (rows[..., :head_dim].float() * _per_number(scale, head_dim)).to(dtype)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] fp32 -> (q [..., D] int8, scale [..., ceil(D / 16)] fp32): scale = max|x| / 127 over each group
    of 16 numbers, q = round(x / its group's scale) (ties to even); bitwise what csrc/kv_format.h's
    kv_encode_row stores."""
    d = x.shape[-1]
    groups = int8_groups(d)
    padded = torch.nn.functional.pad(x, (0, groups * INT8_GROUP - d))  # zeros leave each max|x| as it is
    scale = (padded.unflatten(-1, (groups, INT8_GROUP)).abs().amax(dim=-1) / 127.0).clamp_min(_TINY)
    q = torch.round(x / _per_number(scale, d)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _per_number(scale: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Group scales [..., groups] -> each number's scale [..., head_dim]."""
    return scale.repeat_interleave(INT8_GROUP, dim=-1)[..., :head_dim]


def round_trip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a cache of `dtype` gives back for x ([..., head_dim]): x itself when it stores x's dtype."""
    if dtype == x.dtype:
        return x
    return decode(encode(x, dtype), x.shape[-1], x.dtype)
