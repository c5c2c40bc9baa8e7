"""Plumbing of `specserve bench serve` (levels, statistics, report, the llama-server command, the streaming
client against a stand-in server); the benchmark itself is run by hand."""
from __future__ import annotations

import math
import sys
import textwrap
from argparse import Namespace
from dataclasses import asdict

import pytest

from specserve.bench.common import ServerProcess
from specserve.bench.llamacpp import LLAMA_SERVER, llama_server_command
from specserve.bench.serve import (
    SPECSERVE, RequestRecord, agreement, agreements, format_report, parse_levels, percentiles, run_level, summarize)


def test_percentiles_pick_ranked_values_and_skip_nan():
    values = [float(v) for v in range(1, 101)] + [float("nan")]
    p = percentiles(values)
    assert (p["p50"], p["p90"], p["p99"]) == (51.0, 90.0, 99.0) and p["mean"] == 50.5
    assert math.isnan(percentiles([])["p50"])


def test_levels_are_one_or_more_positive_integers():
    assert parse_levels("8") == [8] and parse_levels("8,16, 32") == [8, 16, 32]
    for bad in ("", "0", "8,x", "-1"):
        with pytest.raises(ValueError, match="--concurrency"):
            parse_levels(bad)


def scenario(server: str, name: str, concurrency: int, records: list[RequestRecord], wall_s: float) -> dict:
    return {"server": server, "name": name, **summarize(records, wall_s, concurrency),
            "requests": [asdict(r) for r in records]}


def test_summary_and_report():
    ok = RequestRecord(0, ttft_s=0.1, e2e_s=1.1, chunk_gaps_s=[0.1] * 5, num_output_tokens=11, text="x",
                       speculation={"num_drafts": 4, "num_draft_tokens": 8, "num_accepted_tokens": 6})
    failed = RequestRecord(1, error="HTTP 503: full")
    s = summarize([ok, failed], wall_s=2.0, concurrency=2)
    assert s["num_failed"] == 1 and s["output_tokens_per_s"] == 5.5
    assert s["tpot_s"]["p50"] == 0.1 and s["mean_acceptance_length"] == 2.5 and s["acceptance_rate"] == 0.75
    other = RequestRecord(0, ttft_s=0.2, e2e_s=2.2, num_output_tokens=11, text="y")
    scenarios = [scenario(SPECSERVE, "no_speculation", 2, [ok, failed], 2.0),
                 scenario(SPECSERVE, "speculation", 2, [ok, failed], 2.0),
                 scenario(LLAMA_SERVER, "plain", 2, [other, RequestRecord(1, text="z", num_output_tokens=11)], 8.0)]
    assert agreement(scenarios[0]["requests"], scenarios[1]["requests"]) == {"identical": 1, "total": 2}
    agree = agreements(scenarios)
    assert [(a["server"], a["name"], a["identical"]) for a in agree] == [
        (SPECSERVE, "speculation", 1), (LLAMA_SERVER, "plain", 0)]
    report = {"env": {"cpu_count": 2}, "args": {"num_prompts": 2, "max_tokens": 11}, "greedy_agreement": agree,
              "scenarios": scenarios}
    text = format_report(report)
    assert "speculation" in text and "2.50" in text and "HTTP 503" in text
    assert "2.00x" in text  # specserve's 5.5 tok/s against llama-server's 22 tokens in 8 s
    assert "gave specserve's greedy outputs without speculation for 0/2" in text


def test_llama_server_command_matches_the_kv_type_and_slots():
    def flags(cmd: list[str]) -> dict[str, str]:
        return {cmd[i]: cmd[i + 1] for i in range(1, len(cmd) - 1)}

    cmd = llama_server_command("/bin/llama-server", "m.gguf", 16, 2, 600, "bfloat16")
    assert cmd[0] == "/bin/llama-server" and flags(cmd)["--model"] == "m.gguf" and flags(cmd)["--parallel"] == "16"
    assert flags(cmd)["--ctx-size"] == str(16 * 600) and flags(cmd)["--threads"] == flags(cmd)["--threads-batch"] == "2"
    assert flags(cmd)["--cache-type-k"] == flags(cmd)["--cache-type-v"] == "bf16"
    for dtype, kv in (("auto", "f32"), ("int8", "q8_0")):
        got = flags(llama_server_command("s", "m.gguf", 1, 2, 64, dtype))
        assert got["--cache-type-k"] == got["--cache-type-v"] == kv
    assert llama_server_command("s", "m.gguf", 1, 2, 64, "auto", ["--spec-type", "ngram-simple"])[-2:] == [
        "--spec-type", "ngram-simple"]
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        llama_server_command("s", "m.gguf", 1, 2, 64, "fp8")


STAND_IN = textwrap.dedent('''
    """A stand-in for llama-server: /health, and /v1/completions streaming one token a chunk, usage last."""
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def log_message(self, *args):
            pass
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert self.path == "/v1/completions" and body["stream"] and body["ignore_eos"]
            assert body["cache_prompt"] is False and all(isinstance(t, int) for t in body["prompt"])
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            n = body["max_tokens"]
            events = [{"choices": [{"text": f"<{body['prompt'][0]}:{i}>", "index": 0}]} for i in range(n)]
            events.append({"choices": [], "usage": {"completion_tokens": n}})
            for event in events:
                self.wfile.write(f"data: {json.dumps(event)}\\n\\n".encode())
            self.wfile.write(b"data: [DONE]\\n\\n")
            self.close_connection = True

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), Handler).serve_forever()
''')


def test_streaming_client_against_a_server_process(tmp_path):
    """The client path of a llama-server level: prompt token ids in, one text chunk a token, usage counted."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    args = Namespace(api_key=None, max_tokens=5)
    prompts = [[7, 1, 2], [8, 3], [9]]
    with ServerProcess([sys.executable, str(script)], "--port", "stand-in-") as server:
        result = run_level(server.url, args, prompts, 2, LLAMA_SERVER, "plain", {"cache_prompt": False})
    assert server.proc.poll() is not None  # stopped on exit
    assert result["num_requests"] == 3 and result["num_failed"] == 0 and result["num_output_tokens"] == 15
    assert [r["text"] for r in result["requests"]] == ["".join(f"<{p[0]}:{i}>" for i in range(5)) for p in prompts]
    assert all(len(r["chunk_gaps_s"]) == 4 and r["ttft_s"] > 0 for r in result["requests"])


def test_a_dropped_connection_is_a_failed_request_not_a_failed_run(tmp_path):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    with ServerProcess([sys.executable, str(script)], "--port", "stand-in-") as server:
        url = server.url
    # the server is gone: every request fails with a transport error, and the level still reports
    result = run_level(url, Namespace(api_key=None, max_tokens=3), [[1], [2]], 2, LLAMA_SERVER, "plain", {})
    assert result["num_failed"] == 2 and result["output_tokens_per_s"] == 0
    assert all(e.startswith("ConnectError") for e in result["errors"])
