"""Time linear-layer (matmul) backends for SmolLM2-135M shapes on this CPU.

Usage (from the repository root)::

    .venv/bin/python benchmarks/matmul_backends.py                 # full run (3 configs, ~15-30 min on 2 shared vCPUs)
    .venv/bin/python benchmarks/matmul_backends.py --quick         # fewer rows / rounds
    .venv/bin/python benchmarks/matmul_backends.py --configs default --shapes qkv,lm_head --rows 1,8 --no-step
    .venv/bin/python benchmarks/matmul_backends.py --no-micro --no-contention   # only the whole-model step

Each process config (CONFIGS: default, blas2, passive) runs in its own child process,
because OPENBLAS_NUM_THREADS / OMP_WAIT_POLICY only take effect before the libraries start
their thread pools. Torch threads 1 and 2 are interleaved inside each child (same rounds,
same neighbour load).

* default: OpenBLAS 1 thread (what FastLinear enforces), OpenMP default spin-wait
* blas2:   OpenBLAS 2 threads (the library default on 2 cores), exact backends only
* passive: OpenBLAS 1 thread, OMP_WAIT_POLICY=passive, exact backends only

The machine this was written on is 2 vCPUs shared with other jobs: results from separate
configs (run at different times) are not comparable to each other, only rows inside one
table are. Anything at 2 torch threads with the default spin-wait can show 4-16 ms
scheduler-tick stalls per call when the other vCPU is busy.

What it measures
----------------
* ``micro``: for each (config, shape, rows) every (candidate, torch threads) pair is
  timed *interleaved* (round-robin, shuffled order each round) and the median of the
  per-round means is reported, in ms per call.  Weights are reused call after
  call, so everything except lm_head (113 MB) is cache-hot here; the ``step``
  section is the realistic (cache-cold, bandwidth-bound) number.
* ``step``: 30 layers of distinct weights (qkv 960, o, gate_up 3072, down)
  plus lm_head through ``specserve.models.linear.FastLinear`` (variants auto, onednn,
  numpy, torch, bf16, int8), with the small torch ops of a layer in between
  (rmsnorm / silu*mul / residual add), so that thread hand-offs between OpenBLAS
  (pthreads) and torch (OpenMP) show up.
* ``contention``: numpy(OpenBLAS) and oneDNN(OpenMP, 2 threads) calls alternated vs.
  each alone, with OpenBLAS at 1 and 2 threads.

Candidates (``exact`` = fp32 result, same math as F.linear up to summation order):

=================  ======  ==========================================================
name               exact   call
=================  ======  ==========================================================
torch_linear       yes     F.linear(x, w)            (MKL sgemm via addmm/mm)
torch_mm_wt        yes     torch.mm(x, wt)           wt = w.t().contiguous()
numpy_wt           yes     np.matmul(x_np, wt_np, out=y_np)  (OpenBLAS)
numpy_w            yes     np.matmul(x_np, w_np.T, out=y_np) (OpenBLAS, trans-B)
numpy_gemv         yes     np.matmul(w_np, x_vec, out=y)     (rows == 1 only)
onednn_packed      yes     torch.ops.mkldnn._linear_pointwise(x, w_packed, ...)
onednn_mkldnn_in   yes     torch._C._nn.mkldnn_linear(x.to_mkldnn(), w_mkldnn).to_dense()
torch_bf16         no      F.linear(x.bf16, w.bf16).float()
onednn_bf16        no      _linear_pointwise(x.bf16, w_packed_bf16).float()
int8_dynamic       no      torch.ops.quantized.linear_dynamic (fbgemm, per-tensor act)
onednn_fp16_dyn    no      torch.ops.onednn.linear_dynamic_fp16(x, w_fp16)  (not run by default)
=================  ======  ==========================================================

Results are printed as tables and written to ``bench_results/matmul_backends.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import warnings
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

# --------------------------------------------------------------------------------------
# Model shapes

HIDDEN = 576
INTER = 1536
N_LAYERS = 30
VOCAB = 49152

SHAPES: dict[str, tuple[int, int]] = {  # name -> (out_features, in_features)
    "q": (576, 576),
    "kv": (192, 576),
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_or_up": (1536, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (VOCAB, 576),
}
ROWS = [1, 2, 4, 8, 16, 32, 64, 256, 512]

EXACT = {
    "torch_linear": True,
    "torch_mm_wt": True,
    "numpy_wt": True,
    "numpy_w": True,
    "numpy_gemv": True,
    "onednn_packed": True,
    "onednn_mkldnn_in": True,
    "torch_bf16": False,
    "onednn_bf16": False,
    "int8_dynamic": False,
    "onednn_fp16_dyn": False,
}
# onednn_fp16_dyn is left out by default: without avx512_fp16 it takes 400-500 ms for lm_head.
DEFAULT_BACKENDS = [b for b in EXACT if b != "onednn_fp16_dyn"]

# --------------------------------------------------------------------------------------
# OpenBLAS thread control without threadpoolctl (not a dependency): numpy's bundled
# scipy-openblas exports scipy_openblas_{get,set}_num_threads64_.


class _OpenBLAS:
    def __init__(self) -> None:
        from specserve.models.openblas import find_openblas

        self.lib, self.prefix, self.suffix = find_openblas() or (None, "", "")

    def _fn(self, name: str):
        return getattr(self.lib, f"{self.prefix}_{name}{self.suffix}")

    def get_num_threads(self) -> int | None:
        return int(self._fn("get_num_threads")()) if self.lib else None

    def set_num_threads(self, n: int) -> None:
        if self.lib:
            self._fn("set_num_threads")(ctypes.c_int(n))

    def config(self) -> str | None:
        if not self.lib:
            return None
        f = self._fn("get_config")
        f.restype = ctypes.c_char_p
        return f().decode()

    def corename(self) -> str | None:
        if not self.lib:
            return None
        f = self._fn("get_corename")
        f.restype = ctypes.c_char_p
        return f().decode()


OPENBLAS = _OpenBLAS()


# --------------------------------------------------------------------------------------
# Candidate construction


def make_candidate(name: str, w: torch.Tensor, rows: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Return fn(x[rows, in]) -> y[rows, out] or None if not applicable/available."""
    out_f, in_f = w.shape
    if name == "torch_linear":
        return lambda x: F.linear(x, w)
    if name == "torch_mm_wt":
        wt = w.t().contiguous()
        return lambda x: torch.mm(x, wt)
    if name == "numpy_wt":
        wt_np = w.t().contiguous().numpy()

        def f(x):
            y = torch.empty(x.shape[0], out_f)
            np.matmul(x.numpy(), wt_np, out=y.numpy())
            return y

        return f
    if name == "numpy_w":
        w_np_t = w.numpy().T

        def f(x):
            y = torch.empty(x.shape[0], out_f)
            np.matmul(x.numpy(), w_np_t, out=y.numpy())
            return y

        return f
    if name == "numpy_gemv":
        if rows != 1:
            return None
        w_np = w.numpy()

        def f(x):
            y = torch.empty(1, out_f)
            np.matmul(w_np, x.numpy()[0], out=y.numpy()[0])
            return y

        return f
    if name == "onednn_packed":
        # packed with the call's row count as hint (oneDNN's best case). FastLinear packs once
        # with hint None; measured identical except hint=1 (plain layout, slower from 2 rows).
        wp = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, wp, None, "none", [], "")
    if name == "onednn_mkldnn_in":
        wm = w.to_mkldnn()
        return lambda x: torch._C._nn.mkldnn_linear(x.to_mkldnn(), wm, None).to_dense()
    if name == "torch_bf16":
        wb = w.to(torch.bfloat16)
        return lambda x: F.linear(x.to(torch.bfloat16), wb).float()
    if name == "onednn_bf16":
        wbp = torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), rows)
        return lambda x: torch.ops.mkldnn._linear_pointwise(
            x.to(torch.bfloat16), wbp, None, "none", [], ""
        ).float()
    if name == "int8_dynamic":
        if "fbgemm" not in torch.backends.quantized.supported_engines:
            return None
        torch.backends.quantized.engine = "fbgemm"
        # per-channel weight quantization (torch.ao's default dynamic qconfig is per-tensor;
        # per-channel is more accurate and fbgemm supports it at the same speed)
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        with warnings.catch_warnings():  # deprecated in 2.13, still works
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, scales, torch.zeros(out_f, dtype=torch.long), 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(qw, None)
        # reduce_range=True (7-bit activations, safe without VNNI). FastLinear uses False on
        # VNNI CPUs: same speed measured, about half the error.
        return lambda x: torch.ops.quantized.linear_dynamic(x, packed, True)
    if name == "onednn_fp16_dyn":
        w16 = torch.ops.onednn.linear_prepack_fp16(w, None) if hasattr(
            torch.ops.onednn, "linear_prepack_fp16"
        ) else w.to(torch.float16)
        return lambda x: torch.ops.onednn.linear_dynamic_fp16(x, w16, None)
    raise ValueError(name)


# --------------------------------------------------------------------------------------
# Timing


def interleaved_bench(
    fns: dict[str, Callable[[], object]],
    budget_s: float,
    min_rounds: int = 7,
    max_rounds: int = 60,
    sample_s: float = 0.004,
) -> dict[str, dict]:
    """Round-robin timing. Each round runs every fn `inner[name]` times back to back
    (inner chosen so one sample is >= sample_s) in shuffled order. Returns per-fn
    median / p20 / p80 of the per-round mean, in ms."""
    inner: dict[str, int] = {}
    per_round = 0.0
    for name, fn in fns.items():
        fn()
        fn()  # warm up (first call may pack / JIT / allocate)
        t0 = time.perf_counter()
        fn()
        dt = max(time.perf_counter() - t0, 1e-7)
        inner[name] = max(1, min(1000, int(sample_s / dt)))
        per_round += dt * inner[name]
    rounds = int(max(min_rounds, min(max_rounds, budget_s / max(per_round, 1e-9))))
    samples: dict[str, list[float]] = {n: [] for n in fns}
    names = list(fns)
    for _ in range(rounds):
        random.shuffle(names)
        for name in names:
            fn, k = fns[name], inner[name]
            t0 = time.perf_counter()
            for _ in range(k):
                fn()
            samples[name].append((time.perf_counter() - t0) / k * 1e3)
    res = {}
    for name, s in samples.items():
        s = sorted(s)
        res[name] = {
            "median_ms": statistics.median(s),
            "p20_ms": s[int(0.2 * (len(s) - 1))],
            "p80_ms": s[int(0.8 * (len(s) - 1))],
            "rounds": len(s),
            "inner": inner[name],
        }
    return res


def max_rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# --------------------------------------------------------------------------------------
# Sections


def _with_threads(fn: Callable[[], object], threads: int) -> Callable[[], object]:
    """Wrap so that torch's thread count is set before each timed batch (cheap, ~1 us)."""

    def g():
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return fn()

    return g


def run_micro(shapes, rows_list, threads_list, backends, budget_s) -> list[dict]:
    """Every (backend, torch threads) candidate is interleaved in the same rounds, so the
    1- vs 2-thread comparison sees the same neighbour load."""
    results = []
    gen = torch.Generator().manual_seed(0)
    for sname in shapes:
        out_f, in_f = SHAPES[sname]
        w = torch.randn(out_f, in_f, generator=gen) / in_f**0.5
        for rows in rows_list:
            x = torch.randn(rows, in_f, generator=gen)
            ref = F.linear(x.double(), w.double()).float()
            fns, errs = {}, {}
            for b in backends:
                try:
                    fn = make_candidate(b, w, rows)
                    if fn is None:
                        continue
                    errs[b] = max_rel_err(fn(x), ref)
                except Exception as e:  # backend unavailable in this build
                    print(f"  [skip] {b} {sname} rows={rows}: {type(e).__name__}: {e}"[:200], file=sys.stderr)
                    continue
                for t in threads_list:
                    fns[(b, t)] = _with_threads(lambda fn=fn: fn(x), t)
            timing = interleaved_bench(fns, budget_s * len(threads_list))
            for (b, t), r in timing.items():
                results.append(
                    dict(section="micro", shape=sname, out=out_f, inp=in_f, rows=rows, threads=t,
                         openblas_threads=OPENBLAS.get_num_threads(), backend=b, exact=EXACT[b],
                         max_rel_err=errs[b], **r)
                )
            msg = []
            for t in threads_list:
                tt = {b: r for (b, th), r in timing.items() if th == t}
                be = min((b for b in tt if EXACT[b]), key=lambda b: tt[b]["median_ms"])
                ba = min(tt, key=lambda b: tt[b]["median_ms"])
                msg.append(f"t{t}: exact {be} {tt[be]['median_ms']:.4f} / any {ba} {tt[ba]['median_ms']:.4f}")
            print(f"{sname:>10} rows={rows:>3}  " + " | ".join(msg), flush=True)
            del fns
        del w
        gc.collect()
    return results


def _layer_shapes():
    return [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]


STEP_VARIANTS = {
    # name: FastLinear kwargs (what the model actually gets)
    "auto": dict(backend="auto"),
    "onednn": dict(backend="onednn"),
    "numpy": dict(backend="numpy"),
    "torch": dict(backend="torch"),
    "bf16": dict(weight_dtype=torch.bfloat16),
    "int8": dict(weight_dtype="int8"),
}
STEP_EXACT = {"auto": True, "onednn": True, "numpy": True, "torch": True, "bf16": False, "int8": False}


def run_step(rows_list, threads_list, variants, reps) -> list[dict]:
    """30 layers of distinct weights (qkv, o, gate_up, down; ~14 MB fp32 per layer, so the
    425 MB of layer weights stream from DRAM as in a real model) + lm_head, through
    specserve.models.linear.FastLinear, with the small torch ops of a decoder layer
    (rmsnorm, silu*mul, residual adds) in between. Variants x torch-threads are interleaved
    step by step. Reports median ms per step and the lm_head alone."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
    from specserve.models.linear import FastLinear

    results = []
    gen = torch.Generator().manual_seed(1)
    layer_ws = [[torch.randn(o, i, generator=gen) / i**0.5 for (_, o, i) in _layer_shapes()] for _ in range(N_LAYERS)]
    lm_w = torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5
    built = {}
    for v in variants:
        try:
            built[v] = ([[FastLinear(w, **STEP_VARIANTS[v]) for w in ws] for ws in layer_ws],
                        FastLinear(lm_w, **STEP_VARIANTS[v]))
        except Exception as e:
            print(f"  [skip step] {v}: {e}"[:200], file=sys.stderr)

    def rms(h):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)

    for rows in rows_list:
        x0 = torch.randn(rows, HIDDEN, generator=gen)
        fns = {}
        for v, (layers, lm) in built.items():
            def step(layers=layers, lm=lm):
                h = x0
                for qkv, o, gate_up, down in layers:
                    a = qkv(rms(h))
                    h = h + o(a[:, :HIDDEN])  # stands in for attention output
                    gu = gate_up(rms(h))
                    h = h + down(F.silu(gu[:, :INTER]) * gu[:, INTER:])
                    h = h / h.abs().amax().clamp_min(1.0)  # keep values bounded
                return lm(rms(h))

            for t in threads_list:
                fns[(v, t, "full_step")] = _with_threads(step, t)
                fns[(v, t, "lm_head_only")] = _with_threads(lambda lm=lm: lm(x0), t)
        samples = {k: [] for k in fns}
        names = list(fns)
        for k in names:
            fns[k]()
        for _ in range(reps):
            random.shuffle(names)
            for k in names:
                t0 = time.perf_counter()
                fns[k]()
                samples[k].append((time.perf_counter() - t0) * 1e3)
        for (v, t, part), s in samples.items():
            s = sorted(s)
            results.append(dict(section="step", rows=rows, threads=t, openblas_threads=OPENBLAS.get_num_threads(),
                                backend=v, exact=STEP_EXACT[v], part=part, median_ms=statistics.median(s),
                                min_ms=s[0], p80_ms=s[int(0.8 * (len(s) - 1))], reps=len(s)))
        line = sorted((statistics.median(s), f"{v}@t{t}") for (v, t, p), s in samples.items() if p == "full_step")
        print(f"step rows={rows}: " + ", ".join(f"{n}={m:.1f}ms" for m, n in line), flush=True)
        del fns
        gc.collect()
    return results


def run_contention(budget_s: float) -> list[dict]:
    """Alternate a numpy/OpenBLAS matmul with a oneDNN (OpenMP) matmul and compare with
    the sum of each alone. Done for OpenBLAS threads 1 and 2 (torch threads 2)."""
    results = []
    blas_default = OPENBLAS.get_num_threads()
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(3072, 576, generator=gen)
    for rows in (1, 8, 64):
        x = torch.randn(rows, 576, generator=gen)
        npf = make_candidate("numpy_wt", w, rows)
        dnn = make_candidate("onednn_packed", w, rows)
        small_torch = lambda: (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))  # noqa: E731
        for blas_thr in (1, 2):
            torch.set_num_threads(2)
            OPENBLAS.set_num_threads(blas_thr)
            fns = {
                "numpy": lambda: npf(x),
                "onednn": lambda: dnn(x),
                "numpy+onednn": lambda: (npf(x), dnn(x)),
                "numpy+torch_elementwise": lambda: (npf(x), small_torch()),
                "torch_elementwise": small_torch,
            }
            t = interleaved_bench(fns, budget_s)
            for k, v in t.items():
                results.append(dict(section="contention", rows=rows, torch_threads=2, openblas_threads=blas_thr,
                                    case=k, **v))
            print(
                f"contention rows={rows} openblas_thr={blas_thr}: "
                + ", ".join(f"{k}={v['median_ms']:.4f}" for k, v in t.items())
                + f"  (sum alone={t['numpy']['median_ms'] + t['onednn']['median_ms']:.4f})",
                flush=True,
            )
    OPENBLAS.set_num_threads(blas_default)
    return results


# --------------------------------------------------------------------------------------
# Reporting


def print_micro_table(results: list[dict]) -> None:
    micro = [r for r in results if r["section"] == "micro"]
    if not micro:
        return
    backends = [b for b in EXACT if any(r["backend"] == b for r in micro)]
    short = {b: b.replace("onednn_", "dnn_").replace("numpy_", "np_").replace("torch_", "t_") for b in backends}
    for cfg, threads in dict.fromkeys((r["config"], r["threads"]) for r in micro):
        print(f"\n=== ms per call (median), config {cfg} ({CONFIG_DOC[cfg]}), torch threads={threads}; "
              "'*' = fastest exact fp32, '+' = fastest overall ===")
        print(f"{'shape':>10} {'rows':>4} " + " ".join(f"{short[b]:>13}" for b in backends))
        sel = [r for r in micro if r["config"] == cfg and r["threads"] == threads]
        keys = sorted({(r["shape"], r["rows"]) for r in sel}, key=lambda k: (list(SHAPES).index(k[0]), k[1]))
        for shape, rows in keys:
            rs = {r["backend"]: r for r in sel if r["shape"] == shape and r["rows"] == rows}
            best_exact = min((b for b in rs if rs[b]["exact"]), key=lambda b: rs[b]["median_ms"])
            best = min(rs, key=lambda b: rs[b]["median_ms"])
            cells = []
            for b in backends:
                if b not in rs:
                    cells.append(f"{'-':>13}")
                    continue
                mark = ("*" if b == best_exact else "") + ("+" if b == best else "")
                cells.append(f"{rs[b]['median_ms']:>11.4f}{mark:<2}")
            print(f"{shape:>10} {rows:>4} " + " ".join(cells))


def print_contention_table(results: list[dict]) -> None:
    cont = [r for r in results if r["section"] == "contention"]
    if not cont:
        return
    print("\n=== contention: gate_up-sized matmul (3072x576), numpy(OpenBLAS) vs oneDNN(OpenMP, 2 threads), "
          "ms (median) ===")
    cases = list(dict.fromkeys(r["case"] for r in cont))
    print(f"{'config':>8} {'rows':>4} {'blas_thr':>8} " + " ".join(f"{c:>24}" for c in cases))
    for cfg in dict.fromkeys(r["config"] for r in cont):
        for rows in sorted({r["rows"] for r in cont}):
            for bt in (1, 2):
                rs = {r["case"]: r["median_ms"] for r in cont
                      if r["config"] == cfg and r["rows"] == rows and r["openblas_threads"] == bt}
                if rs:
                    print(f"{cfg:>8} {rows:>4} {bt:>8} " + " ".join(f"{rs.get(c, float('nan')):>24.4f}" for c in cases))


def print_step_table(results: list[dict]) -> None:
    step = [r for r in results if r["section"] == "step"]
    if not step:
        return
    print("\n=== whole-model linears via FastLinear: 30 layers (distinct weights) + lm_head + small torch ops, "
          "ms per step (median [p80]) ===")
    for cfg in dict.fromkeys(r["config"] for r in step):
        for rows in sorted({r["rows"] for r in step if r["config"] == cfg}):
            rs = [r for r in step if r["config"] == cfg and r["rows"] == rows]
            full = sorted((r for r in rs if r["part"] == "full_step"), key=lambda r: r["median_ms"])
            lm = {(r["backend"], r["threads"]): r["median_ms"] for r in rs if r["part"] == "lm_head_only"}
            print(f"config {cfg} ({CONFIG_DOC[cfg]}), rows={rows}:")
            for r in full:
                print(f"   {r['backend']:>7} t{r['threads']} {'exact ' if r['exact'] else 'approx'} "
                      f"total={r['median_ms']:8.2f} [{r['p80_ms']:8.2f}] ms"
                      f"  (lm_head alone {lm.get((r['backend'], r['threads']), float('nan')):7.2f} ms)"
                      f"  -> {1000.0 / r['median_ms'] * rows:7.1f} tok/s linear-only ceiling")


def system_info() -> dict:
    flags, model = "", platform.processor()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Flags:"):
                flags = line + " "
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except Exception:
        pass
    wanted = ["avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx512_fp16", "amx_bf16", "amx_tile",
              "amx_int8"]
    return {
        "cpu": model,
        "nproc": os.cpu_count(),
        "isa_flags": {f: f" {f} " in flags for f in wanted},
        "torch": torch.__version__,
        "numpy": np.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn_available": torch.backends.mkldnn.is_available(),
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "openblas_config": OPENBLAS.config(),
        "openblas_corename": OPENBLAS.corename(),
        "openblas_num_threads": OPENBLAS.get_num_threads(),
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                                "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "SPECSERVE_LINEAR_BACKEND")},
    }


EXACT_SUBSET = "torch_linear,numpy_wt,numpy_gemv,onednn_packed"
CONFIGS: dict[str, dict] = {
    # name: environment of the child process (thread pools read it when they start) and the
    # defaults for what to run in it. Torch threads 1 and 2 are interleaved inside each child.
    "default": dict(env={"OPENBLAS_NUM_THREADS": "1"}, backends=",".join(DEFAULT_BACKENDS),
                    rows=",".join(map(str, ROWS)), step_variants=",".join(STEP_VARIANTS), contention=True,
                    doc="OpenBLAS 1 thread (what FastLinear sets), OpenMP default spin-wait"),
    "blas2": dict(env={"OPENBLAS_NUM_THREADS": "2"}, backends=EXACT_SUBSET, rows="1,2,8,64",
                  step_variants="auto,onednn,numpy", contention=False,
                  doc="OpenBLAS 2 threads set explicitly (= the library default; FastLinear then leaves it)"),
    "passive": dict(env={"OPENBLAS_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive"}, backends=EXACT_SUBSET,
                    rows="1,2,8,64", step_variants="auto,onednn,numpy", contention=True,
                    doc="OpenBLAS 1 thread, OMP_WAIT_POLICY=passive (OpenMP workers sleep instead of spinning)"),
}
CONFIG_DOC = {k: v["doc"] for k, v in CONFIGS.items()}


def run_child(a) -> dict:
    """Run the sections in this process (environment already set by the parent)."""
    cfg = CONFIGS[a.child]
    threads_list = [int(t) for t in a.threads.split(",")]
    info = system_info()
    info["config"] = a.child
    results: list[dict] = []
    torch.set_grad_enabled(False)
    if not a.no_micro:
        results += run_micro(a.shapes.split(","), [int(r) for r in (a.rows or cfg["rows"]).split(",")],
                             threads_list, (a.backends or cfg["backends"]).split(","), a.budget)
    if a.contention and cfg["contention"]:
        results += run_contention(a.budget)
    if a.step:
        results += run_step([int(r) for r in a.step_rows.split(",")], threads_list,
                            (a.step_variants or cfg["step_variants"]).split(","), a.step_reps)
    for r in results:
        r["config"] = a.child
    return {"system": info, "results": results}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="process configs: " + "; ".join(f"{k}: {v}" for k, v in CONFIG_DOC.items()))
    p.add_argument("--threads", default="1,2", help="torch thread counts, interleaved within each config")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rows", default=None, help=f"default: {','.join(map(str, ROWS))} (1,2,8,64 for non-default configs)")
    p.add_argument("--backends", default=None, help=f"micro candidates; default per config. All: {','.join(EXACT)}")
    p.add_argument("--budget", type=float, default=0.5, help="seconds of timing per (shape, rows, thread) group")
    p.add_argument("--quick", action="store_true", help="rows 1,2,8,64,512, budget 0.2 s, fewer step reps")
    p.add_argument("--no-micro", action="store_true")
    p.add_argument("--step", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--step-rows", default="1,8")
    p.add_argument("--step-reps", type=int, default=15)
    p.add_argument("--step-variants", default=None, help=f"FastLinear variants: {','.join(STEP_VARIANTS)}")
    p.add_argument("--contention", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", default="bench_results/matmul_backends.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.rows = a.rows or "1,2,8,64,512"
        a.budget, a.step_reps = 0.2, 7

    if a.child:
        with open(a.out, "w") as f:
            json.dump(run_child(a), f)
        return 0

    t_start = time.time()
    systems, results = {}, []
    passthrough = list(argv if argv is not None else sys.argv[1:])
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    for cfg in a.configs.split(","):
        print(f"\n##### config {cfg}: {CONFIG_DOC[cfg]}", flush=True)
        env = {k: v for k, v in os.environ.items()
               if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "SPECSERVE_LINEAR_BACKEND")}
        env.update(CONFIGS[cfg]["env"])
        tmp = f"{a.out}.{cfg}.tmp"
        cmd = [sys.executable, os.path.abspath(__file__), *passthrough, "--child", cfg, "--out", tmp]
        subprocess.run(cmd, env=env, check=True)
        with open(tmp) as f:
            d = json.load(f)
        os.remove(tmp)
        systems[cfg] = d["system"]
        results += d["results"]
    print(json.dumps(systems[next(iter(systems))], indent=1))
    print(f"parent process (your environment): torch.get_num_threads()={torch.get_num_threads()}, "
          f"OpenBLAS threads={OPENBLAS.get_num_threads()}")
    print_micro_table(results)
    print_contention_table(results)
    print_step_table(results)
    with open(a.out, "w") as f:
        json.dump({"system": systems, "configs": CONFIG_DOC, "args": vars(a), "elapsed_s": time.time() - t_start,
                   "results": results}, f, indent=1)
    print(f"\nwrote {a.out} ({len(results)} rows, {time.time() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
