"""`specserve bench load`: total output tok/s and inter-token latency against the number of requests in flight,
plain decoding against each speculative method, on the same Spec-Bench prompts in one run.

At every level plain decoding runs before, between and after the methods, and a method's ratio to plain is
taken against the plain runs beside it; plain runs taken the same way against plain give the level's noise
floor (`plain_vs_plain`). With --lockstep every method's batch of a level runs at once instead, the engines
taking turns a step each, each timed by its own steps (`run_lockstep`). Times are taken after each engine step. Wall time: first request
added to last token delivered. TTFT: first request added to a request's first token. ITL is per token
(ITL_DEFINITION); p50/p99 are over every token.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from specserve.bench.common import (
    DEFAULT_DATASET, BenchPrompt, Stopwatch, common_prefix_len, environment_info, format_table, median,
    mismatch_exit_status, prompts_summary, read_specbench, render_prompts, safe_div, select_spread, write_json)
from specserve.bench.latency import WARMUP_MESSAGE, WARMUP_TOKENS, spec_configs
from specserve.bench.latency_report import DEFAULT_NUM_SPECULATIVE_TOKENS

DEFAULT_CONCURRENCY = "1,2,4,8,16,32,64"
DEFAULT_METHODS = "ngram,suffix,draft_model,auto"
DEFAULT_OUTPUT = "bench_results/load.json"
DEFAULT_PLOT = "bench_results/load.png"
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

    @property
    def wall_s(self) -> float:
        return max(t.times[-1] for t in self.traces) - self.start

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t.token_ids) for t in self.traces)

    @property
    def tokens_per_s(self) -> float:
        return safe_div(self.num_output_tokens, self.wall_s)


# ---------------------------------------------------------------- command line


def add_parser(bench_sub) -> None:
    from specserve.engine_args import add_engine_args

    p = bench_sub.add_parser(
        "load", help="total tok/s and inter-token latency vs concurrency: plain vs each speculative method",
        description="For each concurrency N, plain decoding and each speculative method (all loaded up front) get "
                    "the same Spec-Bench prompts (chat template, greedy, EOS ignored), N in flight: N requests "
                    "start at once and each one that finishes is replaced by the next until --requests-per-slot x N "
                    "have run, as N clients that each send their next request when the last is answered. Reports total "
                    f"output tok/s, its ratio to plain, TTFT and inter-token latency p50/p99, a token's ITL being "
                    f"{ITL_DEFINITION}. Each N takes the next N prompts of a spread over the categories, so no "
                    "engine sees a prompt twice (a method that caches earlier outputs would copy them); before a level "
                    "is timed, every engine runs a short warm-up prompt N at a time. Exits with "
                    "status 1 when a speculative output differs from plain decoding's. Redraw the PNG from the "
                    "JSON with: specserve bench load --replot JSON --plot OUT.png")
    p.add_argument("--dataset", default=DEFAULT_DATASET, help="Spec-Bench JSONL (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default: %(default)s)")
    p.add_argument("--concurrency", default=DEFAULT_CONCURRENCY,
                   help="comma-separated numbers of requests in flight (default: %(default)s)")
    p.add_argument("--requests-per-slot", type=int, default=2,
                   help="requests each of the N slots runs in turn at concurrency N (default: %(default)s)")
    p.add_argument("--min-requests", type=int, default=16,
                   help="at least this many requests per level, so a level at low concurrency runs long enough "
                        "to time (default: %(default)s)")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help=f"comma-separated speculative methods run besides plain decoding, from "
                        f"{', '.join(DEFAULT_NUM_SPECULATIVE_TOKENS)} (default: %(default)s)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help=f"k for every speculative method (default per method: {DEFAULT_NUM_SPECULATIVE_TOKENS})")
    p.add_argument("--spec-config-json", type=json.loads, default=None,
                   help='per-method speculative_config overrides, e.g. \'{"ngram": {"prompt_lookup_max": 3}}\'')
    p.add_argument("--draft-model", default=None,
                   help="HF folder or .gguf file for draft_model (default: the target itself with int8 weights)")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds, each on freshly loaded engines with the methods in a rotated order; each "
                        "(method, N) reports its median-tok/s round, and its ratio to plain is the median "
                        "over rounds of its tok/s over the mean of the plain runs right before and after it "
                        "(plain runs between the methods at every level); 'plain / plain' is the same ratio for the "
                        "plain runs between methods, the level's noise floor (default: %(default)s)")
    p.add_argument("--lockstep", action="store_true",
                   help="run every method's batch of a level at once, the engines taking turns one step each, and "
                        "time each engine by its own steps: a shared host's slow moments then fall on neighbouring "
                        "steps of all engines alike (default: each method's batch alone, plain runs between)")
    p.add_argument("--output-json", default=DEFAULT_OUTPUT, help="where to write results (default: %(default)s)")
    p.add_argument("--plot", default=DEFAULT_PLOT,
                   help="PNG to draw, '' for none; needs matplotlib, specserve[bench] (default: %(default)s)")
    p.add_argument("--replot", metavar="JSON", default=None,
                   help="only redraw --plot from a JSON file this command wrote; runs no model")
    add_engine_args(p, speculation_flags=False)
    p.set_defaults(max_num_seqs=None, func=cmd_load)


def parse_concurrency(text: str) -> list[int]:
    """The levels in ascending order; each an integer >= 1, none twice."""
    try:
        levels = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency must be a comma-separated list of integers >= 1, got {text!r}")
    if len(set(levels)) != len(levels):
        raise ValueError(f"--concurrency lists a value twice: {text}")
    return sorted(levels)


def check_args(args: argparse.Namespace) -> None:
    levels = parse_concurrency(args.concurrency)
    if args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be >= 2 (inter-token latency needs a token after the first), "
                         f"got {args.max_tokens}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.requests_per_slot < 1:
        raise ValueError(f"--requests-per-slot must be >= 1, got {args.requests_per_slot}")
    if args.min_requests < 1:
        raise ValueError(f"--min-requests must be >= 1, got {args.min_requests}")
    if args.max_num_seqs is not None and args.max_num_seqs < max(levels):
        raise ValueError(f"--max-num-seqs {args.max_num_seqs} is below the largest --concurrency {max(levels)}: "
                         "requests would queue instead of running together")
    if args.plot and not args.plot.endswith(".png"):
        raise ValueError(f"--plot must name a .png file (or be empty for no plot), got {args.plot!r}")
    if args.speculative_config is not None:
        raise ValueError("bench load takes --methods and --spec-config-json, not --speculative-config")
    spec_configs(args)  # refuses bad methods and keys before any model loads


def cmd_load(args: argparse.Namespace) -> int:
    if args.replot:
        if not Path(args.replot).is_file():
            raise ValueError(f"--replot: no such file {args.replot}")
        return 0 if save_plot(json.loads(Path(args.replot).read_text()), args.plot or DEFAULT_PLOT) else 1
    check_args(args)
    configs = spec_configs(args)
    levels = parse_concurrency(args.concurrency)
    env = environment_info()
    print(header_line(args, env, configs, levels), flush=True)
    prompts, runs = run_rounds(args, configs, levels, read_specbench(args.dataset))
    env["load_average_1m_end"] = environment_info().get("load_average_1m")  # the machine may be shared
    report = build_report(args, env, configs, prompts, runs)
    print()
    print(format_report(report))
    print(f"\nwrote {write_json(args.output_json, report)}")
    if args.plot:
        save_plot(report, args.plot)
    return mismatch_exit_status("load", [m["line"] for m in report["greedy_mismatches"]])


def header_line(args: argparse.Namespace, env: dict, configs: dict[str, dict], levels: list[int]) -> str:
    methods = ", ".join(f"{m} (k={c.get('num_speculative_tokens', 'per proposer')})" for m, c in configs.items()) or "none"
    return (f"specserve bench load: model {args.model or 'default (SmolLM2-135M-Instruct GGUF)'}, concurrency "
            f"{', '.join(map(str, levels))}, {args.max_tokens} new tokens per request, {args.repeats} round(s), "
            f"greedy, EOS ignored; speculative methods: {methods}\n"
            f"torch {env['torch']} with {env['torch_num_threads']} threads on {env['cpu_count']} CPUs "
            f"({env['cpu']}), load average {env.get('load_average_1m', '?')}")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- running


def run_rounds(args: argparse.Namespace, configs: dict[str, dict], levels: list[int], rows: list[dict]
               ) -> tuple[dict[int, list[BenchPrompt]], list[BatchRun]]:
    """Every round loads every engine up front, so a machine that slows down mid-run slows all methods
    alike; a later round reloads them, since a method may keep earlier outputs (suffix's cache)."""
    methods = [PLAIN, *configs]
    by_level, runs = {}, []
    for r in range(args.repeats):
        engines = {m: load_engine(args, m, configs.get(m), max(levels)) for m in methods}
        if r == 0:
            by_level = prompts_by_level(engines[PLAIN].get_tokenizer(), rows, levels, args.requests_per_slot,
                                        args.min_requests)
        spec = methods[1:]
        order = spec[r % len(spec):] + spec[:r % len(spec)] if spec else []
        for n in levels:
            warm_up(engines, n)
            if args.lockstep:
                runs += run_lockstep(engines, [PLAIN, *order], by_level[n], args.max_tokens, f"{r}-{n}", r, n)
                for run in runs[-len(methods):]:
                    _log(f"round {r + 1}, {n} in flight, {run.method}: {run.tokens_per_s:.1f} tok/s (own steps)")
                continue
            for position, method in enumerate(interleaved(order)):
                runs.append(run_batch(engines[method], method, by_level[n], args.max_tokens, f"{r}-{n}", r, n))
                runs[-1].position = position
                _log(f"round {r + 1}, {n} in flight, {method}: {runs[-1].tokens_per_s:.1f} tok/s")
        del engines
        gc.collect()
    return by_level, runs


def interleaved(methods: list[str]) -> list[str]:
    """Plain decoding before, between and after the speculative methods (plain, m1, plain, m2, ..., plain):
    each method is compared with the plain runs right before and after it, seconds apart, since a shared
    host drifts by several percent over the minutes a level takes."""
    order = [PLAIN]
    for method in methods:
        order += [method, PLAIN]
    return order


def load_engine(args: argparse.Namespace, method: str, spec_config: dict | None, max_concurrency: int):
    from specserve.engine_args import engine_kwargs
    from specserve.llm import LLM

    kwargs = engine_kwargs(args)
    kwargs.update(speculative_config=spec_config, max_num_seqs=args.max_num_seqs or max_concurrency)
    with Stopwatch() as sw:
        llm = LLM(**kwargs)
    _log(f"{method}: loaded in {sw.seconds:.1f} s")
    return llm


def warm_up(engines: dict, concurrency: int = 1) -> None:
    """Short requests, `concurrency` at once, through every engine before a level's measured runs, on a prompt
    that is not a Spec-Bench question (nothing for caches): each engine meets the level's step sizes before
    it is timed (new buffers, its thread choices), as plain decoding's later runs of the level have."""
    warmup = render_prompts(engines[PLAIN].get_tokenizer(), [{"category": "warmup", "turns": [WARMUP_MESSAGE]}])
    for method, llm in engines.items():
        run_batch(llm, method, warmup * concurrency, WARMUP_TOKENS, "warmup")


def prompts_by_level(tokenizer, rows: list[dict], levels: list[int], per_slot: int = 1, min_requests: int = 1
                     ) -> dict[int, list[BenchPrompt]]:
    """Level N's max(N x per_slot, min_requests) prompts: the next ones of a round-robin over the
    categories, wrapping around (with a note) only when the dataset has fewer questions than all levels
    together."""
    sizes = {n: max(n * per_slot, min_requests) for n in levels}
    total = sum(sizes.values())
    spread = render_prompts(tokenizer, select_spread(rows, min(total, len(rows))))
    if total > len(spread):
        _log(f"note: {total} requests over all levels but {len(spread)} questions: prompts repeat, and a method "
             "that caches earlier outputs may find their answers")
    by_level, start = {}, 0
    for n in levels:
        by_level[n] = [spread[(start + i) % len(spread)] for i in range(sizes[n])]
        start += sizes[n]
    return by_level


def run_batch(llm, method: str, prompts: list[BenchPrompt], max_tokens: int, tag: str, repeat: int = 0,
              concurrency: int | None = None) -> BatchRun:
    """`concurrency` requests in flight (default: all at once); each that finishes is replaced by the next
    prompt; `step()` until none is left, timing each step's deliveries."""
    batch = Batch(llm, method, prompts, max_tokens, tag, repeat, concurrency)
    while batch.step():
        pass
    return batch.run


def run_lockstep(engines: dict, methods: list[str], prompts: list[BenchPrompt], max_tokens: int, tag: str,
                 repeat: int, concurrency: int) -> list[BatchRun]:
    """Every method's batch at once, the engines taking turns one step each: each batch's times are on its
    own clock (the seconds of its own steps and deliveries), so a host that slows for a moment slows
    neighbouring steps of every engine instead of one engine's whole run."""
    batches = [Batch(engines[m], m, prompts, max_tokens, f"{tag}-{m}", repeat, concurrency, own_clock=True)
               for m in methods]
    running = list(batches)
    while running:
        running = [b for b in running if b.step()]
    return [b.run for b in batches]


class Batch:
    """One engine's run of a level, a step at a time: N requests in flight, each that finishes replaced by
    the next prompt. Times are perf_counter readings, or with own_clock the seconds this batch's own steps
    (with their bookkeeping) took so far."""

    def __init__(self, llm, method: str, prompts: list[BenchPrompt], max_tokens: int, tag: str, repeat: int = 0,
                 concurrency: int | None = None, own_clock: bool = False) -> None:
        from specserve.sampling_params import SamplingParams

        self.engine, self.method, self.own_clock, self.clock = llm.llm_engine, method, own_clock, 0.0
        self.engine.kv_cache_manager.reset_prefix_cache()  # every run prefills its prompts in full
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.traces = {f"load-{tag}-{i}": RequestTrace(p) for i, p in enumerate(prompts)}
        self.waiting = list(self.traces.items())[::-1]
        self.run = BatchRun(method, concurrency or len(prompts), repeat, self._now(), 0, list(self.traces.values()))
        for _ in range(min(concurrency or len(prompts), len(prompts))):
            self._add_next()

    def _now(self) -> float:
        return self.clock if self.own_clock else time.perf_counter()

    def _add_next(self) -> None:
        request_id, trace = self.waiting.pop()
        trace.added = self._now()
        try:
            self.engine.add_request(request_id, {"prompt_token_ids": list(trace.prompt.token_ids)}, self.params)
        except ValueError as e:
            raise ValueError(f"{self.method}: question {trace.prompt.question_id} cannot run: {e}") from e

    def step(self) -> bool:
        """One engine step and its deliveries; False once every request is done."""
        if not self.engine.has_unfinished_requests():
            return False
        start = time.perf_counter()
        outputs = self.engine.step()
        self.run.num_steps += 1
        self.clock += time.perf_counter() - start
        now, finished = self._now(), 0
        for out in outputs:
            if out.error:
                raise RuntimeError(f"{self.method}: request {out.request_id} (question "
                                   f"{self.traces[out.request_id].prompt.question_id}) failed: {out.error}")
            self.traces[out.request_id].observe(now, out)
            finished += out.finished
        start = time.perf_counter()
        for _ in range(min(finished, len(self.waiting))):
            self._add_next()
        self.clock += time.perf_counter() - start
        return True


# ---------------------------------------------------------------- report


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
            "num_accepted_tokens": sum(t.num_accepted_tokens for t in run.traces)}


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
                     "vs_plain": _lower_median(ratios)})
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
                 prompts: dict[int, list[BenchPrompt]], runs: list[BatchRun]) -> dict:
    rows = median_rows(runs)
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    return {"benchmark": "load", "settings": settings, "environment": env, "speculative_configs": configs,
            "methods": [PLAIN, *configs], "concurrency": sorted(prompts),
            "definitions": {"wall_s": "first request added to last token delivered", "itl": ITL_DEFINITION,
                            "ttft": "first request added to the request's first token",
                            "acceptance_length": "1 + accepted / drafts, over all requests",
                            "drafted_step_share": "steps that verified a draft / steps after the first token",
                            "num_draft_tokens": "draft tokens verified, over the run's requests",
                            "plain_vs_plain": "noise floor: plain runs between methods against the plain runs "
                                              "two places away, median over rounds per place"},
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


def save_plot(report: dict, path: str) -> bool:
    """Draw the figure (specserve.bench.load_plot), or say why not when matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        print(f"note: matplotlib is not installed, so {path} was not drawn (pip install 'specserve[bench]')")
        return False
    from specserve.bench.load_plot import plot_load

    print(f"wrote {plot_load(report, path)}")
    return True
