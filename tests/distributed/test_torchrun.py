"""Ranks launched by torchrun (or by hand with its variables): the driver's greedy tokens equal one process's,
the workers never run the caller's code after LLM(...) and exit with the driver, a killed worker fails the
driver's next step with WorkerFailure, a killed driver ends its workers, and WORLD_SIZE must equal
tensor_parallel_size.
"""
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch.distributed as dist

from specserve.distributed.torchrun import (HEARTBEAT_TIMEOUT_S, START_TIMEOUT, Heartbeats, TorchrunLaunch,
                                          gloo_address, heartbeat_key, route_key, torchrun_launch)
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from tests.tiny_models import save_hf_folder, tiny_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, block_size=8,
                   kv_cache_memory_bytes=8 << 20)
PROMPTS = [[5, 9, 13, 77, 160, 2, 8], list(range(100, 140))]
GREEDY = dict(temperature=0.0, max_tokens=16, ignore_eos=True)
# What every rank runs: rank 0 writes its tokens, then (with a pipe on stdin) waits for a line and tries
# another step; a worker never gets past LLM(...), so it writes nothing.
SCRIPT = textwrap.dedent(f"""
    import json, os, sys
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    folder, out = sys.argv[1], sys.argv[2]
    llm = LLM(model=folder, tensor_parallel_size=2, **{TINY_ENGINE!r})
    params = SamplingParams(**{GREEDY!r})
    tokens = [o.outputs[0].token_ids for o in llm.generate({PROMPTS!r}, params, use_tqdm=False)]
    with open(os.path.join(out, "rank" + os.environ["RANK"] + ".json"), "w") as f:
        json.dump(tokens, f)
    if not sys.stdin.isatty() and sys.stdin.readline():
        try:
            llm.generate({PROMPTS!r}, params, use_tqdm=False)
        except Exception as exc:
            print(type(exc).__name__, exc, flush=True)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    """A Llama with q/k/v/o biases and an odd vocabulary (161: the second rank's slice ends in padding)."""
    return save_hf_folder(tiny_hf_model("llama", vocab_size=161, attention_bias=True),
                          tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[list[int]]:
    llm = LLM(model=tiny_llama, **TINY_ENGINE)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)]


@pytest.fixture
def script(tmp_path) -> str:
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    return str(path)


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def test_torchrun_standalone_gives_one_process_tokens(tiny_llama, reference, script, tmp_path):
    proc = subprocess.run(_torchrun("--standalone", "--nproc-per-node", "2", script, tiny_llama, str(tmp_path)),
                          capture_output=True, text=True, timeout=180, env=_env(), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]  # the worker exited cleanly too
    assert json.loads((tmp_path / "rank0.json").read_text()) == reference
    assert not (tmp_path / "rank1.json").exists()  # the worker's process ended with the driver's engine


def test_torchrun_two_nodes_with_c10d_rendezvous(tiny_llama, reference, script, tmp_path):
    """Two torchrun agents, as on two hosts (their own addresses on loopback): each rank finds its gloo
    address from its route to MASTER_ADDR."""
    endpoint = f"127.0.0.1:{_free_port()}"
    agents = [subprocess.Popen(_torchrun("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                                         "--rdzv-endpoint", endpoint, "--local-addr", address,
                                         script, tiny_llama, str(tmp_path)),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                               stdin=subprocess.DEVNULL)
              for address in ("127.0.0.1", "127.0.0.2")]
    outputs = [agent.communicate(timeout=180)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert json.loads((tmp_path / "rank0.json").read_text()) == reference
    assert not (tmp_path / "rank1.json").exists()


def _start_ranks(script: str, folder: str, out) -> list[subprocess.Popen]:
    """RANK 0 and 1 started by hand with torch.distributed's env:// variables (RANK 0 serves the store)."""
    env = dict(_env(), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    return [subprocess.Popen([sys.executable, script, folder, str(out)], env=dict(env, RANK=str(rank)),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in range(2)]


def _wait_for(path, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-3000:]
        time.sleep(0.1)


def test_a_killed_worker_fails_the_drivers_next_step(tiny_llama, script, tmp_path):
    driver, worker = _start_ranks(script, tiny_llama, tmp_path)
    try:
        _wait_for(tmp_path / "rank0.json", driver)
        worker.kill()
        out, err = driver.communicate("step\n", timeout=60)
        assert driver.returncode == 0, err[-3000:]
        assert out.startswith("WorkerFailure") and "connection closed during a step" in out, out
    finally:
        for process in (driver, worker):
            process.kill()
            process.wait()


def test_a_killed_driver_ends_its_worker(tiny_llama, script, tmp_path):
    driver, worker = _start_ranks(script, tiny_llama, tmp_path)
    try:
        _wait_for(tmp_path / "rank0.json", driver)
        driver.kill()
        _, err = worker.communicate(timeout=30)
        assert worker.returncode == 0 and "the driver is gone" in err, err[-3000:]
    finally:
        for process in (driver, worker):
            process.kill()
            process.wait()


def _set_launch_env(monkeypatch, world_size: int) -> None:
    for name, value in dict(RANK="0", WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)


def test_world_size_other_than_tensor_parallel_size_is_refused(tiny_llama, monkeypatch):
    _set_launch_env(monkeypatch, 3)
    with pytest.raises(ValueError, match=r"WORLD_SIZE=3, but tensor_parallel_size=2"):
        LLM(model=tiny_llama, tensor_parallel_size=2, **TINY_ENGINE)


def test_a_multiprocessing_child_is_not_a_rank_of_the_launch(monkeypatch):
    """A data-parallel replica inherits torchrun's variables; it must not take a rank's place."""
    import multiprocessing

    _set_launch_env(monkeypatch, 2)
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: object())
    with pytest.raises(ValueError, match="not one of the launch's ranks"):
        torchrun_launch(None, 2)
    assert torchrun_launch("mp", 2) is None  # a backend given: the engine starts its own workers


def _launch(rank: int, local_world_size: int = 1) -> TorchrunLaunch:
    return TorchrunLaunch(rank, 2, local_world_size, "host-a", 29400, True, 0)


@pytest.mark.parametrize("routes, expected", [
    (["10.0.0.1 10.0.0.1", "10.0.0.2 10.0.0.1"], ["10.0.0.1", "10.0.0.2"]),
    # host-a's name resolves to 127.0.1.1 there (Debian's /etc/hosts): it takes its address as host-b sees it
    (["127.0.1.1 127.0.1.1", "10.0.0.2 10.0.0.1"], ["10.0.0.1", "10.0.0.2"]),
    # two "hosts" on one machine
    (["127.0.0.1 127.0.0.1", "127.0.0.2 127.0.0.1"], ["127.0.0.1", "127.0.0.2"]),
])
def test_each_rank_announces_an_address_the_other_hosts_reach(routes, expected):
    store = dist.HashStore()
    for rank, route in enumerate(routes):
        store.set(route_key(rank), route)
    assert [gloo_address(_launch(rank), store) for rank in range(2)] == expected


def test_one_host_uses_loopback_and_gloo_socket_ifname_names_interfaces(monkeypatch):
    store = dist.HashStore()
    store.set(route_key(0), "10.0.0.1 10.0.0.1")
    store.set(route_key(1), "10.0.0.2 10.0.0.1")
    assert gloo_address(_launch(1, local_world_size=2), store) == "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    assert gloo_address(_launch(1), store) is None


def test_a_worker_whose_heartbeats_stop_is_reported(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    store = dist.HashStore()
    heartbeats = Heartbeats(store, [1, 2])
    store.add(heartbeat_key(1), 1)
    clock[0] = 1.0
    assert heartbeats.stopped() == {}
    clock[0] = 1.0 + HEARTBEAT_TIMEOUT_S + 1
    assert heartbeats.stopped() == {1: "(torchrun) sent no heartbeat for 30 s"}
    clock[0] = START_TIMEOUT.total_seconds() + 1
    assert list(heartbeats.stopped()) == [1, 2]  # rank 2 never started
