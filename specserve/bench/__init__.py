"""`specserve bench ...`: benchmarks that print a table and write JSON.

Each benchmark module has `add_parser(bench_subparsers)`, whose subcommand sets `func(args) -> exit code`;
adding one is a line in BENCHMARKS.
"""
from __future__ import annotations

import importlib

BENCHMARKS = ("throughput", "latency", "serve", "load", "structured")  # module names under specserve.bench


def add_bench_parser(sub) -> None:
    """Add `bench` and its benchmarks to the `specserve` command's subparsers."""
    bench = sub.add_parser("bench", help="benchmarks (specserve vs transformers on Spec-Bench)",
                           description="Benchmarks: each prints a table and writes JSON.")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name in BENCHMARKS:
        importlib.import_module(f"specserve.bench.{name}").add_parser(bench_sub)
