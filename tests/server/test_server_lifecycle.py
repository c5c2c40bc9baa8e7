"""A small real server (one sequence at a time, one waiting slot, API key from SPECSERVE_API_KEY): 401 without
the key, 503 + Retry-After when the waiting queue is full, and a clean exit on SIGTERM mid-stream."""
from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.server.helpers import ServerProcess, metric, scrape, wait_for_metric

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
SHUTDOWN_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--max-model-len", "512", "--max-num-seqs", "1", "--max-waiting-requests", "1",
                         "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), env={"SPECSERVE_API_KEY": KEY})
    yield proc
    proc.stop()


def long_stream_body(max_tokens: int = 400) -> dict:
    return {"prompt": "Tell me a long story.", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}


def test_api_key_is_required_on_v1_only(server):
    assert httpx.get(server.url + "/v1/models").status_code == 401
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_full_waiting_queue_answers_503_with_retry_after(server):
    with httpx.stream("POST", server.url + "/v1/completions", json=long_stream_body(), headers=AUTH,
                      timeout=120) as running:
        lines = running.iter_lines()  # keep it: a dropped iterator closes the response (and aborts it)
        next(lines)  # the only sequence slot is taken
        waiting_result = {}
        waiting = threading.Thread(target=lambda: waiting_result.update(r=httpx.post(
            server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=AUTH, timeout=120)))
        waiting.start()
        wait_for_metric(server.url, "specserve:num_requests_waiting", lambda v: v == 1)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=AUTH,
                       timeout=30)
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "queue_full"
    # closing the running stream aborts it; the waiting request then runs to completion
    waiting.join(120)
    assert waiting_result["r"].status_code == 200
    wait_for_metric(server.url, "specserve:kv_cache_usage_perc", lambda v: v == 0)


def test_sigterm_mid_stream_ends_the_stream_and_exits(server):
    lines = []
    with httpx.stream("POST", server.url + "/v1/completions", json=long_stream_body(480), headers=AUTH,
                      timeout=120) as r:
        it = r.iter_lines()
        lines.append(next(it))
        assert metric(scrape(server.url), "specserve:num_requests_running") == 1
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        lines.extend(it)  # the server lets it run for --shutdown-timeout, then aborts it and ends the stream
    events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert any('"aborted"' in e for e in events) or any('"finish_reason":"length"' in e for e in events)
    assert server.proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once shut down
    assert time.monotonic() - start < SHUTDOWN_TIMEOUT_S + 20
