"""Test helpers: a real `specserve serve` subprocess on a free loopback port, and /metrics parsing."""
from __future__ import annotations

import os
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from specserve.bench.common import ServerProcess as BenchServerProcess

STARTUP_TIMEOUT_S = 180  # model load on two busy cores


class ServerProcess(BenchServerProcess):
    """`python -m specserve.cli serve ...` in a subprocess; `url` is its base URL once /health answers."""

    def __init__(self, *args: str, env: dict | None = None) -> None:
        super().__init__([sys.executable, "-m", "specserve.cli", "serve", "--log-level", "warning", *args],
                         "--port", "specserve-server-", env={**os.environ, **(env or {})},
                         startup_timeout_s=STARTUP_TIMEOUT_S)


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """/metrics as {(sample name, frozenset(labels without model_name)): value}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
            samples[(s.name, labels)] = s.value
    return samples


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def wait_for_metric(url: str, name: str, predicate, timeout: float = 30, **labels) -> float:
    """Poll /metrics until predicate(value) holds; returns the value (fails the test on timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        value = metric(scrape(url), name, **labels)
        if predicate(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}{labels or ''} stayed at {value} for {timeout} s")
        time.sleep(0.2)


def hostile_server(speculative_config: str) -> ServerProcess:
    """The default model served small (512 tokens, 64 MiB of KV) with `speculative_config`, for suites that send
    hostile requests and probe that the server still answers plainly."""
    return ServerProcess("--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20),
                         "--speculative-config", speculative_config)


def completion_text(url: str, body: dict, timeout: float = 60) -> str:
    """The text of one completion, asserting it succeeded."""
    r = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
    assert r.status_code == 200, r.text[:500]
    return r.json()["choices"][0]["text"]


def assert_never_reset(url: str) -> None:
    """No case may have taken the engine down to a reset: each failed alone or was refused."""
    assert scrape(url)[("specserve:num_engine_restarts_total", frozenset())] == 0


def app_over(engine, model: str):
    """(AsyncLLM, ASGI app) of the OpenAI server over an in-process `engine`, served under the name `model`
    (the AsyncLLM not started yet)."""
    from specserve.server.api_server import build_app
    from specserve.server.async_engine import AsyncLLM
    from specserve.server.metrics import ServerMetrics
    from specserve.server.serving import ServingContext

    async_engine = AsyncLLM(engine)
    metrics = ServerMetrics(async_engine, model)
    async_engine.stat_logger = metrics
    ctx = ServingContext(async_engine, engine.tokenizer, [model], engine.max_model_len,
                         engine.model.config.vocab_size)
    return async_engine, build_app(ctx, metrics)
