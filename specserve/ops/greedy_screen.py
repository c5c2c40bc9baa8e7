"""The exact greedy LM head (csrc/greedy.c): an int8 screen of the head's weight finds the few columns that can
hold a row's argmax, which are then computed exactly, so a greedy step reads about a quarter of the head's
fp32 bytes and gets torch.argmax's answer."""
from __future__ import annotations

import torch

from specserve.ops.kernels import _check, _lib, _ptr, quantize_int8


def pack_argmax_screen(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] fp32 -> lm_head_argmax's int8 screen of it (csrc/greedy.c): quantize_int8's q packed
    [ceil(N / 16), ceil(K / 4), 16, 4] (four k's of 16 columns per 64 bytes, zero padded); its scales [N];
    sum_k q[n, k] [N] int32; sum_k |w[n, k]| [N] float64."""
    return pack_argmax_screen_rows(tuple(weight.shape), lambda start, end: weight[start:end])


SCREEN_PACK_ROWS = 1024  # rows of W dequantized at a time: a vocabulary's fp32 head is never whole in memory


def pack_argmax_screen_rows(shape: tuple[int, int], rows) -> tuple[torch.Tensor, ...]:
    """pack_argmax_screen of the [N, K] weight whose fp32 rows start..end-1 `rows(start, end)` gives, made
    SCREEN_PACK_ROWS rows at a time (the same tensors)."""
    n, k = shape
    k4 = -(-k // 4)
    packed = torch.zeros(-(-n // 16), k4, 16, 4, dtype=torch.int8)
    scale, col_sum, w_l1 = torch.empty(n), torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.float64)
    for start in range(0, n, SCREEN_PACK_ROWS):  # a multiple of 16: each chunk fills whole column blocks
        end = min(start + SCREEN_PACK_ROWS, n)
        w = rows(start, end)
        q, scale[start:end] = quantize_int8(w)
        padded = torch.zeros(-(-(end - start) // 16) * 16, k4 * 4, dtype=torch.int8)
        padded[:end - start, :k] = q
        packed[start // 16:start // 16 + padded.shape[0] // 16] = padded.view(-1, 16, k4, 4).permute(0, 2, 1, 3)
        col_sum[start:end] = q.sum(dim=1, dtype=torch.int32)
        w_l1[start:end] = w.double().abs().sum(dim=1)
    return packed, scale, col_sum, w_l1


def lm_head_argmax(x: torch.Tensor, packed: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   col_sum: torch.Tensor, w_l1: torch.Tensor, allowed: torch.Tensor | None = None,
                   weight_format: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """x [M, K] -> [M] int64: torch.argmax of gemm_packed(x, packed, None, N) per row, exactly, screened
    through pack_argmax_screen's int8 copy (q, scale, col_sum, w_l1) of the same weight (csrc/greedy.c);
    with allowed [M, N] bool, the argmax of the logits where the others are -inf. weight_format: (format,
    group) of `packed` for gemm_weight ((0, 0): fp32 blocks of pack_gemm_weight)."""
    _check(x=x, scale=scale)
    if not packed.is_contiguous():
        raise ValueError("C kernel: packed must be contiguous")
    _check(torch.int8, q=q)
    _check(torch.int32, col_sum=col_sum)
    _check(torch.float64, w_l1=w_l1)
    rows, k = x.shape
    if allowed is not None:
        _check(torch.bool, allowed=allowed)
        if allowed.shape != (rows, scale.shape[0]):
            raise ValueError(f"allowed must be [{rows}, {scale.shape[0]}], got {list(allowed.shape)}")
    out = torch.empty(rows, dtype=torch.int64)
    if rows and _lib().lm_head_argmax_f32(x.data_ptr(), packed.data_ptr(), *weight_format, q.data_ptr(), scale.data_ptr(),
                                         col_sum.data_ptr(), w_l1.data_ptr(), _ptr(allowed), rows, k,
                                         scale.shape[0], out.data_ptr()):
        raise MemoryError("lm_head_argmax: out of memory for its work buffers")
    return out
