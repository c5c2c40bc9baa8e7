"""The int8-activation GEMM for 8-bit GGUF blocks (ops/csrc/gemm_q8_i8.c, QuantizedWeight.for_int8_activations on
Q8_0, Q5_0, Q6_K...): bitwise the integer arithmetic of a reference written here, the same bits from every path
the CPU runs (and never an AMX route), rows independent of their batch and of the thread count, and the
layout's round trips."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.models.gguf_quant import Q8, Q8_I8, Q8_Q8, QuantizedWeight, cat_rows
from specserve.ops import kernels
from tests.kernel_support import requires_c_kernels

pytestmark = requires_c_kernels


def random_q8(rng: np.random.Generator, n: int, k: int, group: int = 32, low: int = -128,
              high: int = 127) -> QuantizedWeight:
    """A Q8-layout weight: q in low..high, positive scales, non-positive offsets (w = a * q + b)."""
    q = rng.integers(low, high + 1, size=(n, k)).astype(np.int8)
    a = rng.uniform(1e-3, 2e-2, size=(n, k // group)).astype(np.float32)
    b = -rng.uniform(0, 0.1, size=(n, k // group)).astype(np.float32)
    return QuantizedWeight.pack(q, a, b, Q8, group, "Q8_0")


def fma32(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """fp32 x * y + z rounded once: the product is exact in float64, and the float64 sum rounds again before
    fp32 only harmlessly unless it lands on an fp32 midpoint after an inexact add (checked never to happen)."""
    p = x.astype(np.float64) * y.astype(np.float64)
    s = p + z.astype(np.float64)
    t = s - p
    inexact = ((p - (s - t)) + (z.astype(np.float64) - t)) != 0  # the sum's rounding error (TwoSum)
    r = s.astype(np.float32)
    other = np.nextafter(r, np.where(s > r, np.inf, -np.inf).astype(np.float32))
    midpoint = (s - r.astype(np.float64)) * 2 == other.astype(np.float64) - r.astype(np.float64)
    assert not (inexact & midpoint & (s != r)).any(), "double rounding: the reference cannot decide this lane"
    return r


def quantize_rows(x: np.ndarray, digits: int) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] fp32 -> (256 hi + lo [M, K] int64, unit = d / 256 [M, K / 32] fp32): per group of 32, d = max|x|
    / 127, hi = round(x / d), lo = round((x / d - hi) * 256) clamped to +-127 (0 with one digit)."""
    m, k = x.shape
    groups = x.reshape(m, k // 32, 32)
    d = (np.abs(groups).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    r = (groups * inv).astype(np.float32)
    hi = np.rint(r)
    lo = np.clip(np.rint((r - hi.astype(np.float32)) * np.float32(256)), -127, 127) * (digits == 2)
    wide = (256 * hi.astype(np.int64) + lo.astype(np.int64)).reshape(m, k)
    return wide, (d[..., 0] / np.float32(256)).astype(np.float32)


def reference(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
              digits: int = 2) -> torch.Tensor:
    """The kernel's arithmetic from scratch: per weight group of G k's the exact T = sum q * (256 hi + lo) and
    S = sum (256 hi + lo), then acc = fma(T, a * unit, acc), acc = fma(b, unit * S, acc) group by group, plus
    the bias."""
    q, a, b = weight.unpack()  # [N, K] int8, [N, K / G] fp32
    n, k = q.shape
    g = weight.group
    wide, unit = quantize_rows(x.numpy(), digits)
    m = wide.shape[0]
    acc = np.zeros((m, n), np.float32)
    for j in range(k // g):
        cols = slice(j * g, (j + 1) * g)
        t = wide[:, cols] @ q[:, cols].astype(np.int64).T  # [M, N], exact
        u = unit[:, j * g // 32][:, None]
        s = (u * wide[:, cols].sum(1, keepdims=True).astype(np.float32)).astype(np.float32)
        acc = fma32(t.astype(np.float32), (a[:, j][None, :] * u).astype(np.float32), acc)
        acc = fma32(np.broadcast_to(b[:, j][None, :], acc.shape), np.broadcast_to(s, acc.shape), acc)
    if bias is not None:
        acc = (acc + bias.numpy()[None, :]).astype(np.float32)
    return torch.from_numpy(acc)


def gemm(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return kernels.gemm_weight(x.contiguous(), weight.packed, weight.weight_format, bias, weight.shape[0])


@pytest.fixture
def restore_path():
    yield
    kernels.set_int8_path(None)


def paths() -> list[str]:
    return kernels.int8_paths("gemm_q8")


@pytest.mark.parametrize("digits", [2, 1])
@pytest.mark.parametrize("group", [32, 16])
@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (45, 64), (100, 576), (70, 1536)])
def test_every_path_is_bitwise_the_integer_arithmetic(n, k, group, digits, restore_path):
    rng = np.random.default_rng(n + k + group)
    weight = random_q8(rng, n, k, group).for_int8_activations(digits)
    assert weight.weight_format == ({2: Q8_I8, 1: Q8_Q8}[digits], group)
    x = torch.from_numpy((rng.standard_normal((9, k)) * rng.uniform(0.01, 30, (9, 1))).astype(np.float32))
    x[3, :32] = 0.0  # a group of zeros: scale 0, no division by it
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    for b in (None, bias):
        want = reference(x, weight, b, digits)
        for path in paths():
            kernels.set_int8_path(path)
            assert torch.equal(gemm(x, weight, b), want), (path, b is None)


@pytest.mark.parametrize("digits", [2, 1])
@pytest.mark.parametrize("group", [32, 16])
def test_extreme_values_are_exact(group, digits, restore_path):
    """q at -128 and 127 (stored 0 and 255) against digits at +-127 in every lane: the largest integer sums,
    where AVX2's vpmaddubsw would saturate."""
    n, k = 40, 128
    rows = []
    for hi_value, lo_half in ((127.0, False), (126.5, True)):  # 126.5: hi 126, lo 128 clamped to 127
        for sign in (1, -1):
            row = np.full(k, sign * hi_value, np.float32)
            if lo_half:
                row[::32] = sign * 127.0  # each group's max: d = 1
            rows += [row, -row * np.where(np.arange(k) % 2, 1, -1)]
    x = torch.from_numpy(np.stack(rows).astype(np.float32))
    q = np.where((np.arange(n)[:, None] + np.arange(k)[None, :] // 7) % 3 == 0, -128, 127).astype(np.int8)
    q[:8] = -128
    q[8:16] = 127
    a = np.full((n, k // group), 1e-3, np.float32)
    b = np.where(np.arange(n)[:, None] % 2, -0.25, -0.0).astype(np.float32) * np.ones((1, k // group), np.float32)
    weight = QuantizedWeight.pack(q, a, b, Q8, group, "Q8_0").for_int8_activations(digits)
    want = reference(x, weight, None, digits)
    wide, _ = quantize_rows(x.numpy(), digits)
    assert np.abs(wide).max() == 127 * 256  # hi at +-127 ...
    assert (np.abs(wide) == 126 * 256 + 127).any() == (digits == 2)  # ... and lo too
    for path in paths():
        kernels.set_int8_path(path)
        assert torch.equal(gemm(x, weight), want), path


ROW_COUNTS = range(1, 41)


@pytest.mark.parametrize("group", [32, 16])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_result_does_not_depend_on_its_batch_nor_the_threads(threads, group, restore_path):
    """Each path: a row's result is its one-row call's in batches of 1 to 40 rows, with 1 or 2 threads, and
    every path gives the portable path's bits (1000 columns: 31 blocks and a partial one)."""
    rng = np.random.default_rng(6 + group)
    n = 1000
    weight = random_q8(rng, n, 576, group).for_int8_activations()
    x = torch.from_numpy((rng.standard_normal((40, 576)) * rng.uniform(0.01, 30, (40, 1))).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    results = {}
    try:
        for path in paths():
            kernels.set_int8_path(path)
            alone = torch.cat([gemm(x[i:i + 1], weight, bias) for i in range(40)])
            for rows in ROW_COUNTS:
                assert torch.equal(gemm(x[:rows], weight, bias), alone[:rows]), (path, rows)
            results[path] = alone
    finally:
        torch.set_num_threads(previous)
    for path in paths():
        assert torch.equal(results[path], results["portable"]), path
    assert torch.equal(results["portable"], reference(x, weight, bias))


def test_int8_activations_stay_close_to_fp32():
    rng = np.random.default_rng(1)
    exact = random_q8(rng, 256, 576, 16)
    x = torch.from_numpy(rng.standard_normal((4, 576)).astype(np.float32))
    fp32 = gemm(x, exact)
    err = {d: ((gemm(x, exact.for_int8_activations(d)) - fp32).norm() / fp32.norm()).item() for d in (1, 2)}
    assert err[2] < 1e-4 and err[2] * 30 < err[1] < 1e-2, err


@pytest.mark.parametrize("group", [32, 16])
def test_layout_round_trips(group):
    rng = np.random.default_rng(3)
    exact = random_q8(rng, 45, 96, group)
    int8 = exact.for_int8_activations()
    assert not torch.equal(int8.packed, exact.packed) and int8.nbytes == exact.nbytes
    assert torch.equal(int8.dequantize(), exact.dequantize())
    assert torch.equal(int8[torch.tensor([44, 0, 7])], exact[torch.tensor([44, 0, 7])])
    assert torch.equal(int8.as_exact().packed, exact.packed)
    one = int8.for_int8_activations(1)
    assert torch.equal(one.packed, int8.packed) and one.weight_format == (Q8_Q8, group)
    for part, want in zip(int8.unpack(), exact.unpack()):
        np.testing.assert_array_equal(part, want)
    for sizes in ((64, 32, 20), (20, 64)):  # whole blocks then a partial one (records joined), a partial first
        parts = [random_q8(rng, n, 96, group) for n in sizes]
        fused = cat_rows([p.for_int8_activations() for p in parts])
        assert fused.weight_format == (Q8_I8, group) and fused.shape == (sum(sizes), 96)
        assert torch.equal(fused.packed, cat_rows(parts).for_int8_activations().packed)


def test_mixed_blocks_fuse_into_the_q8_int8_layout():
    """A Q4_K_M layer's q, k (4-bit, groups of 32) with its v (Q6_K: 8-bit, groups of 16) fuse to 8-bit groups of
    16 on int8 activations, the same values."""
    rng = np.random.default_rng(4)
    q4 = QuantizedWeight.pack(rng.integers(0, 16, size=(64, 64)).astype(np.uint8),
                              rng.uniform(1e-3, 2e-2, (64, 2)).astype(np.float32),
                              -rng.uniform(0, 0.1, (64, 2)).astype(np.float32), kernels.WEIGHT_Q4, 32, "Q4_K")
    q6 = random_q8(rng, 32, 64, 16, -32, 31)
    fused = cat_rows([q4.for_int8_activations(), q6.for_int8_activations()])
    assert fused.weight_format == (Q8_I8, 16)
    assert torch.equal(fused.dequantize(), torch.cat([q4.dequantize(), q6.dequantize()]))


def test_the_q8_kernel_never_routes_to_amx(restore_path):
    """It has no AMX path: its routes refuse AMX, and a forced AMX path gives it the VNNI one."""
    assert "amx" not in kernels.int8_paths("gemm_q8")
    for amx in ("amx", kernels.AMX_EMULATED):
        with pytest.raises(ValueError):
            kernels.set_int8_routes("gemm_q8", ["portable", amx])
    if "avx512_vnni" in kernels.int8_paths():
        kernels.set_int8_path(kernels.AMX_EMULATED)
        assert kernels.int8_route("gemm_q8", 64) == "avx512_vnni"
        assert kernels.int8_route("gemm", 64) == kernels.AMX_EMULATED


def test_calls_take_their_measured_route(restore_path):
    """The Q8 kernel's calls follow its own route table (kernel "gemm_q8"), counted per path."""
    rng = np.random.default_rng(5)
    weight = random_q8(rng, 64, 128).for_int8_activations()
    table = [paths()[r % len(paths())] for r in range(6)]
    kernels.set_int8_routes("gemm_q8", table, remember=False)
    for rows in range(1, 7):
        before = kernels.int8_route_calls("gemm_q8")
        gemm(torch.randn(rows, 128), weight)
        after = kernels.int8_route_calls("gemm_q8")
        assert {p: after[p] - before[p] for p in after if after[p] != before[p]} == {table[rows - 1]: 1}
