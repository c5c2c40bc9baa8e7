"""GGUF weights kept in their quantized blocks, repacked for the C GEMM (csrc/gemm_gguf.c).

Each supported block type stores a weight row as groups of G consecutive values w = a * q + b, q a small
integer and a, b per group (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K: G = 32; Q6_K: G = 16). `decode_blocks` reads a
tensor's blocks into q [N, K] and a, b [N, K / G] (fp32, each a product of the file's fp16 scales and its
small integer scales, exact in fp32); `QuantizedWeight.pack` lays them out for the kernel: per block of 32
output columns, per group, a[32] and b[32] then the group's q, 4 bits a value (Q4: q in 0..15) or 8 (Q8).
Because a * q is exact, a * q + b rounds once, so the kernel's in-register values, `dequantize()` and the
gguf package's dequantizer agree value for value (Q4_0's zero weights can differ in sign, which no sum
sees). A k-quant's a and b are its super-block's fp16 scales times small integers: `in_super_blocks` keeps them
so (int8 per group, fp32 per super-block of 256 k's; csrc/gemm_common.h's group_record), the same values in fewer
bytes, and loading a file does it wherever the scales factor exactly. F16 weights keep their halves in the fp32
GEMM's block layout.

`QuantizedWeight.for_int8_activations()` turns a 4-bit weight (groups of 32) into the layout of
csrc/gemm_q4_i8.c and an 8-bit one (groups of 32 or 16) into that of csrc/gemm_q8_i8.c, which write each input
row per group of 32 as two int8 digits (~15 bits; Q4_I8, Q8_I8) or one (8 bits, llama.cpp's Q8_0 activations;
Q4_Q8, Q8_Q8) and take integer dot products: the same bytes reordered, extra rows cheaper than on fp32
activations, at the cost of the activations' rounding (`EngineConfig.gguf_compute`).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from specserve.ops import kernels

logger = logging.getLogger(__name__)

BLOCK = kernels.GEMM_BLOCK  # output columns per packed block
Q4, Q8, F16 = kernels.WEIGHT_Q4, kernels.WEIGHT_Q8, kernels.WEIGHT_F16
Q4_I8, Q4_Q8 = kernels.WEIGHT_Q4_I8, kernels.WEIGHT_Q4_Q8  # 4-bit blocks x int8 activations, two digits or one
Q8_I8, Q8_Q8 = kernels.WEIGHT_Q8_I8, kernels.WEIGHT_Q8_Q8  # 8-bit blocks x int8 activations, two digits or one
# each int8-activation format -> (the exact format of the same values, digits per activation)
_INT8_FORMS = {Q4_I8: (Q4, 2), Q4_Q8: (Q4, 1), Q8_I8: (Q8, 2), Q8_Q8: (Q8, 1)}
INT8_ACTIVATION_FORMATS = tuple(_INT8_FORMS)
_FORMAT_NAMES = {Q4: "q4", Q8: "q8", F16: "f16", Q4_I8: "q4 x int8", Q4_Q8: "q4 x q8", Q8_I8: "q8 x int8",
                 Q8_Q8: "q8 x q8"}
# EngineConfig.gguf_compute -> the int8 digits per activation of the int8 GEMMs (absent: fp32 activations)
ACTIVATION_DIGITS = {"int8": 2, "q8": 1}
_HEADER = 2 * BLOCK * 4  # a[32] and b[32] fp32 at the start of each record
_SUPER = 256  # values per k-quant super-block
_CHUNK_ROWS = 64 * BLOCK  # rows repacked at a time (from_gguf)


def _halves(raw: np.ndarray, at: int) -> np.ndarray:
    """[nblocks] float32 from the little-endian fp16 at byte `at` of each block."""
    return raw[:, at:at + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, B] bytes -> [n, 2B]: the B low nibbles, then the B high nibbles."""
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _decode_q4_0(raw):
    d = _halves(raw, 0)[:, None]
    return _nibbles(raw[:, 2:18]), d, -8 * d


def _decode_q4_1(raw):
    return _nibbles(raw[:, 4:20]), _halves(raw, 0)[:, None], _halves(raw, 2)[:, None]


def _decode_q8_0(raw):
    d = _halves(raw, 0)[:, None]
    return raw[:, 2:34].view(np.int8), d, np.full_like(d, -0.0)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes of a little-endian uint32 -> [n, 32]: bit i of it, shifted to 16 (the fifth bit of value i)."""
    bits = qh.copy().view("<u4")[:, 0][:, None] >> np.arange(32, dtype=np.uint32)
    return ((bits & 1) << 4).astype(np.uint8)


def _decode_q5_0(raw):
    d = _halves(raw, 0)[:, None]
    return _nibbles(raw[:, 6:22]) | _fifth_bits(raw[:, 2:6]), d, -16 * d


def _decode_q5_1(raw):
    return _nibbles(raw[:, 8:24]) | _fifth_bits(raw[:, 4:8]), _halves(raw, 0)[:, None], _halves(raw, 2)[:, None]


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit mins -> ([n, 8], [n, 8]) uint8."""
    lo, hi, mixed = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([lo & 63, (mixed & 15) | ((lo >> 6) << 4)], axis=1)
    mins = np.concatenate([hi & 63, (mixed >> 4) | ((hi >> 6) << 4)], axis=1)
    return scales, mins


def _k_groups(raw, q: np.ndarray):
    """a, b [n, 8] of a Q4_K/Q5_K super-block: a = d * scale, b = -(dmin * min)."""
    scales, mins = _k_scales(raw[:, 4:16])
    a = _halves(raw, 0)[:, None] * scales.astype(np.float32)
    b = -(_halves(raw, 2)[:, None] * mins.astype(np.float32))
    return q, a, b


def _decode_q4_k(raw):
    # 4 chunks of 32 bytes: each chunk's low nibbles are one group of 32 values, its high nibbles the next
    qs = raw[:, 16:144].reshape(-1, 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, _SUPER)
    return _k_groups(raw, q)


def _decode_q5_k(raw):
    qh = raw[:, 16:48]  # bit i of byte l: the fifth bit of value l of group i
    qs = raw[:, 48:176].reshape(-1, 4, 32)
    low = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32)
    high = np.stack([(qh >> i) & 1 for i in range(8)], axis=1)
    return _k_groups(raw, (low | (high << 4)).reshape(-1, _SUPER))


def _decode_q6_k(raw):
    ql, qh = raw[:, 0:128].reshape(-1, 2, 64), raw[:, 128:192].reshape(-1, 2, 32)
    # per half of 128 values: low 4 bits from ql's 64 bytes (low nibbles, then high nibbles), top 2 bits from
    # qh's 32 bytes (bit pairs 0-1, 2-3, 4-5, 6-7 for the four runs of 32)
    low = np.concatenate([ql & 15, ql >> 4], axis=2).reshape(-1, 2, 4, 32)
    high = np.stack([(qh >> (2 * i)) & 3 for i in range(4)], axis=2)
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(-1, _SUPER)
    d = _halves(raw, 208)[:, None]
    a = d * raw[:, 192:208].view(np.int8).astype(np.float32)
    return q, a, np.full_like(a, -0.0)


# GGUF type name -> (decoder, kernel format, group, values per block, bytes per block)
BLOCK_TYPES = {
    "Q4_0": (_decode_q4_0, Q4, 32, 32, 18),
    "Q4_1": (_decode_q4_1, Q4, 32, 32, 20),
    "Q8_0": (_decode_q8_0, Q8, 32, 32, 34),
    "Q5_0": (_decode_q5_0, Q8, 32, 32, 22),
    "Q5_1": (_decode_q5_1, Q8, 32, 32, 24),
    "Q4_K": (_decode_q4_k, Q4, 32, _SUPER, 144),
    "Q5_K": (_decode_q5_k, Q8, 32, _SUPER, 176),
    "Q6_K": (_decode_q6_k, Q8, 16, _SUPER, 210),
}


def decode_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]):
    """A GGUF tensor's raw blocks (uint8, [N, K / values_per_block * bytes_per_block] or flat) -> (q [N, K]
    uint8/int8, a [N, K / G] fp32, b [N, K / G] fp32, format, G)."""
    decoder, fmt, group, per_block, nbytes = BLOCK_TYPES[type_name]
    n, k = shape
    if k % per_block:
        raise ValueError(f"{type_name} rows of {k} values are not whole blocks of {per_block}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, nbytes)
    if blocks.shape[0] != n * k // per_block:
        raise ValueError(f"{type_name} tensor {list(shape)}: expected {n * k // per_block} blocks, got {blocks.shape[0]}")
    q, a, b = decoder(blocks)
    return (q.reshape(n, k), a.astype(np.float32).reshape(n, k // group), b.astype(np.float32).reshape(n, k // group),
            fmt, group)


@dataclass
class QuantizedWeight:
    """A [N, K] weight in a packed GGUF form (see the module docstring); `qtype` names the file's block type.

    Indexing with token ids gives fp32 rows (an embedding lookup); `dequantize()` the whole fp32 weight.
    """

    packed: torch.Tensor  # uint8 (q4, q8) or int16 (f16), flat
    format: int
    group: int
    shape: tuple[int, int]
    qtype: str
    supers: int = 0  # groups per super-block whose scales are int8 (0: fp32 a, b in every group record)

    # ------------------------------------------------------------------ construction

    @classmethod
    def pack(cls, q: np.ndarray, a: np.ndarray, b: np.ndarray, fmt: int, group: int, qtype: str) -> "QuantizedWeight":
        """From q [N, K] and a, b [N, K / group] (decode_blocks' form)."""
        n, k = q.shape
        if k % group or a.shape != (n, k // group) or b.shape != a.shape:
            raise ValueError(f"q {list(q.shape)} and scales {list(a.shape)} do not fit groups of {group}")
        pad = -n % BLOCK
        q = np.pad(q, ((0, pad), (0, 0)))
        a, b = (np.pad(t.astype(np.float32), ((0, pad), (0, 0))) for t in (a, b))
        nb, ng = (n + pad) // BLOCK, k // group
        # [block, group, column] scales and [block, group, k, column] values
        scales = [t.reshape(nb, BLOCK, ng).transpose(0, 2, 1).copy().view(np.uint8) for t in (a, b)]
        values = q.reshape(nb, BLOCK, ng, group).transpose(0, 2, 3, 1)
        if fmt == Q4:
            values = (values[..., :16].astype(np.uint8) | (values[..., 16:].astype(np.uint8) << 4))
        else:
            values = values.astype(np.int8).view(np.uint8)
        records = np.concatenate([*scales, values.reshape(nb, ng, -1)], axis=2)
        return cls(torch.from_numpy(np.ascontiguousarray(records).reshape(-1)), fmt, group, (n, k), qtype)

    @classmethod
    def from_f16(cls, halves: np.ndarray) -> "QuantizedWeight":
        """From an F16 tensor [N, K]: the fp32 GEMM's block layout in halves."""
        n, k = halves.shape
        padded = np.zeros((n + (-n % BLOCK), k), dtype=np.float16)
        padded[:n] = halves
        blocks = padded.reshape(-1, BLOCK, k).transpose(0, 2, 1)
        return cls(torch.from_numpy(np.ascontiguousarray(blocks).view(np.int16).reshape(-1)), F16, 0, (n, k), "F16")

    @classmethod
    def from_gguf(cls, raw: np.ndarray, type_name: str, shape: tuple[int, int],
                  row_order: np.ndarray | None = None, super_blocks: bool = True) -> "QuantizedWeight":
        """From a GGUF tensor's raw data; row_order: a permutation of the N rows to apply (llama's q/k). A
        k-quant's groups come in super-blocks with int8 scales (in_super_blocks) unless super_blocks is False.

        A large weight is repacked _CHUNK_ROWS rows at a time into its final tensor: decoding and reordering a
        whole 152k-row embedding at once would hold ~4x its packed size in temporaries."""
        n, k = shape
        if row_order is None and n > _CHUNK_ROWS:
            rows = np.asarray(raw).reshape(n, -1)
            first = cls.from_gguf(rows[:_CHUNK_ROWS], type_name, (_CHUNK_ROWS, k), None, super_blocks)
            per_row = first.packed.numel() // _CHUNK_ROWS  # per row of whole column blocks
            packed = torch.empty((n + (-n % BLOCK)) * per_row, dtype=first.packed.dtype)
            packed[: first.packed.numel()] = first.packed
            for start in range(_CHUNK_ROWS, n, _CHUNK_ROWS):
                part = cls.from_gguf(rows[start:start + _CHUNK_ROWS], type_name, (min(_CHUNK_ROWS, n - start), k),
                                     None, super_blocks)
                if part.supers != first.supers:  # some rows' scales do not factor: plain records for all
                    return cls.from_gguf(raw, type_name, shape, None, super_blocks=False)
                packed[start * per_row: start * per_row + part.packed.numel()] = part.packed
            return cls(packed, first.format, first.group, shape, type_name, first.supers)
        if type_name == "F16":
            halves = np.ascontiguousarray(raw).view(np.float16).reshape(shape)
            return cls.from_f16(halves if row_order is None else halves[row_order])
        q, a, b, fmt, group = decode_blocks(raw, type_name, shape)
        if row_order is not None:
            q, a, b = q[row_order], a[row_order], b[row_order]
        weight = cls.pack(q, a, b, fmt, group, type_name)
        return weight.in_super_blocks() if super_blocks else weight

    def for_int8_activations(self, digits: int = 2) -> "QuantizedWeight":
        """This weight for activations as `digits` int8 digits: a 4-bit one (groups of 32) in gemm_q4_i8.c's
        layout (2: Q4_I8, 1: Q4_Q8; each record's q bytes from [k][16] to [k / 4][16][4]), an 8-bit one (groups
        of 32 or 16) in gemm_q8_i8.c's (2: Q8_I8, 1: Q8_Q8; each q as q + 128, from [k][32] to [k / 4][32][4]).
        Other formats are returned as they are."""
        if digits not in (1, 2):
            raise ValueError(f"digits must be 1 or 2, got {digits}")
        if self.format in INT8_ACTIVATION_FORMATS:
            if _INT8_FORMS[self.format][1] == digits:
                return self
            fmt = {Q4_I8: Q4_Q8, Q4_Q8: Q4_I8, Q8_I8: Q8_Q8, Q8_Q8: Q8_I8}[self.format]  # the same bytes
            return QuantizedWeight(self.packed, fmt, self.group, self.shape, self.qtype, self.supers)
        if self.format == Q4 and self.group == 32:
            fmt = Q4_I8 if digits == 2 else Q4_Q8
        elif self.format == Q8 and self.group in (16, 32):
            fmt = Q8_I8 if digits == 2 else Q8_Q8
        else:
            return self
        packed = _regroup(self.packed, self.group, self.supers, self.format == Q8, to_quads=True)
        return QuantizedWeight(packed, fmt, self.group, self.shape, self.qtype, self.supers).in_super_blocks()

    def in_super_blocks(self) -> "QuantizedWeight":
        """The same values with int8 scales per group and fp32 factors per super-block of 256 k's
        (csrc/gemm_common.h's group_record: the same a and b, so the same bits from every kernel) where every
        group's scales factor so, as a k-quant's do (Q4_K: 4.75 bits a weight instead of 6); else itself."""
        if self.format == F16 or self.supers:
            return self
        compact = _in_super_blocks(self.packed, self.group, self.shape)
        if compact is None:
            return self
        return QuantizedWeight(compact, self.format, self.group, self.shape, self.qtype, _SUPER // self.group)

    def plain(self) -> "QuantizedWeight":
        """The same layout with fp32 a, b in every group record (the inverse of in_super_blocks)."""
        if not self.supers:
            return self
        return QuantizedWeight(_plain_records(self.packed, self.group, self.supers, self.shape), self.format,
                               self.group, self.shape, self.qtype)

    def as_exact(self) -> "QuantizedWeight":
        """The fp32-activation form of the same values (the inverse of for_int8_activations)."""
        if self.format not in INT8_ACTIVATION_FORMATS:
            return self
        fmt = _INT8_FORMS[self.format][0]
        packed = _regroup(self.packed, self.group, self.supers, fmt == Q8, to_quads=False)
        return QuantizedWeight(packed, fmt, self.group, self.shape, self.qtype, self.supers)

    # ------------------------------------------------------------------ reading back

    @property
    def weight_format(self) -> tuple[int, int]:
        """(format, group) as the C kernels take them: group | supers << 8 (csrc/gemm_common.h's group_record)."""
        return self.format, self.group | self.supers << 8

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32  # the values it gives

    def unpack(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q [N, K], a, b [N, K / group]) of a Q4/Q8 weight: the inverse of `pack`."""
        if self.format == F16:
            raise ValueError("an F16 weight has no groups")
        if self.format in INT8_ACTIVATION_FORMATS:
            return self.as_exact().unpack()
        if self.supers:
            return self.plain().unpack()
        n, k = self.shape
        nb, ng, group = -(-n // BLOCK), k // self.group, self.group
        records = self.packed.numpy().reshape(nb, ng, -1)
        a, b = (records[:, :, i * 128:(i + 1) * 128].copy().view(np.float32).transpose(0, 2, 1).reshape(-1, ng)[:n]
                for i in range(2))
        values = records[:, :, 256:].reshape(nb, ng, group, -1)
        if self.format == Q4:
            values = np.concatenate([values & 15, values >> 4], axis=3)
        else:
            values = values.view(np.int8)
        q = values.transpose(0, 3, 1, 2).reshape(nb * BLOCK, k)[:n]
        return q, a, b

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [N, K] (in C when the kernels are built, else numpy: the same values)."""
        if kernels.kernel_enabled():
            return kernels.weight_rows(self.packed, self.weight_format, self.shape[1], torch.arange(self.shape[0]))
        n, k = self.shape
        if self.format == F16:
            blocks = self.packed.numpy().view(np.float16).reshape(-1, k, BLOCK)
            return torch.from_numpy(blocks.transpose(0, 2, 1).reshape(-1, k)[:n].astype(np.float32))
        q, a, b = self.unpack()
        g = self.group
        values = q.astype(np.float32).reshape(n, k // g, g) * a[:, :, None] + b[:, :, None]
        return torch.from_numpy(np.ascontiguousarray(values.reshape(n, k), dtype=np.float32))

    def __getitem__(self, ids) -> torch.Tensor:
        """fp32 rows: weight[ids] for an int64 tensor of row ids (an embedding lookup)."""
        ids = torch.as_tensor(ids, dtype=torch.int64)
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.shape[0]):
            raise IndexError(f"row ids must be in [0, {self.shape[0]}), got [{int(flat.min())}, {int(flat.max())}]")
        if kernels.kernel_enabled():
            rows = kernels.weight_rows(self.packed, self.weight_format, self.shape[1], flat)
        else:
            rows = self.dequantize()[flat]
        return rows.reshape(*ids.shape, self.shape[1])

    def describe(self) -> str:
        scales = ", int8 scales" if self.supers else ""
        return f"{self.qtype} ({_FORMAT_NAMES[self.format]}{scales}, {self.nbytes / 2**20:.1f} MiB)"


def _factor(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [..., S] fp32 -> (f [...] fp32, s [..., S] int8, ok [...] bool): per set of S values one factor and
    small integers with f * s == x bit for bit (zeros' signs included) where ok. A k-quant's group scales are
    its fp16 super-block scale times 6- or 8-bit integers, so theirs factor; other values in general do not."""
    bits = x.view(np.uint32)
    negative = (bits >> 31).astype(bool)
    mantissa, exponent = np.frexp(np.abs(x.astype(np.float64)))
    ints = (mantissa * 2.0 ** 24).astype(np.int64)  # |x| = ints * 2**(exponent - 24), exactly
    exponent = exponent.astype(np.int64) - 24
    nonzero = ints != 0
    low = np.where(nonzero, exponent, np.iinfo(np.int64).max).min(axis=-1, keepdims=True)
    low = np.where(nonzero.any(axis=-1, keepdims=True), low, 0)
    shift = np.where(nonzero, exponent - low, 0)
    ok = np.isfinite(x).all(axis=-1) & (shift <= 30).all(axis=-1)  # each set's integers below 2^54
    scaled = ints << np.minimum(shift, 30)
    common = np.gcd.reduce(scaled, axis=-1)
    steps = scaled // np.maximum(common, 1)[..., None]
    magnitude = common * np.exp2(low[..., 0].astype(np.float64))
    best_f, best_s = np.zeros(x.shape[:-1], np.float32), np.zeros(x.shape, np.int8)
    found = np.zeros(x.shape[:-1], bool)
    for sign in (-1.0, 1.0):  # the factor's sign decides each zero's: try both
        f = (sign * magnitude).astype(np.float32)
        signed = np.where(negative == (sign < 0), steps, -steps)
        fits = ok & (f.astype(np.float64) == sign * magnitude) & ((signed >= -128) & (signed <= 127)).all(axis=-1)
        s8 = np.clip(signed, -128, 127).astype(np.int8)
        exact = ((f[..., None] * s8.astype(np.float32)).view(np.uint32) == bits).all(axis=-1)
        take = fits & exact & ~found
        best_f, best_s = np.where(take, f, best_f), np.where(take[..., None], s8, best_s)
        found |= take
    return best_f, best_s, found


_CHUNK_BLOCKS = _CHUNK_ROWS // BLOCK  # column blocks converted at a time: a vocabulary's temporaries stay small


def _in_super_blocks(packed: torch.Tensor, group: int, shape: tuple[int, int]) -> torch.Tensor | None:
    """Plain group records (a[32], b[32] fp32, then q) in super-blocks of 256 k's with int8 scales
    (csrc/gemm_common.h's group_record), or None where some super-block's scales do not factor exactly."""
    n, k = shape
    supers = _SUPER // group
    if k % _SUPER or supers < 2:
        return None
    nb, ng = -(-n // BLOCK), k // group
    records = packed.numpy().reshape(nb, ng // supers, supers, -1)
    qbytes = records.shape[3] - _HEADER
    out = np.empty((nb, ng // supers, _HEADER + supers * (2 * BLOCK + qbytes)), np.uint8)
    for start in range(0, nb, _CHUNK_BLOCKS):
        part = records[start:start + _CHUNK_BLOCKS]
        # per block, super-block and column: the S groups' a (then b)
        a, b = (part[..., i * 128:(i + 1) * 128].copy().view(np.float32).transpose(0, 1, 3, 2) for i in range(2))
        fa, sa, ok_a = _factor(a)
        fb, sb, ok_b = _factor(b)
        if not (ok_a.all() and ok_b.all()):
            return None
        small = [t.transpose(0, 1, 3, 2).view(np.uint8) for t in (sa, sb)]  # [block, super, group, column]
        groups = np.concatenate([*small, part[..., _HEADER:]], axis=3).reshape(part.shape[0], ng // supers, -1)
        out[start:start + part.shape[0], :, :_HEADER] = np.concatenate([fa.view(np.uint8), fb.view(np.uint8)], axis=2)
        out[start:start + part.shape[0], :, _HEADER:] = groups
    return torch.from_numpy(out.reshape(-1))


def _plain_records(packed: torch.Tensor, group: int, supers: int, shape: tuple[int, int]) -> torch.Tensor:
    """The inverse of _in_super_blocks: each group's a, b = the factor times its int8 scale, in fp32 again."""
    n, k = shape
    nb, ng = -(-n // BLOCK), k // group
    body = packed.numpy().reshape(nb, ng // supers, -1)
    qbytes = (body.shape[2] - _HEADER) // supers - 2 * BLOCK
    out = np.empty((nb, ng // supers, supers, _HEADER + qbytes), np.uint8)
    for start in range(0, nb, _CHUNK_BLOCKS):
        part = body[start:start + _CHUNK_BLOCKS]
        factors = part[..., :_HEADER].copy().view(np.float32).reshape(part.shape[0], ng // supers, 1, 2, BLOCK)
        groups = part[..., _HEADER:].reshape(part.shape[0], ng // supers, supers, -1)
        small = groups[..., :2 * BLOCK].view(np.int8).reshape(part.shape[0], ng // supers, supers, 2, BLOCK)
        scales = factors * small.astype(np.float32)
        out[start:start + part.shape[0], ..., :_HEADER] = scales.reshape(*groups.shape[:3], 2 * BLOCK).view(np.uint8)
        out[start:start + part.shape[0], ..., _HEADER:] = groups[..., 2 * BLOCK:]
    return torch.from_numpy(out.reshape(-1))


_REGROUP_RECORDS = 1 << 14  # records reordered at a time: a vocabulary's temporaries stay small


def _regroup(packed: torch.Tensor, group: int, supers: int, eight: bool, to_quads: bool) -> torch.Tensor:
    """A copy of the records with each one's q bytes reordered: 4-bit (groups of 32) from [k][16] to
    [k / 4][16][4] (to_quads) or back; 8-bit (groups of `group`) from int8 [k][32] to q + 128 in [k / 4][32][4]
    (to_quads) or back. The scales (plain or in super-blocks) stay as they are."""
    qbytes = group * (32 if eight else 16)
    out = packed.numpy().copy()
    if supers:  # views of out: [super-block, group, the group's q bytes]
        records = out.reshape(-1, _HEADER + supers * (2 * BLOCK + qbytes))[:, _HEADER:]
        q = records.reshape(records.shape[0], supers, 2 * BLOCK + qbytes)[:, :, 2 * BLOCK:]
    else:
        q = out.reshape(-1, 1, _HEADER + qbytes)[:, :, _HEADER:]
    if eight:
        shape = (-1, group // 4, 4, 32) if to_quads else (-1, group // 4, 32, 4)
    else:
        shape = (-1, 8, 4, 16) if to_quads else (-1, 8, 16, 4)
    for start in range(0, q.shape[0], _REGROUP_RECORDS):
        part = q[start:start + _REGROUP_RECORDS]
        moved = part.reshape(shape).transpose(0, 1, 3, 2)
        part[:] = (moved ^ 0x80 if eight else moved).reshape(part.shape)
    return torch.from_numpy(out)


def quantize_q4(weight: torch.Tensor, group: int = 32) -> QuantizedWeight:
    """[N, K] fp32 -> 4-bit values in groups of `group` along K, each value q * a + b with q in 0..15, a = (max -
    min) / 15 and b = min of its group (GGUF Q4_1's rule): an approximate weight for drafters, a quarter of
    fp32's bytes plus the scales."""
    w = weight.detach().float().numpy()
    n, k = w.shape
    if k % group:
        raise ValueError(f"quantize_q4: K = {k} is not a multiple of the group size {group}")
    groups = w.reshape(n, k // group, group)
    low, high = groups.min(-1), groups.max(-1)
    a = ((high - low) / 15).astype(np.float32)
    step = np.where(a > 0, a, 1)[..., None]
    q = np.clip(np.rint((groups - low[..., None]) / step), 0, 15).astype(np.uint8)
    return QuantizedWeight.pack(q.reshape(n, k), a, low.astype(np.float32), Q4, group, "Q4_1")


def int8_activation_weights(state_dict: Mapping, digits: int = 2) -> Mapping:
    """The decoder layers' 4-bit and 8-bit QuantizedWeights in the int8-activation layouts
    (for_int8_activations) for `digits` int8 digits per activation. Embeddings and the LM head keep theirs (the
    exact greedy argmax screens the head through an int8 copy of its own) unless they are k-quants in
    super-blocks: a 0.5-8B model's head, whose int8 copy would be 150-250 MB beside it, then takes int8
    activations as the layers do, and a greedy step the argmax of those logits. Each weight is repacked when
    it is read and not kept: a
    model builder that fuses q/k/v or gate/up holds one copy of them, never the parts and the fused weight of
    every layer at once (a 1.5B model's blocks are ~1 GB)."""
    return Int8ActivationWeights(state_dict, digits)


class Int8ActivationWeights(Mapping):
    """A read-only view of a state dict with the decoder layers' GGUF blocks in the int8-activation layouts,
    made on each read (see int8_activation_weights)."""

    def __init__(self, state_dict: Mapping, digits: int) -> None:
        if digits not in (1, 2):
            raise ValueError(f"digits must be 1 or 2, got {digits}")
        self.state_dict, self.digits = state_dict, digits

    def __getitem__(self, name: str):
        w = self.state_dict[name]
        if isinstance(w, QuantizedWeight) and (".layers." in name or w.supers):
            return w.for_int8_activations(self.digits)
        return w

    def __iter__(self):
        return iter(self.state_dict)

    def __len__(self) -> int:
        return len(self.state_dict)


def cat_rows(weights: list) -> "QuantizedWeight | torch.Tensor":
    """Concatenate weights along their output rows (fused q/k/v, gate/up). Quantized parts with the same
    format and group stay quantized; mixed parts are brought to a common form (Q4 values widen to Q8, groups
    of 32 split into 16); parts with F16 or fp32 among quantized ones are dequantized, with a log line."""
    if not any(isinstance(w, QuantizedWeight) for w in weights):
        return torch.cat(weights)
    formats = {w.format if isinstance(w, QuantizedWeight) else None for w in weights}
    if formats <= set(INT8_ACTIVATION_FORMATS):
        groups = {(w.group, w.supers) for w in weights}
        if len(formats) == 1 and len(groups) == 1 and all(w.shape[0] % BLOCK == 0 for w in weights[:-1]):
            # whole column blocks: the records follow each other, each reordered within itself
            n = sum(w.shape[0] for w in weights)
            group, supers = groups.pop()
            return QuantizedWeight(torch.cat([w.packed for w in weights]), weights[0].format, group,
                                   (n, weights[0].shape[1]), _joined_qtype(weights), supers)
        digits = max(_INT8_FORMS[f][1] for f in formats)
        return cat_rows([w.as_exact() for w in weights]).for_int8_activations(digits)
    weights = [w.as_exact() if isinstance(w, QuantizedWeight) else w for w in weights]
    if not all(isinstance(w, QuantizedWeight) and w.format in (Q4, Q8) for w in weights):
        if all(isinstance(w, QuantizedWeight) and w.format == F16 for w in weights):
            return QuantizedWeight.from_f16(np.concatenate([w.dequantize().numpy().astype(np.float16) for w in weights]))
        logger.info("fusing weights of types %s: dequantized to fp32", [getattr(w, "qtype", "F32") for w in weights])
        return torch.cat([w.dequantize() if isinstance(w, QuantizedWeight) else w for w in weights])
    fmt = Q4 if all(w.format == Q4 for w in weights) else Q8
    group = min(w.group for w in weights)
    same_form = all(w.weight_format == (fmt, group) for w in weights)
    if same_form and all(w.shape[0] % BLOCK == 0 for w in weights[:-1]):
        packed = torch.cat([w.packed for w in weights])  # whole column blocks: the records follow each other
        n = sum(w.shape[0] for w in weights)
        return QuantizedWeight(packed, fmt, group, (n, weights[0].shape[1]), _joined_qtype(weights))
    parts = []
    for w in weights:
        q, a, b = w.unpack()
        repeat = w.group // group
        parts.append((q.astype(np.int16), np.repeat(a, repeat, axis=1), np.repeat(b, repeat, axis=1)))
    q, a, b = (np.concatenate(t) for t in zip(*parts))
    return QuantizedWeight.pack(q.astype(np.uint8 if fmt == Q4 else np.int8), a, b, fmt, group, _joined_qtype(weights))


def _joined_qtype(weights) -> str:
    names = sorted({w.qtype for w in weights})
    return names[0] if len(names) == 1 else "+".join(names)
