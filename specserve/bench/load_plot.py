"""The figures of `specserve bench load`, drawn from its JSON reports: throughput over plain decoding's and
inter-token latency against concurrency for one run; total throughput and latency of several runs together
(one per KV cache dtype, say). The only user of matplotlib (the `bench` extra), imported on use."""
from __future__ import annotations

from pathlib import Path

from specserve.bench.load_report import PLAIN


def plot_load(report: dict, path: str | Path) -> Path:
    """Left: each method's total tok/s over plain's; right: p50 ITL incl. plain; both against concurrency
    on a log2 axis. `report` is what `specserve bench load` writes (or its JSON file, loaded)."""
    fig, (left, right) = _figure()
    for i, method in enumerate(report["methods"]):  # plain first, in black; one colour per method after it
        xs, mine = _rows(report, method)
        style = {"marker": "o", "label": method, "color": f"C{i - 1}" if method != PLAIN else "black"}
        if method != PLAIN:
            left.plot(xs, [_num(r["vs_plain"]) for r in mine], **style)
        right.plot(xs, [_num(r["itl_p50_ms"]) for r in mine], **style)
    left.axhline(1.0, color="black", linestyle="--", linewidth=1, label="plain (1.0)")
    left.axhline(0.98, color="gray", linestyle="--", linewidth=1, label="0.98")
    left.set(ylabel="total output tok/s / plain's", title="throughput vs plain decoding")
    right.set(ylabel="inter-token latency p50 (ms)", title="inter-token latency")
    return _finish(fig, (left, right), report["concurrency"], report.get("settings", {}), path)


def plot_loads(reports: list[dict], path: str | Path) -> Path:
    """Several reports on shared axes against concurrency (log2): left, each method's total output tok/s;
    right, its inter-token latency p50 (solid) and p99 (dotted); one colour per report and method, labelled
    with the report's KV cache dtype."""
    fig, (left, right) = _figure()
    colour, levels = 0, set()
    for report in reports:
        kv = (report.get("kv_cache") or {}).get("kv_cache_dtype") or report.get("settings", {}).get("kv_cache_dtype")
        for method in report["methods"]:
            xs, mine = _rows(report, method)
            levels.update(xs)
            label, c = f"{method}, KV {kv or '?'}", f"C{colour}"
            colour += 1
            left.plot(xs, [_num(r["tokens_per_s"]) for r in mine], marker="o", color=c, label=label)
            right.plot(xs, [_num(r["itl_p50_ms"]) for r in mine], marker="o", color=c, label=f"{label} p50")
            right.plot(xs, [_num(r["itl_p99_ms"]) for r in mine], marker=".", linestyle=":", color=c,
                       label=f"{label} p99")
    left.set(ylabel="total output tok/s", title="throughput")
    right.set(ylabel="inter-token latency (ms)", title="inter-token latency p50 and p99")
    return _finish(fig, (left, right), sorted(levels), reports[0].get("settings", {}) if reports else {}, path)


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5))
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, 2)


def _rows(report: dict, method: str) -> tuple[list[int], list[dict]]:
    """A method's result rows by concurrency, and the concurrencies."""
    mine = sorted((r for r in report["results"] if r["method"] == method), key=lambda r: r["concurrency"])
    return [r["concurrency"] for r in mine], mine


def _finish(fig, axes, levels: list[int], settings: dict, path: str | Path) -> Path:
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set(xlabel="requests in flight")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"specserve bench load: {settings.get('model') or 'default model'}, "
                 f"{settings.get('max_tokens')} new tokens per request")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def _num(value: float | None) -> float:
    return float("nan") if value is None else value  # the JSON writes NaN as null
