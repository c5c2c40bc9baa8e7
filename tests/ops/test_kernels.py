"""Building, caching and falling back from the C kernels."""
import pytest
import torch

from specserve.ops import greedy_screen, kernels
from tests.kernel_support import int8_path, int8_paths_to_test, requires_c_kernels


@pytest.fixture
def fresh_kernel_state(monkeypatch, tmp_path):
    """An empty kernel cache and no loaded library; the real state comes back afterwards."""
    saved = dict(kernels._loaded)
    kernels._loaded.clear()
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    yield tmp_path
    kernels._loaded.clear()
    kernels._loaded.update(saved)


def test_unknown_backend_is_refused(monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="SPECSERVE_KERNELS must be one of"):
        kernels.kernel_enabled()


def test_torch_backend_never_builds(monkeypatch, fresh_kernel_state):
    monkeypatch.setenv(kernels.ENV_VAR, "torch")
    assert not kernels.kernel_enabled()
    assert "lib" not in kernels._loaded


def test_a_failing_compiler_falls_back_to_pytorch(monkeypatch, fresh_kernel_state):
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv(kernels.ENV_VAR, "auto")
    assert not kernels.kernel_enabled()
    assert not kernels.kernel_usable(torch.float32)
    monkeypatch.setenv(kernels.ENV_VAR, "c")
    with pytest.raises(RuntimeError, match="did not build"):
        kernels.kernel_enabled()


@requires_c_kernels
def test_built_once_then_loaded_from_the_cache(fresh_kernel_state):
    assert kernels.load_kernel() is not None
    built = list((fresh_kernel_state / "kernels").glob("specserve-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    kernels._loaded.clear()
    assert kernels.load_kernel() is not None
    assert built[0].stat().st_mtime_ns == mtime  # not rebuilt


def test_only_fp32_caches_use_the_kernel():
    assert not kernels.kernel_usable(torch.bfloat16)


@requires_c_kernels
@pytest.mark.parametrize("rows", [1, 40])  # one thread, and split over threads
def test_add_rms_norm_matches_torch(rows):
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(rows, 576, generator=g) for _ in range(2))
    weight = torch.randn(576, generator=g)
    expected_residual = x + residual
    expected = torch.nn.functional.rms_norm(expected_residual, (576,), weight, 1e-5)
    out = kernels.add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)  # updated in place
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    alone = kernels.add_rms_norm(None, residual.clone(), weight, 1e-5)  # no add
    torch.testing.assert_close(alone, expected, atol=1e-6, rtol=1e-5)


@requires_c_kernels
@pytest.mark.parametrize("rows", [1, 40])
def test_silu_mul_matches_torch_over_the_whole_range(rows):
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(rows, 2 * 96, generator=g) * 8
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.0, -1e-8])  # saturation, signed zero
    inter = gate_up.shape[1] // 2
    expected = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    torch.testing.assert_close(kernels.silu_mul(gate_up), expected, atol=1e-6, rtol=1e-6)


@requires_c_kernels
def test_rope_rotates_q_and_k_heads_in_place_and_leaves_v():
    from specserve.models.rope import RotaryEmbedding, apply_rotary

    n, heads, kv_heads, dim = 7, 4, 2, 16
    rotary = RotaryEmbedding(dim, 64, 10000.0, None)
    cos, sin = rotary.cos_sin(torch.tensor([0, 1, 5, 9, 20, 33, 63]))
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim)
    q, k = qkv[:, : heads * dim].view(n, heads, dim), qkv[:, heads * dim:(heads + kv_heads) * dim].view(n, kv_heads, dim)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    kernels.rope_qk(qkv, cos.reshape(n, dim), sin.reshape(n, dim), heads + kv_heads, dim)
    torch.testing.assert_close(q, expected_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, expected_k, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before)



@requires_c_kernels
@pytest.mark.parametrize("out_f,in_f", [(96, 64), (45, 7), (960, 576), (33, 1536)])  # incl. partial blocks
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_matches_float64_reference(out_f, in_f, with_bias):
    g = torch.Generator().manual_seed(out_f * in_f)
    w = torch.randn(out_f, in_f, generator=g) / in_f**0.5
    b = torch.randn(out_f, generator=g) if with_bias else None
    packed = kernels.pack_gemm_weight(w)
    assert torch.equal(kernels.unpack_gemm_weight(packed, out_f), w)
    for rows in (0, 1, 3, 8, 9, 12, 13, 70):  # every chunking case: below, at and past 12 rows
        x = torch.randn(rows, in_f, generator=g)
        ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        y = kernels.gemm_packed(x, packed, b, out_f)
        assert y.shape == (rows, out_f)
        torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)


@requires_c_kernels
def test_gemm_rows_do_not_depend_on_the_batch():
    """A row's output is bitwise the same computed alone, in a verification-sized batch or in a big one:
    verified tokens see exactly the numbers plain decoding computes."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 576, generator=g)
    packed = kernels.pack_gemm_weight(w)
    x = torch.randn(29, 576, generator=g)
    full = kernels.gemm_packed(x, packed, None, 200)
    for start, rows in [(0, 1), (5, 1), (3, 4), (20, 6), (8, 13)]:
        part = kernels.gemm_packed(x[start:start + rows].contiguous(), packed, None, 200)
        assert torch.equal(part, full[start:start + rows])


@requires_c_kernels
@pytest.mark.parametrize("out_f,in_f", [(96, 64), (45, 7), (960, 576), (33, 1536)])
def test_int8_gemm_matches_its_dequantized_weight(out_f, in_f):
    """Weight-only int8: per-output-channel rounding within half a step, then the product of the fp32
    activations with exactly the dequantized weight (float64 reference), batch-invariant like the fp32 GEMM."""
    g = torch.Generator().manual_seed(out_f + in_f)
    w = torch.randn(out_f, in_f, generator=g) / in_f**0.5
    w[0] = 0.0  # an all-zero channel must not divide by zero
    b = torch.randn(out_f, generator=g)
    packed, scale = kernels.pack_gemm_weight_int8(w)
    assert packed.dtype == torch.int8 and scale.shape == (out_f,)
    dequant = kernels.unpack_gemm_weight_int8(packed, scale)
    assert torch.all((dequant - w).abs() <= scale[:, None] / 2 + 1e-7)
    assert torch.equal(dequant[0], w[0])
    x = torch.randn(29, in_f, generator=g)
    full = kernels.gemm_packed_int8(x, packed, scale, b)
    ref = torch.nn.functional.linear(x.double(), dequant.double(), b.double())
    torch.testing.assert_close(full.double(), ref, atol=1e-5, rtol=1e-5)
    for start, rows in [(0, 0), (0, 1), (5, 1), (3, 4), (20, 6), (8, 13)]:
        part = kernels.gemm_packed_int8(x[start:start + rows].contiguous(), packed, scale, b)
        assert torch.equal(part, full[start:start + rows])


def _lm_head_case(seed: int, n: int = 3000, k: int = 96):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[7] = w[1900]  # an exact tie between two columns: the first must win
    w[2500] = w[400]
    w[2500, 5] = torch.nextafter(w[400, 5], torch.tensor(1.0))  # a one-ulp near-tie
    return g, w, kernels.pack_gemm_weight(w), greedy_screen.pack_argmax_screen(w)


@requires_c_kernels
@pytest.mark.parametrize("seed", [0, 1])
def test_lm_head_argmax_is_the_argmax_of_the_fp32_logits(seed):
    """The int8-screened argmax is exactly torch.argmax of gemm_packed's logits: ties go to the first
    column, one-ulp differences are resolved as the fp32 GEMM resolves them, any row count."""
    g, w, packed, screen = _lm_head_case(seed)
    x = torch.randn(40, w.shape[1], generator=g) * torch.rand(40, 1, generator=g) * 4
    x[3] = w[1900] * 50  # aligned with the tied columns: they are the maximum
    x[4] = w[400] * 50
    x[5] = 0.0  # every logit 0: the first column
    for path in int8_paths_to_test():  # the screen's integer sums on each instruction set
        with int8_path(path):
            for rows in (0, 1, 3, 9, 13, 40):
                xr = x[:rows].contiguous()
                expected = kernels.gemm_packed(xr, packed, None, w.shape[0]).argmax(dim=-1)
                assert torch.equal(greedy_screen.lm_head_argmax(xr, packed, *screen), expected), (path, rows)
            assert greedy_screen.lm_head_argmax(x[3:5].contiguous(), packed, *screen).tolist()[0] == 7


@requires_c_kernels
@pytest.mark.parametrize("seed", [0, 1])
def test_lm_head_argmax_under_a_mask_is_the_argmax_of_the_masked_logits(seed):
    """Structured output's masks: the screened argmax over the allowed columns equals torch.argmax of the
    logits with the others at -inf, whatever the mask: dense, sparse, only low logits, one column, the tied
    columns' second, none (the first column, as torch gives for a row of -inf)."""
    g, w, packed, screen = _lm_head_case(seed)
    n = w.shape[0]
    x = torch.randn(12, w.shape[1], generator=g) * torch.rand(12, 1, generator=g) * 4
    x[3] = w[1900] * 50
    logits = kernels.gemm_packed(x, packed, None, n)
    allowed = torch.rand(12, n, generator=g) < torch.tensor([0.5, 0.01, 0.9, 0.3] * 3).unsqueeze(1)
    allowed[4] = logits[4] < logits[4].median()  # only the lower half of the logits
    allowed[5] = False
    allowed[5, 1234] = True  # one column
    allowed[6] = False  # none
    allowed[3] = True
    allowed[3, 7] = False  # the tied maximum's first column (7) refused: its twin (1900) wins
    expected = logits.masked_fill(~allowed, float("-inf")).argmax(dim=-1)
    assert torch.equal(greedy_screen.lm_head_argmax(x, packed, *screen, allowed=allowed), expected)
    assert expected[3] == 1900 and expected[5] == 1234 and expected[6] == 0
    for rows in (1, 5, 12):
        xr, ar = x[:rows].contiguous(), allowed[:rows].contiguous()
        assert torch.equal(greedy_screen.lm_head_argmax(xr, packed, *screen, allowed=ar), expected[:rows])


@requires_c_kernels
@pytest.mark.parametrize("n,k", [(1001, 61), (17, 5), (48, 64)])
def test_lm_head_argmax_on_ragged_shapes_and_outlier_activations(n, k):
    """Vocabulary sizes that do not fill the screen's 16-column blocks and widths that do not fill its
    groups of 4; hidden states with a few dimensions far above the rest (as real ones have: the screen
    writes each row as two int8 terms so that these do not loosen its bound)."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(24, k, generator=g)
    x[:, 0] *= 40.0  # one outlier dimension in every row
    x[5:9, k // 2] = -300.0
    x[10] = 0.0
    packed, screen = kernels.pack_gemm_weight(w), greedy_screen.pack_argmax_screen(w)
    for path in int8_paths_to_test():  # k = 5, 61, 64: the AMX screen's 64-byte chunks whole, partial, absent
        with int8_path(path):
            for rows in (1, 2, 9, 24):
                xr = x[:rows].contiguous()
                expected = kernels.gemm_packed(xr, packed, None, n).argmax(dim=-1)
                assert torch.equal(greedy_screen.lm_head_argmax(xr, packed, *screen), expected), (path, rows)


@requires_c_kernels
def test_lm_head_argmax_settles_near_ties_with_the_gemm_rounding():
    """200 columns whose logits agree to within rounding: which one wins depends on how each sum is
    rounded, so the survivors must be recomputed exactly as the fp32 GEMM computes them."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(3000, 96, generator=g) * 0.02
    base = torch.randn(96, generator=g) * 0.05
    w[1000:1200] = base + torch.randn(200, 96, generator=g) * 1e-8
    packed, screen = kernels.pack_gemm_weight(w), greedy_screen.pack_argmax_screen(w)
    x = (base * 40 + torch.randn(16, 96, generator=g)).contiguous()
    logits = kernels.gemm_packed(x, packed, None, 3000)
    expected = logits.argmax(dim=-1)
    assert ((expected >= 1000) & (expected < 1200)).all()
    assert not torch.equal(expected, (x.double() @ w.double().T).argmax(dim=-1))  # rounding decides
    assert torch.equal(greedy_screen.lm_head_argmax(x, packed, *screen), expected)


@requires_c_kernels
def test_lm_head_argmax_falls_back_to_the_full_row():
    """Non-finite inputs and rows where the screen cannot narrow the field (huge inputs, many nearly
    equal logits) take the full fp32 row, with torch.argmax's answer (the first NaN included)."""
    g, w, packed, screen = _lm_head_case(2)
    flat = torch.ones(3000, 96) * 0.01 + torch.randn(3000, 96, generator=g) * 1e-6  # ~3000 near-ties
    flat_packed, flat_screen = kernels.pack_gemm_weight(flat), greedy_screen.pack_argmax_screen(flat)
    x = torch.randn(4, 96, generator=g)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    x[3] *= 1e30
    for wt, p, sc in ((w, packed, screen), (flat, flat_packed, flat_screen)):
        expected = kernels.gemm_packed(x, p, None, wt.shape[0]).argmax(dim=-1)
        assert torch.equal(greedy_screen.lm_head_argmax(x, p, *sc), expected)


@requires_c_kernels
def test_argmax_matches_torch_on_ties_nans_and_infinities():
    g = torch.Generator().manual_seed(1)
    for rows, cols in [(1, 49152), (6, 49152), (20, 1000), (3, 70), (2, 5)]:
        x = torch.randn(rows, cols, generator=g)
        assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))
    x = torch.randn(7, 200, generator=g)
    x[0, 150] = x[0, 40] = 9.0  # a tie: the first
    x[1, 130] = x[1, 3] = float("nan")  # NaN wins, the first one
    x[2] = 1.0  # all equal
    x[3] = float("-inf")
    x[4, 199] = float("inf")
    x[5, 64] = 50.0  # first element of the second 64-wide stretch
    x[6, 63] = 50.0  # last element of the first
    assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))
    assert kernels.argmax_rows(x.double()).dtype == torch.int64  # other dtypes: torch's
    assert torch.equal(kernels.argmax_rows(x.t().contiguous().t()), x.argmax(dim=-1))  # non-contiguous: torch's


def test_the_build_key_covers_every_source_file():
    """The cached library is keyed by the files listed: a C file or header left out would let a stale
    build survive its edits."""
    csrc = kernels.SOURCES[0].parent
    assert {p.name for p in csrc.iterdir() if p.suffix in (".c", ".h")} == {
        p.name for p in kernels.SOURCES + kernels.HEADERS}
