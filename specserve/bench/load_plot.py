"""The figure of `specserve bench load`, drawn from its JSON report: throughput over plain decoding's and
inter-token latency against concurrency. The only user of matplotlib (the `bench` extra), imported on use."""
from __future__ import annotations

from pathlib import Path

from specserve.bench.load_report import PLAIN


def plot_load(report: dict, path: str | Path) -> Path:
    """Left: each method's total tok/s over plain's; right: p50 ITL incl. plain; both against concurrency
    on a log2 axis. `report` is what `specserve bench load` writes (or its JSON file, loaded)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    for i, method in enumerate(report["methods"]):  # plain first, in black; one colour per method after it
        mine = sorted((r for r in report["results"] if r["method"] == method), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in mine]
        style = {"marker": "o", "label": method, "color": f"C{i - 1}" if method != PLAIN else "black"}
        if method != PLAIN:
            left.plot(xs, [_num(r["vs_plain"]) for r in mine], **style)
        right.plot(xs, [_num(r["itl_p50_ms"]) for r in mine], **style)
    left.axhline(1.0, color="black", linestyle="--", linewidth=1, label="plain (1.0)")
    left.axhline(0.98, color="gray", linestyle="--", linewidth=1, label="0.98")
    left.set(ylabel="total output tok/s / plain's", title="throughput vs plain decoding")
    right.set(ylabel="inter-token latency p50 (ms)", title="inter-token latency")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(report["concurrency"], [str(n) for n in report["concurrency"]])
        ax.set(xlabel="requests in flight")
        ax.grid(alpha=0.3)
        ax.legend()
    settings = report.get("settings", {})
    fig.suptitle(f"specserve bench load: {settings.get('model') or 'default model'}, "
                 f"{settings.get('max_tokens')} new tokens per request")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def _num(value: float | None) -> float:
    return float("nan") if value is None else value  # the JSON writes NaN as null
