"""The C kernels that run a whole model part in one call (csrc/decoder.c): the decoder layers, a
mixture-of-experts MLP's routed experts, and an EAGLE-3 head's forward and greedy draft chains. The
structures mirror decoder.c's; the caller keeps the tensors behind their pointers alive (TensorKeyed)."""
from __future__ import annotations

import ctypes

import torch

from specserve.ops.kernels import _check, _lib, _ptr


class LinearC(ctypes.Structure):
    """csrc/decoder.c's linear_t: packed weight, int8 scales (NULL: the weight's format says), bias (NULL:
    none), the weight's format and group (gemm_weight)."""
    _fields_ = [("weight", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("format", ctypes.c_int64), ("group", ctypes.c_int64)]


class DecoderLayerC(ctypes.Structure):
    """csrc/decoder.c's layer_t."""
    _fields_ = [("qkv", LinearC), ("o_proj", LinearC), ("gate_up", LinearC), ("down", LinearC),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p), ("window", ctypes.c_int64),
                ("kv_dtype", ctypes.c_int64)]  # kv_cache.KV_CODES of the caches' dtype


def linear_c(operands: tuple) -> LinearC:
    """A LinearC from FastLinear.c_operands(): (packed weight, scales or None, bias or None, (format, group))."""
    weight, scale, bias, (fmt, group) = operands
    return LinearC(weight.data_ptr(), _ptr(scale), _ptr(bias), fmt, group)


def moe_experts(h: torch.Tensor, gate_up, down, inter: int, used: torch.Tensor, offsets: torch.Tensor,
                rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A mixture-of-experts MLP's routed experts in one C call (csrc/decoder.c's moe_experts_f32): h [N, hidden];
    gate_up, down: ctypes arrays of LinearC, one per expert (the caller keeps their tensors alive); used [U] int64
    expert ids ascending, offsets [U + 1] int64 into rows [T] int64 and weights [T] fp32 (each used expert's rows
    and routing weights). Returns [N, hidden]: the sum over experts of weight times the expert's output."""
    _check(h=h, weights=weights)
    _check(torch.int64, used=used, offsets=offsets, rows=rows)
    out = torch.zeros_like(h)
    if _lib().moe_experts_f32(h.data_ptr(), out.data_ptr(), h.shape[1], inter, gate_up, down, used.data_ptr(),
                              len(used), offsets.data_ptr(), rows.data_ptr(), weights.data_ptr()):
        raise MemoryError("moe_experts: out of memory for its work buffer")
    return out


def decoder_forward(layers, x: torch.Tensor, final_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    slot_mapping: torch.Tensor, batch, dims: tuple[int, int, int, int, int], block_size: int,
                    eps: float, scale: float, aux_layers: tuple[int, ...] = (), slot_rows: torch.Tensor | None = None):
    """Run every layer and the final norm in one C call (csrc/decoder.c); returns (out [N, hidden], aux).

    layers: a ctypes array of DecoderLayerC whose tensors the caller keeps alive; x: [N, hidden] embeddings,
    overwritten (the residual stream); cos, sin: [N, head_dim]; slot_mapping: [W] int64, the slot of each
    K/V write, of row slot_rows[w] ([W] int64; None: row w, W = N); batch: the
    attention metadata's KernelBatch; dims: (hidden, heads, kv heads, head_dim, intermediate). aux: the
    inputs of `aux_layers` (ascending), a list of [N, hidden], or None when none are asked for.
    """
    _check(x=x, final_norm=final_norm, cos=cos, sin=sin)
    _check(torch.int64, slot_mapping=slot_mapping)
    if slot_rows is not None:
        _check(torch.int64, slot_rows=slot_rows)
    hidden, num_heads, num_kv_heads, head_dim, inter = dims
    out = torch.empty_like(x)
    aux = torch.empty((len(aux_layers), *x.shape), dtype=x.dtype) if aux_layers else None
    aux_ids = torch.tensor(aux_layers, dtype=torch.int64)
    failed = _lib().decoder_forward_f32(
        layers, len(layers), x.data_ptr(), out.data_ptr(), final_norm.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        slot_mapping.data_ptr(), _ptr(slot_rows), len(slot_mapping), batch.block_table.data_ptr(),
        batch.block_table.shape[1], batch.query_start.data_ptr(), batch.query_len.data_ptr(), batch.context_len.data_ptr(),
        len(batch.query_start), x.shape[0], hidden, num_heads, num_kv_heads, head_dim, inter, block_size,
        float(eps), float(scale), aux_ids.data_ptr(), len(aux_layers), _ptr(aux))
    if failed:
        raise MemoryError("decoder kernel: out of memory for its buffers")
    return out, (list(aux.unbind(0)) if aux is not None else None)


class Eagle3C(ctypes.Structure):
    """csrc/decoder.c's eagle3_t."""
    _fields_ = [("qkv", LinearC), ("o_proj", LinearC), ("gate_up", LinearC), ("down", LinearC), ("lm_head", LinearC),
                ("input_norm", ctypes.c_void_p), ("hidden_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("norm", ctypes.c_void_p), ("embed", ctypes.c_void_p), ("embed_format", ctypes.c_int64),
                ("embed_group", ctypes.c_int64), ("screen_q", ctypes.c_void_p), ("screen_scale", ctypes.c_void_p),
                ("screen_col_sum", ctypes.c_void_p), ("screen_w_l1", ctypes.c_void_p), ("draft_ids", ctypes.c_void_p),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p), ("window", ctypes.c_int64),
                ("norm_before_residual", ctypes.c_int64), ("kv_dtype", ctypes.c_int64)]


def eagle3_chains(head: Eagle3C, g0: torch.Tensor, num_drafts: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  slots: torch.Tensor, context_len: torch.Tensor, block_table: torch.Tensor,
                  dims: tuple[int, int, int, int, int, int], block_size: int, eps: float, scale: float) -> torch.Tensor:
    """Greedy EAGLE-3 draft chains in one C call (csrc/decoder.c's eagle3_chains_f32; the caller keeps the
    tensors behind `head` alive). g0: [R, H] the outputs each row's first draft comes from; num_drafts: [R]
    int64 (>= 1); for each row's draft steps that feed a draft back, [R, max - 1] of slots and context_len
    (int64) and [R, max - 1, head_dim] of cos and sin; block_table: [R, W] int64; dims: (H, heads, kv heads,
    head_dim, intermediate, draft vocabulary). Returns [R, max] int64 drafts (target ids), -1 past num_drafts."""
    _check(g0=g0, cos=cos, sin=sin)
    _check(torch.int64, num_drafts=num_drafts, slots=slots, context_len=context_len, block_table=block_table)
    rows, most = g0.shape[0], int(num_drafts.max())
    H, num_heads, num_kv_heads, head_dim, inter, vd = dims
    if slots.shape != (rows, most - 1) or context_len.shape != slots.shape or cos.shape != (rows, most - 1, head_dim):
        raise ValueError(f"eagle3_chains: slots and context_len must be [{rows}, {most - 1}], cos and sin "
                         f"[{rows}, {most - 1}, {head_dim}]")
    out = torch.empty(rows, most, dtype=torch.int64)
    if _lib().eagle3_chains_f32(ctypes.byref(head), g0.data_ptr(), rows, num_drafts.data_ptr(), most, cos.data_ptr(),
                                sin.data_ptr(), slots.data_ptr(), context_len.data_ptr(), block_table.data_ptr(),
                                block_table.shape[1], H, num_heads, num_kv_heads, head_dim, inter, vd, block_size,
                                float(eps), float(scale), out.data_ptr()):
        raise MemoryError("eagle3_chains: out of memory for its buffers")
    return out


def eagle3_forward(head: Eagle3C, hidden: torch.Tensor, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   slot_mapping: torch.Tensor, slot_rows: torch.Tensor | None, batch,
                   dims: tuple[int, int, int, int, int], block_size: int, eps: float, scale: float) -> torch.Tensor:
    """One EAGLE-3 head forward in one C call (csrc/decoder.c's eagle3_forward_f32): hidden [N, H], ids [N] int64,
    cos/sin [N, head_dim], the attention metadata's slot_mapping, slot_rows and KernelBatch; dims (H, heads, kv
    heads, head_dim, intermediate). Returns g [N, H]."""
    _check(hidden=hidden, cos=cos, sin=sin)
    _check(torch.int64, ids=ids, slot_mapping=slot_mapping)
    if slot_rows is not None:
        _check(torch.int64, slot_rows=slot_rows)
    H, num_heads, num_kv_heads, head_dim, inter = dims
    g = torch.empty_like(hidden)
    if hidden.shape[0] and _lib().eagle3_forward_f32(
            ctypes.byref(head), hidden.data_ptr(), ids.data_ptr(), hidden.shape[0], cos.data_ptr(), sin.data_ptr(),
            slot_mapping.data_ptr(), _ptr(slot_rows), len(slot_mapping), batch.block_table.data_ptr(),
            batch.block_table.shape[1], batch.query_start.data_ptr(), batch.query_len.data_ptr(),
            batch.context_len.data_ptr(), len(batch.query_start), H, num_heads, num_kv_heads, head_dim, inter,
            block_size, float(eps), float(scale), g.data_ptr()):
        raise MemoryError("eagle3_forward: out of memory for its buffers")
    return g


class TensorKeyed:
    """One value built from a set of tensors (a ctypes array of their pointers, say), rebuilt only when the
    tensors change. It holds the tensors, so their memory cannot be freed and reused under the pointers."""

    def __init__(self, build) -> None:
        self._build = build
        self._tensors: tuple = ()
        self._value = None

    def get(self, tensors: tuple[torch.Tensor, ...]):
        if self._value is None or len(tensors) != len(self._tensors) or any(
                a is not b for a, b in zip(tensors, self._tensors)):
            self._tensors, self._value = tensors, self._build(tensors)
        return self._value
