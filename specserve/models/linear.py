"""Fast inference-only linear layers for CPU.

``FastLinear(weight[out, in], bias=None)`` computes ``x @ weight.T + bias`` like
``torch.nn.functional.linear``, with the weight prepared once for the kernel it will use:

* ``c`` (what ``auto`` picks when specserve's C kernels build): our own fp32 GEMM
  (``specserve/ops/csrc/gemm.c``) on a weight packed into 32-column blocks. Up to 12 rows share
  every weight load, so a verification step over 2-8 tokens streams the weights once, like a
  one-token decode step; each output is one summation in a fixed order, so a row's result does not
  depend on how many rows are computed with it (batch invariance: a verified token sees exactly the
  numbers plain decoding would have).
* oneDNN inner product with a weight pre-packed once at construction
  (``torch.ops.mkldnn._reorder_linear_weight`` + ``torch.ops.mkldnn._linear_pointwise``) when the
  C kernels are unavailable;
* numpy ``matmul`` (OpenBLAS sgemv at one row, single thread) for one row when this torch build
  has no oneDNN either, and torch's ``F.linear`` above.

Why ``c`` (2026-12-02, ``benchmarks/matmul_backends.py``-style whole-model streaming: SmolLM2's 120
layer weights + lm_head, distinct weights per call, 2 threads, medians of 7 interleaved rounds):

    rows         1      2      4      6      8     16     32     64    128    512
    c (ms)     13.6   12.9   13.9   14.4   14.8   18.2   28.0   45.8   84.3  339
    oneDNN     15.4   16.2   17.0   15.7   17.9   20.9   30.9   50.8   87.0  342

(1 thread: 15.5 vs 19.0 at one row, 22.3 vs 26.5 at eight.)

Until 2026-12-02 ``auto`` was oneDNN at every row count; before that it sent one-row calls to numpy,
which wins cache-hot per-call timings (table below) but loses streaming a whole model:
SmolLM2's 121 linears at one row, medians of 15 interleaved rounds, took 19.6 ms with numpy
(1 or 2 threads alike), 17.1 ms with oneDNN on 1 thread and 14.7 ms on 2 threads.

Both are exact fp32 (same products, different summation order: max relative error vs.
``F.linear`` ~1e-6). The plain ``torch`` path (``F.linear`` -> MKL sgemm) ties at one row
for small layers but is 3x slower for lm_head and 2-4x slower from 2 rows up, so it is
never picked automatically.

Memory: ``auto`` and ``onednn`` keep only the oneDNN-packed copy (the fp32 weight bytes once);
``dense_weight()`` unpacks it on demand.

Why: ``.venv/bin/python benchmarks/matmul_backends.py`` (results in
bench_results/matmul_backends.json). AMD EPYC Zen 5 (avx512, avx512_bf16, avx512_vnni, no
AMX), 2 shared vCPUs, torch 2.13 CPU (MKL 2024.2, oneDNN 3.12), numpy 2.4 with
scipy-openblas 0.3.31 (runs its "Haswell" AVX2 kernels on this CPU). Medians of interleaved
rounds, ms per call, torch 1 thread, OpenBLAS 1 thread, weights cache-hot::

    shape            rows   F.linear(MKL)   numpy(OpenBLAS)   oneDNN packed
    o 576x576          1       0.020           0.017            0.042
    kv 192x576         1       0.0068          0.0065           0.018
    qkv 960x576        1       0.032           0.029            0.046
    gate_up 3072x576   1       0.137           0.092            0.132
    down 576x1536      1       0.049           0.044            0.069
    lm_head 49152x576  1      11.4             3.9              6.3
    qkv                2       0.063           0.117            0.047
    qkv                8       0.138           0.130            0.068
    gate_up            8       0.535           0.477            0.214
    down               8       0.444           0.415            0.099
    lm_head            8      15.3            11.4              5.3
    lm_head           64      50.5            36.7             21.5
    lm_head          512     376             294              171

With 2 torch threads (quiet machine) oneDNN gains 1.3-1.7x from 2 rows up (gate_up x8:
0.114 vs 0.190 ms, lm_head x8: 4.3 vs 6.0 ms) and nothing at 1 row (bandwidth bound). The
``to_mkldnn()`` input route (``torch._C._nn.mkldnn_linear``) costs 20-100% more than the
prepacked ``_linear_pointwise`` call on a plain tensor; the packing batch-size hint does not
matter except ``1`` (plain layout, slower from 2 rows), so weights are packed with ``None``.

Whole-model linears (30 layers of distinct weights + lm_head = 538 MB fp32 streamed from
DRAM per step, with rmsnorm/silu/residual torch ops in between; torch 1 thread): 1 row
19-22 ms for auto/oneDNN (~28 GB/s, memory bound; numpy alone 21-25, F.linear 38), 8 rows
27-39 ms (oneDNN; numpy 75, F.linear 96). bf16: 13-16 ms / 18-32 ms; int8: 8-9 ms / 11-20 ms.

Threading: numpy's OpenBLAS runs its own pthread pool next to torch's OpenMP pool.
With both at 2 threads on 2 cores, alternating calls make the two pools' spinning
workers fight over the cores (whole-model step 0.9-1.4 s instead of ~22 ms). The numpy
path therefore limits OpenBLAS to 1 thread the first time it is used, unless the user
set ``OPENBLAS_NUM_THREADS`` explicitly (see ``specserve.models.openblas``). The 1-row
numpy path also keeps decode steps out of OpenMP entirely, which matters on a shared
machine: with torch at 2 threads and the default OpenMP spin-wait, every parallel
region can stall for a scheduler tick when the other vCPU is busy (measured ~1 s per
8-row step vs 39 ms with 1 thread). Thread counts are the caller's business; see the
benchmark's ``passive`` config (OMP_WAIT_POLICY=passive) and torch.set_num_threads(1).

Backend override: ``SPECSERVE_LINEAR_BACKEND`` in {auto, c, torch, numpy, onednn}
(read when a FastLinear is constructed; ``auto`` is the default above), or the
``backend=`` constructor argument.

Approximate (opt-in only, ``weight_dtype=``), both measured faster than any fp32 path:

* ``torch.bfloat16``: oneDNN bf16 (avx512_bf16 brgemm), activations rounded to bf16,
  fp32 output. lm_head 2.2 ms at 1 row / 3.0 ms at 8 (vs 3.9 / 5.3 fp32); whole model
  ~1.4x faster. Max relative error ~3e-3 per layer.
* ``"int8"`` / ``torch.qint8``: per-output-channel symmetric int8 weights. With the C kernels
  (``c_int8``): weight-only quantization, fp32 activations, the fp32 GEMM's block layout with
  each k step's 32 weights widened to fp32 once for every row (csrc/gemm.c). A decode step
  streams a quarter of the bytes: lm_head 0.46 ms vs 2.1 ms fp32 at 1 row, SmolLM2's linears
  3.6 vs 11.9 ms per step (2 threads). Error: the weights' rounding only (max relative
  error ~4e-3 per weight). Without the C kernels: fbgemm dynamic quantization, activations
  quantized per call too (per-tensor uint8; full range because this CPU has VNNI): lm_head
  1.2 / 1.7 ms, whole model 2-2.5x faster than fp32, max relative error ~1e-2 per layer.
  Either will change greedy tokens; evaluate before use (the draft model uses it: drafts
  need only agree with the target most of the time).
  (``torch._weight_int8pack_mm`` was 100x slower with fp32 activations; oneDNN fp16
  ``linear_dynamic_fp16`` 400-500 ms for lm_head without avx512_fp16.)

Inference only: weights are plain tensors (not Parameters), nothing builds an autograd
graph, and inputs that require grad are rejected. No scratch buffers are shared
between calls, so a FastLinear may be called from several threads at once.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Optional, Union

import numpy as np
import torch
import torch.nn.functional as F

from specserve.models import openblas
from specserve.ops import kernels

logger = logging.getLogger(__name__)

ENV_VAR = "SPECSERVE_LINEAR_BACKEND"
BACKENDS = ("auto", "c", "torch", "numpy", "onednn")

# auto without oneDNN: numpy for rows <= NUMPY_MAX_ROWS, torch above.
NUMPY_MAX_ROWS = 1


# --------------------------------------------------------------------------------------
# Capability probes


def _probe_onednn() -> bool:
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(3, 2), None)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 2), w, None, "none", [], "")
        return bool(torch.allclose(y, torch.full((2, 3), 2.0)))
    except Exception:  # pragma: no cover - depends on the torch build
        return False


def _probe_onednn_bf16() -> bool:
    if not ONEDNN_AVAILABLE:
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(3, 2, dtype=torch.bfloat16), None)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 2, dtype=torch.bfloat16), w, None, "none", [], "")
        return y.dtype == torch.bfloat16 and bool((y.float() == 2.0).all())
    except Exception:  # pragma: no cover
        return False


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:  # pragma: no cover
        pass
    return set()


ONEDNN_AVAILABLE = _probe_onednn()
ONEDNN_BF16_AVAILABLE = _probe_onednn_bf16()
FBGEMM_AVAILABLE = "fbgemm" in torch.backends.quantized.supported_engines
_CPU_FLAGS = _cpu_flags()
# With VNNI, fbgemm's u8*s8 dot products do not saturate, so the full activation range
# can be used (reduce_range=False halves the int8 error: measured 1.1e-2 vs 1.9e-2).
_INT8_REDUCE_RANGE = not ({"avx512_vnni", "avx_vnni", "amx_int8"} & _CPU_FLAGS)


def select_backend(backend: Optional[str] = None) -> str:
    """Resolve the backend name: explicit argument > $SPECSERVE_LINEAR_BACKEND > "auto".

    "auto" means the C GEMM when specserve's C kernels build, else oneDNN at every row count; if oneDNN
    is not usable in this torch build either, numpy for rows <= NUMPY_MAX_ROWS and torch above.
    """
    name = backend if backend is not None else os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"{ENV_VAR}/backend must be one of {BACKENDS}, got {name!r}")
    if name == "onednn" and not ONEDNN_AVAILABLE:
        raise RuntimeError("oneDNN (mkldnn) linear ops are not available in this torch build")
    if name == "c" and not kernels.kernel_enabled():
        raise RuntimeError("the C GEMM is not available (specserve's C kernels did not build or SPECSERVE_KERNELS=torch)")
    return name


# Backend picked for this process at import time (FastLinear re-reads the env var on
# construction, so tests and tools can change it later; an invalid value raises there).
try:
    SELECTED_BACKEND = select_backend()
except (ValueError, RuntimeError) as _e:  # do not break `import specserve.models`
    logger.warning("ignoring %s: %s", ENV_VAR, _e)
    SELECTED_BACKEND = "auto"


# --------------------------------------------------------------------------------------


def _normalize_weight_dtype(weight_dtype) -> Optional[str]:
    if weight_dtype is None or weight_dtype in (torch.float32, "float32", "fp32"):
        return None
    if weight_dtype in (torch.bfloat16, "bfloat16", "bf16"):
        return "bf16"
    if weight_dtype in (torch.qint8, torch.int8, "int8", "qint8"):
        return "int8"
    raise ValueError(f"unsupported weight_dtype {weight_dtype!r} (use None, torch.bfloat16 or 'int8')")


class FastLinear(torch.nn.Module):
    """Inference-only ``y = x @ weight.T + bias`` with per-call backend choice by row count.

    Args:
        weight: ``[out_features, in_features]`` float tensor (copied/packed; the module keeps
            a reference to it only where a backend reads it directly, e.g. the numpy path
            uses the contiguous fp32 weight without copying).
        bias: optional ``[out_features]``.
        backend: "auto" | "c" | "torch" | "numpy" | "onednn"; default from $SPECSERVE_LINEAR_BACKEND.
        weight_dtype: None (exact fp32, default) or an *approximate* opt-in:
            ``torch.bfloat16`` (oneDNN bf16) or ``"int8"`` (int8 weights: the C GEMM with fp32
            activations when the C kernels build, else fbgemm dynamic quantization).
            With a weight_dtype the backend argument is ignored.

    ``forward(x[..., in]) -> [..., out]`` for float32 ``x`` of any shape/strides.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        *,
        backend: Optional[str] = None,
        weight_dtype: Union[None, str, torch.dtype] = None,
    ) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"weight must be [out, in], got shape {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.weight_dtype = _normalize_weight_dtype(weight_dtype)
        self._requested_backend = backend
        self.backend = select_backend(backend)
        with torch.no_grad():
            w = weight.detach().to(device="cpu", dtype=torch.float32).contiguous()
            b = None if bias is None else bias.detach().to(device="cpu", dtype=torch.float32).contiguous()
        if b is not None and b.shape != (self.out_features,):
            raise ValueError(f"bias must be [{self.out_features}], got {tuple(b.shape)}")
        self.bias = b
        # Representations, filled as needed (None when unused):
        self._w = None  # dense fp32 [out, in] (torch path; numpy 1-row path without oneDNN)
        self._w_np = None  # numpy view of _w
        self._wt_np = None  # numpy [in, out] contiguous (forced numpy backend, all rows)
        self._w_blocks = None  # fp32 weight packed for the C GEMM: [ceil(out / 32), in, 32]
        self._w_packed = None  # oneDNN-packed fp32 weight (opaque mkldnn tensor)
        self._w_packed_bf16 = None  # oneDNN-packed bf16 weight
        self._w_int8 = None  # fbgemm packed params
        self._w_blocks_int8 = None  # (int8 blocks [ceil(out / 32), in, 32], fp32 scales [out]) for the C GEMM
        self._screen = None  # int8 copy of the fp32 C-GEMM weight for an exact argmax (enable_exact_argmax)
        self._numpy_max_rows = 0  # rows <= this go to numpy
        self._slow = "torch"  # path for rows above _numpy_max_rows

        if self.weight_dtype == "bf16":
            if not ONEDNN_BF16_AVAILABLE:
                raise RuntimeError("weight_dtype=bfloat16 needs oneDNN bf16 support")
            self._w_packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), None)
            self.backend, self._slow = "onednn_bf16", "bf16"
        elif self.weight_dtype == "int8" and kernels.kernel_enabled():
            self._w_blocks_int8 = kernels.pack_gemm_weight_int8(w)
            self.backend, self._slow = "c_int8", "c_int8"
        elif self.weight_dtype == "int8":
            if not FBGEMM_AVAILABLE:
                raise RuntimeError("weight_dtype=int8 needs the fbgemm quantized engine")
            self._w_int8 = _pack_int8(w, b)
            self.backend, self._slow = "int8_dynamic", "int8"
        elif self.backend == "torch":
            self._w = w
        elif self.backend == "numpy":
            self._wt_np = w.t().contiguous().numpy()
            self._numpy_max_rows = 1 << 62
            self._slow = "numpy"
        elif self.backend == "c" or (self.backend == "auto" and kernels.kernel_enabled()):
            self._w_blocks = kernels.pack_gemm_weight(w)
            self._slow = "c"
        elif self.backend == "onednn":
            self._w_packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            self._slow = "onednn"
        elif ONEDNN_AVAILABLE:  # auto
            self._w_packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            self._slow = "onednn"
        else:  # pragma: no cover - auto on a torch without mkldnn
            self._w = w
            self._w_np = w.numpy()
            self._numpy_max_rows = NUMPY_MAX_ROWS
            self._slow = "torch"

    # ------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, **kwargs) -> "FastLinear":
        return cls(linear.weight, linear.bias, **kwargs)

    def __getstate__(self):
        # The packed oneDNN/fbgemm weights cannot be pickled or deep-copied; rebuild from dense.
        return {"weight": self.dense_weight().clone(), "bias": self.bias,
                "backend": self._requested_backend, "weight_dtype": self.weight_dtype}

    def __setstate__(self, state):
        FastLinear.__init__(self, state["weight"], state["bias"], backend=state["backend"],
                            weight_dtype=state["weight_dtype"])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, backend={self.backend}")

    def dense_weight(self) -> torch.Tensor:
        """The fp32 weight [out, in] (reconstructed for packed/quantized backends)."""
        if self._w is not None:
            return self._w
        if self._wt_np is not None:
            return torch.from_numpy(self._wt_np).t()
        if self._w_blocks is not None:
            return kernels.unpack_gemm_weight(self._w_blocks, self.out_features)
        if self._w_packed is not None:
            return self._w_packed.to_dense()
        if self._w_packed_bf16 is not None:
            return self._w_packed_bf16.to_dense().float()
        if self._w_blocks_int8 is not None:
            return kernels.unpack_gemm_weight_int8(*self._w_blocks_int8)
        w, _ = torch.ops.quantized.linear_unpack(self._w_int8)
        return w.dequantize()

    def enable_exact_argmax(self) -> bool:
        """Keep an int8 copy of an fp32 C-GEMM weight without bias so that `argmax` can screen with it;
        False (and nothing kept) on any other path."""
        if self._slow != "c" or self._numpy_max_rows or self.bias is not None:
            return False
        if self._screen is None:
            self._screen = kernels.pack_argmax_screen(self.dense_weight())
        return True

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] -> [M] int64, exactly ``self(x).argmax(-1)`` (see kernels.lm_head_argmax); after
        ``enable_exact_argmax``, a quarter of the weight bytes for a greedy step's LM head."""
        x = x.reshape(-1, self.in_features).contiguous()
        if self._screen is None:
            return kernels.argmax_rows(self(x))
        return kernels.lm_head_argmax(x, self._w_blocks, *self._screen)

    def c_operands(self) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]] | None:
        """(packed weight, int8 scales or None, bias or None) when every call takes a C GEMM, else None:
        what a fused C caller (kernels.decoder_forward) passes for this layer."""
        if self._numpy_max_rows:
            return None
        if self._slow == "c":
            return self._w_blocks, None, self.bias
        if self._slow == "c_int8":
            return self._w_blocks_int8[0], self._w_blocks_int8[1], self.bias
        return None

    def path_for_rows(self, rows: int) -> str:
        """Which kernel a call with ``rows`` rows uses ("c", "numpy", "onednn", "torch", "bf16", "c_int8",
        "int8")."""
        return "numpy" if rows <= self._numpy_max_rows else self._slow

    # ------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"FastLinear expects float32 input, got {x.dtype}")
        if x.requires_grad:
            raise RuntimeError("FastLinear is inference-only; call it under torch.inference_mode()")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected last dim {self.in_features}, got {tuple(x.shape)}")
        lead = x.shape[:-1]
        rows = x.numel() // self.in_features if self.in_features else 0
        if rows <= self._numpy_max_rows:
            return self._forward_numpy(x, lead, rows)
        path = self._slow
        if path == "c":
            y = kernels.gemm_packed(x.reshape(rows, self.in_features).contiguous(), self._w_blocks, self.bias, self.out_features)
            return y.view(*lead, self.out_features)
        if path == "c_int8":
            y = kernels.gemm_packed_int8(x.reshape(rows, self.in_features).contiguous(), *self._w_blocks_int8, self.bias)
            return y.view(*lead, self.out_features)
        if path == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self._w_packed, self.bias, "none", [], "")
        if path == "torch":
            return F.linear(x, self._w, self.bias)
        x2 = x.reshape(-1, self.in_features)
        if path == "bf16":
            y = torch.ops.mkldnn._linear_pointwise(x2.to(torch.bfloat16), self._w_packed_bf16, None, "none", [], "")
            y = y.float()
            if self.bias is not None:
                y.add_(self.bias)
        else:  # int8 (bias is inside the packed params)
            y = torch.ops.quantized.linear_dynamic(x2.contiguous(), self._w_int8, _INT8_REDUCE_RANGE)
        return y.view(*lead, self.out_features)

    def _forward_numpy(self, x: torch.Tensor, lead: torch.Size, rows: int) -> torch.Tensor:
        openblas.ensure_single_thread()
        y = torch.empty(*lead, self.out_features, dtype=torch.float32)
        if rows == 0:
            return y
        y_np = y.numpy().reshape(rows, self.out_features)  # view: y is fresh and contiguous
        x_np = x.reshape(rows, self.in_features).numpy()
        if rows == 1 and self._w_np is not None:
            # sgemv on the row-major [out, in] weight: y = W @ x
            np.matmul(self._w_np, x_np[0], out=y_np[0])
        elif self._wt_np is not None:
            np.matmul(x_np, self._wt_np, out=y_np)
        else:
            np.matmul(x_np, self._w_np.T, out=y_np)
        if self.bias is not None:
            y_np += self.bias.numpy()
        return y


def _pack_int8(w: torch.Tensor, b: Optional[torch.Tensor]):
    """Per-output-channel symmetric int8 weights packed for fbgemm dynamic linear."""
    prev_engine = torch.backends.quantized.engine
    try:
        torch.backends.quantized.engine = "fbgemm"
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zero_points = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensor creation is deprecated in 2.13 but works
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)
            return torch.ops.quantized.linear_prepack(qw, b)
    finally:
        torch.backends.quantized.engine = prev_engine
