"""`specserve bench load`: total output tok/s and inter-token latency against the number of requests in flight,
plain decoding against each speculative method, on the same Spec-Bench prompts in one run.

At every level plain decoding runs before, between and after the methods, and a method's ratio to plain is
taken against the plain runs beside it; plain runs taken the same way against plain give the level's noise
floor (`plain_vs_plain`). With --lockstep every method's batch of a level runs at once instead, the engines
taking turns a step each, each timed by its own steps (`run_lockstep`). Times are taken after each engine
step. Wall time: first request added to last token delivered. TTFT: first request added to a request's first
token. ITL is per token (ITL_DEFINITION); p50/p99 are over every token. The records and the report are in
load_report.py.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import time
from pathlib import Path

from specserve.bench.common import (
    DEFAULT_DATASET, BenchPrompt, Stopwatch, environment_info, mismatch_exit_status, read_specbench, render_prompts,
    select_spread, write_json)
from specserve.bench.latency import WARMUP_MESSAGE, WARMUP_TOKENS, spec_configs
from specserve.bench.latency_report import DEFAULT_NUM_SPECULATIVE_TOKENS
from specserve.bench.load_report import ITL_DEFINITION, PLAIN, BatchRun, RequestTrace, build_report, format_report

DEFAULT_CONCURRENCY = "1,2,4,8,16,32,64"
DEFAULT_METHODS = "ngram,suffix,draft_model,auto"
DEFAULT_OUTPUT = "bench_results/load.json"
DEFAULT_PLOT = "bench_results/load.png"


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
                   help="only redraw --plot from a JSON file this command wrote, or from several (comma-separated: "
                        "runs with different --kv-cache-dtype, say), drawn together as total tok/s and "
                        "inter-token latency per method and KV dtype; runs no model")
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
        paths = [p for p in args.replot.split(",") if p]
        missing = [p for p in paths if not Path(p).is_file()]
        if missing or not paths:
            raise ValueError(f"--replot: no such file {', '.join(missing) or repr(args.replot)}")
        reports = [json.loads(Path(p).read_text()) for p in paths]
        return 0 if save_plot(reports[0] if len(reports) == 1 else reports, args.plot or DEFAULT_PLOT) else 1
    check_args(args)
    configs = spec_configs(args)
    levels = parse_concurrency(args.concurrency)
    env = environment_info()
    print(header_line(args, env, configs, levels), flush=True)
    prompts, runs, kv_cache = run_rounds(args, configs, levels, read_specbench(args.dataset))
    env["load_average_1m_end"] = environment_info().get("load_average_1m")  # the machine may be shared
    report = build_report(args, env, configs, prompts, runs, kv_cache)
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
               ) -> tuple[dict[int, list[BenchPrompt]], list[BatchRun], dict]:
    """Every round loads every engine up front, so a machine that slows down mid-run slows all methods
    alike; a later round reloads them, since a method may keep earlier outputs (suffix's cache). Returns the
    prompts by level, the runs, and the plain engine's KV cache (kv_cache_info)."""
    methods = [PLAIN, *configs]
    by_level, runs, kv_cache = {}, [], {}
    for r in range(args.repeats):
        engines = {m: load_engine(args, m, configs.get(m), max(levels)) for m in methods}
        if r == 0:
            by_level = prompts_by_level(engines[PLAIN].get_tokenizer(), rows, levels, args.requests_per_slot,
                                        args.min_requests)
            kv_cache = kv_cache_info(engines[PLAIN].llm_engine)
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
    return by_level, runs, kv_cache


def kv_cache_info(engine) -> dict:
    """An engine's KV cache: its dtype, bytes a token (the target's and any drafter's), blocks and their size."""
    return {"kv_cache_dtype": engine.config.kv_cache_dtype, "bytes_per_token": engine.kv_bytes_per_token,
            "num_blocks": engine.kv_cache_manager.num_blocks, "block_size": engine.config.block_size}


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
        self.preemptions_before = self.engine.scheduler.num_preemptions
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.traces = {f"load-{tag}-{i}": RequestTrace(p) for i, p in enumerate(prompts)}
        self.waiting = list(self.traces.items())[::-1]
        self.run = BatchRun(method, concurrency or len(prompts), repeat, self._now(), 0, list(self.traces.values()))
        self.thread_runs = dict(self._threads().runs)
        for _ in range(min(concurrency or len(prompts), len(prompts))):
            self._add_next()

    def _threads(self):
        return self.engine.runner.thread_policy

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
            runs = self._threads().runs
            self.run.steps_by_threads = {t: n - self.thread_runs.get(t, 0) for t, n in sorted(runs.items())}
            self.run.num_preemptions = self.engine.scheduler.num_preemptions - self.preemptions_before
            return False
        start = time.perf_counter()
        outputs = self.engine.step()
        self.run.num_steps += 1
        self.clock += time.perf_counter() - start
        in_use = self.engine.scheduler.get_stats().kv_cache_blocks_in_use
        self.run.peak_kv_blocks_in_use = max(self.run.peak_kv_blocks_in_use, in_use)
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


def save_plot(report: dict | list[dict], path: str) -> bool:
    """Draw the figure of one report, or of several together (specserve.bench.load_plot), or say why not when
    matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        print(f"note: matplotlib is not installed, so {path} was not drawn (pip install 'specserve[bench]')")
        return False
    from specserve.bench.load_plot import plot_load, plot_loads

    print(f"wrote {plot_load(report, path) if isinstance(report, dict) else plot_loads(report, path)}")
    return True
