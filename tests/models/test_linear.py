"""FastLinear must match F.linear for every backend, shape and stride layout."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from specserve.models import linear as L
from specserve.models import openblas
from specserve.models.linear import FastLinear
from specserve.ops import kernels
from tests.kernel_support import requires_c_kernels

# Not kernel_enabled(): under SPECSERVE_KERNELS=c a failed build must fail the "c" cases, not the import.
C_AVAILABLE = kernels.kernels_backend() != "torch" and kernels.load_kernel() is not None
C_BACKEND = pytest.param("c", marks=requires_c_kernels)
EXACT_BACKENDS = ["auto", "torch", "numpy"] + (["onednn"] if L.ONEDNN_AVAILABLE else []) + [C_BACKEND]
AUTO_PATH = "c" if C_AVAILABLE else "onednn" if L.ONEDNN_AVAILABLE else None
ROWS = [1, 2, 3, 8, 33]


def _weights(out_f=160, in_f=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) / in_f**0.5
    b = torch.randn(out_f, generator=g)
    return w, b


def _check(y, ref, atol=1e-4, rtol=1e-5, msg=""):
    assert y.shape == ref.shape, msg
    assert y.dtype == torch.float32, msg
    torch.testing.assert_close(y, ref, atol=atol, rtol=rtol, msg=lambda m: f"{msg}: {m}")


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(L.ENV_VAR, raising=False)


@pytest.mark.parametrize("backend", EXACT_BACKENDS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear_rows(backend, with_bias):
    w, b = _weights()
    b = b if with_bias else None
    lin = FastLinear(w, b, backend=backend)
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, w.shape[1], generator=g)
            _check(lin(x), F.linear(x, w, b), msg=f"{backend} rows={rows}")


@pytest.mark.parametrize("backend", EXACT_BACKENDS)
def test_shapes_and_strides(backend):
    w, b = _weights()
    lin = FastLinear(w, b, backend=backend)
    in_f = w.shape[1]
    g = torch.Generator().manual_seed(2)
    inputs = {
        "1d": torch.randn(in_f, generator=g),
        "3d": torch.randn(2, 5, in_f, generator=g),
        "3d_one_row": torch.randn(1, 1, in_f, generator=g),
        "transposed": torch.randn(in_f, 6, generator=g).t(),
        "strided_last_dim": torch.randn(4, 2 * in_f, generator=g)[:, ::2],
        "strided_one_row": torch.randn(1, 2 * in_f, generator=g)[:, 1::2],
        "3d_permuted": torch.randn(5, 2, in_f, generator=g).transpose(0, 1),
        "row_slice": torch.randn(9, in_f, generator=g)[::3],
    }
    with torch.inference_mode():
        for name, x in inputs.items():
            _check(lin(x), F.linear(x, w, b), msg=f"{backend} {name}")
    # also works outside inference_mode when nothing requires grad
    x = torch.randn(3, in_f)
    _check(lin(x), F.linear(x, w, b))


@pytest.mark.parametrize("backend", EXACT_BACKENDS)
def test_zero_rows(backend):
    w, b = _weights()
    lin = FastLinear(w, b, backend=backend)
    with torch.inference_mode():
        y = lin(torch.randn(0, w.shape[1]))
    assert y.shape == (0, w.shape[0])


def test_model_shapes_exact():
    # SmolLM2 shapes (smaller lm_head), both sides of the numpy/oneDNN switch
    g = torch.Generator().manual_seed(3)
    for out_f, in_f in [(960, 576), (576, 1536), (3072, 576), (4096, 576)]:
        w = torch.randn(out_f, in_f, generator=g) / in_f**0.5
        lin = FastLinear(w)
        with torch.inference_mode():
            for rows in (1, 2, 16):
                x = torch.randn(rows, in_f, generator=g)
                ref = F.linear(x.double(), w.double()).float()
                y = lin(x)
                assert float((y - ref).abs().max() / ref.abs().max()) < 1e-5


def test_auto_policy_paths():
    w, _ = _weights()
    lin = FastLinear(w)
    assert lin.backend == "auto"
    assert lin.path_for_rows(1) == (AUTO_PATH or "numpy")
    assert lin.path_for_rows(2) == (AUTO_PATH or "torch")
    assert lin.path_for_rows(512) == lin.path_for_rows(2)


@pytest.mark.parametrize("name", ["torch", "numpy", "onednn", C_BACKEND, "auto"])
def test_env_override(monkeypatch, name):
    if name == "onednn" and not L.ONEDNN_AVAILABLE:
        pytest.skip("no oneDNN in this PyTorch build")
    monkeypatch.setenv(L.ENV_VAR, name.upper() if name == "numpy" else name)
    assert L.select_backend() == name
    w, b = _weights()
    lin = FastLinear(w, b)
    assert lin.backend == name
    expected = {"torch": "torch", "numpy": "numpy", "onednn": "onednn", "c": "c", "auto": AUTO_PATH or "torch"}
    assert lin.path_for_rows(8) == expected[name]
    with torch.inference_mode():
        x = torch.randn(8, w.shape[1])
        _check(lin(x), F.linear(x, w, b))
    # explicit argument beats the env var
    assert FastLinear(w, backend="torch").backend == "torch"


def test_env_override_invalid(monkeypatch):
    monkeypatch.setenv(L.ENV_VAR, "cuda")
    with pytest.raises(ValueError):
        FastLinear(torch.randn(4, 4))
    with pytest.raises(ValueError):
        FastLinear(torch.randn(4, 4), backend="mkl")


def test_rejects_bad_inputs():
    w, _ = _weights()
    lin = FastLinear(w)
    with pytest.raises(TypeError):
        lin(torch.randn(2, w.shape[1], dtype=torch.float64))
    with pytest.raises(ValueError):
        lin(torch.randn(2, w.shape[1] + 1))
    with pytest.raises(RuntimeError):
        lin(torch.randn(2, w.shape[1], requires_grad=True))
    with pytest.raises(ValueError):
        FastLinear(torch.randn(3, 4, 5))


def test_no_autograd_state():
    w, b = _weights()
    lin = FastLinear(torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone()))
    assert list(lin.parameters()) == []
    with torch.inference_mode():
        y = lin(torch.randn(3, w.shape[1]))
    assert not y.requires_grad


@pytest.mark.parametrize("backend", EXACT_BACKENDS)
def test_dense_weight_roundtrip(backend):
    w, b = _weights()
    lin = FastLinear(w, b, backend=backend)
    torch.testing.assert_close(lin.dense_weight(), w, atol=0, rtol=0)


@pytest.mark.parametrize("kwargs", [dict(), dict(backend="numpy"), dict(backend="torch"), dict(weight_dtype="int8")])
def test_deepcopy_and_pickle(kwargs):
    import copy
    import pickle

    w, b = _weights()
    lin = FastLinear(w, b, **kwargs)
    x = torch.randn(3, w.shape[1])
    with torch.inference_mode():
        ref = lin(x)
        for other in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
            assert other.backend == lin.backend
            torch.testing.assert_close(other(x), ref, atol=1e-5, rtol=1e-5)


def test_from_linear():
    ref = torch.nn.Linear(96, 40)
    lin = FastLinear.from_linear(ref)
    x = torch.randn(5, 96)
    with torch.inference_mode():
        _check(lin(x), ref(x))


def test_numpy_path_limits_openblas_threads(monkeypatch):
    if openblas.openblas_num_threads() is None:
        pytest.skip("OpenBLAS thread control unavailable")
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    old = openblas.openblas_num_threads()
    try:
        openblas.limit_openblas_threads(2, force=True)
        monkeypatch.setattr(openblas, "_checked", False)
        lin = FastLinear(torch.randn(8, 8), backend="numpy")
        with torch.inference_mode():
            lin(torch.randn(1, 8))
        assert openblas.openblas_num_threads() == 1
    finally:
        openblas.limit_openblas_threads(old, force=True)


def test_thread_safety():
    w, b = _weights(out_f=256, in_f=128)
    lin = FastLinear(w, b)
    errors = []

    def work(seed):
        g = torch.Generator().manual_seed(seed)
        try:
            with torch.inference_mode():
                for i in range(40):
                    x = torch.randn(1 + (i + seed) % 4, 128, generator=g)
                    torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# ---- approximate, opt-in weight dtypes


def test_bf16_opt_in_is_close():
    """oneDNN's bf16 linear where the CPU has bf16 instructions, torch's bf16 matmul elsewhere."""
    w, b = _weights(out_f=256, in_f=192)
    lin = FastLinear(w, b, weight_dtype=torch.bfloat16)
    assert lin.backend == ("onednn_bf16" if L.ONEDNN_BF16_AVAILABLE else "torch_bf16")
    with torch.inference_mode():
        for x in (torch.randn(192), torch.randn(1, 192), torch.randn(7, 192), torch.randn(2, 3, 192)):
            ref = F.linear(x, w, b)
            y = lin(x)
            assert y.shape == ref.shape and y.dtype == torch.float32
            assert float((y - ref).abs().max() / ref.abs().max()) < 2e-2


@pytest.mark.parametrize("kernels_env", ["auto", "torch"])
def test_int8_opt_in_is_close(monkeypatch, kernels_env):
    """int8 weights: the C GEMM (weight-only, fp32 activations) when the kernels build, else int8 activations
    quantized per row; both within a few percent of the fp32 layer, the C path much closer."""
    monkeypatch.setenv("SPECSERVE_KERNELS", kernels_env)
    c_path = kernels.kernel_enabled()
    w, b = _weights(out_f=256, in_f=192)
    lin = FastLinear(w, b, weight_dtype="int8")
    assert lin.backend == ("c_int8" if c_path else "int8_dynamic")
    tolerance = 1e-2 if c_path else 5e-2
    with torch.inference_mode():
        for x in (torch.randn(192), torch.randn(1, 192), torch.randn(7, 192), torch.randn(192, 2).t()):
            ref = F.linear(x, w, b)
            y = lin(x)
            assert y.shape == ref.shape and y.dtype == torch.float32
            assert float((y - ref).abs().max() / ref.abs().max()) < tolerance
    assert float((lin.dense_weight() - w).abs().max() / w.abs().max()) < 1e-2


def test_exact_argmax_only_on_the_fp32_c_path(monkeypatch):
    w, b = _weights(out_f=300, in_f=64)
    with torch.inference_mode():
        x = torch.randn(5, 64)
        for lin, enabled in ((FastLinear(w), kernels.kernel_enabled()), (FastLinear(w, b), False),
                             (FastLinear(w, weight_dtype="int8"), False), (FastLinear(w, backend="torch"), False)):
            assert lin.enable_exact_argmax() == enabled
            assert torch.equal(lin.argmax(x), lin(x).argmax(dim=-1))  # screened or not, the same answer
            assert (lin._screen is not None) == enabled


def test_default_is_exact_fp32():
    # no silent low precision: default construction never uses bf16/int8
    w, b = _weights()
    lin = FastLinear(w, b)
    assert lin.weight_dtype is None
    assert lin.backend in ("auto", "c", "torch", "numpy", "onednn")
    with pytest.raises(ValueError):
        FastLinear(w, weight_dtype=torch.float16)


def test_without_c_kernels_auto_uses_onednn_and_c_is_refused(monkeypatch):
    monkeypatch.setenv("SPECSERVE_KERNELS", "torch")
    w, b = _weights()
    lin = FastLinear(w, b)
    assert lin.path_for_rows(4) == ("onednn" if L.ONEDNN_AVAILABLE else "torch")
    with torch.inference_mode():
        x = torch.randn(4, w.shape[1])
        _check(lin(x), F.linear(x, w, b))
    with pytest.raises(RuntimeError, match="C GEMM is not available"):
        FastLinear(w, backend="c")


@pytest.mark.parametrize("weight_dtype", [None, "int8", torch.bfloat16], ids=["fp32", "int8", "bf16"])
@pytest.mark.parametrize("kernels_env", ["auto", "torch"])
def test_a_rows_result_does_not_depend_on_the_other_rows(monkeypatch, kernels_env, weight_dtype):
    """What lets a verification step stand for plain decoding: each row of a 1..64-row call is bitwise the
    row computed alone, on every path (the C kernels and the PyTorch fallback, fp32, int8 and bf16 weights)."""
    monkeypatch.setenv("SPECSERVE_KERNELS", kernels_env)
    w, b = _weights(out_f=320, in_f=192)
    lin = FastLinear(w, b, weight_dtype=weight_dtype)
    x = torch.randn(64, 192, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.1, 10, 64)[:, None]
    with torch.inference_mode():
        alone = torch.cat([lin(x[i:i + 1]) for i in range(64)])
        for rows in (2, 5, 9, 17, 64):
            assert torch.equal(lin(x[:rows]), alone[:rows]), (lin.path_for_rows(rows), rows)
