"""Which instruction-set path each int8 kernel call takes, by its row count: timed on the loaded model's own
calls the first time a model of these shapes runs with this kernel build on this CPU and thread count, then
read from a file beside the built kernels.

Every path gives the same bits (csrc/gemm_q4_i8.c, csrc/gemm_q8_i8.c), so a call may take whichever is fastest
for its rows: AMX tiles pay only from some row count on (a one-row call is bound by the weights' bytes, and the
tiles' setup and epilogue cost more than the dot products they save), while the fastest vector path is the one
to beat at one row; a kernel without an AMX version (the Q8-layout GEMM) is timed on the others only. The
choice is a measurement, never the CPU's flags alone (ARCHITECTURE.md, invariant 10).

How the table is made (`measure`, `choose`):
- the fastest vector path the CPU runs (by its flags: AVX512-VNNI, else AVX2, else portable) is the baseline,
  what every call takes until a table is set; each other path is probed at a few row counts and kept only if
  it comes within MARGIN of the baseline at one of them (a path SLOW times the baseline at a probe is
  dropped there unless it already came within MARGIN), so noise can lose a possible gain but never the
  baseline;
- the rest are timed in turns at each row count of MEASURED_ROWS, REPEATS times (the least is kept, and
  close calls get more turns), over every call of the model up to FULL_PASS_ROWS rows (one step's weights, as
  the memory sees them) and above it a share of them that keeps the work of a FULL_PASS_ROWS pass (where the
  arithmetic, not the bytes, sets the time);
- the path in use (the baseline before the first count) changes only to one that beats it by MARGIN at two
  neighbouring measured counts (a lone noisy timing moves nothing); counts between two measured ones take
  the lower one's path.
A cache file that does not parse, names another CPU or version, or routes to a path this CPU does not run is
measured again, never trusted.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.ops import kernels

logger = logging.getLogger(__name__)

CACHE_VERSION = 1
_GEMM_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256, 512)
MEASURED_ROWS = {"gemm": _GEMM_ROWS, "gemm_q8": _GEMM_ROWS, "screen": (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)}
PROBE_ROWS = {"gemm": (1, 16, 256), "gemm_q8": (1, 16, 256), "screen": (1, 16, 64)}
MARGIN = 0.03
CLOSE = 0.15
SLOW = 2.0
REPEATS = 3
FULL_PASS_ROWS = 32  # above it, the first FULL_PASS_ROWS / rows of the calls (whole layers: they come in order)

_logged: set[str] = set()


@dataclass(frozen=True)
class Int8Call:
    """One call a model makes of an int8 kernel: `run(x)` with x [rows, in_features] fp32; `shape` names it for
    the cache key (the weight's format and sizes)."""
    in_features: int
    shape: tuple
    run: Callable[[torch.Tensor], object]


@dataclass(frozen=True)
class RouteTable:
    """One kernel's routes: row counts from starts[i] up to starts[i + 1] - 1 take paths[i] (the last: every
    larger count too)."""
    kernel: str
    starts: tuple[int, ...]
    paths: tuple[str, ...]

    def path_for(self, rows: int) -> str:
        index = max(i for i, start in enumerate(self.starts) if start <= max(rows, 1))
        return self.paths[index]

    def per_row(self) -> list[str]:
        """The path of each row count 1..the last start (what kernels.set_int8_routes takes)."""
        return [self.path_for(rows) for rows in range(1, self.starts[-1] + 1)]

    def describe(self) -> str:
        ends = [start - 1 for start in self.starts[1:]] + [None]
        spans = [f"{s}+" if e is None else (f"{s}" if s == e else f"{s}-{e}") for s, e in zip(self.starts, ends)]
        return f"{self.kernel}: " + ", ".join(f"rows {span} {path}" for span, path in zip(spans, self.paths))

    def to_json(self) -> dict:
        return {"starts": list(self.starts), "paths": list(self.paths)}

    @classmethod
    def from_json(cls, kernel: str, data: dict, runs: list[str]) -> "RouteTable":
        """The table `data` describes; ValueError unless it is well formed and every path runs here."""
        starts, paths = data["starts"], data["paths"]
        if not (isinstance(starts, list) and isinstance(paths, list) and starts and len(starts) == len(paths)):
            raise ValueError("starts and paths must be lists of one length")
        if starts[0] != 1 or any(not isinstance(s, int) or isinstance(s, bool) for s in starts) or any(
                b <= a for a, b in zip(starts, starts[1:])) or starts[-1] > kernels.INT8_ROUTE_ROWS:
            raise ValueError(f"starts must rise from 1 to at most {kernels.INT8_ROUTE_ROWS}: {starts}")
        if any(p not in runs for p in paths):
            raise ValueError(f"paths {paths} include one this CPU does not run ({runs})")
        return cls(kernel, tuple(starts), tuple(paths))


def choose(kernel: str, timings: dict[str, dict[int, float]], baseline: str | None = None) -> RouteTable:
    """The table from seconds per path and row count (see the module docstring): the path in use (`baseline`
    before the first count, else the first count's fastest) changes only to one that beats it by MARGIN at a
    measured count and at the next one (or the one before, at the last), so a lone noisy timing moves
    nothing."""
    rows_measured = sorted({rows for per_path in timings.values() for rows in per_path})

    def fastest(rows: int, current: str | None) -> str | None:
        times = {path: per_path[rows] for path, per_path in timings.items() if rows in per_path}
        best = min(times, key=times.get)
        return current if current in times and times[current] <= times[best] * (1 + MARGIN) else best

    starts, paths = [], []
    current = baseline if baseline is not None and baseline in timings else fastest(rows_measured[0], None)
    for i, rows in enumerate(rows_measured):
        pick = fastest(rows, current)
        if pick != current and len(rows_measured) > 1:
            neighbour = rows_measured[i + 1] if i + 1 < len(rows_measured) else rows_measured[i - 1]
            pick = pick if fastest(neighbour, current) == pick else current
        if not paths or pick != paths[-1]:
            starts.append(1 if not starts else rows)
            paths.append(pick)
        current = pick
    return RouteTable(kernel, tuple(starts), tuple(paths))


def baseline_path(paths: list[str]) -> str:
    """The fastest vector path of `paths` (slowest first): what every call takes until a table is set, and the
    path each other one must beat (AMX is no vector path: its tiles pay only from some row count on)."""
    return [path for path in paths if path != "amx"][-1]


def measure(kernel: str, calls: list[Int8Call], paths: list[str], rows_measured=None,
            repeats: int = REPEATS) -> dict[str, dict[int, float]]:
    """Seconds per path and row count of `calls`, the least of the turns (see the module docstring): other
    processes only ever add time, so the least is the call's own cost. The paths are probed first (`probe`);
    row counts where the two fastest are within CLOSE of each other get `repeats` more turns. The kernel's
    routes are forced path by path meanwhile and left to the caller to set."""
    rows_measured = rows_measured or MEASURED_ROWS[kernel]
    inputs = _inputs(calls, max(rows_measured))
    for path in paths:  # first touches: buffers, pages, tile state
        _timed(kernel, path, calls, inputs, 1)
    probes = [r for r in PROBE_ROWS[kernel] if r <= max(rows_measured)] or [min(rows_measured)]
    paths, probed = probe(kernel, calls, inputs, paths, probes)
    if len(paths) == 1:
        return {paths[0]: probed[paths[0]]}
    samples = {path: {rows: [] for rows in rows_measured} for path in paths}
    _turns(kernel, calls, inputs, samples, paths, rows_measured, repeats)
    for rows in rows_measured:
        first, second = sorted(paths, key=lambda path: min(samples[path][rows]))[:2]
        if min(samples[second][rows]) <= min(samples[first][rows]) * (1 + CLOSE):
            _turns(kernel, calls, inputs, samples, [first, second], [rows], repeats)
    return {path: {rows: min(times) for rows, times in per_rows.items()} for path, per_rows in samples.items()}


def probe(kernel: str, calls: list[Int8Call], inputs, paths: list[str], probes: list[int]):
    """(the paths worth measuring, the seconds of every path probed): at each probe row count in turn (the
    least of two timings), a path other than the baseline is dropped when it takes SLOW times the baseline's
    time without having been within MARGIN of it at an earlier probe; after the last, one never within MARGIN
    is dropped. Noise can only drop a path that might have won, never the baseline."""
    baseline = baseline_path(paths)
    seconds = {path: {} for path in paths}
    contender = {baseline}
    for rows in probes:
        for path in paths:
            seconds[path][rows] = min(_timed(kernel, path, calls, inputs, rows) for _ in range(2))
        limit = seconds[baseline][rows]
        contender |= {path for path in paths if seconds[path][rows] <= (1 + MARGIN) * limit}
        paths = [path for path in paths if path in contender or seconds[path][rows] <= SLOW * limit]
    return [path for path in paths if path in contender], seconds


def _turns(kernel, calls, inputs, samples, paths, rows_measured, repeats) -> None:
    """`repeats` timings of each path at each row count into samples[path][rows], the paths taking turns (each
    turn starts with the next path: none always goes first)."""
    for turn in range(repeats):
        for rows in rows_measured:
            for i in range(len(paths)):
                path = paths[(i + turn) % len(paths)]
                samples[path][rows].append(_timed(kernel, path, calls, inputs, rows))


def _inputs(calls: list[Int8Call], rows: int) -> dict[int, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {k: torch.randn(rows, k, generator=generator) for k in {call.in_features for call in calls}}


def _timed(kernel: str, path: str, calls: list[Int8Call], inputs: dict[int, torch.Tensor], rows: int) -> float:
    kernels.set_int8_routes(kernel, [path], remember=False)
    share = calls if rows <= FULL_PASS_ROWS else calls[:max(1, len(calls) * FULL_PASS_ROWS // rows)]
    xs = [inputs[call.in_features][:rows] for call in share]
    start = time.perf_counter()
    for call, x in zip(share, xs):
        call.run(x)
    return time.perf_counter() - start


def ensure_routes(workloads: dict[str, list[Int8Call]]) -> dict[str, RouteTable]:
    """Route each kernel of `workloads` (kernel -> the model's calls of it) by the table measured for these
    calls here, measuring it the first time; returns the tables in use ({} when SPECSERVE_INT8_PATH forces a
    path, the C kernels are off, or there are no calls)."""
    workloads = {kernel: calls for kernel, calls in workloads.items() if calls}
    if not workloads or not kernels.kernel_enabled() or kernels.forced_int8_path() is not None:
        return {}
    runs = {kernel: kernels.int8_paths(kernel) for kernel in workloads}  # the paths each kernel has here
    key = workload_key(workloads)
    file = cache_file()
    tables = _read_entry(file, key, runs)
    if tables is None:
        logger.info("int8 kernels: timing the paths %s on this model's calls (once for this model here)",
                    kernels.int8_paths())
        try:
            timings = {kernel: measure(kernel, calls, runs[kernel]) for kernel, calls in workloads.items()}
        finally:  # measuring forces paths one by one: what was routed before comes back whatever happens
            kernels.set_int8_path(None)
        tables = {kernel: choose(kernel, per_path, baseline_path(runs[kernel]))
                  for kernel, per_path in timings.items()}
        _write_entry(file, key, tables, timings)
    for kernel, table in tables.items():
        kernels.set_int8_routes(kernel, table.per_row())
    if key not in _logged:
        _logged.add(key)
        logger.info("int8 routes (%s, %d threads): %s", kernels.cpu_model(), torch.get_num_threads(),
                    "; ".join(table.describe() for table in tables.values()))
    return tables


def workload_key(workloads: dict[str, list[Int8Call]]) -> str:
    """What a table depends on besides the CPU and the kernel build: the calls' shapes and the thread count."""
    shapes = {kernel: [[call.in_features, *call.shape] for call in calls] for kernel, calls in workloads.items()}
    text = json.dumps({"threads": torch.get_num_threads(), "shapes": shapes}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_file() -> Path:
    """Beside the built kernels, named for their build (sources, flags, compiler and CPU flags)."""
    library = kernels.built_library()
    return library.with_name(library.stem + ".int8-routes.json")


def _read_entry(file: Path, key: str, runs: dict[str, list[str]]) -> dict[str, RouteTable] | None:
    """The tables cached for `key` (one per kernel of `runs`, each naming only the paths runs[kernel] lists), or
    None when there are none or the file cannot be trusted (logged)."""
    if not file.exists():
        return None
    try:
        data = json.loads(file.read_text())
        if data.get("version") != CACHE_VERSION or data.get("cpu") != kernels.cpu_model():
            raise ValueError(f"made for version {data.get('version')} on {data.get('cpu')!r}")
        entry = data["entries"].get(key)
        if entry is None:
            return None
        tables = {kernel: RouteTable.from_json(kernel, entry["tables"][kernel], paths)
                  for kernel, paths in runs.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        logger.warning("int8 routes: %s is not usable (%s); measuring again", file, e)
        return None
    return tables


def _write_entry(file: Path, key: str, tables: dict[str, RouteTable], timings: dict) -> None:
    """Adds `key`'s tables (and the timings behind them) to the file, replacing it whole: a reader sees the old
    file or the new one. A file that cannot be read is started afresh; one that cannot be written is logged."""
    try:
        data = json.loads(file.read_text()) if file.exists() else {}
        current = isinstance(data, dict) and data.get("version") == CACHE_VERSION
        if not (current and data.get("cpu") == kernels.cpu_model() and isinstance(data.get("entries"), dict)):
            data = {}
    except (OSError, ValueError):
        data = {}
    data = {"version": CACHE_VERSION, "cpu": kernels.cpu_model(), "entries": data.get("entries", {})}
    data["entries"][key] = {
        "threads": torch.get_num_threads(),
        "tables": {kernel: table.to_json() for kernel, table in tables.items()},
        "seconds": {kernel: {path: {str(rows): t for rows, t in per_rows.items()}
                             for path, per_rows in per_path.items()} for kernel, per_path in timings.items()},
    }
    try:
        with tempfile.NamedTemporaryFile("w", dir=file.parent, delete=False, suffix=".tmp") as out:
            json.dump(data, out, indent=1)
        os.replace(out.name, file)
    except OSError as e:
        logger.warning("int8 routes: could not write %s: %s", file, e)


def cached_entries() -> dict:
    """The cache file's entries as written (for `specserve kernels`), or {} when there is none or it is not
    usable."""
    try:
        data = json.loads(cache_file().read_text())
        return data["entries"] if data.get("cpu") == kernels.cpu_model() else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
