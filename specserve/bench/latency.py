"""`specserve bench latency`: one request at a time, per Spec-Bench category: time to first token and decode
speed of specserve (plain and each speculative method) against transformers' generate and prompt lookup.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from specserve.bench.common import (
    DEFAULT_DATASET, BenchPrompt, Stopwatch, environment_info, format_table, load_hf_model, median,
    mismatch_exit_status, prompts_summary, read_specbench, render_prompts, safe_div, write_json)
from specserve.bench.llamacpp import LLAMACPP_PLAIN, LLAMACPP_PROMPT_LOOKUP, PROMPT_LOOKUP_TOKENS as LLAMACPP_LOOKUP
from specserve.models.loader import default_model_path

DEFAULT_OUTPUT = "bench_results/latency.json"
DEFAULT_METHODS = "ngram,suffix,draft_model,auto"
# num_speculative_tokens per method when --num-speculative-tokens is not given; the adaptive policy drafts
# fewer when they do not pay. Here a step over 1 + k tokens costs ~1 + 0.02-0.03k one-token steps at ~1k
# tokens of context, and an int8 self-draft ~0.5 of a step per draft token. ngram's k is 8: replaying plain
# decoding's outputs (benchmarks/spec_replay.py) at 2% per draft, k=8 matches k=5 everywhere but
# extraction, where long copies make it better (3.32 vs 3.01 tokens per unit of cost).
DEFAULT_NUM_SPECULATIVE_TOKENS = {"ngram": 8, "suffix": 5, "draft_model": 4, "eagle": 4, "eagle3": 4, "medusa": 3,
                                  "auto": None}  # auto: each of its proposers' own default
HF_PROMPT_LOOKUP_TOKENS = 10  # transformers' prompt_lookup_num_tokens, as in ANCHORS.md
WARMUP_TOKENS = 16
# Not a Spec-Bench question, so warming up leaves nothing in the prefix or suffix caches that a measured
# prompt could reuse.
WARMUP_MESSAGE = "Write two sentences about the sea."

PLAIN, HF_PLAIN, HF_PROMPT_LOOKUP = "plain", "hf_plain", "hf_prompt_lookup"
LABELS = {PLAIN: "specserve plain", **{m: f"specserve {m}" for m in DEFAULT_NUM_SPECULATIVE_TOKENS},
          HF_PLAIN: "transformers plain",
          HF_PROMPT_LOOKUP: f"transformers prompt lookup ({HF_PROMPT_LOOKUP_TOKENS})",
          LLAMACPP_PLAIN: "llama.cpp plain", LLAMACPP_PROMPT_LOOKUP: f"llama.cpp prompt lookup ({LLAMACPP_LOOKUP})"}


@dataclass
class RequestTiming:
    """One prompt through one method: the numbers the per-category medians are taken over.

    ttft_s: arrival to first token; decode_s: first token to last token; total_s: the whole request.
    """

    method: str
    category: str
    question_id: Any
    num_prompt_tokens: int
    ttft_s: float
    decode_s: float
    total_s: float
    token_ids: list[int] = field(repr=False)
    acceptance_length: float | None = None  # 1 + accepted / drafts (speculative methods)
    spec_stats: dict = field(default_factory=dict)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def decode_tokens_per_s(self) -> float:
        """Output tokens after the first over the time after the first."""
        return safe_div(self.num_output_tokens - 1, self.decode_s) if self.num_output_tokens > 1 else float("nan")

    @property
    def e2e_tokens_per_s(self) -> float:
        return safe_div(self.num_output_tokens, self.total_s)

    def to_json(self) -> dict:
        return {"method": self.method, "category": self.category, "question_id": self.question_id,
                "num_prompt_tokens": self.num_prompt_tokens, "num_output_tokens": self.num_output_tokens,
                "ttft_s": self.ttft_s, "decode_s": self.decode_s, "total_s": self.total_s,
                "decode_tokens_per_s": self.decode_tokens_per_s, "e2e_tokens_per_s": self.e2e_tokens_per_s,
                "acceptance_length": self.acceptance_length, **self.spec_stats}


# ---------------------------------------------------------------- command line


def add_parser(bench_sub) -> None:
    from specserve.engine_args import add_engine_args

    p = bench_sub.add_parser(
        "latency", help="batch-1 latency per Spec-Bench category: specserve methods vs transformers",
        description="One request at a time on the same Spec-Bench prompts per category (chat template, greedy, "
                    "EOS ignored): time to first token, decode and end-to-end tokens/s and acceptance length "
                    "of specserve plain and speculative decoding, transformers' generate and prompt lookup. "
                    "transformers' time to first token is a separate 1-token generate of the same prompt; its "
                    "decode tokens/s is (N-1) / (t_total - t_first_token). Exits with status 1 when a "
                    "speculative output differs from plain decoding's.")
    p.add_argument("--dataset", default=DEFAULT_DATASET, help="Spec-Bench JSONL (default: %(default)s)")
    p.add_argument("--categories", default=None,
                   help="comma-separated categories (default: every category in the dataset)")
    p.add_argument("--prompts-per-category", type=int, default=4,
                   help="the first N questions of each category, in file order (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="new tokens per request; EOS is ignored so every method makes exactly this many")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma-separated speculative methods to run besides plain decoding: ngram, suffix, "
                        "draft_model, eagle, eagle3, medusa (the last three take their head folder through "
                        "--spec-config-json, e.g. '{\"eagle3\": {\"model\": \"PATH\"}}') (default: %(default)s)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help=f"k for every speculative method (default per method: {DEFAULT_NUM_SPECULATIVE_TOKENS})")
    p.add_argument("--spec-config-json", type=json.loads, default=None,
                   help='per-method speculative_config overrides, e.g. \'{"ngram": {"prompt_lookup_max": 3}}\'')
    p.add_argument("--draft-model", default=None,
                   help="HF folder or .gguf file for the draft_model method (default: the target model itself "
                        "with int8 weights, an approximate self-draft)")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of every specserve (prompt, method) run, each on freshly loaded engines with the "
                        "methods in a rotated order; each pair reports its median-decode round (default: "
                        "%(default)s). Single runs on a shared machine vary by ~15%%")
    p.add_argument("--skip-hf", action="store_true", help="do not run transformers")
    p.add_argument("--llamacpp", action="store_true",
                   help="also run llama.cpp (llama-cpp-python, the llamacpp extra) on the same GGUF file and prompt "
                        "token ids, plain and with prompt lookup, with as many threads as specserve")
    p.add_argument("--output-json", default=DEFAULT_OUTPUT, help="where to write results (default: %(default)s)")
    add_engine_args(p, speculation_flags=False)
    p.set_defaults(max_num_seqs=1, func=cmd_latency)


def check_args(args: argparse.Namespace) -> None:
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.prompts_per_category < 1:
        raise ValueError(f"--prompts-per-category must be >= 1, got {args.prompts_per_category}")
    if args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be >= 2 (decode speed needs tokens after the first), "
                         f"got {args.max_tokens}")
    if args.speculative_config is not None:
        raise ValueError("bench latency takes --methods and --spec-config-json, not --speculative-config")
    spec_configs(args)  # refuses bad methods and keys before any model loads
    if args.llamacpp:
        from specserve.bench.llamacpp import require_llamacpp

        require_llamacpp()


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in (text or "").split(",") if m.strip()]
    unknown = [m for m in methods if m not in DEFAULT_NUM_SPECULATIVE_TOKENS]
    if unknown:
        raise ValueError(f"--methods: unknown method(s) {', '.join(unknown)} "
                         f"(allowed: {', '.join(DEFAULT_NUM_SPECULATIVE_TOKENS)})")
    if len(set(methods)) != len(methods):
        raise ValueError(f"--methods lists a method twice: {text}")
    return methods


def spec_configs(args: argparse.Namespace) -> dict[str, dict]:
    """Each speculative method's speculative_config: its default k (or --num-speculative-tokens), then the
    method's entry in --spec-config-json; validated here so a typo fails before any model loads."""
    from specserve.config import SpeculativeConfig

    methods = parse_methods(args.methods)
    overrides = args.spec_config_json or {}
    if not isinstance(overrides, dict) or not all(isinstance(v, dict) for v in overrides.values()):
        raise ValueError('--spec-config-json must map method names to dicts, e.g. {"ngram": {"prompt_lookup_max": 3}}')
    extra = set(overrides) - set(methods)
    if extra:
        raise ValueError(f"--spec-config-json names method(s) not in --methods: {', '.join(sorted(extra))}")
    configs = {}
    for method in methods:
        config = {"method": method}
        if args.num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS[method]:
            config["num_speculative_tokens"] = args.num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS[method]
        if method == "draft_model":
            if args.draft_model:
                config["model"] = args.draft_model
            else:  # no smaller model shares SmolLM2's tokenizer here: its own weights in int8 draft for it
                config.update(model=args.model or default_model_path(), quantization="int8")
        config.update(overrides.get(method, {}))
        if config["method"] != method:
            raise ValueError(f"--spec-config-json: the {method!r} entry cannot change its method")
        SpeculativeConfig.from_dict(dict(config), args.model)
        configs[method] = config
    return configs


def cmd_latency(args: argparse.Namespace) -> int:
    check_args(args)
    configs = spec_configs(args)
    env = environment_info()
    print(header_line(args, env, configs), flush=True)
    rows = select_per_category(read_specbench(args.dataset), parse_categories(args.categories),
                               args.prompts_per_category)
    # Every engine is loaded up front and the methods take turns on each prompt, so a machine that slows
    # down during the run (it is shared) slows every method alike instead of whichever ran last.
    methods = [(PLAIN, None), *configs.items()]
    engines = {method: load_specserve(args, method, config) for method, config in methods}
    tokenizer = engines[PLAIN].get_tokenizer()
    prompts = render_prompts(tokenizer, rows)
    warmup = render_prompts(tokenizer, [{"category": "warmup", "turns": [WARMUP_MESSAGE]}])[0]
    pad_token_id = tokenizer.eos_token_id
    rounds = []
    for r in range(args.repeats):
        if r:  # fresh engines: suffix's cache of finished requests must not hold this prompt's earlier output
            engines = {method: load_specserve(args, method, config) for method, config in methods}
        order = [m for m, _ in methods[r % len(methods):] + methods[:r % len(methods)]]  # who runs first rotates
        rounds.append(run_specserve({m: engines[m] for m in order}, prompts, warmup, args.max_tokens))
        del engines
        gc.collect()
    timings = median_rounds(rounds)
    if not args.skip_hf:
        timings += run_transformers(args, prompts, warmup, pad_token_id)
    if args.llamacpp:
        import torch

        from specserve.bench.llamacpp import run_llamacpp

        timings += run_llamacpp(args.model or default_model_path(), prompts, warmup, args.max_tokens,
                                torch.get_num_threads(), WARMUP_TOKENS, _log)
    env["load_average_1m_end"] = environment_info().get("load_average_1m")  # the machine may be shared
    report = build_report(args, env, configs, prompts, timings)
    print()
    print(format_report(report))
    path = write_json(args.output_json, report)
    print(f"\nwrote {path}")
    return mismatch_exit_status("latency", speculative_mismatches(report))


def header_line(args: argparse.Namespace, env: dict, configs: dict[str, dict]) -> str:
    methods = ", ".join(f"{m} (k={c.get('num_speculative_tokens', 'per proposer')})" for m, c in configs.items()) or "none"
    return (f"specserve bench latency: model {args.model or 'default (SmolLM2-135M-Instruct GGUF)'}, "
            f"{args.prompts_per_category} Spec-Bench prompts per category, {args.max_tokens} new tokens each, "
            f"{args.repeats} round(s) of specserve, "
            f"batch 1, greedy, EOS ignored; speculative methods: {methods}\n"
            f"torch {env['torch']} with {env['torch_num_threads']} threads on {env['cpu_count']} CPUs "
            f"({env['cpu']}), load average {env.get('load_average_1m', '?')}; "
            f"specserve {env['specserve']}, transformers {env['transformers']}")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- prompts


def parse_categories(text: str | None) -> list[str] | None:
    if text is None:
        return None
    categories = [c.strip() for c in text.split(",") if c.strip()]
    if not categories:
        raise ValueError("--categories is empty")
    return categories


def select_per_category(rows: Sequence[dict], categories: Sequence[str] | None, per_category: int) -> list[dict]:
    """The first `per_category` rows of each category, categories in the order given (default: order of
    first appearance in the dataset)."""
    by_category: dict[str, list[dict]] = {}
    for row in rows:
        by_category.setdefault(row["category"], []).append(row)
    categories = list(by_category) if categories is None else list(categories)
    unknown = [c for c in categories if c not in by_category]
    if unknown:
        raise ValueError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)} "
                         f"(the dataset has: {', '.join(by_category)})")
    short = [f"{c} ({len(by_category[c])})" for c in categories if len(by_category[c]) < per_category]
    if short:
        raise ValueError(f"--prompts-per-category {per_category} but these categories have fewer: {', '.join(short)}")
    return [row for c in dict.fromkeys(categories) for row in by_category[c][:per_category]]


# ---------------------------------------------------------------- specserve


def load_specserve(args: argparse.Namespace, method: str, spec_config: dict | None):
    from specserve.engine_args import engine_kwargs
    from specserve.llm import LLM

    kwargs = engine_kwargs(args)
    kwargs["speculative_config"] = spec_config
    with Stopwatch() as sw:
        llm = LLM(**kwargs)
    _log(f"{LABELS[method]}: loaded in {sw.seconds:.1f} s")
    return llm


def run_specserve(engines: dict, prompts: list[BenchPrompt], warmup: BenchPrompt, max_tokens: int
                  ) -> list[RequestTiming]:
    """Each prompt through every engine in turn (engines: method -> LLM)."""
    from specserve.sampling_params import SamplingParams

    for llm in engines.values():
        llm.generate([warmup.as_engine_prompt()], SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS,
                                                                 ignore_eos=True), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    timings = []
    for prompt in prompts:
        for method, llm in engines.items():
            # Every request prefills its whole prompt, as transformers does (no prefix cache there).
            llm.llm_engine.kv_cache_manager.reset_prefix_cache()
            with Stopwatch() as sw:
                out = llm.generate([prompt.as_engine_prompt()], params, use_tqdm=False)[0]
            if out.error:
                raise RuntimeError(f"{LABELS[method]} failed on question {prompt.question_id}: {out.error}")
            timings.append(_specserve_timing(method, prompt, out, sw.seconds))
    for method in engines:
        _log(f"{LABELS[method]}: {len(prompts)} prompts in "
             f"{sum(t.total_s for t in timings if t.method == method):.1f} s")
    return timings


def median_rounds(rounds: list[list[RequestTiming]]) -> list[RequestTiming]:
    """Per (method, prompt), the round with the median decode time (the lower middle one for an even count),
    with every round's decode time kept in its spec_stats; in the first round's order."""
    by_key: dict[tuple, list[RequestTiming]] = {}
    for timings in rounds:
        for t in timings:
            by_key.setdefault((t.method, t.question_id), []).append(t)
    chosen = []
    for t in rounds[0]:
        in_order = by_key[(t.method, t.question_id)]
        runs = sorted(in_order, key=lambda x: x.decode_s)
        pick = runs[(len(runs) - 1) // 2]
        if len(runs) > 1:
            pick = replace(pick, spec_stats={**pick.spec_stats, "decode_s_rounds": [x.decode_s for x in in_order]})
            if any(x.token_ids != runs[0].token_ids for x in runs):  # greedy: every round must agree
                raise RuntimeError(f"{LABELS[t.method]} gave different outputs across rounds on question "
                                   f"{t.question_id}")
        chosen.append(pick)
    return chosen


def _specserve_timing(method: str, prompt: BenchPrompt, out, total_s: float) -> RequestTiming:
    m = out.metrics
    spec_stats = ({"num_drafts": m.num_drafts, "num_draft_tokens": m.num_draft_tokens,
                   "num_accepted_tokens": m.num_accepted_tokens,
                   "accepted_per_position": list(m.accepted_per_position)} if method != PLAIN else {})
    return RequestTiming(method, prompt.category, prompt.question_id, len(prompt.token_ids),
                         ttft_s=m.first_token_time - m.arrival_time, decode_s=m.last_token_time - m.first_token_time,
                         total_s=total_s, token_ids=list(out.outputs[0].token_ids),
                         acceptance_length=m.mean_acceptance_length, spec_stats=spec_stats)


# ---------------------------------------------------------------- transformers


def run_transformers(args: argparse.Namespace, prompts: list[BenchPrompt], warmup: BenchPrompt,
                     pad_token_id: int) -> list[RequestTiming]:
    from specserve.models.loader import default_model_path

    with Stopwatch() as sw:
        model = load_hf_model(args.model or default_model_path(), args.dtype)
    _log(f"transformers: loaded in {sw.seconds:.1f} s")
    timings = []
    for method, kwargs in ((HF_PLAIN, {}), (HF_PROMPT_LOOKUP, {"prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS})):
        generate = _hf_generate_fn(model, pad_token_id, kwargs)
        generate(warmup.token_ids, WARMUP_TOKENS)
        timings += [hf_timing(method, prompt, generate, args.max_tokens) for prompt in prompts]
        _log(f"{LABELS[method]}: {len(prompts)} prompts in "
             f"{sum(t.total_s + t.ttft_s for t in timings if t.method == method):.1f} s")
    return timings


def _hf_generate_fn(model, pad_token_id: int, kwargs: dict) -> Callable[[list[int], int], list[int]]:
    """A greedy batch-1 `generate` making exactly `max_tokens` new tokens (min_new_tokens keeps EOS out)."""
    import torch

    def generate(token_ids: list[int], max_tokens: int) -> list[int]:
        input_ids = torch.tensor([token_ids], dtype=torch.long)  # [1, num_prompt_tokens]
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=pad_token_id, **kwargs)
        return out[0, len(token_ids):].tolist()

    return generate


def hf_timing(method: str, prompt: BenchPrompt, generate: Callable[[list[int], int], list[int]],
              max_tokens: int) -> RequestTiming:
    """transformers has no per-token timestamps: time to first token is a separate 1-token generate of the
    same prompt, and decode time is the full generate's time less that."""
    with Stopwatch() as first:
        generate(prompt.token_ids, 1)
    with Stopwatch() as full:
        token_ids = generate(prompt.token_ids, max_tokens)
    return RequestTiming(method, prompt.category, prompt.question_id, len(prompt.token_ids), ttft_s=first.seconds,
                         decode_s=full.seconds - first.seconds, total_s=full.seconds, token_ids=token_ids)


# ---------------------------------------------------------------- report


def reference_method(method: str) -> str | None:
    """Whose greedy tokens a method must reproduce: the plain decoding of the same engine."""
    if method in (PLAIN, HF_PLAIN, LLAMACPP_PLAIN):
        return None
    if method.startswith("llamacpp_"):
        return LLAMACPP_PLAIN
    return HF_PLAIN if method.startswith("hf_") else PLAIN


def summarize(timings: list[RequestTiming]) -> list[dict]:
    """One row per (category, method): medians over the category's prompts, decode-speed ratios to specserve
    plain and transformers plain (ratios of medians), and greedy equivalence with the reference method."""
    methods = list(dict.fromkeys(t.method for t in timings))
    categories = list(dict.fromkeys(t.category for t in timings))
    tokens = {(t.method, t.question_id): t.token_ids for t in timings}
    plain_of = {t.question_id: t for t in timings if t.method == PLAIN}
    rows = []
    for category in categories:
        decode = {m: median(t.decode_tokens_per_s for t in timings if t.method == m and t.category == category)
                  for m in methods}
        for method in methods:
            group = [t for t in timings if t.method == method and t.category == category]
            row = {"category": category, "method": method, "num_prompts": len(group),
                   "ttft_median_s": median(t.ttft_s for t in group),
                   "decode_tokens_per_s_median": decode[method],
                   "e2e_tokens_per_s_median": median(t.e2e_tokens_per_s for t in group),
                   "acceptance_length_median": _median_or_none(t.acceptance_length for t in group),
                   "decode_vs_specserve_plain": safe_div(decode[method], decode.get(PLAIN, float("nan"))),
                   "decode_vs_transformers_plain": safe_div(decode[method], decode.get(HF_PLAIN, float("nan"))),
                   "decode_vs_llamacpp_plain": safe_div(decode[method], decode.get(LLAMACPP_PLAIN, float("nan"))),
                   "decode_vs_specserve_plain_paired": paired_ratio(group, plain_of)}
            row.update(greedy_check(group, tokens, reference_method(method)))
            rows.append(row)
    return rows


def paired_ratio(group: list[RequestTiming], plain_of: dict) -> float | None:
    """Decode speed over specserve plain's, each prompt against plain's run of the same prompt in the same
    round (seconds apart): the median over rounds per prompt, the geometric mean over prompts. A host whose
    speed drifts between prompts moves both runs of a pair alike. None for a method plain does not pair with."""
    ratios = []
    for t in group:
        plain = plain_of.get(t.question_id)
        if plain is None or (t.method != PLAIN and reference_method(t.method) != PLAIN):
            return None
        mine = t.spec_stats.get("decode_s_rounds") or [t.decode_s]
        theirs = plain.spec_stats.get("decode_s_rounds") or [plain.decode_s]
        ratios.append(median([safe_div(p, m) for p, m in zip(theirs, mine)]))
    return geometric_mean(ratios) if ratios else None


def _median_or_none(values) -> float | None:
    values = [v for v in values if v is not None]
    return median(values) if values else None


def greedy_check(group: list[RequestTiming], tokens: dict, reference: str | None) -> dict:
    """How many of the group's outputs equal the reference's for the same prompt, and where each mismatch
    starts (None where there is no reference or it was not run)."""
    pairs = [(t, tokens.get((reference, t.question_id))) for t in group]
    pairs = [(t, ref) for t, ref in pairs if ref is not None]
    if reference is None or not pairs:
        return {"greedy_reference": None, "greedy_identical": None, "greedy_compared": 0, "greedy_mismatches": []}
    mismatches = [{"question_id": t.question_id, "first_diff": _first_diff(t.token_ids, ref)}
                  for t, ref in pairs if t.token_ids != ref]
    return {"greedy_reference": reference, "greedy_identical": len(pairs) - len(mismatches),
            "greedy_compared": len(pairs), "greedy_mismatches": mismatches}


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def geometric_mean(values) -> float:
    values = [v for v in values if v is not None and v == v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def acceptance_by_position(timings: list[RequestTiming]) -> list[float]:
    """Per draft position i, the share of all drafting rounds whose token i was accepted."""
    rounds = sum(t.spec_stats.get("num_drafts", 0) for t in timings)
    per_position = [t.spec_stats.get("accepted_per_position", []) for t in timings]
    width = max(map(len, per_position), default=0)
    return [sum(p[i] for p in per_position if i < len(p)) / rounds for i in range(width)] if rounds else []


def summarize_methods(rows: list[dict], timings: list[RequestTiming] = ()) -> list[dict]:
    """Per method, over categories: geometric means of the ratios, acceptance, and the greedy check's totals."""
    timings_of: dict[str, list[RequestTiming]] = {}
    for t in timings:
        timings_of.setdefault(t.method, []).append(t)
    summary = []
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        acceptance = [r["acceptance_length_median"] for r in mine if r["acceptance_length_median"] is not None]
        summary.append({
            "method": method, "num_categories": len(mine),
            "decode_vs_specserve_plain_geomean": geometric_mean(r["decode_vs_specserve_plain"] for r in mine),
            "decode_vs_transformers_plain_geomean": geometric_mean(r["decode_vs_transformers_plain"] for r in mine),
            "decode_vs_llamacpp_plain_geomean": geometric_mean(r["decode_vs_llamacpp_plain"] for r in mine),
            "decode_vs_specserve_plain_paired_geomean": geometric_mean(r.get("decode_vs_specserve_plain_paired")
                                                                       for r in mine),
            "decode_vs_specserve_plain_paired_min": min((r["decode_vs_specserve_plain_paired"] for r in mine
                                                         if r.get("decode_vs_specserve_plain_paired")), default=None),
            "ttft_median_s_geomean": geometric_mean(r["ttft_median_s"] for r in mine),
            "acceptance_length_mean": sum(acceptance) / len(acceptance) if acceptance else None,
            "acceptance_by_position": acceptance_by_position(timings_of.get(method, [])),
            "greedy_identical": sum(r["greedy_identical"] or 0 for r in mine),
            "greedy_compared": sum(r["greedy_compared"] for r in mine)})
    return summary


def build_report(args: argparse.Namespace, env: dict, configs: dict[str, dict], prompts: list[BenchPrompt],
                 timings: list[RequestTiming]) -> dict:
    rows = summarize(timings)
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    mismatches = [{"category": r["category"], "method": r["method"], **m}
                  for r in rows for m in r["greedy_mismatches"]]
    return {"benchmark": "latency", "settings": settings, "environment": env,
            "speculative_configs": configs, "hf_prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS,
            "timing_notes": "specserve: from RequestMetrics (ttft = first_token - arrival, decode = last_token - "
                            "first_token); transformers: ttft = a separate 1-token generate of the same prompt, "
                            "decode = full generate - that",
            "prompts": prompts_summary(prompts), "per_category": rows, "summary": summarize_methods(rows, timings),
            "greedy_mismatches": mismatches, "per_request": [t.to_json() for t in timings]}


def format_report(report: dict) -> str:
    """The per-category table, the per-method summary, and every greedy mismatch."""
    with_llamacpp = any(r["method"] == LLAMACPP_PLAIN for r in report["per_category"])
    headers = ["category", "method", "TTFT ms", "decode tok/s", "e2e tok/s", "accept len", "vs plain",
               "vs HF plain", *(["vs llama.cpp"] if with_llamacpp else []), "greedy = ref"]
    rows = [[r["category"], LABELS.get(r["method"], r["method"]), r["ttft_median_s"] * 1000,
             r["decode_tokens_per_s_median"], r["e2e_tokens_per_s_median"], r["acceptance_length_median"],
             _ratio(r["decode_vs_specserve_plain"]), _ratio(r["decode_vs_transformers_plain"]),
             *([_ratio(r.get("decode_vs_llamacpp_plain"))] if with_llamacpp else []), _greedy_cell(r)]
            for r in report["per_category"]]
    summary_headers = ["method", "decode vs plain (geomean)", "paired (geomean, lowest category)",
                       "decode vs HF plain (geomean)",
                       *(["decode vs llama.cpp plain (geomean)"] if with_llamacpp else []), "TTFT ms (geomean)",
                       "accept len (mean)", "greedy = ref"]
    summary = [[LABELS.get(s["method"], s["method"]), _ratio(s["decode_vs_specserve_plain_geomean"]),
                _paired_cell(s), _ratio(s["decode_vs_transformers_plain_geomean"]),
                *([_ratio(s.get("decode_vs_llamacpp_plain_geomean"))] if with_llamacpp else []),
                s["ttft_median_s_geomean"] * 1000, s["acceptance_length_mean"],
                f"{s['greedy_identical']}/{s['greedy_compared']}" if s["greedy_compared"] else None]
               for s in report["summary"]]
    lines = ["Medians over each category's prompts; ratios are of decode tok/s; 'greedy = ref' counts outputs "
             "identical to the same engine's plain decoding; 'paired': each prompt against plain's run of it in "
             "the same round.", format_table(headers, rows), "",
             "Summary over categories:", format_table(summary_headers, summary)]
    for s in report["summary"]:
        if s.get("acceptance_by_position"):
            lines.append(f"{LABELS.get(s['method'], s['method'])}: draft position accepted in "
                         + ", ".join(f"{r:.0%}" for r in s["acceptance_by_position"]) + " of rounds")
    for m in report["greedy_mismatches"]:
        lines.append(f"GREEDY MISMATCH: {LABELS.get(m['method'], m['method'])}, {m['category']} question "
                     f"{m['question_id']}: first differs from {LABELS[reference_method(m['method'])]} at output "
                     f"token {m['first_diff']}")
    return "\n".join(lines)


def speculative_mismatches(report: dict) -> list[str]:
    """One line per specserve speculative output that differs from specserve's plain decoding of the same
    prompt. transformers' prompt lookup is checked in the table too, but its mismatches are not ours to fail on."""
    return [f"{LABELS.get(m['method'], m['method'])} on {m['category']} question {m['question_id']}: output differs "
            f"from {LABELS[PLAIN]} at token {m['first_diff']}"
            for m in report["greedy_mismatches"] if reference_method(m["method"]) == PLAIN]


def _ratio(value: float | None) -> str | None:
    return None if value is None or value != value else f"{value:.2f}x"


def _paired_cell(summary: dict) -> str | None:
    paired = summary.get("decode_vs_specserve_plain_paired_geomean")
    lowest = summary.get("decode_vs_specserve_plain_paired_min")
    return None if paired is None or paired != paired else f"{paired:.2f}x, {lowest:.2f}x"


def _greedy_cell(row: dict) -> str | None:
    if not row["greedy_compared"]:
        return None
    cell = f"{row['greedy_identical']}/{row['greedy_compared']}"
    return cell if row["greedy_identical"] == row["greedy_compared"] else cell + " MISMATCH"
