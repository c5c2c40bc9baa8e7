"""K-quant weights in the int8-activation layouts keep their scales as int8 per group and fp32 per super-block
(gguf_quant._in_super_blocks, csrc/gemm_common.h's group_record): the same fp32 a and b as the plain records, so the
same values and, on every instruction-set path and row count, the same GEMM bits, in fewer bytes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.models import gguf_quant
from specserve.models.gguf_quant import Q4, Q4_I8, Q4_Q8, Q8_I8, Q8_Q8, QuantizedWeight, _factor, _regroup, cat_rows
from specserve.models.llama import make_linear
from specserve.ops import kernels
from tests.kernel_support import requires_c_kernels
from tests.models.test_gguf_quant import random_blocks

pytestmark = requires_c_kernels

# k-quant -> (groups per super-block, bytes of the int8-scale layout / bytes of the plain one)
SUPER_BLOCKS = {"Q4_K": (8, (256 + 8 * (64 + 512)) / (8 * (256 + 512))),
                "Q5_K": (8, (256 + 8 * (64 + 1024)) / (8 * (256 + 1024))),
                "Q6_K": (16, (256 + 16 * (64 + 512)) / (16 * (256 + 512)))}


def plain_layout(weight: QuantizedWeight, digits: int) -> QuantizedWeight:
    """The int8-activation layout with fp32 a, b in every record: what for_int8_activations gave before."""
    weight = weight.plain()
    eight = weight.format != Q4
    fmt = (Q8_I8 if digits == 2 else Q8_Q8) if eight else (Q4_I8 if digits == 2 else Q4_Q8)
    return QuantizedWeight(_regroup(weight.packed, weight.group, 0, eight, to_quads=True), fmt, weight.group,
                           weight.shape, weight.qtype)


@pytest.fixture
def restore_path():
    yield
    kernels.set_int8_path(None)


@pytest.mark.parametrize("qtype", sorted(SUPER_BLOCKS))
def test_k_quant_scales_are_int8_with_the_same_values(qtype):
    rng = np.random.default_rng(len(qtype))
    n, k = 45, 768  # a partial column block; three super-blocks
    exact = QuantizedWeight.from_gguf(random_blocks(rng, qtype, n, k), qtype, (n, k), super_blocks=False)
    supers, ratio = SUPER_BLOCKS[qtype]
    for digits in (2, 1):
        int8 = exact.for_int8_activations(digits)
        plain = plain_layout(exact, digits)
        assert int8.supers == supers and int8.weight_format == (plain.format, exact.group | supers << 8)
        assert int8.nbytes == pytest.approx(plain.nbytes * ratio)
        assert torch.equal(int8.dequantize(), exact.dequantize())
        assert torch.equal(int8[torch.tensor([44, 0, 31])], exact[torch.tensor([44, 0, 31])])
        assert torch.equal(int8.as_exact().plain().packed, exact.packed)
        for part, want in zip(int8.unpack(), exact.unpack()):
            np.testing.assert_array_equal(part, want)


@pytest.mark.parametrize("qtype", sorted(SUPER_BLOCKS))
def test_every_path_gives_the_plain_layouts_bits(qtype, restore_path):
    """The kernels make each group's a = D * sc and b = E * mn (exact products), so every path gives the bits
    it gives on the plain records, for any row count."""
    rng = np.random.default_rng(7)
    n, k = 70, 512
    exact = QuantizedWeight.from_gguf(random_blocks(rng, qtype, n, k), qtype, (n, k), super_blocks=False)
    x = torch.from_numpy((rng.standard_normal((40, k)) * rng.uniform(0.01, 30, (40, 1))).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    kernel = "gemm" if exact.format == Q4 else "gemm_q8"
    for digits in (2, 1):
        int8, plain = exact.for_int8_activations(digits), plain_layout(exact, digits)
        for path in kernels.int8_paths(kernel):
            assert kernels.set_int8_path(path) == path
            for rows in (1, 2, 3, 5, 9, 16, 17, 33, 40):
                got = kernels.gemm_weight(x[:rows], int8.packed, int8.weight_format, bias, n)
                want = kernels.gemm_weight(x[:rows], plain.packed, plain.weight_format, bias, n)
                assert torch.equal(got, want), (path, digits, rows)


def test_scales_that_do_not_factor_keep_fp32_records():
    """Q4_1-like scales (any fp32 per group) have no common factor with small integers: the plain records."""
    rng = np.random.default_rng(3)
    q = rng.integers(0, 16, size=(64, 512), dtype=np.uint8)
    a = rng.uniform(1e-3, 2e-2, size=(64, 16)).astype(np.float32)
    b = -rng.uniform(0, 0.1, size=(64, 16)).astype(np.float32)
    weight = QuantizedWeight.pack(q, a, b, Q4, 32, "Q4_1").for_int8_activations()
    assert weight.supers == 0 and weight.weight_format == (Q4_I8, 32)


def test_factor_keeps_each_values_bits():
    d = np.float32(np.float16(1.3e-3))
    rows = np.array([[d * 3, d * 63, 0.0, d * 7],  # 6-bit scales
                     [-(d * 5), -0.0, -(d * 1), -(d * 2)],  # Q4_K's b = -(dmin * min): zeros are -0
                     [d * -128, d * 127, d * 0, d * -1],  # Q6_K's signed scales, -128 included
                     [-0.0, -0.0, -0.0, -0.0],
                     [0.1, 0.2, 0.3, 0.7],  # no factor with integers below 128
                     [0.0, -0.0, d, d]],  # zeros of both signs: no factor's sign gives both
                    np.float32)
    f, s, ok = _factor(rows)
    assert ok.tolist() == [True, True, True, True, False, False]
    made = f[:, None] * s.astype(np.float32)
    assert (made.view(np.uint32)[ok] == rows.view(np.uint32)[ok]).all()


def test_fused_k_quant_weights_stay_in_super_blocks():
    rng = np.random.default_rng(5)
    parts = [QuantizedWeight.from_gguf(random_blocks(rng, "Q4_K", n, 512), "Q4_K", (n, 512)) for n in (64, 32, 20)]
    fused = cat_rows([p.for_int8_activations() for p in parts])
    assert fused.supers == 8 and fused.shape == (116, 512)
    assert torch.equal(fused.packed, cat_rows(parts).for_int8_activations().packed)
    mixed = cat_rows([parts[0].for_int8_activations(),
                      QuantizedWeight.from_gguf(random_blocks(rng, "Q6_K", 32, 512), "Q6_K", (32, 512))
                      .for_int8_activations()])  # Q4_K and Q6_K rows: widened to 8 bits, groups of 16
    assert mixed.format == Q8_I8 and mixed.group == 16 and mixed.supers == 16


@pytest.mark.parametrize("qtype", sorted(SUPER_BLOCKS))
def test_the_fp32_activation_layout_in_super_blocks_gives_the_same_bits(qtype):
    """Embeddings and LM heads keep the fp32-activation layout (lookups, the exact greedy argmax): in super-blocks
    their GEMM, rows, single columns and argmax are the plain layout's, bit for bit."""
    rng = np.random.default_rng(11)
    n, k = 300, 512
    raw = random_blocks(rng, qtype, n, k)
    plain = QuantizedWeight.from_gguf(raw, qtype, (n, k), super_blocks=False)
    compact = QuantizedWeight.from_gguf(raw, qtype, (n, k))  # what loading a file gives
    assert torch.equal(compact.packed, plain.in_super_blocks().packed)
    assert compact.supers == SUPER_BLOCKS[qtype][0] and compact.format == plain.format
    assert compact.nbytes == pytest.approx(plain.nbytes * SUPER_BLOCKS[qtype][1])
    assert torch.equal(compact.plain().packed, plain.packed) and compact.in_super_blocks() is compact
    assert torch.equal(compact.dequantize(), plain.dequantize())
    x = torch.from_numpy(rng.standard_normal((9, k)).astype(np.float32))
    for rows in (1, 4, 9):
        got = kernels.gemm_weight(x[:rows], compact.packed, compact.weight_format, None, n)
        assert torch.equal(got, kernels.gemm_weight(x[:rows], plain.packed, plain.weight_format, None, n))
    head = make_linear(compact, None, torch.float32)
    assert head.enable_exact_argmax()
    want = kernels.gemm_weight(x, plain.packed, plain.weight_format, None, n).argmax(-1)
    assert torch.equal(head.argmax(x), want)
    assert torch.equal(compact.for_int8_activations().packed, plain.for_int8_activations().packed)


def test_a_large_weight_is_converted_in_chunks_of_rows(monkeypatch):
    rng = np.random.default_rng(13)
    n, k = gguf_quant._CHUNK_ROWS + 100, 256
    raw = random_blocks(rng, "Q6_K", n, k)
    plain = QuantizedWeight.from_gguf(raw, "Q6_K", (n, k), super_blocks=False)
    chunked = QuantizedWeight.from_gguf(raw, "Q6_K", (n, k))
    assert chunked.supers == 16 and torch.equal(chunked.packed, plain.in_super_blocks().packed)
    calls = []
    real = gguf_quant._in_super_blocks

    def second_chunk_does_not_factor(packed, group, shape):
        calls.append(shape)
        return None if len(calls) == 2 else real(packed, group, shape)

    monkeypatch.setattr(gguf_quant, "_in_super_blocks", second_chunk_does_not_factor)
    mixed = QuantizedWeight.from_gguf(raw, "Q6_K", (n, k))  # every chunk in plain records then
    assert mixed.supers == 0 and torch.equal(mixed.packed, plain.packed)
