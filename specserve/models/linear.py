"""Fast inference-only linear layers for CPU.

``FastLinear(weight[out, in], bias=None)`` computes ``x @ weight.T + bias`` like
``torch.nn.functional.linear``, with the weight prepared once for the kernel it will use:

* ``c`` (what ``auto`` picks when specserve's C kernels build): our own fp32 GEMM
  (``specserve/ops/csrc/gemm.c``) on a weight packed into 32-column blocks. Up to 12 rows share
  every weight load, so a verification step over 2-8 tokens streams the weights once, like a
  one-token decode step; each output is one summation in a fixed order, so a row's result does not
  depend on how many rows are computed with it (batch invariance: a verified token sees exactly the
  numbers plain decoding would have).
* oneDNN inner product with a weight pre-packed once at construction when the C kernels are
  unavailable;
* numpy ``matmul`` (OpenBLAS sgemv, single thread) for one row when this torch build has no oneDNN
  either, and torch's ``F.linear`` above. PyTorch's MKL path is 2-4x slower than these from 2 rows up, so it
  is never picked automatically. The measurements behind these choices are in docs/performance.md.

All are exact fp32 (same products, different summation order: max relative error vs ``F.linear``
~1e-6). numpy's OpenBLAS pool is limited to one thread on first use (unless ``OPENBLAS_NUM_THREADS`` is
set), so it does not fight torch's OpenMP pool for the cores (see ``specserve.models.openblas``).

Backend override: ``SPECSERVE_LINEAR_BACKEND`` in {auto, c, torch, numpy, onednn} (read when a
FastLinear is constructed), or the ``backend=`` constructor argument.

GGUF weights kept quantized (``FastLinear(QuantizedWeight)``, see ``specserve.models.gguf_quant``): the C
GEMM reads the file's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16) and dequantizes them in
registers to exactly the fp32 values the load-time dequantizer produces, with the fp32 GEMM's summation order:
outputs bitwise equal to the fp32 path at a fifth to a third of the bytes; in the int8-activation formats
(``for_int8_activations``) it takes integer dot products on int8-quantized activations instead. Without the
C kernels the weight is dequantized once.

Approximate (opt-in only, ``weight_dtype=``):

* ``torch.bfloat16``: oneDNN bf16 (torch's bf16 matmul on CPUs without bf16 instructions), activations
  rounded to bf16, fp32 output (~3e-3 relative error per layer).
* ``"int8"`` / ``torch.qint8``: per-output-channel symmetric int8 weights. With the C kernels
  (``c_int8``): weight-only quantization with fp32 activations, a quarter of the bytes per decode step
  (~4e-3 relative error per weight). Without them: int8 activations too, quantized per row (each row its
  own scale, so a row's result never depends on the other rows of the call) and multiplied exactly in int32
  (``torch._int_mm``), ~1e-2 per layer.
  Either can change greedy tokens; the draft model uses it, as drafts need only agree with the target
  most of the time.

Inference only: weights are plain tensors (not Parameters), nothing builds an autograd graph, and inputs
that require grad are rejected. No scratch buffers are shared between calls, so a FastLinear may be
called from several threads at once.
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Union

import numpy as np
import torch
import torch.nn.functional as F

from specserve.models import openblas
from specserve.models.gguf_quant import INT8_ACTIVATION_FORMATS, Q4_I8, Q4_Q8, Q8_I8, Q8_Q8, QuantizedWeight
from specserve.ops import greedy_screen, kernels
from specserve.ops.int8_routes import Int8Call

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
_CPU_FLAGS = _cpu_flags()


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
        self._wq = None  # a QuantizedWeight read by the C GEMM
        if isinstance(weight, QuantizedWeight):
            if weight_dtype is None and backend in (None, "auto", "c") and kernels.kernel_enabled():
                self._init_quantized(weight, bias)
                return
            weight = weight.dequantize()
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
        self._w_int8 = None  # (int8 weight [out, in], fp32 per-output-channel scales [out]) for torch._int_mm
        self._w_blocks_int8 = None  # (int8 blocks [ceil(out / 32), in, 32], fp32 scales [out]) for the C GEMM
        self._screen = None  # int8 copy of the fp32 C-GEMM weight for an exact argmax (enable_exact_argmax)
        self._numpy_max_rows = 0  # rows <= this go to numpy
        self._slow = "torch"  # path for rows above _numpy_max_rows
        self._pack(w)

    def _pack(self, w: torch.Tensor) -> None:
        """The representation of the fp32 weight w [out, in] that weight_dtype and the backend ask for."""
        if self.weight_dtype == "bf16":
            if ONEDNN_BF16_AVAILABLE:
                self._w_packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), None)
                self.backend = "onednn_bf16"
            else:  # a CPU without bf16 instructions: torch's own bf16 matmul, the same roundings, slower
                self._w_packed_bf16 = w.to(torch.bfloat16).contiguous()
                self.backend = "torch_bf16"
            self._slow = "bf16"
        elif self.weight_dtype == "int8" and kernels.kernel_enabled():
            self._w_blocks_int8 = kernels.pack_gemm_weight_int8(w)
            self.backend, self._slow = "c_int8", "c_int8"
        elif self.weight_dtype == "int8":
            self._w_int8 = _quantize_per_channel(w)
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

    def _init_quantized(self, weight: QuantizedWeight, bias: Optional[torch.Tensor]) -> None:
        self.out_features, self.in_features = weight.shape
        self.weight_dtype = None
        self._requested_backend = None
        self.backend = self._slow = "c_gguf"
        self._wq = weight
        self.bias = None if bias is None else bias.detach().to(device="cpu", dtype=torch.float32).contiguous()
        if self.bias is not None and self.bias.shape != (self.out_features,):
            raise ValueError(f"bias must be [{self.out_features}], got {tuple(self.bias.shape)}")
        self._w = self._w_np = self._wt_np = self._w_blocks = self._w_packed = self._w_packed_bf16 = None
        self._w_int8 = self._w_blocks_int8 = self._screen = None
        self._numpy_max_rows = 0

    # ------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, **kwargs) -> "FastLinear":
        return cls(linear.weight, linear.bias, **kwargs)

    def __getstate__(self):
        # The packed oneDNN/fbgemm weights cannot be pickled or deep-copied; rebuild from dense.
        return {"weight": self._wq if self._wq is not None else self.dense_weight().clone(), "bias": self.bias,
                "backend": self._requested_backend, "weight_dtype": self.weight_dtype}

    def __setstate__(self, state):
        FastLinear.__init__(self, state["weight"], state["bias"], backend=state["backend"],
                            weight_dtype=state["weight_dtype"])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, backend={self.backend}")

    def dense_weight(self) -> torch.Tensor:
        """The fp32 weight [out, in] (reconstructed for packed/quantized backends)."""
        if self._wq is not None:
            return self._wq.dequantize()
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
        q, scales = self._w_int8
        return q.float() * scales[:, None]

    def enable_exact_argmax(self) -> bool:
        """Keep an int8 copy of an fp32 C-GEMM weight without bias so that `argmax` can screen with it;
        False (and nothing kept) on any other path."""
        if self._slow not in ("c", "c_gguf") or self._numpy_max_rows or self.bias is not None or (
                self._wq is not None and self._wq.format in INT8_ACTIVATION_FORMATS):  # its GEMM rounds x to int8
            return False
        if self._screen is None:
            self._screen = self._pack_screen()
        return True

    def _pack_screen(self) -> tuple[torch.Tensor, ...]:
        """The screen of the fp32 weight; of GGUF blocks a few thousand rows at a time (a vocabulary's head in
        fp32 is several times the file's size)."""
        wq = self._wq
        if wq is None:
            return greedy_screen.pack_argmax_screen(self.dense_weight())
        return greedy_screen.pack_argmax_screen_rows(wq.shape, lambda start, end: kernels.weight_rows(
            wq.packed, wq.weight_format, wq.shape[1], torch.arange(start, end)))

    def argmax(self, x: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, in] -> [M] int64, exactly ``self(x).argmax(-1)`` (see greedy_screen.lm_head_argmax), or with
        allowed [M, out] bool the argmax over the allowed columns; after ``enable_exact_argmax``, a quarter of
        the weight bytes for a greedy step's LM head."""
        x = x.reshape(-1, self.in_features).contiguous()
        if self._screen is None:
            y = self(x)
            return kernels.argmax_rows(y if allowed is None else y.masked_fill(~allowed, float("-inf")))
        weight, weight_format = self._gemm_weight()
        allowed = None if allowed is None else allowed.contiguous()
        return greedy_screen.lm_head_argmax(x, weight, *self._screen, allowed=allowed, weight_format=weight_format)

    def _gemm_weight(self) -> tuple[torch.Tensor, tuple[int, int]]:
        """(packed weight, (format, group)) of the C GEMM's fp32 or GGUF path, as kernels.gemm_weight takes it."""
        if self._wq is not None:
            return self._wq.packed, self._wq.weight_format
        return self._w_blocks, (kernels.WEIGHT_F32, 0)

    def c_operands(self) -> tuple | None:
        """(packed weight, int8 scales or None, bias or None, (format, group)) when every call takes a C GEMM,
        else None: what a fused C caller (fused.decoder_forward) passes for this layer."""
        if self._numpy_max_rows:
            return None
        if self._slow in ("c", "c_gguf"):
            weight, weight_format = self._gemm_weight()
            return weight, None, self.bias, weight_format
        if self._slow == "c_int8":
            return self._w_blocks_int8[0], self._w_blocks_int8[1], self.bias, (kernels.WEIGHT_F32, 0)
        return None

    @property
    def weight_nbytes(self) -> int:
        """Bytes of weight this layer keeps for its kernels (the argmax screen included)."""
        tensors = [self._w, self._w_blocks, self._w_blocks_int8[0] if self._w_blocks_int8 else None,
                   self._wq.packed if self._wq is not None else None, *(self._screen or ()),
                   self._w_packed, self._w_packed_bf16, self._w_int8[0] if self._w_int8 else None]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None) + (
            self._wt_np.nbytes if self._wt_np is not None else 0)

    def path_for_rows(self, rows: int) -> str:
        """Which kernel a call with ``rows`` rows uses ("c", "c_gguf", "numpy", "onednn", "torch", "bf16",
        "c_int8", "int8")."""
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
        if path == "c_gguf":
            y = kernels.gemm_weight(x.reshape(rows, self.in_features).contiguous(), self._wq.packed,
                                    self._wq.weight_format, self.bias, self.out_features)
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
            if self.backend == "onednn_bf16":
                y = torch.ops.mkldnn._linear_pointwise(x2.to(torch.bfloat16), self._w_packed_bf16, None, "none", [],
                                                       "")
            else:
                y = F.linear(x2.to(torch.bfloat16), self._w_packed_bf16)
            y = y.float()
            if self.bias is not None:
                y.add_(self.bias)
        else:  # int8
            y = _int8_rows_linear(x2, *self._w_int8, self.bias)
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


def _quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] fp32 -> (int8 [out, in], fp32 scales [out]): symmetric, one scale per output channel."""
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    return torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8), scales.float()


def _int8_rows_linear(x: torch.Tensor, q: torch.Tensor, w_scales: torch.Tensor,
                      bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, in] fp32 @ (q [out, in] int8 * w_scales [out])^T (+ bias): each row of x quantized to int8 with its
    own scale, the products summed exactly in int32, then scaled: a row's result depends on that row alone."""
    x_scales = (x.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [M]
    xq = torch.round(x / x_scales[:, None]).clamp_(-127, 127).to(torch.int8)
    y = torch._int_mm(xq, q.t()).float() * x_scales[:, None] * w_scales[None, :]
    return y if bias is None else y.add_(bias)




PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")  # a decoder layer's linear layers, as every model names them


# the int8 kernel (int8_routes' name) of each int8-activation format: 4-bit blocks, 8-bit blocks
_INT8_KERNEL = {Q4_I8: "gemm", Q4_Q8: "gemm", Q8_I8: "gemm_q8", Q8_Q8: "gemm_q8"}


def int8_workloads(model) -> dict[str, list[Int8Call]]:
    """The model's calls of the int8 kernels, in the order a step makes them: its projections with int8
    activations, in 4-bit blocks ("gemm") and in 8-bit ones ("gemm_q8"), and its LM head's argmax screen
    ("screen"); what int8_routes times."""
    calls = {"gemm": [], "gemm_q8": []}
    for layer in getattr(model, "layers", ()):
        for name in PROJECTIONS:
            linear = getattr(getattr(layer, name, None), "local", getattr(layer, name, None))
            wq = getattr(linear, "_wq", None)
            if isinstance(linear, FastLinear) and wq is not None and wq.format in INT8_ACTIVATION_FORMATS:
                call = Int8Call(linear.in_features, (wq.format, linear.out_features), linear)
                calls[_INT8_KERNEL[wq.format]].append(call)
    head = getattr(model, "lm_head", None)
    screen = []
    if isinstance(head, FastLinear) and head._screen is not None:
        screen.append(Int8Call(head.in_features, ("screen", head.out_features), head.argmax))
    return {**calls, "screen": screen}
