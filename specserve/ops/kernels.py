"""specserve's C kernels (csrc/): paged attention, fused decoder-layer steps and the fp32 linear layers.

They are compiled on first use with the machine's C compiler (`cc -O3 -march=native -fopenmp`) into one
library under `~/.cache/specserve/kernels/` (or `$SPECSERVE_CACHE_DIR/kernels`), keyed by the sources,
the flags and the CPU, so later starts load it in milliseconds; calls go through ctypes. The int8 kernels
hold one compiled copy per instruction set (INT8_PATHS) and route each call by its row count to the
fastest for it (specserve.ops.int8_routes). Their OpenMP regions resolve to the libgomp that PyTorch has
already loaded, so they run on torch's thread pool and follow `torch.set_num_threads`.

`SPECSERVE_KERNELS`: `auto` (default: the C kernels when they build, else PyTorch ops), `c` (fail if they
do not build), `torch` (never use them). Only fp32 tensors take the C path.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from specserve.ops.kv_cache import KV_CODES
from specserve.ops.paths import cache_root

logger = logging.getLogger(__name__)

ENV_VAR = "SPECSERVE_KERNELS"
BACKENDS = ("auto", "c", "torch")
SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("paged_attention.c", "layer_ops.c", "gemm.c", "gemm_gguf.c", "gemm_q4_i8.c", "gemm_q8_i8.c",
                        "decoder.c", "greedy.c", "kv_copy.c", "ngram.c", "probe.c")]
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))  # all of them: a header edit rebuilds
# -fno-trapping-math lets GCC vectorize floorf (no FP exceptions are relied on anywhere).
FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]

COMPILE_TIMEOUT_S = 600  # per source file; the slowest takes ~25 s on a 2-core AVX2 host

_lock = threading.Lock()
_loaded: dict[str, object] = {}


def kernels_backend() -> str:
    name = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"{ENV_VAR} must be one of {BACKENDS}, got {name!r}")
    return name


def kernel_enabled() -> bool:
    """Whether the C kernels should be used (building them on the first call)."""
    backend = kernels_backend()
    if backend == "torch":
        return False
    lib = load_kernel()
    if lib is None and backend == "c":
        raise RuntimeError(f"{ENV_VAR}=c but the C kernels did not build: {_loaded.get('error')}")
    return lib is not None


def kernel_usable(dtype: torch.dtype) -> bool:
    """Whether tensors of `dtype` (a KV cache, a model's activations) take the C kernels: fp32 only."""
    return dtype == torch.float32 and kernel_enabled()


def load_kernel():
    """The loaded library, or None when it cannot be built here (the reason is logged once)."""
    with _lock:
        if "lib" not in _loaded:
            try:
                built = _build()
                lib = _bind(ctypes.CDLL(str(built)))
                _loaded["path"] = built
                _choose_int8_path(lib)
                _loaded["lib"] = lib
            except (OSError, subprocess.SubprocessError, RuntimeError) as e:
                _loaded["lib"], _loaded["error"] = None, str(e)
                logger.warning("C kernels unavailable, using PyTorch ops: %s", e)
        return _loaded["lib"]


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    return cc


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    return line
    except OSError:
        pass
    return os.uname().machine


def _build() -> Path:
    cc = _compiler()
    sources = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    key = hashlib.sha256(sources + " ".join([cc, *FLAGS, _cpu_model()]).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"specserve-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        objects = _compile_objects(cc, Path(tmp))
        _run_compiler([cc, *FLAGS, *map(str, objects), "-o", str(out), "-lm"], "linking")
        os.replace(out, target)  # atomic: a concurrent process sees the old state or the whole file
    logger.info("built the C kernels: %s", target)
    return target


def _compile_objects(cc: str, tmp: Path) -> list[Path]:
    """Each source to an object file, as many at once as there are cores (the build takes ~1 min on 2 cores)."""
    compile_flags = [flag for flag in FLAGS if flag != "-shared"]
    objects = [tmp / f"{source.stem}.o" for source in SOURCES]
    jobs = [[cc, *compile_flags, "-c", str(source), "-o", str(obj)] for source, obj in zip(SOURCES, objects)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for future in [pool.submit(_run_compiler, job, Path(job[-3]).name) for job in jobs]:
            future.result()
    return objects


def _run_compiler(command: list[str], what: str) -> None:
    proc = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{command[0]} failed on {what}: {proc.stderr.strip()[:500]}")


def _bind(lib):
    ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    signatures = {
        "paged_attention_f32": ([ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, f32, i64,
                                 i64], ctypes.c_int),
        "add_rms_norm_f32": ([ptr, ptr, ptr, ptr, i64, i64, f32], None),
        "silu_mul_f32": ([ptr, ptr, i64, i64], None),
        "rope_qk_f32": ([ptr, ptr, ptr, i64, i64, i64, i64], None),
        "gemm_packed_f32": ([ptr, ptr, ptr, ptr, i64, i64, i64], None),
        "gemm_packed_i8": ([ptr, ptr, ptr, ptr, ptr, i64, i64, i64], None),
        "argmax_rows_f32": ([ptr, i64, i64, ptr], None),
        "gemm_weight_f32": ([ptr, ptr, i64, i64, ptr, ptr, i64, i64, i64], ctypes.c_int),
        "weight_rows_f32": ([ptr, i64, i64, i64, ptr, i64, ptr], None),
        "lm_head_argmax_f32": ([ptr, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, ptr], ctypes.c_int),
        "ngram_match_i64": ([ptr, i64, i64, i64, i64], ctypes.c_int64),
        "decoder_profile_f32": ([i64, ptr], None),
        "q4_i8_supported": ([i64], ctypes.c_int),
        "q4_i8_select": ([i64], ctypes.c_int),
        "int8_route_set": ([i64, ptr, i64], ctypes.c_int),
        "int8_route_get": ([i64, i64], ctypes.c_int),
        "int8_route_calls": ([i64, i64], i64),
        "q4_i8_amx_check_in_child": ([i64], ctypes.c_int),
        "probe_read": ([ptr, i64], ctypes.c_uint64),
        "probe_dot_products": ([i64], i64),
        "moe_experts_f32": ([ptr, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr], ctypes.c_int),
        "decoder_forward_f32": ([ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64,
                                 i64, i64,
                                 i64, i64, i64, i64, f32, f32, ptr, i64, ptr], ctypes.c_int),
        "eagle3_chains_f32": ([ptr, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64,
                               i64, f32, f32, ptr], ctypes.c_int),
        "eagle3_forward_f32": ([ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64,
                                i64, i64, i64, i64, f32, f32, ptr], ctypes.c_int),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


# Instruction-set paths of the int8 kernels (the 4-bit GEMM, csrc/gemm_q4_i8.c, the Q8-layout GEMM,
# csrc/gemm_q8_i8.c, and the LM head's screen, csrc/greedy.c), slowest first: all give the same bits. Each call
# takes the path its kernel's route gives its row count: measured routes once a model has set them
# (specserve.ops.int8_routes), before that the fastest vector path the CPU runs; SPECSERVE_INT8_PATH forces one
# path for every call. AMX_EMULATED is the AMX path's code with the tile instructions written in C, for tests on
# CPUs without AMX: never chosen by itself.
INT8_PATHS = ("portable", "avx2", "avx512_vnni", "amx")
AMX_EMULATED = "amx_emulated"
ALL_INT8_PATHS = (*INT8_PATHS, AMX_EMULATED)
INT8_KERNELS = ("gemm", "screen", "gemm_q8")  # the C enum's order (csrc/specserve_kernels.h)
NO_AMX_KERNELS = ("gemm_q8",)  # kernels without an AMX version: their routes never name it
INT8_ROUTE_ROWS = 1024  # row counts routed one by one; larger calls take the last one's path
INT8_PATH_ENV = "SPECSERVE_INT8_PATH"
_routes: dict[str, list[str]] = {}  # per kernel, the measured paths of row counts 1..n (set_int8_routes)
_forced: list[str] = []  # the path set_int8_path forces in this process, if any


def _choose_int8_path(lib) -> None:
    asked = forced_int8_path(lib)
    chosen = lib.q4_i8_select(-1 if asked is None else INT8_PATHS.index(asked))
    runs = [name for i, name in enumerate(INT8_PATHS) if lib.q4_i8_supported(i)]
    how = "forced by " + INT8_PATH_ENV if asked else "until a model's routes are measured"
    logger.info("int8 kernels: the %s path, %s (this CPU runs %s)", INT8_PATHS[chosen], how, ", ".join(runs))


def forced_int8_path(lib=None) -> str | None:
    """The path set_int8_path or else SPECSERVE_INT8_PATH forces for every call, or None ("auto", unset, or a
    path this CPU does not run: a warning says so). Raises ValueError for a name that is no path."""
    if _forced:
        return _forced[0]
    asked = os.environ.get(INT8_PATH_ENV, "").strip().lower() or "auto"
    if asked not in ("auto", *INT8_PATHS):
        raise ValueError(f"{INT8_PATH_ENV} must be one of {('auto', *INT8_PATHS)}, got {asked!r}")
    if asked == "auto":
        return None
    lib = lib or _lib()
    runs = [name for i, name in enumerate(INT8_PATHS) if lib.q4_i8_supported(i)]
    if asked not in runs:
        logger.warning("%s=%s: this CPU does not run it (it runs %s); choosing by measurement", INT8_PATH_ENV,
                       asked, runs)
        return None
    return asked


def int8_paths(kernel: str | None = None) -> list[str]:
    """The int8 kernels' instruction-set paths this CPU runs, slowest first; with `kernel`, those it has."""
    lib = _lib()
    runs = [name for i, name in enumerate(INT8_PATHS) if lib.q4_i8_supported(i)]
    return [name for name in runs if name != "amx"] if kernel in NO_AMX_KERNELS else runs


def set_int8_path(name: str | None) -> str:
    """Every call of the int8 kernels on path `name` (one of ALL_INT8_PATHS) from now on, in this process (a
    model loaded meanwhile keeps it), or with None the routes measured for the loaded model (set_int8_routes),
    else the fastest vector path; returns
    `name`, or the one-row GEMM's path for None. Raises ValueError for a path the CPU does not run."""
    lib = _lib()
    _forced.clear()
    if name is None:
        lib.q4_i8_select(-1)
        for kernel, paths in _routes.items():
            _apply_routes(lib, kernel, paths)
        return int8_route(INT8_KERNELS[0], 1)
    chosen = lib.q4_i8_select(ALL_INT8_PATHS.index(name)) if name in ALL_INT8_PATHS else -1
    if chosen < 0:
        raise ValueError(f"int8 path {name!r}: this CPU runs {int8_paths()}")
    _forced.append(name)
    return ALL_INT8_PATHS[chosen]


def set_int8_routes(kernel: str, paths: list[str], remember: bool = True) -> None:
    """`kernel`'s calls of r rows on paths[r - 1] (r <= len(paths); larger calls on paths[-1]); with remember,
    these are the routes set_int8_path(None) returns to, and no path is forced any more. Raises ValueError for
    an unknown kernel or path, or a path the CPU does not run."""
    if kernel not in INT8_KERNELS:
        raise ValueError(f"int8 kernel {kernel!r}: one of {INT8_KERNELS}")
    if not 1 <= len(paths) <= INT8_ROUTE_ROWS or any(p not in ALL_INT8_PATHS for p in paths):
        raise ValueError(f"int8 routes: 1 to {INT8_ROUTE_ROWS} paths from {ALL_INT8_PATHS}, got {paths[:8]}...")
    if kernel in NO_AMX_KERNELS and {"amx", AMX_EMULATED} & set(paths):
        raise ValueError(f"int8 routes for {kernel}: it has no AMX path")
    _apply_routes(_lib(), kernel, paths)
    if remember:
        _routes[kernel] = list(paths)
        _forced.clear()


def _apply_routes(lib, kernel: str, paths: list[str]) -> None:
    table = (ctypes.c_int64 * len(paths))(*(ALL_INT8_PATHS.index(p) for p in paths))
    if lib.int8_route_set(INT8_KERNELS.index(kernel), table, len(paths)) != 0:
        raise ValueError(f"int8 routes for {kernel}: a path this CPU does not run (it runs {int8_paths()})")


def int8_route(kernel: str, rows: int) -> str:
    """The path `kernel`'s calls of `rows` rows take now."""
    return ALL_INT8_PATHS[_lib().int8_route_get(INT8_KERNELS.index(kernel), rows)]


def int8_route_calls(kernel: str) -> dict[str, int]:
    """Per path, the calls of `kernel` it took since the library loaded."""
    lib = _lib()
    return {p: lib.int8_route_calls(INT8_KERNELS.index(kernel), i) for i, p in enumerate(ALL_INT8_PATHS)}


def built_library() -> Path:
    """The loaded library's file (its name carries the build's key: sources, flags, compiler and CPU)."""
    _lib()
    return _loaded["path"]


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (the machine type where it gives none)."""
    line = _cpu_model()
    return line.split(":", 1)[1].strip() if ":" in line else line


def _lib():
    lib = _loaded.get("lib") or load_kernel()
    if lib is None:
        raise RuntimeError(f"the C kernels are unavailable: {_loaded.get('error')}")
    return lib


def _ptr(t: torch.Tensor | None):
    return t.data_ptr() if t is not None else None


def _check(dtype: torch.dtype = torch.float32, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"C kernel: {name} must be a contiguous {dtype} tensor, got {t.dtype}")


def paged_attention_c(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_table: torch.Tensor, query_start: torch.Tensor, query_len: torch.Tensor,
                          context_len: torch.Tensor, scale: float, window: int = 0) -> None:
    """Write the attention output of the listed requests' query tokens (any query length) into `out`.
    window: 0, or a sliding window (each query sees its last `window` keys, itself included).

    q: [N, H, D]; caches: [num_blocks, block_size, Hkv, R] in attention.kv_caches' layouts (values
    contiguous, keys transposed within each block), fp32, bf16 or int8 rows (kv_cache.py); block_table: [S, W]
    int64; query_start, query_len, context_len: [S] int64. q and out fp32, the rest contiguous.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    _check(q=q, out=out)
    if k_cache.dtype not in KV_CODES or v_cache.dtype != k_cache.dtype or not v_cache.is_contiguous():
        raise ValueError(f"C kernel: caches must be contiguous {list(KV_CODES)} of one dtype, got "
                         f"{k_cache.dtype} and {v_cache.dtype}")
    if not k_cache.permute(0, 2, 3, 1).is_contiguous():
        raise ValueError("C kernel: k_cache must be stored [num_blocks, Hkv, R, block_size] (a permuted view, as "
                         f"attention.kv_caches makes it), got strides {k_cache.stride()}")
    _check(torch.int64, block_table=block_table, query_start=query_start, query_len=query_len,
           context_len=context_len)
    failed = _lib().paged_attention_f32(
        q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(),
        block_table.shape[1], query_start.data_ptr(), query_len.data_ptr(), context_len.data_ptr(),
        len(query_start), num_heads, num_kv_heads, head_dim, block_size, float(scale), int(window),
        KV_CODES[k_cache.dtype])
    if failed:
        raise MemoryError("paged kernel: out of memory for its work buffer")


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place; x None: no add), then return rms_norm(residual) * weight. [rows, dim]."""
    _check(residual=residual, weight=weight, **({"x": x} if x is not None else {}))
    out = torch.empty_like(residual)
    rows, dim = residual.shape
    _lib().add_rms_norm_f32(x.data_ptr() if x is not None else None, residual.data_ptr(), weight.data_ptr(),
                            out.data_ptr(), rows, dim, float(eps))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [rows, 2 * inter] -> silu(gate) * up: [rows, inter]."""
    _check(gate_up=gate_up)
    rows, width = gate_up.shape
    out = gate_up.new_empty(rows, width // 2)
    _lib().silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
    return out


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int) -> None:
    """Rotate the first num_heads heads (q then k) of each fused qkv row in place; cos, sin: [rows, head_dim]."""
    _check(qkv=qkv, cos=cos, sin=sin)
    _lib().rope_qk_f32(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), qkv.shape[0], qkv.shape[1], num_heads,
                       head_dim)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, cols] -> [rows] int64, torch.argmax(x, dim=-1)'s answer (first maximum; first NaN), on the C
    kernel for contiguous fp32 rows when the kernels are enabled, else torch's."""
    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or x.shape[1] == 0 or not kernel_enabled():
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _lib().argmax_rows_f32(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out


GEMM_BLOCK = 32  # output columns per packed block (csrc/gemm.c)


def pack_gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 -> the block layout gemm_packed reads: [ceil(N / 32), K, 32], zero columns past N."""
    n, k = weight.shape
    blocks = -(-n // GEMM_BLOCK)
    padded = weight.new_zeros(blocks * GEMM_BLOCK, k)
    padded[:n] = weight
    return padded.view(blocks, GEMM_BLOCK, k).transpose(1, 2).contiguous()


def unpack_gemm_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of pack_gemm_weight: [N, K]."""
    blocks, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(blocks * GEMM_BLOCK, k)[:out_features].contiguous()


def gemm_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] with W packed by pack_gemm_weight; each row's result is the same
    whatever M is (one summation order per output)."""
    _check(x=x, packed=packed, **({"bias": bias} if bias is not None else {}))
    rows, k = x.shape
    y = x.new_empty(rows, out_features)
    if rows:
        _lib().gemm_packed_f32(x.data_ptr(), packed.data_ptr(), bias.data_ptr() if bias is not None else None,
                               y.data_ptr(), rows, k, out_features)
    return y


# Formats of csrc/gemm_gguf.c's packed weights (specserve_kernels.h); see specserve.models.gguf_quant.
WEIGHT_F32, WEIGHT_Q4, WEIGHT_Q8, WEIGHT_F16, WEIGHT_Q4_I8, WEIGHT_Q4_Q8 = 0, 2, 3, 4, 5, 6
WEIGHT_Q8_I8, WEIGHT_Q8_Q8 = 7, 8


def gemm_weight(x: torch.Tensor, packed: torch.Tensor, weight_format: tuple[int, int], bias: torch.Tensor | None,
                out_features: int) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] for W packed in one of gemm_weight's formats (csrc/gemm_gguf.c):
    bitwise what gemm_packed gives on the dequantized fp32 weight, except the int8-activation formats
    (WEIGHT_Q4_I8, WEIGHT_Q8_I8 and their one-digit twins WEIGHT_Q4_Q8, WEIGHT_Q8_Q8), which round x per group
    of 32 to two int8 digits or one (csrc/gemm_q4_i8.c, csrc/gemm_q8_i8.c); either way a row's result does not
    depend on M."""
    _check(x=x, **({"bias": bias} if bias is not None else {}))
    if not packed.is_contiguous():
        raise ValueError("C kernel: packed must be contiguous")
    rows, k = x.shape
    y = x.new_empty(rows, out_features)
    if rows and _lib().gemm_weight_f32(x.data_ptr(), packed.data_ptr(), *weight_format, _ptr(bias), y.data_ptr(),
                                       rows, k, out_features):
        raise ValueError(f"gemm_weight: unsupported weight format {weight_format}")
    return y


def weight_rows(packed: torch.Tensor, weight_format: tuple[int, int], in_features: int,
                ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` ([R] int64, each in range) of the dequantized weight [N, K] packed in gemm_weight's format:
    [R, K] fp32, the values the GEMM multiplies by."""
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.shape[0], in_features, dtype=torch.float32)
    if ids.shape[0]:
        _lib().weight_rows_f32(packed.data_ptr(), *weight_format, in_features, ids.data_ptr(), ids.shape[0],
                               out.data_ptr())
    return out


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] fp32 -> (q [N, K] int8, scales [N] fp32): symmetric per-output-channel quantization,
    q = round(w / scale) with scale = max|w[n]| / 127."""
    scale = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.contiguous()


def pack_gemm_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] fp32 -> (int8 blocks [ceil(N / 32), K, 32], fp32 scales [N]) of quantize_int8."""
    q, scale = quantize_int8(weight)
    return pack_gemm_weight(q), scale


def unpack_gemm_weight_int8(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The dequantized fp32 weight [N, K] of pack_gemm_weight_int8's output."""
    return unpack_gemm_weight(packed.float(), scale.shape[0]) * scale[:, None]


def gemm_packed_int8(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] fp32 @ (scale * q)^T (+ bias) -> [M, N], q packed by pack_gemm_weight_int8; like gemm_packed,
    a row's result does not depend on M."""
    _check(x=x, scale=scale, **({"bias": bias} if bias is not None else {}))
    _check(torch.int8, packed=packed)
    rows, k = x.shape
    y = x.new_empty(rows, scale.shape[0])
    if rows:
        _lib().gemm_packed_i8(x.data_ptr(), packed.data_ptr(), scale.data_ptr(),
                              bias.data_ptr() if bias is not None else None, y.data_ptr(), rows, k, scale.shape[0])
    return y


def ngram_match(tokens, min_n: int, max_n: int, prefer_end: int = -1) -> int:
    """`specserve.spec_decode.ngram.find_ngram_match` in C (same result): tokens is a contiguous int64
    numpy array [L]."""
    if tokens.dtype.itemsize != 8 or tokens.dtype.kind != "i" or not tokens.flags.c_contiguous:
        raise ValueError(f"ngram_match: tokens must be a contiguous int64 array, got {tokens.dtype}")
    return _lib().ngram_match_i64(tokens.ctypes.data, tokens.shape[0], min_n, max_n, prefer_end)


def ngram_match_at(address: int, size: int, min_n: int, max_n: int, prefer_end: int = -1) -> int:
    """ngram_match on the `size` int64 tokens at `address`, which the caller keeps alive: for a history
    buffer whose address is known, without numpy's `.ctypes` (~25 us a call once a forward pass has evicted
    the caches, against ~15 us for the whole call through ctypes)."""
    return _lib().ngram_match_i64(address, size, min_n, max_n, prefer_end)
