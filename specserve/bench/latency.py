"""`specserve bench latency`: one request at a time, per Spec-Bench category: time to first token and decode
speed of specserve (plain and each speculative method) against transformers' generate and prompt lookup.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import replace
from typing import Callable, Sequence

from specserve.bench.common import (
    DEFAULT_DATASET, BenchPrompt, Stopwatch, environment_info, load_hf_model, mismatch_exit_status, read_specbench,
    render_prompts, write_json)
from specserve.bench.latency_report import (
    DEFAULT_NUM_SPECULATIVE_TOKENS, HF_PLAIN, HF_PROMPT_LOOKUP, HF_PROMPT_LOOKUP_TOKENS, LABELS, PLAIN,
    RequestTiming, build_report, format_report, speculative_mismatches)
from specserve.config import resolve_model_name
from specserve.models.loader import default_model_path

DEFAULT_OUTPUT = "bench_results/latency.json"
DEFAULT_METHODS = "ngram,suffix,draft_model,auto"
WARMUP_TOKENS = 16
# Not a Spec-Bench question, so warming up leaves nothing in the prefix or suffix caches that a measured
# prompt could reuse.
WARMUP_MESSAGE = "Write two sentences about the sea."

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
                        "--spec-config-json, e.g. '{\"eagle3\": {\"model\": \"PATH\"}}'); METHOD+tree drafts "
                        "trees (draft_tree \"auto\"), e.g. suffix,suffix+tree (default: %(default)s)")
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


# A method listed as "<method>+tree" drafts trees (speculative_config draft_tree "auto") where its drafter can.
TREE_SUFFIX = "+tree"


def method_of(label: str) -> str:
    """The speculative method of a --methods entry: "suffix+tree" -> "suffix"."""
    return label[:-len(TREE_SUFFIX)] if label.endswith(TREE_SUFFIX) else label


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in (text or "").split(",") if m.strip()]
    unknown = [m for m in methods if method_of(m) not in DEFAULT_NUM_SPECULATIVE_TOKENS]
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
    for label in methods:
        method = method_of(label)
        config = {"method": method}
        if label != method:
            config["draft_tree"] = "auto"
        if args.num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS[method]:
            config["num_speculative_tokens"] = args.num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS[method]
        if method == "draft_model":
            if args.draft_model:
                config["model"] = args.draft_model
            else:  # no smaller model with SmolLM2's tokenizer is bundled: its own weights in int8 draft for it
                config.update(model=resolve_model_name(args.model) or default_model_path(), quantization="int8")
        config.update(overrides.get(label, {}))
        if config["method"] != method:
            raise ValueError(f"--spec-config-json: the {label!r} entry cannot change its method")
        SpeculativeConfig.from_dict(dict(config), args.model)
        configs[label] = config
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

        model_file = resolve_model_name(args.model) or default_model_path()
        timings += run_llamacpp(model_file, prompts, warmup, args.max_tokens,
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
        model = load_hf_model(resolve_model_name(args.model) or default_model_path(), args.dtype)
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
