"""`specserve bench serve`: N concurrent streaming chat clients over Spec-Bench prompts against the
OpenAI-compatible server, with speculation on and off (per request), reporting throughput, TTFT, TPOT and
inter-chunk latency percentiles.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

from specserve.bench.common import (
    add_dataset_args, environment_info, format_table, read_specbench, safe_div, select_spread, write_json)

DEFAULT_OUTPUT = "bench_results/serve.json"
DEFAULT_SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4}
STARTUP_TIMEOUT_S = 300
PERCENTILES = (50, 90, 99)


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
                    "prefix caching, so both runs see the prompts cold) and stopped afterwards.")
    add_dataset_args(p, num_prompts=16, max_tokens=64)
    p.add_argument("--concurrency", type=int, default=8, help="clients in flight (default: %(default)s)")
    p.add_argument("--url", default=None, help="an already running server, e.g. http://127.0.0.1:8000 (it "
                                               "should have a speculative_config and prefix caching off)")
    p.add_argument("--api-key", default=None, help="bearer token for --url")
    p.add_argument("--output-json", default=DEFAULT_OUTPUT, help="where to write results (default: %(default)s)")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve_bench)


def check_args(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "max_tokens", "concurrency"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def cmd_serve_bench(args: argparse.Namespace) -> int:
    check_args(args)
    questions = [row["turns"][0] for row in select_spread(read_specbench(args.dataset), args.num_prompts)]
    env = environment_info()
    server = None if args.url else LaunchedServer(args)
    url = args.url or server.url
    try:
        _log(f"benchmarking {url}: {len(questions)} prompts, {args.concurrency} clients, "
             f"{args.max_tokens} tokens each")
        scenarios = {}
        for name, extra in (("no_speculation", {"num_speculative_tokens": 0}), ("speculation", {})):
            records, wall_s = asyncio.run(run_scenario(url, args, questions, extra))
            scenarios[name] = summarize(records, wall_s, args.concurrency)
            scenarios[name]["requests"] = [asdict(r) for r in records]
            _log(f"{name}: {wall_s:.1f} s")
    finally:
        if server is not None:
            server.stop()
    env["load_average_1m_end"] = environment_info().get("load_average_1m")
    report = {"benchmark": "serve", "url": args.url, "env": env, "args": _args_json(args),
              "greedy_agreement": agreement(scenarios), "scenarios": scenarios}
    print(format_report(report))
    print(f"\nwrote {write_json(args.output_json, report)}")
    return 0


def _args_json(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the server


class LaunchedServer:
    """`specserve serve` in a subprocess on a free loopback port, with the bench's engine arguments."""

    def __init__(self, args: argparse.Namespace) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        spec = args.speculative_config or DEFAULT_SPECULATIVE_CONFIG
        cmd = [sys.executable, "-m", "specserve.cli", "serve", "--port", str(port), "--log-level", "warning",
               "--no-prefix-caching", "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
               "--max-num-seqs", str(max(args.max_num_seqs, args.concurrency)),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--speculative-config", json.dumps(spec)]
        if args.model:
            cmd += ["--model", args.model]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="specserve-bench-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        _log(f"started specserve serve (log: {self.log.name}), speculative_config {json.dumps(spec)}")
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        import httpx

        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server was not healthy after {STARTUP_TIMEOUT_S} s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---------------------------------------------------------------- the clients


async def run_scenario(url: str, args: argparse.Namespace, questions: list[str], extra: dict
                       ) -> tuple[list[RequestRecord], float]:
    """Every question once, `args.concurrency` at a time; returns the records (in question order) and wall time."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 1)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=None, limits=limits) as client:
        await stream_chat(client, -1, questions[0], 4, extra)  # warm-up
        queue: asyncio.Queue = asyncio.Queue()
        for item in enumerate(questions):
            queue.put_nowait(item)
        records: list[RequestRecord] = []

        async def worker() -> None:
            while not queue.empty():
                index, question = queue.get_nowait()
                records.append(await stream_chat(client, index, question, args.max_tokens, extra))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall_s = time.perf_counter() - start
    return sorted(records, key=lambda r: r.prompt_index), wall_s


async def stream_chat(client, index: int, question: str, max_tokens: int, extra: dict) -> RequestRecord:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **extra}
    record = RequestRecord(index)
    start = last = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            record.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
            return record
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            _absorb(record, json.loads(line[len("data: "):]), start, last)
            last = time.perf_counter() if record.text else last
    record.e2e_s = time.perf_counter() - start
    return record


def _absorb(record: RequestRecord, event: dict, start: float, last: float) -> None:
    """One server-sent event: content (timing it), usage, or an error."""
    now = time.perf_counter()
    if "error" in event:
        record.error = event["error"].get("message")
    for choice in event.get("choices") or ():
        content = choice.get("delta", {}).get("content")
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


def agreement(scenarios: dict) -> dict:
    """Greedy outputs with and without speculation must be identical; count how many are."""
    plain = scenarios["no_speculation"]["requests"]
    spec = scenarios["speculation"]["requests"]
    same = sum(a["text"] == b["text"] and a["error"] is None for a, b in zip(plain, spec))
    return {"identical": same, "total": len(plain)}


def format_report(report: dict) -> str:
    headers = ["scenario", "reqs", "clients", "out tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms",
               "TPOT p50 ms", "TPOT p99 ms", "ITL p50 ms", "ITL p99 ms", "accept len"]
    rows = []
    for name, s in report["scenarios"].items():
        ms = {k: {p: v * 1000 for p, v in s[k].items()} for k in ("ttft_s", "tpot_s", "inter_chunk_latency_s")}
        rows.append([name, s["num_requests"] - s["num_failed"], s["concurrency"], s["output_tokens_per_s"],
                     s["requests_per_s"], ms["ttft_s"]["p50"], ms["ttft_s"]["p99"], ms["tpot_s"]["p50"],
                     ms["tpot_s"]["p99"], ms["inter_chunk_latency_s"]["p50"], ms["inter_chunk_latency_s"]["p99"],
                     s["mean_acceptance_length"]])
    env, agree = report["env"], report["greedy_agreement"]
    lines = [f"specserve bench serve: {report['args']['num_prompts']} Spec-Bench prompts, "
             f"{report['args']['max_tokens']} tokens each, greedy, EOS ignored; "
             f"load average {env.get('load_average_1m', '?')} -> {env.get('load_average_1m_end', '?')} "
             f"on {env['cpu_count']} CPUs",
             format_table(headers, rows),
             f"greedy outputs identical with and without speculation: {agree['identical']}/{agree['total']}",
             "ITL = gap between streamed chunks (a chunk can carry several tokens with speculation); "
             "TPOT = (end-to-end - TTFT) / (tokens - 1)."]
    failed = {n: s["errors"] for n, s in report["scenarios"].items() if s["num_failed"]}
    if failed:
        lines.append(f"failed requests: {failed}")
    return "\n".join(lines)
