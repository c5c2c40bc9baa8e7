"""`specserve bench throughput`: specserve against transformers' `generate` on the same model and the same
Spec-Bench prompts, one request at a time and with many requests in flight.
"""
from __future__ import annotations

import argparse
import gc
import sys
from dataclasses import dataclass, field

from specserve.bench.common import (
    BenchPrompt, Stopwatch, add_dataset_args, common_prefix_len, environment_info, evenly_spaced, format_table,
    hf_generate, load_bench_prompts, load_hf_model, median, mismatch_exit_status, prompts_summary,
    request_latencies, safe_div, write_json)
from specserve.config import resolve_model_name

DEFAULT_OUTPUT = "bench_results/throughput.json"
WARMUP_TOKENS = 8


@dataclass
class ScenarioResult:
    """One engine on one scenario: output tokens over the wall time of the whole scenario."""

    scenario: str  # "batch1" or "concurrent"
    engine: str  # "specserve" or "transformers"
    num_requests: int
    concurrency: int
    num_prompt_tokens: int
    num_output_tokens: int
    wall_s: float
    output_token_ids: list[list[int]] = field(repr=False)
    extra: dict = field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float:
        return safe_div(self.num_output_tokens, self.wall_s)

    def to_json(self) -> dict:
        return {"scenario": self.scenario, "engine": self.engine, "num_requests": self.num_requests,
                "concurrency": self.concurrency, "num_prompt_tokens": self.num_prompt_tokens,
                "num_output_tokens": self.num_output_tokens, "wall_s": self.wall_s,
                "output_tokens_per_s": self.output_tokens_per_s, **self.extra}


# ---------------------------------------------------------------- command line


def add_parser(bench_sub) -> None:
    from specserve.engine_args import add_engine_args

    p = bench_sub.add_parser(
        "throughput", help="tokens/s of specserve vs transformers on Spec-Bench",
        description="Generate on the same Spec-Bench prompts with specserve and with transformers' generate "
                    "(greedy, EOS ignored), one request at a time and with many in flight; print a table "
                    "and write JSON. With speculation, plain decoding runs too (untimed) and the command exits "
                    "with status 1 when a speculative output differs from it.")
    add_dataset_args(p)
    p.add_argument("--batch1-prompts", type=int, default=4,
                   help="prompts run one at a time, evenly spaced over the selection (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=32,
                   help="requests in flight in the concurrent scenario: specserve's max_num_seqs (unless "
                        "--max-num-seqs is given) and transformers' padded batch size (default: %(default)s)")
    p.add_argument("--skip-hf", action="store_true", help="run specserve only")
    p.add_argument("--output-json", default=DEFAULT_OUTPUT, help="where to write results (default: %(default)s)")
    add_engine_args(p, speculate_by_default=False)  # specserve plain against transformers unless asked
    p.set_defaults(max_num_seqs=None, func=cmd_throughput)


def check_args(args: argparse.Namespace) -> None:
    for name, low in (("num_prompts", 1), ("max_tokens", 1), ("batch1_prompts", 0), ("concurrency", 1)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if args.batch1_prompts > args.num_prompts:
        raise ValueError(f"--batch1-prompts ({args.batch1_prompts}) cannot exceed --num-prompts ({args.num_prompts})")


def cmd_throughput(args: argparse.Namespace) -> int:
    from specserve.engine_args import speculative_config

    check_args(args)
    env = environment_info()
    print(header_line(args, env), flush=True)
    llm = load_specserve(args)
    prompts = load_bench_prompts(llm.get_tokenizer(), args.dataset, args.num_prompts)
    batch1 = evenly_spaced(prompts, args.batch1_prompts)
    eos_token_ids = set(llm.get_tokenizer().eos_token_ids)
    pad_token_id = llm.get_tokenizer().eos_token_id
    results = run_specserve(llm, prompts, batch1, args.max_tokens)
    plain = run_plain_reference(llm, prompts, batch1, args.max_tokens) if speculative_config(args) else None
    del llm
    gc.collect()
    if not args.skip_hf:
        results += run_transformers(args, prompts, batch1, pad_token_id)
    env["load_average_1m_end"] = environment_info().get("load_average_1m")  # the machine may be shared
    report = build_report(args, env, prompts, batch1, results, eos_token_ids, plain)
    print()
    print(format_report(report))
    path = write_json(args.output_json, report)
    print(f"\nwrote {path}")
    return mismatch_exit_status("throughput", speculative_mismatches(report))


def header_line(args: argparse.Namespace, env: dict) -> str:
    return (f"specserve bench throughput: model {args.model or 'default (SmolLM2-135M-Instruct GGUF)'}, "
            f"{args.num_prompts} Spec-Bench prompts, {args.max_tokens} new tokens each, greedy, EOS ignored\n"
            f"torch {env['torch']} with {env['torch_num_threads']} threads on {env['cpu_count']} CPUs "
            f"({env['cpu']}), load average {env.get('load_average_1m', '?')}; "
            f"specserve {env['specserve']}, transformers {env['transformers']}")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- specserve


def load_specserve(args: argparse.Namespace):
    from specserve.engine_args import engine_kwargs
    from specserve.llm import LLM

    kwargs = engine_kwargs(args)
    kwargs["max_num_seqs"] = args.max_num_seqs or args.concurrency
    with Stopwatch() as sw:
        llm = LLM(**kwargs)
    _log(f"specserve: loaded in {sw.seconds:.1f} s")
    return llm


def run_specserve(llm, prompts: list[BenchPrompt], batch1: list[BenchPrompt], max_tokens: int
                  ) -> list[ScenarioResult]:
    from specserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([prompts[0].as_engine_prompt()], SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS,
                                                                 ignore_eos=True), use_tqdm=False)
    results = []
    if batch1:
        _reset_prefix_cache(llm)
        runs = [_specserve_timed(llm, [p], params) for p in batch1]
        outputs = [out for run in runs for out in run[0]]
        results.append(_specserve_result("batch1", batch1, 1, outputs, sum(run[1] for run in runs), 0))
        _log(f"specserve: batch 1 done in {results[-1].wall_s:.1f} s")
    _reset_prefix_cache(llm)
    preemptions = llm.get_metrics().num_preemptions
    outputs, seconds = _specserve_timed(llm, prompts, params)
    preemptions = llm.get_metrics().num_preemptions - preemptions
    concurrency = llm.config.max_num_seqs
    results.append(_specserve_result("concurrent", prompts, concurrency, outputs, seconds, preemptions))
    _log(f"specserve: {len(prompts)} requests, {concurrency} in flight, done in {seconds:.1f} s")
    return results


def run_plain_reference(llm, prompts: list[BenchPrompt], batch1: list[BenchPrompt], max_tokens: int
                        ) -> dict[str, list[list[int]]]:
    """Plain decoding's tokens from the same engine (num_speculative_tokens=0 per request), untimed, in each
    scenario's shape: the batch-1 prompts one at a time, then all prompts together."""
    from specserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=0)
    plain = {}
    if batch1:
        _reset_prefix_cache(llm)
        plain["batch1"] = [list(_specserve_timed(llm, [p], params)[0][0].outputs[0].token_ids) for p in batch1]
    _reset_prefix_cache(llm)
    plain["concurrent"] = [list(out.outputs[0].token_ids) for out in _specserve_timed(llm, prompts, params)[0]]
    _log("specserve: plain decoding's outputs computed for the losslessness check")
    return plain


def _reset_prefix_cache(llm) -> None:
    """So a scenario does not reuse the KV of prompts an earlier scenario (or the warm-up) computed."""
    llm.llm_engine.kv_cache_manager.reset_prefix_cache()


def _specserve_timed(llm, prompts: list[BenchPrompt], params) -> tuple[list, float]:
    with Stopwatch() as sw:
        outputs = llm.generate([p.as_engine_prompt() for p in prompts], params, use_tqdm=False)
    failed = [out.error for out in outputs if out.error]
    if failed:
        raise RuntimeError(f"specserve failed {len(failed)} request(s): {failed[0]}")
    return outputs, sw.seconds


def _specserve_result(scenario: str, prompts: list[BenchPrompt], concurrency: int, outputs: list,
                      seconds: float, preemptions: int) -> ScenarioResult:
    token_ids = [list(out.outputs[0].token_ids) for out in outputs]
    latencies = [request_latencies(out) for out in outputs]
    extra = {"num_preemptions": preemptions,
             "ttft_median_s": median(lat["ttft_s"] for lat in latencies),
             "decode_tokens_per_s_median": median(lat["decode_tokens_per_s"] for lat in latencies),
             "per_request": latencies}
    return ScenarioResult(scenario, "specserve", len(prompts), concurrency, sum(len(p.token_ids) for p in prompts),
                          sum(map(len, token_ids)), seconds, token_ids, extra)


# ---------------------------------------------------------------- transformers


def run_transformers(args: argparse.Namespace, prompts: list[BenchPrompt], batch1: list[BenchPrompt],
                     pad_token_id: int) -> list[ScenarioResult]:
    from specserve.models.loader import default_model_path

    with Stopwatch() as sw:
        model = load_hf_model(resolve_model_name(args.model) or default_model_path(), args.dtype)
    _log(f"transformers: loaded in {sw.seconds:.1f} s")
    hf_generate(model, [prompts[0].token_ids], WARMUP_TOKENS, pad_token_id)
    results = []
    if batch1:
        results.append(_hf_scenario(model, "batch1", batch1, 1, args.max_tokens, pad_token_id))
        _log(f"transformers: batch 1 done in {results[-1].wall_s:.1f} s")
    concurrency = min(args.concurrency, len(prompts))
    results.append(_hf_scenario(model, "concurrent", prompts, concurrency, args.max_tokens, pad_token_id))
    _log(f"transformers: {len(prompts)} requests in padded batches of {concurrency} done in "
         f"{results[-1].wall_s:.1f} s")
    return results


def _hf_scenario(model, scenario: str, prompts: list[BenchPrompt], batch_size: int, max_tokens: int,
                 pad_token_id: int) -> ScenarioResult:
    """Consecutive left-padded batches of `batch_size` prompts, each one `generate` call."""
    token_ids, seconds = [], 0.0
    for start in range(0, len(prompts), batch_size):
        batch = [p.token_ids for p in prompts[start:start + batch_size]]
        with Stopwatch() as sw:
            token_ids += hf_generate(model, batch, max_tokens, pad_token_id)
        seconds += sw.seconds
    return ScenarioResult(scenario, "transformers", len(prompts), batch_size,
                          sum(len(p.token_ids) for p in prompts), sum(map(len, token_ids)), seconds, token_ids)


# ---------------------------------------------------------------- report


def build_report(args: argparse.Namespace, env: dict, prompts: list[BenchPrompt], batch1: list[BenchPrompt],
                 results: list[ScenarioResult], eos_token_ids: set[int] = frozenset(),
                 plain: dict[str, list[list[int]]] | None = None) -> dict:
    """Everything a program needs to compare runs: settings, machine, prompts, per-engine results,
    specserve/transformers ratios and how often the two engines' greedy outputs agree; with `plain` (plain
    decoding's tokens per scenario, from run_plain_reference), whether speculation reproduced them."""
    from specserve.engine_args import speculative_config

    comparisons = {}
    for scenario in ("batch1", "concurrent"):
        ours, theirs = _find(results, scenario, "specserve"), _find(results, scenario, "transformers")
        if ours and theirs:
            comparisons[scenario] = {"speedup": safe_div(ours.output_tokens_per_s, theirs.output_tokens_per_s),
                                     **greedy_agreement(ours.output_token_ids, theirs.output_token_ids,
                                                        eos_token_ids)}
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    scenario_prompts = {"batch1": batch1, "concurrent": prompts}
    vs_plain = {scenario: lossless_check(_find(results, scenario, "specserve").output_token_ids, tokens,
                                         scenario_prompts[scenario])
                for scenario, tokens in (plain or {}).items() if _find(results, scenario, "specserve")}
    return {"benchmark": "throughput", "settings": settings, "environment": env,
            "speculative_config": speculative_config(args),
            "prompts": prompts_summary(prompts), "batch1_prompts": prompts_summary(batch1),
            "results": [r.to_json() for r in results], "specserve_vs_transformers": comparisons,
            "speculative_vs_plain": vs_plain}


def lossless_check(speculative: list[list[int]], plain: list[list[int]], prompts: list[BenchPrompt]) -> dict:
    """Speculative against plain decoding's tokens, prompt by prompt: both ignore EOS, so every token must
    agree."""
    mismatches = [{"question_id": p.question_id, "category": p.category, "first_diff": common_prefix_len(a, b)}
                  for a, b, p in zip(speculative, plain, prompts) if a != b]
    return {"identical_outputs": len(prompts) - len(mismatches), "num_outputs": len(prompts),
            "mismatches": mismatches}


def speculative_mismatches(report: dict) -> list[str]:
    """One line per speculative output that differs from plain decoding's on the same prompt."""
    method = (report.get("speculative_config") or {}).get("method", "speculative")
    return [f"specserve {method}, {'batch 1' if scenario == 'batch1' else 'concurrent'}, {m['category']} question "
            f"{m['question_id']}: output differs from plain decoding at token {m['first_diff']}"
            for scenario, check in report.get("speculative_vs_plain", {}).items() for m in check["mismatches"]]


def greedy_agreement(ours: list[list[int]], theirs: list[list[int]], eos_token_ids: set[int] = frozenset()
                     ) -> dict:
    """Same model, greedy: outputs should match token for token up to float rounding differences.

    Each pair is compared up to (not including) specserve's first EOS: from there the engines differ by design
    (ignore_eos emits the EOS and goes on; transformers' min_new_tokens masks EOS and takes the runner-up).
    """
    spans = [next((i for i, t in enumerate(a) if t in eos_token_ids), len(a)) for a in ours]
    prefix = [min(common_prefix_len(a, b), n) for a, b, n in zip(ours, theirs, spans)]
    fractions = [p / n if n else 1.0 for p, n in zip(prefix, spans)]
    return {"identical_outputs": sum(p == n for p, n in zip(prefix, spans)), "num_outputs": len(spans),
            "mean_common_prefix_fraction": safe_div(sum(fractions), len(fractions)),
            "compared_tokens": spans, "common_prefix_tokens": prefix}


def _find(results: list[ScenarioResult], scenario: str, engine: str) -> ScenarioResult | None:
    return next((r for r in results if r.scenario == scenario and r.engine == engine), None)


def format_report(report: dict) -> str:
    """The table a person reads, plus specserve's batch-1 latencies and the greedy agreement."""
    comparisons = report["specserve_vs_transformers"]
    rows = []
    for r in sorted(report["results"], key=lambda r: r["scenario"] != "batch1"):  # stable: engines stay in order
        label = "batch 1" if r["scenario"] == "batch1" else f"{r['concurrency']} concurrent"
        ratio = comparisons.get(r["scenario"], {}).get("speedup") if r["engine"] == "specserve" else None
        rows.append([label, r["engine"], r["num_requests"], r["num_prompt_tokens"], r["num_output_tokens"],
                     r["wall_s"], r["output_tokens_per_s"], None if ratio is None else f"{ratio:.2f}x"])
    headers = ["scenario", "engine", "requests", "prompt tok", "output tok", "wall s", "output tok/s",
               "specserve/transformers"]
    lines = [format_table(headers, rows), ""]
    for r in report["results"]:
        if r["engine"] == "specserve":
            lines.append(f"specserve {'batch 1' if r['scenario'] == 'batch1' else 'concurrent'}: "
                         f"median time to first token {r['ttft_median_s'] * 1000:.0f} ms, median decode "
                         f"{r['decode_tokens_per_s_median']:.1f} tok/s per request, "
                         f"{r['num_preemptions']} preemptions")
    for scenario, c in comparisons.items():
        lines.append(f"greedy agreement, {scenario} (up to specserve's first EOS): {c['identical_outputs']}/"
                     f"{c['num_outputs']} outputs identical, mean common prefix {c['mean_common_prefix_fraction']:.0%}")
    for scenario, c in report.get("speculative_vs_plain", {}).items():
        lines.append(f"speculative vs plain decoding, {scenario}: {c['identical_outputs']}/{c['num_outputs']} "
                     f"outputs identical" + ("" if not c["mismatches"] else " MISMATCH"))
    lines += [f"SPECULATIVE MISMATCH: {line}" for line in speculative_mismatches(report)]
    return "\n".join(lines)
