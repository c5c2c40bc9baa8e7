"""`specserve bench load`'s records and report: one request's deliveries (RequestTrace), one engine's run of a
level (BatchRun), the per-level medians and ratios to plain decoding, the noise floor, the greedy check and
the printed tables.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Sequence

from specserve.bench.common import BenchPrompt, common_prefix_len, format_table, median, prompts_summary, safe_div

PLAIN = "plain"
ITL_DEFINITION = ("each gap between consecutive steps that deliver tokens to a request, divided equally among the "
                  "tokens the later step delivered (3 tokens 30 ms after the previous delivery count 10 ms each); "
                  "the tokens of a request's first delivery count in TTFT, not ITL")


@dataclass
class RequestTrace:
    """One request in one batch: when each step that brought it tokens ended (perf_counter), and how many."""

    prompt: BenchPrompt
    times: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_drafts: int = 0
    num_accepted_tokens: int = 0
    added: float = 0.0  # perf_counter when the request was added
    num_draft_tokens: int = 0

    def observe(self, now: float, output) -> None:
        """Record a step's RequestOutput (its token_ids are the whole output so far)."""
        token_ids = output.outputs[0].token_ids
        if len(token_ids) > len(self.token_ids):
            self.times.append(now)
            self.counts.append(len(token_ids) - len(self.token_ids))
            self.token_ids = list(token_ids)
        metrics = output.metrics
        self.num_drafts, self.num_accepted_tokens = metrics.num_drafts, metrics.num_accepted_tokens
        self.num_draft_tokens = metrics.num_draft_tokens


@dataclass
class BatchRun:
    """One method's engine at one concurrency level: N requests in flight until all of the level's are done."""

    method: str
    concurrency: int
    repeat: int
    start: float  # perf_counter just before the first request was added
    num_steps: int
    traces: list[RequestTrace]
    position: int | None = None  # order among the runs of its round and level (plain runs between methods)
    steps_by_threads: dict[int, int] = field(default_factory=dict)  # the runner's steps by thread count
    peak_kv_blocks_in_use: int = 0  # the most KV-cache blocks requests held after any step of the run
    num_preemptions: int = 0  # requests preempted for lack of KV blocks during the run

    @property
    def wall_s(self) -> float:
        return max(t.times[-1] for t in self.traces) - self.start

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t.token_ids) for t in self.traces)

    @property
    def tokens_per_s(self) -> float:
        return safe_div(self.num_output_tokens, self.wall_s)


def itl_samples(times: Sequence[float], counts: Sequence[int]) -> list[float]:
    """One ITL per token after the first delivery: the gap to the previous delivery over its token count."""
    return [(times[j] - times[j - 1]) / counts[j] for j in range(1, len(times)) for _ in range(counts[j])]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), interpolating linearly between the two nearest ranks (numpy's default)."""
    if not values:
        return float("nan")
    ordered, position = sorted(values), (len(values) - 1) * q / 100
    low, high = int(position), min(int(position) + 1, len(values) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize_run(run: BatchRun) -> dict:
    itl = [s for t in run.traces for s in itl_samples(t.times, t.counts)]
    drafts = sum(t.num_drafts for t in run.traces)
    decode_steps = sum(len(t.times) - 1 for t in run.traces)
    return {"method": run.method, "concurrency": run.concurrency, "repeat": run.repeat, "wall_s": run.wall_s,
            "num_steps": run.num_steps, "num_output_tokens": run.num_output_tokens, "tokens_per_s": run.tokens_per_s,
            "ttft_median_ms": 1000 * median(t.times[0] - t.added for t in run.traces),
            "itl_p50_ms": 1000 * percentile(itl, 50), "itl_p99_ms": 1000 * percentile(itl, 99),
            "num_itl_samples": len(itl),
            "acceptance_length": 1 + sum(t.num_accepted_tokens for t in run.traces) / drafts if drafts else None,
            "drafted_step_share": safe_div(drafts, decode_steps) if run.method != PLAIN else None,
            "num_drafts": drafts, "num_draft_tokens": sum(t.num_draft_tokens for t in run.traces),
            "num_accepted_tokens": sum(t.num_accepted_tokens for t in run.traces),
            "steps_by_threads": {str(t): n for t, n in run.steps_by_threads.items()},
            "peak_kv_blocks_in_use": run.peak_kv_blocks_in_use, "num_preemptions": run.num_preemptions}


def median_rows(runs: list[BatchRun]) -> list[dict]:
    """Per (method, N), the summary of its median-tok/s round (the lower middle for an even count), with every
    round's tok/s, and vs_plain: the median over rounds of its tok/s over plain's beside it at the same N
    (`_plain_beside`: plain runs seconds apart, so a host that turns busy moves both); ordered by N, then
    method as first run."""
    by_key: dict[tuple[int, str], list[BatchRun]] = {}
    for run in sorted(runs, key=lambda r: r.concurrency):
        by_key.setdefault((run.concurrency, run.method), []).append(run)
    rows = []
    for group in by_key.values():
        ranked = sorted(group, key=lambda r: r.tokens_per_s)
        row = summarize_run(ranked[(len(ranked) - 1) // 2])
        ratios = [1.0 if r.method == PLAIN else safe_div(r.tokens_per_s, _plain_beside(r, runs)) for r in group]
        rows.append({**row, "tokens_per_s_rounds": [r.tokens_per_s for r in group], "vs_plain_rounds": ratios,
                     "vs_plain": _lower_median(ratios),
                     "num_drafts_rounds": [sum(t.num_drafts for t in r.traces) for r in group],
                     "steps_by_threads_rounds": [{str(t): n for t, n in r.steps_by_threads.items()} for r in group]})
    return rows


def _plain_beside(run: BatchRun, runs: list[BatchRun]) -> float:
    """Plain decoding's tok/s to compare a run with: the mean of the plain runs right before and after it in
    its round and level where the runs were interleaved, else the round's plain run at that level."""
    same = [r for r in runs if r.method == PLAIN and (r.concurrency, r.repeat) == (run.concurrency, run.repeat)]
    if run.position is not None:
        beside = [r.tokens_per_s for r in same if r.position is not None and abs(r.position - run.position) == 1]
        if beside:
            return sum(beside) / len(beside)
    return median([r.tokens_per_s for r in same]) if same else float("nan")


def _lower_median(values: list[float]) -> float:
    """The median, the lower middle for an even count (a round's own value, never an average of two)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else float("nan")


def plain_vs_plain(runs: list[BatchRun]) -> dict[int, list[float]]:
    """The noise floor of a level's ratios (an A/A comparison): each plain run between two methods, taken as if
    it were a method, against the mean of the plain runs two places before and after it (as far apart as
    a method's neighbours are from each other), the lower median over rounds per place, as vs_plain is. A
    method that changes nothing lands within the spread of these values."""
    ratios: dict[tuple[int, int], list[float]] = {}
    plain = {(r.concurrency, r.repeat, r.position): r.tokens_per_s for r in runs
             if r.method == PLAIN and r.position is not None}
    for (n, repeat, position), tokens_per_s in plain.items():
        before, after = plain.get((n, repeat, position - 2)), plain.get((n, repeat, position + 2))
        if before is not None and after is not None:
            ratios.setdefault((n, position), []).append(safe_div(tokens_per_s, (before + after) / 2))
    floor: dict[int, list[float]] = {}
    for (n, _), values in sorted(ratios.items()):
        floor.setdefault(n, []).append(_lower_median(values))
    return floor


def ratio_table(rows: list[dict], floor: dict[int, list[float]] | None = None) -> list[dict]:
    """One entry per concurrency: plain's tok/s, each speculative method's tok/s over plain's and, with
    interleaved runs, plain's own over plain's (`plain_vs_plain`)."""
    table: dict[int, dict] = {}
    for row in rows:
        entry = table.setdefault(row["concurrency"], {"concurrency": row["concurrency"]})
        if row["method"] == PLAIN:
            entry["plain_tokens_per_s"] = row["tokens_per_s"]
            if floor and floor.get(row["concurrency"]):
                entry["plain_vs_plain"] = floor[row["concurrency"]]
        else:
            entry[row["method"]] = row["vs_plain"]
    return [table[n] for n in sorted(table)]


def greedy_mismatches(runs: list[BatchRun]) -> list[dict]:
    """Every speculative output that differs from plain decoding's for the same request of the same round."""
    plain = {(r.concurrency, r.repeat): r for r in runs if r.method == PLAIN}
    found = []
    for run in runs:
        reference = plain.get((run.concurrency, run.repeat))
        if run.method == PLAIN or reference is None:
            continue
        for i, (ours, ref) in enumerate(zip(run.traces, reference.traces)):
            if ours.token_ids != ref.token_ids:
                diff = common_prefix_len(ours.token_ids, ref.token_ids)
                p = ours.prompt
                found.append({"method": run.method, "concurrency": run.concurrency, "repeat": run.repeat,
                              "request": i, "question_id": p.question_id, "category": p.category, "first_diff": diff,
                              "line": f"specserve {run.method}, {run.concurrency} in flight (round {run.repeat + 1}), "
                                      f"{p.category} question {p.question_id}: output differs from plain decoding "
                                      f"at token {diff}"})
    return found


def build_report(args: argparse.Namespace, env: dict, configs: dict[str, dict],
                 prompts: dict[int, list[BenchPrompt]], runs: list[BatchRun], kv_cache: dict | None = None) -> dict:
    """kv_cache: the plain engine's KV cache (kv_cache_info), or None when not known."""
    rows = median_rows(runs)
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    return {"benchmark": "load", "settings": settings, "environment": env, "speculative_configs": configs,
            "kv_cache": kv_cache,
            "methods": [PLAIN, *configs], "concurrency": sorted(prompts),
            "definitions": {"wall_s": "first request added to last token delivered", "itl": ITL_DEFINITION,
                            "ttft": "first request added to the request's first token",
                            "acceptance_length": "1 + accepted / drafts, over all requests",
                            "drafted_step_share": "steps that verified a draft / steps after the first token",
                            "num_draft_tokens": "draft tokens verified, over the run's requests",
                            "steps_by_threads": "the target's forward passes in the run by thread count (the "
                                                "runner's thread policy picks one or all threads per step size)",
                            "plain_vs_plain": "noise floor: plain runs between methods against the plain runs "
                                              "two places away, median over rounds per place",
                            "peak_kv_blocks_in_use": "the most KV-cache blocks referenced by requests after any "
                                                     "step of the run",
                            "num_preemptions": "requests preempted for lack of KV blocks during the run"},
            "prompts": {n: prompts_summary(p) for n, p in prompts.items()}, "results": rows,
            "ratio_table": ratio_table(rows, plain_vs_plain(runs)),
            "greedy_compared": sum(len(r.traces) for r in runs if r.method != PLAIN),
            "greedy_mismatches": greedy_mismatches(runs)}


def format_report(report: dict) -> str:
    """Throughput ratios, ITL and acceptance, one row per concurrency; then the greedy check."""
    methods, rows = report["methods"], report["results"]
    spec = methods[1:]
    cell = {(r["concurrency"], r["method"]): r for r in rows}
    levels = report["concurrency"]
    floor = {t["concurrency"]: t.get("plain_vs_plain") for t in report["ratio_table"]}
    throughput = [[n, cell[n, PLAIN]["tokens_per_s"], *[_ratio(cell[n, m]["vs_plain"]) for m in spec],
                   _spread(floor[n])] for n in levels]
    itl = [[n, *[f"{cell[n, m]['itl_p50_ms']:.1f} / {cell[n, m]['itl_p99_ms']:.1f}" for m in methods]] for n in levels]
    accept = [[n, *[_acceptance(cell[n, m]) for m in spec]] for n in levels]
    mismatches = report["greedy_mismatches"]
    lines = ["Total output tok/s (plain) and each method's over plain's:",
             format_table(["concurrency", "plain tok/s", *[f"{m} / plain" for m in spec], "plain / plain"],
                          throughput), "",
             "Inter-token latency p50 / p99 ms (a delivery's gap split equally among its tokens):",
             format_table(["concurrency", *methods], itl)]
    kv = report.get("kv_cache")
    if kv:
        blocks = [[n, *[f"{cell[n, m]['peak_kv_blocks_in_use']} ({cell[n, m]['num_preemptions']})" for m in methods]]
                  for n in levels]
        lines += ["", f"KV cache: {kv['kv_cache_dtype']}, {kv['bytes_per_token']:,.0f} bytes a token (plain's), "
                      f"{kv['num_blocks']} blocks of {kv['block_size']} tokens; peak blocks in use (preemptions):",
                  format_table(["concurrency", *methods], blocks)]
    if spec:
        lines += ["", "Mean acceptance length (share of decode steps that verified a draft):",
                  format_table(["concurrency", *spec], accept), "",
                  f"greedy check: {report['greedy_compared'] - len(mismatches)}/{report['greedy_compared']} "
                  f"speculative outputs identical to plain decoding's" + (" MISMATCH" if mismatches else "")]
    return "\n".join(lines)


def _ratio(value: float | None) -> str | None:
    return None if value is None or value != value else f"{value:.2f}x"


def _spread(values: list[float] | None) -> str | None:
    """The range of a level's plain-vs-plain ratios: how far a method that changes nothing may land."""
    return f"{min(values):.2f}-{max(values):.2f}x" if values else None


def _acceptance(row: dict) -> str | None:
    if row["acceptance_length"] is None:
        return None
    return f"{row['acceptance_length']:.2f} ({row['drafted_step_share']:.0%})"
