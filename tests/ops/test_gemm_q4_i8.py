"""The int8-activation GEMM for 4-bit GGUF blocks (ops/csrc/gemm_q4_i8.c, QuantizedWeight.for_int8_activations):
the integer math of a reference written here, rows independent of their batch and of the thread count, the
same bits from its AVX512-VNNI, AVX2 and portable paths (chosen at run time, all built on every x86 host),
and the layout's round trips."""
from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from specserve.models.gguf_quant import Q4, Q4_I8, Q4_Q8, QuantizedWeight, cat_rows, int8_activation_weights
from specserve.ops import kernels
from tests.kernel_support import int8_paths_to_test, requires_c_kernels

pytestmark = requires_c_kernels


def random_q4(rng: np.random.Generator, n: int, k: int) -> QuantizedWeight:
    """A Q4_1-like weight: q in 0..15, positive scales, negative offsets (w = a * q + b)."""
    q = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    a = rng.uniform(1e-3, 2e-2, size=(n, k // 32)).astype(np.float32)
    b = -rng.uniform(0, 0.1, size=(n, k // 32)).astype(np.float32)
    return QuantizedWeight.pack(q, a, b, Q4, 32, "Q4_1")


def reference(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
              digits: int = 2) -> torch.Tensor:
    """float64 of the kernel's math: x per group of 32 as two int8 digits, d * (hi + lo / 256) with d =
    max|x| / 127 (one digit: lo = 0), times the weight."""
    m, k = x.shape
    groups = x.reshape(m, k // 32, 32)
    d = groups.abs().amax(-1, keepdim=True) / 127
    r = groups * torch.where(d > 0, 1 / d, 0)  # fp32, as the kernel divides
    hi = torch.round(r)
    lo = torch.round((r - hi) * 256).clamp(-127, 127) * (digits == 2)
    xq = (hi.double() + lo.double() / 256) * d.double()
    y = xq.reshape(m, k) @ weight.dequantize().double().T
    return (y if bias is None else y + bias.double()).float()


def gemm(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return kernels.gemm_weight(x.contiguous(), weight.packed, weight.weight_format, bias, weight.shape[0])


@pytest.mark.parametrize("digits", [2, 1])
@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (45, 64), (100, 576), (70, 1536)])
def test_gemm_is_the_int8_math(n, k, digits):
    rng = np.random.default_rng(n + k)
    weight = random_q4(rng, n, k).for_int8_activations(digits)
    assert weight.weight_format == ({2: Q4_I8, 1: Q4_Q8}[digits], 32)
    x = torch.from_numpy(rng.standard_normal((9, k)).astype(np.float32))
    x[3, :32] = 0.0  # a group of zeros: scale 0, no division by it
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    for b in (None, bias):
        want = reference(x, weight, b, digits)
        got = gemm(x, weight, b)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), (got - want).abs().max()


def test_int8_activations_stay_close_to_fp32():
    rng = np.random.default_rng(1)
    exact = random_q4(rng, 256, 576)
    x = torch.from_numpy(rng.standard_normal((4, 576)).astype(np.float32))
    fp32 = gemm(x, exact)
    int8 = gemm(x, exact.for_int8_activations())
    assert not torch.equal(fp32, int8)  # it is a different computation ...
    assert (int8 - fp32).norm() / fp32.norm() < 1e-4  # ... within the activations' 15-bit rounding


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_result_does_not_depend_on_its_batch(threads):
    """What makes speculation lossless on this path: a verification step's rows equal one-token steps."""
    rng = np.random.default_rng(2)
    weight = random_q4(rng, 3072, 576).for_int8_activations()  # large enough for the threaded loop
    x = torch.from_numpy(rng.standard_normal((13, 576)).astype(np.float32))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([gemm(x[i:i + 1], weight) for i in range(13)])
        for rows in (2, 5, 6, 7, 12, 13):
            assert torch.equal(gemm(x[:rows], weight), alone[:rows]), rows
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(gemm(x, weight), alone)  # and across thread counts


def test_layout_round_trips():
    rng = np.random.default_rng(3)
    exact = random_q4(rng, 45, 96)
    int8 = exact.for_int8_activations()
    assert not torch.equal(int8.packed, exact.packed) and int8.nbytes == exact.nbytes
    assert torch.equal(int8.dequantize(), exact.dequantize())
    assert torch.equal(int8[torch.tensor([44, 0, 7])], exact[torch.tensor([44, 0, 7])])
    assert torch.equal(int8.as_exact().packed, exact.packed)
    for part, want in zip(int8.unpack(), exact.unpack()):
        np.testing.assert_array_equal(part, want)
    for sizes in ((64, 32, 20), (20, 64)):  # whole blocks then a partial one (records joined), a partial first
        parts = [random_q4(rng, n, 96) for n in sizes]
        fused = cat_rows([p.for_int8_activations() for p in parts])
        assert fused.weight_format == (Q4_I8, 32) and fused.shape == (sum(sizes), 96)
        assert torch.equal(fused.packed, cat_rows(parts).for_int8_activations().packed)


def test_only_decoder_layers_blocks_change():
    rng = np.random.default_rng(4)
    q8 = QuantizedWeight.pack(rng.integers(-127, 128, size=(32, 64)).astype(np.int8),
                              np.ones((32, 2), np.float32), np.zeros((32, 2), np.float32), kernels.WEIGHT_Q8, 32, "Q8_0")
    q4 = random_q4(rng, 32, 64)
    state = {"model.embed_tokens.weight": q4, "model.layers.0.mlp.up_proj.weight": q4,
             "model.layers.0.mlp.down_proj.weight": q8, "model.norm.weight": torch.ones(64)}
    out = int8_activation_weights(state)
    assert out["model.layers.0.mlp.up_proj.weight"].weight_format == (Q4_I8, 32)
    assert out["model.layers.0.mlp.down_proj.weight"].weight_format == (kernels.WEIGHT_Q8_I8, 32)
    assert out["model.embed_tokens.weight"] is q4
    assert out["model.norm.weight"] is state["model.norm.weight"]
    assert set(out) == set(state) and len(out) == len(state)
    # repacked on each read, nothing kept: a builder that fuses layers never holds every layer's parts
    first, again = out["model.layers.0.mlp.up_proj.weight"], out["model.layers.0.mlp.up_proj.weight"]
    assert first is not again and torch.equal(first.packed, again.packed)
    assert state["model.layers.0.mlp.up_proj.weight"] is q4  # the state dict itself is left as it is


ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 31, 33, 64)


@pytest.fixture
def restore_path():
    yield
    kernels.set_int8_path(None)


@pytest.mark.parametrize("digits", [2, 1])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_path_gives_the_same_bits_for_1_to_64_rows(threads, digits, restore_path):
    """Each instruction-set path (AMX, AVX512-VNNI, AVX2, portable C: csrc/gemm_q4_i8.c) gives the bits of the
    others, and on each a row's result is its one-row call's, whatever the batch and the thread count."""
    paths = int8_paths_to_test()
    assert paths[0] == "portable" and len(paths) == len(set(paths))
    rng = np.random.default_rng(6)
    n = 1000  # 31 blocks and a partial one: unequal shares per thread
    weight = random_q4(rng, n, 576).for_int8_activations(digits)
    x = torch.from_numpy((rng.standard_normal((64, 576)) * rng.uniform(0.01, 30, (64, 1))).astype(np.float32))
    x[5, 64:96] = 0.0
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = {}
        for path in paths:
            assert kernels.set_int8_path(path) == path
            alone = torch.cat([kernels.gemm_weight(x[i:i + 1], weight.packed, weight.weight_format, bias, n)
                               for i in range(64)])
            for rows in ROW_COUNTS:
                got = kernels.gemm_weight(x[:rows], weight.packed, weight.weight_format, bias, n)
                assert torch.equal(got, alone[:rows]), (path, rows)
            results[path] = alone
    finally:
        torch.set_num_threads(previous)
    for path in paths[1:]:
        assert torch.equal(results[path], results["portable"]), path
    want = reference(x, weight, bias, digits)
    assert torch.allclose(results["portable"], want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_one_digit_is_the_int8_math_at_half_the_precision():
    """The Q4_Q8 format (gguf_compute="q8") is the same bytes as Q4_I8, its activations rounded to 8 bits:
    ~100x further from fp32 activations than two digits."""
    rng = np.random.default_rng(8)
    exact = random_q4(rng, 256, 576)
    one, two = exact.for_int8_activations(1), exact.for_int8_activations(2)
    assert torch.equal(one.packed, two.packed) and one.weight_format == (Q4_Q8, 32)
    assert torch.equal(two.for_int8_activations(1).packed, one.packed) and one.as_exact().weight_format[0] == Q4
    x = torch.from_numpy(rng.standard_normal((4, 576)).astype(np.float32))
    fp32 = gemm(x, exact)
    err = {d: ((gemm(x, w) - fp32).norm() / fp32.norm()).item() for d, w in ((1, one), (2, two))}
    assert err[2] * 30 < err[1] < 1e-2, err


def test_the_amx_self_check_runs_in_a_child():
    """Before the AMX path is taken, a forked child checks its bits against the VNNI path's; here with the
    emulated tiles (the real ones need an AMX CPU, where int8_paths lists "amx" only after it passed)."""
    if "avx512_vnni" not in kernels.int8_paths():
        pytest.skip("the check compares against the AVX512-VNNI path")
    assert kernels._lib().q4_i8_amx_check_in_child(1) == 1


def test_a_path_the_cpu_lacks_is_refused(restore_path):
    missing = [p for p in kernels.INT8_PATHS if p not in kernels.int8_paths()]
    for path in [*missing, "sse9"]:
        with pytest.raises(ValueError, match="this CPU runs"):
            kernels.set_int8_path(path)
    default = kernels.set_int8_path(None)  # the measured routes, or before any the fastest vector path
    assert default in kernels.int8_paths()
    if not kernels._routes:
        assert default == [p for p in kernels.int8_paths() if p != "amx"][-1]


def test_the_path_can_be_chosen_by_environment():
    code = "from specserve.ops import kernels; kernels.load_kernel()"
    env = {**os.environ, kernels.INT8_PATH_ENV: "portable"}
    out = subprocess.run([sys.executable, "-c", "import logging; logging.basicConfig(level=logging.INFO); " + code],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "the portable path" in out.stderr
    env[kernels.INT8_PATH_ENV] = "avx9000"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and kernels.INT8_PATH_ENV in out.stderr and "portable" in out.stderr


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
def test_a_baseline_x86_build_holds_every_path(tmp_path):
    """Built for the x86-64 baseline (no AVX), the int8 kernels (the GEMMs and the greedy screen, with what they
    call) still hold the AVX2, AVX512-VNNI and AMX paths (function-level target attributes), and each path the
    CPU runs gives the main library's bits."""
    cc = shutil.which("cc") or shutil.which("gcc")
    out = tmp_path / "baseline.so"
    flags = [f for f in kernels.FLAGS if f not in ("-march=native", "-shared")] + ["-march=x86-64"]
    sources = [p for p in kernels.SOURCES if p.name in ("gemm.c", "gemm_gguf.c", "gemm_q4_i8.c", "gemm_q8_i8.c",
                                                         "greedy.c", "layer_ops.c")]
    compiles = [subprocess.Popen([cc, *flags, "-c", str(p), "-o", str(tmp_path / f"{p.stem}.o")],
                                 stderr=subprocess.PIPE) for p in sources]
    assert all(c.wait(timeout=300) == 0 for c in compiles), [c.stderr.read()[-500:] for c in compiles]
    subprocess.run([cc, *flags, "-shared", *(str(tmp_path / f"{p.stem}.o") for p in sources), "-o", str(out), "-lm"],
                   check=True, capture_output=True, timeout=300)
    lib = ctypes.CDLL(str(out))
    lib.gemm_q4_i8.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5
    lib.gemm_q8_i8.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5
    lib.q4_i8_select.argtypes = lib.q4_i8_supported.argtypes = [ctypes.c_int64]
    runs = [name for i, name in enumerate(kernels.INT8_PATHS) if lib.q4_i8_supported(i)]
    assert runs == kernels.int8_paths()
    rng = np.random.default_rng(5)
    weight = random_q4(rng, 96, 192).for_int8_activations()
    scales = np.full((96, 12), 1e-3, np.float32)
    eight = QuantizedWeight.pack(rng.integers(-128, 128, (96, 192)).astype(np.int8), scales, -100 * scales,
                                 kernels.WEIGHT_Q8, 16, "Q6_K").for_int8_activations()  # 8-bit, groups of 16
    x = torch.from_numpy(rng.standard_normal((7, 192)).astype(np.float32))
    want = kernels.gemm_weight(x, weight.packed, weight.weight_format, None, 96)
    want_eight = kernels.gemm_weight(x, eight.packed, eight.weight_format, None, 96)
    for i, name in enumerate(kernels.INT8_PATHS):
        if name in runs:
            assert lib.q4_i8_select(i) == i
            y = torch.empty(7, 96)
            assert lib.gemm_q4_i8(x.data_ptr(), weight.packed.data_ptr(), None, y.data_ptr(), 7, 192, 96, 2, 0) == 0
            assert torch.equal(y, want), name
            assert lib.gemm_q8_i8(x.data_ptr(), eight.packed.data_ptr(), None, y.data_ptr(), 7, 192, 96, 16, 2) == 0
            assert torch.equal(y, want_eight), name


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
def test_a_compiler_without_amx_builds_the_other_paths():
    """The tile intrinsics need GCC 11 or Clang 12 (amx_tiles.h): with INT8_AMX_BUILT 0, as an older
    compiler gets, the int8 kernels still compile, the emulated AMX code included."""
    cc = shutil.which("cc") or shutil.which("gcc")
    src = kernels.SOURCES[0].parent
    flags = [f for f in kernels.FLAGS if f not in ("-shared",)] + ["-DINT8_AMX_BUILT=0", "-fsyntax-only", f"-I{src}"]
    for name in ("gemm_q4_i8.c", "gemm_q8_i8.c", "greedy.c"):
        out = subprocess.run([cc, *flags, str(src / name)], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
