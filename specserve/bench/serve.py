"""`specserve bench serve`: N concurrent streaming clients over Spec-Bench prompts against the OpenAI-compatible
server, with speculation on and off (per request), at one or more levels of N, reporting throughput, TTFT, TPOT
and inter-chunk latency percentiles; with --llama-server, llama.cpp's server on the same GGUF file and the same
prompt token ids beside it (specserve.bench.llamacpp.launch_llama_server).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field

from specserve.bench.common import (
    ServerProcess, add_dataset_args, environment_info, format_table, read_specbench, render_prompts, safe_div,
    select_spread, write_json)
from specserve.bench.llamacpp import LLAMA_SERVER, launch_llama_server

DEFAULT_OUTPUT = "bench_results/serve.json"
DEFAULT_SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4}
PERCENTILES = (50, 90, 99)
SPECSERVE = "specserve"


@dataclass
class RequestRecord:
    """One streamed request as the client saw it (times in seconds from its start)."""

    prompt_index: int
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    chunk_gaps_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    text: str = ""
    speculation: dict | None = None
    error: str | None = None

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first."""
        return safe_div(self.e2e_s - self.ttft_s, self.num_output_tokens - 1) if self.num_output_tokens > 1 \
            else float("nan")


# ---------------------------------------------------------------- command line


def add_parser(bench_sub) -> None:
    from specserve.engine_args import add_engine_args

    p = bench_sub.add_parser(
        "serve", help="latency and throughput of the HTTP server, with and without speculation",
        description="Stream chat completions for Spec-Bench prompts from --concurrency clients at once, first "
                    "with speculation off (num_speculative_tokens=0 per request) then on (the server's "
                    "speculative_config); greedy, EOS ignored. Without --url a server is started (without "
                    "prefix caching, so both runs see the prompts cold) and stopped afterwards. With "
                    "--llama-server, both servers get the same prompt token ids (the chat template applied here) "
                    "through /v1/completions, and llama.cpp's server runs each level after specserve's.")
    add_dataset_args(p, num_prompts=16, max_tokens=64)
    p.add_argument("--concurrency", default="8",
                   help="clients in flight, or comma-separated levels run in turn, e.g. 8,16,32 (default: "
                        "%(default)s)")
    p.add_argument("--llama-server", metavar="BINARY", default=None,
                   help="also run llama.cpp's llama-server binary (built from the llama-cpp-python sdist's "
                        "vendored sources, see the README) on the same GGUF file at each level N: -np N slots "
                        "with continuous batching, as many threads as specserve, the KV cache type of "
                        "--kv-cache-dtype (auto: f32, bfloat16: bf16, int8: q8_0), no prompt cache")
    p.add_argument("--llama-server-args", default="",
                   help="more llama-server flags, e.g. its speculative decoding: '--spec-draft-model "
                        "DRAFT.gguf --spec-draft-n-max 16' or '--spec-type ngram-simple'")
    p.add_argument("--url", default=None, help="an already running server, e.g. http://127.0.0.1:8000 (it "
                                               "should have a speculative_config and prefix caching off)")
    p.add_argument("--api-key", default=None, help="bearer token for --url")
    p.add_argument("--output-json", default=DEFAULT_OUTPUT, help="where to write results (default: %(default)s)")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve_bench)


def parse_levels(text: str) -> list[int]:
    """--concurrency: one integer >= 1 or a comma-separated list of them, in the order given."""
    try:
        levels = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency must be an integer >= 1 or a comma-separated list of them, got {text!r}")
    return levels


def check_args(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    parse_levels(args.concurrency)
    if args.llama_server and args.url:
        raise ValueError("--llama-server compares with a specserve server this command starts: drop --url")


def cmd_serve_bench(args: argparse.Namespace) -> int:
    check_args(args)
    levels = parse_levels(args.concurrency)
    rows = select_spread(read_specbench(args.dataset), args.num_prompts)
    env = environment_info()
    questions = [row["turns"][0] for row in rows]
    model_file, prompts = llama_server_inputs(args, rows) if args.llama_server else (None, questions)
    server = None if args.url else launch_specserve(args, max(levels))
    url = args.url or server.url
    scenarios = []
    try:
        for n in levels:
            _log(f"benchmarking {url}: {len(prompts)} prompts, {n} clients, {args.max_tokens} tokens each")
            for name, extra in (("no_speculation", {"num_speculative_tokens": 0}), ("speculation", {})):
                if name == "speculation" and speculation_off(args):
                    continue
                scenarios.append(run_level(url, args, prompts, n, SPECSERVE, name, extra))
            if args.llama_server:
                with launch_llama_server(args.llama_server, model_file, n, env["torch_num_threads"],
                                         max(len(p) for p in prompts) + args.max_tokens + 16,
                                         args.kv_cache_dtype, shlex.split(args.llama_server_args), _log) as llama:
                    scenarios.append(run_level(llama.url, args, prompts, n, LLAMA_SERVER,
                                               args.llama_server_args or "plain", {"cache_prompt": False}))
    finally:
        if server is not None:
            server.stop()
    env["load_average_1m_end"] = environment_info().get("load_average_1m")
    report = {"benchmark": "serve", "url": args.url, "model_file": model_file, "env": env,
              "args": _args_json(args), "scenarios": scenarios, "greedy_agreement": agreements(scenarios)}
    print(format_report(report))
    print(f"\nwrote {write_json(args.output_json, report)}")
    return 0


def llama_server_inputs(args: argparse.Namespace, rows: list[dict]) -> tuple[str, list[list[int]]]:
    """The GGUF file both servers load and each question's prompt token ids (its chat template applied here)."""
    from specserve.config import resolve_model_name
    from specserve.models.loader import default_model_path
    from specserve.tokenizer import load_tokenizer

    model_file = resolve_model_name(args.model) or args.model or default_model_path()
    if not str(model_file).endswith(".gguf"):
        raise ValueError(f"--llama-server runs GGUF files only, got --model {args.model}")
    return model_file, [p.token_ids for p in render_prompts(load_tokenizer(model_file), rows)]


def run_level(url: str, args: argparse.Namespace, prompts: list, concurrency: int, server: str, name: str,
              extra: dict) -> dict:
    records, wall_s = asyncio.run(run_scenario(url, args, prompts, concurrency, extra))
    _log(f"{server} {name}, {concurrency} clients: {wall_s:.1f} s")
    return {"server": server, "name": name, **summarize(records, wall_s, concurrency),
            "requests": [asdict(r) for r in records]}


def _args_json(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the server


def speculation_off(args: argparse.Namespace) -> bool:
    """--no-speculation (or --speculative-config none): the server without a drafter, no speculation runs."""
    return bool(getattr(args, "no_speculation", False)) or args.speculative_config == "none"


def launch_specserve(args: argparse.Namespace, max_concurrency: int) -> ServerProcess:
    """`specserve serve` on a free loopback port with the bench's engine arguments, prefix caching off."""
    spec = "none" if speculation_off(args) else args.speculative_config or DEFAULT_SPECULATIVE_CONFIG
    cmd = [sys.executable, "-m", "specserve.cli", "serve", "--log-level", "warning", "--no-prefix-caching",
           "--max-num-seqs", str(max(args.max_num_seqs, max_concurrency)),
           "--speculative-config", spec if spec == "none" else json.dumps(spec)]
    for flag in ("model", "dtype", "gguf_compute", "kv_cache_dtype", "max_model_len", "max_num_batched_tokens",
                 "kv_cache_memory_bytes"):
        if getattr(args, flag, None) is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    _log(f"starting specserve serve, speculative_config {json.dumps(spec)}")
    return ServerProcess(cmd, "--port", "specserve-bench-server-")


# ---------------------------------------------------------------- the clients


async def run_scenario(url: str, args: argparse.Namespace, prompts: list, concurrency: int, extra: dict
                       ) -> tuple[list[RequestRecord], float]:
    """Every prompt once, `concurrency` at a time; returns the records (in prompt order) and wall time. A prompt
    is a question (a chat message) or a list of token ids (a completion)."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # a connection per request: a server that closes a kept-alive connection (llama-server's does after a few
    # requests) would fail the request sent on it
    limits = httpx.Limits(max_connections=concurrency + 1, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=None, limits=limits) as client:
        await asyncio.gather(*(stream(client, -1, prompts[0], 4, extra) for _ in range(concurrency)))  # warm-up
        queue: asyncio.Queue = asyncio.Queue()
        for item in enumerate(prompts):
            queue.put_nowait(item)
        records: list[RequestRecord] = []

        async def worker() -> None:
            while not queue.empty():
                index, prompt = queue.get_nowait()
                records.append(await stream(client, index, prompt, args.max_tokens, extra))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall_s = time.perf_counter() - start
    return sorted(records, key=lambda r: r.prompt_index), wall_s


async def stream(client, index: int, prompt: str | list[int], max_tokens: int, extra: dict) -> RequestRecord:
    """One streamed request: a chat completion of a question, or a completion of prompt token ids."""
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    if isinstance(prompt, str):
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", list(prompt)
    import httpx

    record = RequestRecord(index)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                _absorb(record, json.loads(line[len("data: "):]), start, last)
                last = time.perf_counter() if record.text else last
    except httpx.TransportError as e:  # the run goes on, the request counted as failed
        record.error = f"{type(e).__name__}: {e}"
        return record
    record.e2e_s = time.perf_counter() - start
    return record


def _absorb(record: RequestRecord, event: dict, start: float, last: float) -> None:
    """One server-sent event: content (timing it), usage, or an error."""
    now = time.perf_counter()
    if "error" in event:
        record.error = event["error"].get("message")
    for choice in event.get("choices") or ():
        content = choice["text"] if "text" in choice else (choice.get("delta") or {}).get("content")
        if not content:
            continue
        if not record.text:
            record.ttft_s = now - start
        else:
            record.chunk_gaps_s.append(now - last)
        record.text += content
    usage = event.get("usage")
    if usage:
        record.num_output_tokens = usage["completion_tokens"]
        record.speculation = usage.get("speculation")


# ---------------------------------------------------------------- report


def percentiles(values: list[float]) -> dict[str, float]:
    values = sorted(v for v in values if v == v)
    if not values:
        return {f"p{p}": float("nan") for p in PERCENTILES} | {"mean": float("nan")}
    out = {f"p{p}": values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))] for p in PERCENTILES}
    return out | {"mean": sum(values) / len(values)}


def summarize(records: list[RequestRecord], wall_s: float, concurrency: int) -> dict:
    ok = [r for r in records if r.error is None]
    tokens = sum(r.num_output_tokens for r in ok)
    drafts = sum((r.speculation or {}).get("num_drafts", 0) for r in ok)
    accepted = sum((r.speculation or {}).get("num_accepted_tokens", 0) for r in ok)
    drafted = sum((r.speculation or {}).get("num_draft_tokens", 0) for r in ok)
    return {
        "num_requests": len(records), "num_failed": len(records) - len(ok), "concurrency": concurrency,
        "wall_s": wall_s, "num_output_tokens": tokens,
        "output_tokens_per_s": safe_div(tokens, wall_s), "requests_per_s": safe_div(len(ok), wall_s),
        "ttft_s": percentiles([r.ttft_s for r in ok]), "tpot_s": percentiles([r.tpot_s for r in ok]),
        "inter_chunk_latency_s": percentiles([g for r in ok for g in r.chunk_gaps_s]),
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "errors": sorted({r.error for r in records if r.error})[:5],
    }


def agreement(plain: list[dict], other: list[dict]) -> dict:
    """How many of two runs' greedy outputs (request dicts in prompt order) are the same text."""
    same = sum(a["text"] == b["text"] and a["error"] is None for a, b in zip(plain, other))
    return {"identical": same, "total": len(plain)}


def agreements(scenarios: list[dict]) -> list[dict]:
    """Per level, each run's outputs against specserve's without speculation: with speculation they must be
    identical; llama.cpp's differ where its rounding of the activations flips a near tie."""
    out = []
    for plain in (s for s in scenarios if s["server"] == SPECSERVE and s["name"] == "no_speculation"):
        for other in scenarios:
            if other["concurrency"] == plain["concurrency"] and other is not plain:
                out.append({"concurrency": plain["concurrency"], "server": other["server"], "name": other["name"],
                            **agreement(plain["requests"], other["requests"])})
    return out


def format_report(report: dict) -> str:
    headers = ["server", "scenario", "reqs", "clients", "out tok/s", "x llama-server", "req/s", "TTFT p50 ms",
               "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "ITL p50 ms", "ITL p99 ms", "accept len"]
    llama = {s["concurrency"]: s["output_tokens_per_s"] for s in report["scenarios"] if s["server"] == LLAMA_SERVER}
    rows = []
    for s in report["scenarios"]:
        ms = {k: {p: v * 1000 for p, v in s[k].items()} for k in ("ttft_s", "tpot_s", "inter_chunk_latency_s")}
        ratio = safe_div(s["output_tokens_per_s"], llama[s["concurrency"]]) if s["concurrency"] in llama else None
        rows.append([s["server"], s["name"], s["num_requests"] - s["num_failed"], s["concurrency"],
                     s["output_tokens_per_s"], f"{ratio:.2f}x" if ratio else "-", s["requests_per_s"],
                     ms["ttft_s"]["p50"], ms["ttft_s"]["p99"], ms["tpot_s"]["p50"], ms["tpot_s"]["p99"],
                     ms["inter_chunk_latency_s"]["p50"], ms["inter_chunk_latency_s"]["p99"],
                     s["mean_acceptance_length"]])
    env = report["env"]
    lines = [f"specserve bench serve: {report['args']['num_prompts']} Spec-Bench prompts, "
             f"{report['args']['max_tokens']} tokens each, greedy, EOS ignored; "
             f"load average {env.get('load_average_1m', '?')} -> {env.get('load_average_1m_end', '?')} "
             f"on {env['cpu_count']} CPUs",
             format_table(headers, rows)]
    for a in report["greedy_agreement"]:
        lines.append(f"{a['concurrency']} clients: {a['server']} {a['name']} gave specserve's greedy outputs "
                     f"without speculation for {a['identical']}/{a['total']} prompts")
    lines.append("ITL = gap between streamed chunks (a chunk can carry several tokens with speculation); "
                 "TPOT = (end-to-end - TTFT) / (tokens - 1).")
    failed = {f"{s['server']} {s['name']} x{s['concurrency']}": s["errors"] for s in report["scenarios"]
              if s["num_failed"]}
    if failed:
        lines.append(f"failed requests: {failed}")
    return "\n".join(lines)
