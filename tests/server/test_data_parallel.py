"""Data parallelism: `specserve serve --data-parallel-size 2` through the official openai client, against the
offline LLM run alone as the reference; a replica killed mid-run; a replica whose step fails, resetting its
engine in process; shutdown leaving no process; the router's retry and failure rules on fake engines; and two
replicas as Ray actors when Ray is installed."""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import sys
import time

import httpx
import openai
import pytest

from specserve.cli import main as cli_main
from specserve.config import EngineConfig
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.server.api_server import build_app
from specserve.server.async_engine import EngineDeadError, RequestFailedError
from specserve.server.metrics import ServerMetrics
from specserve.server.replicas import ReplicaClient, ReplicaDiedError
from specserve.server.serving import ServingContext
from tests.server.fake_engine import FakeTokenizer, build_fake_engine
from tests.server.helpers import ServerProcess, metric, scrape, wait_for_metric

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 256
KV_BYTES = 32 << 20  # 700 tokens per replica: room for 8 running sequences of these lengths
MAX_NUM_SEQS = 8
ENGINE_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(KV_BYTES),
               "--max-num-seqs", str(MAX_NUM_SEQS))
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colors are",
           "To make a cup of tea,", "1, 2, 3, 4,", "The sun rises in the", "Water boils at"]
SHORT, LONG = 12, 48  # max_tokens of the concurrency test and of the kill test


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--data-parallel-size", "2", *ENGINE_ARGS)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def reference():
    """prompt, max_tokens -> the greedy text of one engine running that request alone (ignore_eos)."""
    llm = LLM(max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_BYTES)
    cache = {}

    def text(prompt: str, max_tokens: int) -> str:
        if (prompt, max_tokens) not in cache:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            cache[prompt, max_tokens] = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
        return cache[prompt, max_tokens]

    return text


async def stream_text(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> tuple[str, str | None]:
    text, reason = "", None
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        for c in chunk.choices:
            text += c.text
            reason = c.finish_reason or reason
    return text, reason


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def finished(samples: dict, replica: str | None = None) -> float:
    if replica is None:
        return sum(metric(samples, "specserve:request_success_total", finished_reason=r) for r in ("length", "stop"))
    return sum(metric(samples, "specserve:replica_request_success_total", finished_reason=r, replica=replica)
               for r in ("length", "stop"))


# ------------------------------------------------------------------------------------------- flags


def test_bad_data_parallel_flags_name_the_flag(capsys, monkeypatch):
    assert cli_main(["serve", "--data-parallel-size", "0"]) == 2
    assert "--data-parallel-size must be >= 1, got 0" in capsys.readouterr().err
    assert cli_main(["serve", "--ray-address", "127.0.0.1:6379"]) == 2
    assert "--ray-address needs --data-parallel-backend ray" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    assert cli_main(["serve", "--data-parallel-size", "2", "--data-parallel-backend", "ray"]) == 2
    assert "pip install specserve[ray]" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- two real replicas


def test_64_concurrent_streams_match_one_engine_and_use_both_replicas(server, reference):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
    before = scrape(server.url)

    async def run():
        async with async_client(server) as client:
            return await asyncio.gather(*(stream_text(client, p, SHORT) for p in prompts))

    results = asyncio.run(run())
    assert [text for text, _ in results] == [reference(p, SHORT) for p in prompts]
    assert {reason for _, reason in results} == {"length"}
    after = scrape(server.url)
    per_replica = [finished(after, str(i)) - finished(before, str(i)) for i in range(2)]
    assert sum(per_replica) == finished(after) - finished(before) == 64
    assert min(per_replica) >= 16, per_replica  # routed by load: both replicas took a share
    tokens = [metric(after, "specserve:replica_generation_tokens_total", replica=str(i)) for i in range(2)]
    assert sum(tokens) == metric(after, "specserve:generation_tokens_total") and min(tokens) > 0


def test_killed_replica_fails_or_retries_each_request_and_the_survivor_serves(server, reference):
    health = httpx.get(server.url + "/health").json()
    assert health["replicas_alive"] == 2
    victim = health["replicas"][1]["pid"]
    prompts = [PROMPTS[i % 3] for i in range(3 * MAX_NUM_SEQS)]  # 12 per replica: 8 run, 4 wait
    tokens_before = metric(scrape(server.url), "specserve:replica_generation_tokens_total", replica="1")

    async def run():
        async with async_client(server) as client:
            tasks = [asyncio.ensure_future(stream_text(client, p, LONG)) for p in prompts]
            # kill replica 1 once it streams its running requests and still has requests waiting
            await asyncio.to_thread(wait_for_metric, server.url, "specserve:replica_generation_tokens_total",
                                    lambda v: v >= tokens_before + 2 * MAX_NUM_SEQS, replica="1")
            os.kill(victim, signal.SIGKILL)
            return await asyncio.gather(*tasks, return_exceptions=True)

    start = time.monotonic()
    results = asyncio.run(asyncio.wait_for(run(), 120))
    errors = [r for r in results if isinstance(r, BaseException)]
    for r in errors:  # a streamed request that lost its replica ends with an error event naming it
        assert isinstance(r, openai.APIError) and "replica 1 was killed by signal SIGKILL" in str(r), repr(r)
    for prompt, r in zip(prompts, results):
        if not isinstance(r, BaseException):
            assert r == (reference(prompt, LONG), "length")
    samples = scrape(server.url)
    assert metric(samples, "specserve:replicas_alive") == 1
    assert metric(samples, "specserve:replica_alive", replica="1") == 0
    assert len(errors) == metric(samples, "specserve:replica_requests_failed_total", replica="1") >= 1
    assert metric(samples, "specserve:replica_requests_retried_total", replica="1") >= 1  # were waiting
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["replicas"][1]["alive"] is False
    assert "SIGKILL" in health.json()["replicas"][1]["exit_reason"]

    async def after():
        async with async_client(server) as client:
            return await asyncio.gather(*(stream_text(client, p, SHORT) for p in PROMPTS[:4]))

    assert asyncio.run(after()) == [(reference(p, SHORT), "length") for p in PROMPTS[:4]]
    assert time.monotonic() - start < 60


def test_sigterm_drains_then_leaves_no_process_behind(server):
    survivor = httpx.get(server.url + "/health").json()["replicas"][0]["pid"]
    family = descendants(server.proc.pid)
    assert survivor in family  # and multiprocessing's resource tracker
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(lines)
        server.proc.send_signal(signal.SIGTERM)  # in flight: it may finish (--shutdown-timeout, 10 s)
        events = [first, *(line for line in lines if line.startswith("data: "))]
    assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]
    assert server.stop() in (0, -signal.SIGTERM)
    deadline = time.monotonic() + 15
    while any(map(is_alive, family)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in family if is_alive(pid)]


def descendants(pid: int) -> set[int]:
    """Every process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.add(child)
            todo.append(child)
    return found


def is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ------------------------------------------------------------------------------------------- the router, on fakes


def test_router_retries_waiting_requests_fails_streaming_ones_and_503s_with_none_alive():
    """Fake engines run one request at a time (one character per step), so each replica has one streaming
    request and one waiting when replica 1 is killed: the waiting one moves, the streaming one fails."""
    client = ReplicaClient(EngineConfig(max_model_len=64, max_num_seqs=1), 2, engine_factory=build_fake_engine)
    metrics = ServerMetrics(client, "fake", num_replicas=2)
    client.stat_logger = metrics
    info = client.launch()
    app = build_app(ServingContext(client, FakeTokenizer(), ["fake"], info.max_model_len, info.vocab_size), metrics)
    params = SamplingParams(max_tokens=600)

    async def one(i: int):
        last = None
        async for last in client.generate(f"r{i}", {"prompt_token_ids": [65, 66]}, params):
            pass
        return last

    async def run():
        client.start()
        with pytest.raises(ValueError, match="prompt must not be empty"):
            await client.add_request("empty", {"prompt_token_ids": []}, params)
        tasks = [asyncio.ensure_future(one(i)) for i in range(4)]
        while not (client.replicas[1].snapshot.num_waiting == 1 and client.replicas[1].snapshot.metrics
                   and client.replicas[1].snapshot.metrics.num_generation_tokens > 0):
            await asyncio.sleep(0.01)
        os.kill(client.replicas[1].info.pid, signal.SIGKILL)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        os.kill(client.replicas[0].info.pid, signal.SIGKILL)
        while client.is_running:
            await asyncio.sleep(0.01)
        with pytest.raises(EngineDeadError, match="no replica is alive: replica 0 was killed"):
            await client.add_request("late", {"prompt_token_ids": [65]}, params)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            health = await http.get("/health")
            completion = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        await client.shutdown()
        return results, health, completion

    results, health, completion = asyncio.run(asyncio.wait_for(run(), 60))
    died = [r for r in results if isinstance(r, ReplicaDiedError)]
    assert len(died) == 1 and "replica 1 was killed by signal SIGKILL" in str(died[0])
    assert [len(r.outputs[0].text) for r in results if not isinstance(r, BaseException)] == [600] * 3
    assert (client.replicas[1].num_retried, client.replicas[1].num_failed) == (1, 1)
    assert health.status_code == 503 and health.json()["replicas_alive"] == 0
    assert completion.status_code == 503 and "no replica is alive" in completion.json()["error"]["message"]
    assert not multiprocessing.active_children()


POISON = "Say zebra-crossing twice."


def build_engine_with_a_faulty_step(config):
    """A replica's real engine whose forward raises once, on the step that prefills POISON."""
    from specserve.engine.engine import LLMEngine

    engine = LLMEngine(config)
    forward, poison = engine.model.forward, set(engine.tokenizer.encode(POISON, add_special_tokens=False))

    def faulty_forward(input_ids, *args, **kwargs):
        if poison and poison <= set(input_ids.tolist()):
            poison.clear()
            raise RuntimeError("injected fault in the forward")
        return forward(input_ids, *args, **kwargs)

    engine.model.forward = faulty_forward
    return engine


def test_a_replica_resets_its_engine_in_process_and_is_not_declared_dead(reference):
    client = ReplicaClient(EngineConfig(max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_BYTES), 1,
                           engine_factory=build_engine_with_a_faulty_step)
    client.launch()
    params = SamplingParams(temperature=0.0, max_tokens=SHORT, ignore_eos=True)

    async def final(request_id: str, prompt: str):
        last = None
        async for last in client.generate(request_id, prompt, params):
            pass
        return last

    async def run():
        client.start()
        poisoned = await asyncio.gather(final("poisoned", POISON), return_exceptions=True)
        after = await final("after", PROMPTS[0])
        alive = client.replicas[0].alive
        await client.shutdown()
        return poisoned[0], after, alive

    poisoned, after, alive = asyncio.run(asyncio.wait_for(run(), 120))
    assert isinstance(poisoned, RequestFailedError) and "injected fault in the forward" in str(poisoned)
    assert after.outputs[0].text == reference(PROMPTS[0], SHORT)
    assert alive and client.replicas[0].num_failed == 0
    assert client.replicas[0].snapshot.metrics.num_engine_restarts == 1


# ------------------------------------------------------------------------------------------- Ray actors


@pytest.fixture
def ray_address():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def test_two_replicas_as_ray_actors(ray_address, reference):
    import ray

    proc = ServerProcess("--data-parallel-size", "2", "--data-parallel-backend", "ray", "--ray-address",
                         ray_address, *ENGINE_ARGS)
    try:
        pids = {r["pid"] for r in httpx.get(proc.url + "/health").json()["replicas"]}
        assert len(pids) == 2 and proc.proc.pid not in pids

        async def run():
            async with async_client(proc) as client:
                return await asyncio.gather(*(stream_text(client, p, SHORT) for p in PROMPTS))

        assert asyncio.run(run()) == [(reference(p, SHORT), "length") for p in PROMPTS]
        samples = scrape(proc.url)
        assert min(finished(samples, str(i)) for i in range(2)) >= 1
    finally:
        assert proc.stop() in (0, -signal.SIGTERM)
    deadline = time.monotonic() + 15  # the placement group is released with the server
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2
