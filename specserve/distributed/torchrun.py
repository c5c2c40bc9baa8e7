"""Ranks started by torchrun: every process runs the same command; RANK 0 is the driver (the engine and any
server) and every other rank serves it as a worker, then ends its process when the driver shuts down.

The ranks meet in the launch's store at MASTER_ADDR:MASTER_PORT (served by torchrun's agent on RANK 0's
host, or else by RANK 0 itself), where the driver publishes its ShardSpec and the workers count heartbeats.
"""
from __future__ import annotations

import ipaddress
import multiprocessing
import os
import pickle
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import NoReturn

import torch.distributed as dist

from specserve.distributed.group import STORE_TIMEOUT, gloo_host
from specserve.distributed.worker import ShardSpec, failure_posted, run_worker, serve_and_exit

# torch.distributed's env:// variables; TORCHELASTIC_RUN_ID (set by torchrun) marks a launch as well.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SPEC_KEY = "specserve/tp/spec"
# Every rank loads the whole checkpoint before the engine starts tensor parallelism, some more slowly than
# others: how long a rank waits for the rest to get there.
START_TIMEOUT = timedelta(minutes=10)
HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_S = 30.0  # a worker whose heartbeats stop this long is taken for dead

_driver_started = threading.Event()  # the launch's workers serve one engine, then their processes end


@dataclass(frozen=True)
class TorchrunLaunch:
    """This process's place in the launch, from the variables torchrun sets for each process."""

    rank: int
    world_size: int
    local_world_size: int  # the launch's processes on this host
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent serves the store at MASTER_ADDR:MASTER_PORT (else RANK 0 does)
    attempt: int  # torchrun's restart count; each attempt's keys go under a prefix of their own

    @classmethod
    def from_env(cls, env=os.environ) -> TorchrunLaunch | None:
        """None when this process was not started by torchrun (or a launcher that sets the same variables)."""
        if "TORCHELASTIC_RUN_ID" not in env and not all(name in env for name in LAUNCH_VARS):
            return None
        missing = [name for name in LAUNCH_VARS if name not in env]
        if missing:
            raise ValueError(f"a torchrun launch sets {', '.join(LAUNCH_VARS)}, but {', '.join(missing)} "
                             "is missing from this process's environment")
        world_size = int(env["WORLD_SIZE"])
        return cls(int(env["RANK"]), world_size, int(env.get("LOCAL_WORLD_SIZE", world_size)),
                   env["MASTER_ADDR"], int(env["MASTER_PORT"]), env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                   int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))

    @property
    def one_host(self) -> bool:
        return self.local_world_size == self.world_size

    def store(self) -> dist.Store:
        """A connection to the launch's store (served here when this is RANK 0 and no agent serves it)."""
        store = dist.TCPStore(self.master_addr, self.master_port, self.world_size,
                              is_master=self.rank == 0 and not self.agent_store, timeout=STORE_TIMEOUT,
                              wait_for_workers=False)
        return dist.PrefixStore(f"specserve/attempt/{self.attempt}", store)


def torchrun_launch(backend: str | None, size: int) -> TorchrunLaunch | None:
    """The launch whose processes are the engine's ranks: torchrun's variables are set and no backend was
    chosen (`backend`: distributed_executor_backend). ValueError when WORLD_SIZE is not `size`."""
    launch = None if backend is not None else TorchrunLaunch.from_env()
    if launch is not None and multiprocessing.parent_process() is not None:
        raise ValueError(
            "this process has torchrun's variables but was started by another Python process (multiprocessing, "
            "e.g. a data-parallel replica), so it is not one of the launch's ranks: start every rank with "
            "torchrun itself (--data-parallel-size does not combine with torchrun), or pass "
            "distributed_executor_backend='mp' or 'ray'")
    if launch is not None and launch.world_size != size:
        raise ValueError(
            f"this process was started by torchrun with WORLD_SIZE={launch.world_size}, but "
            f"tensor_parallel_size={size}: each process of the launch is one tensor-parallel rank, so the two "
            "must be equal (or pass distributed_executor_backend='mp' or 'ray' to start the workers from "
            "this process instead)")
    return launch


def heartbeat_key(rank: int) -> str:
    return f"specserve/tp/heartbeat/{rank}"


def route_key(rank: int) -> str:
    return f"specserve/tp/route/{rank}"


class TorchrunWorkers:
    """The driver's view of the launch's other ranks. They start with the launch, not with the engine: each
    waits in start_tensor_parallel for the ShardSpec the driver publishes, and ends its process when the
    driver shuts down or its connections close. They are not the driver's children, so they cannot be
    stopped from here, and one that dies shows as heartbeats that stop (or as the connection it closes)."""

    death_notice_s = 0.0  # heartbeats take HEARTBEAT_TIMEOUT_S to tell: a failed step does not wait for them

    def __init__(self, spec: ShardSpec, launch: TorchrunLaunch) -> None:
        if _driver_started.is_set():
            raise RuntimeError("the workers of a torchrun launch serve one tensor-parallel engine and end with "
                               "it; this process has started one already")
        _driver_started.set()
        self.spec, self.torchrun = spec, launch
        self.store: dist.Store | None = None
        self.heartbeats: Heartbeats | None = None

    def launch(self) -> dist.Store:
        """Publish the driver's ShardSpec; returns the launch's store."""
        self.store = self.torchrun.store()
        publish_route(self.torchrun, self.store)
        self.store.set(SPEC_KEY, pickle.dumps(self.spec))
        self.heartbeats = Heartbeats(self.store, range(1, self.spec.size))
        return self.store

    @property
    def gloo_host(self) -> str | None:
        return gloo_address(self.torchrun, self.store)

    def pids(self) -> dict[int, int]:
        return {}  # processes of torchrun's, perhaps on other hosts

    def dead(self) -> dict[int, str]:
        return self.heartbeats.stopped()

    def stop(self, timeout: float) -> None:
        """Nothing to stop: a worker ends on the shutdown command, or when the driver's group closes."""


class Heartbeats:
    """The workers' heartbeat counts in the store, each with the time it last changed (this host's clock)."""

    def __init__(self, store: dist.Store, ranks) -> None:
        self.store = store
        self.counts = {rank: (0, time.monotonic()) for rank in ranks}

    def stopped(self) -> dict[int, str]:
        """{rank: how it ended} of the workers whose heartbeats stopped, or did not start in time."""
        now, out = time.monotonic(), {}
        for rank, (count, since) in self.counts.items():
            latest = self.store.add(heartbeat_key(rank), 0)
            if latest != count:
                self.counts[rank] = (latest, now)
            elif count and now - since > HEARTBEAT_TIMEOUT_S:
                out[rank] = f"(torchrun) sent no heartbeat for {HEARTBEAT_TIMEOUT_S:.0f} s"
            elif not count and now - since > START_TIMEOUT.total_seconds():
                out[rank] = f"(torchrun) did not reach the engine's start within {START_TIMEOUT}"
        return out


def serve_driver(launch: TorchrunLaunch, spec: ShardSpec, loaded) -> NoReturn:
    """RANK > 0: serve the driver's engine as worker `launch.rank` (its shard built from `loaded`, the
    checkpoint this process loaded), then end the process, so that whatever follows the engine's start (a
    server, a script's code after LLM(...)) runs on the driver only."""

    def serve() -> None:
        store = launch.store()
        with failure_posted(store, launch.rank):
            _start_heartbeat(launch)
            publish_route(launch, store)
            _check_driver_spec(store, spec, launch.rank)
            host = gloo_address(launch, store)
        run_worker(spec, launch.rank, store, host, loaded)

    serve_and_exit(launch.rank, serve)


def _check_driver_spec(store: dist.Store, spec: ShardSpec, rank: int) -> None:
    """ValueError when the driver's ShardSpec (threads aside: each host has its own) is not this rank's."""
    store.wait([SPEC_KEY], START_TIMEOUT)
    driver = replace(pickle.loads(store.get(SPEC_KEY)), threads=spec.threads)
    if driver != spec:
        raise ValueError(f"every process of a torchrun launch must run the same command, but rank {rank} "
                         f"would build {spec} and the driver {driver}")


def _start_heartbeat(launch: TorchrunLaunch) -> None:
    """Count this worker's heartbeats in the store, on a connection of their own; when the store is gone (the
    driver's side of the launch has ended), end the process as a worker does when the driver is gone."""
    store = launch.store()

    def beat() -> None:
        try:
            while True:
                store.add(heartbeat_key(launch.rank), 1)
                time.sleep(HEARTBEAT_S)
        except Exception as exc:
            print(f"specserve tensor-parallel worker rank {launch.rank}: the launch's store is gone "
                  f"({str(exc).splitlines()[0]}); exiting", file=sys.stderr, flush=True)
            os._exit(0)

    threading.Thread(target=beat, name="specserve-tp-heartbeat", daemon=True).start()


def publish_route(launch: TorchrunLaunch, store: dist.Store) -> None:
    """Publish how this rank reaches MASTER_ADDR: its address on that route, and MASTER_ADDR's IP here."""
    if launch.one_host:
        return
    master_ip = socket.gethostbyname(launch.master_addr)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master_ip, launch.master_port))  # sends nothing: it only picks the route
        address = probe.getsockname()[0]
    store.set(route_key(launch.rank), f"{address} {master_ip}")


def gloo_address(launch: TorchrunLaunch, store: dist.Store) -> str | None:
    """This rank's address for the other ranks' gloo connections. On one host: loopback. On several: this
    rank's address on its route to MASTER_ADDR, unless that is a loopback address (MASTER_ADDR is this host's
    name and resolves to 127.0.1.1, as Debian's /etc/hosts has it): then MASTER_ADDR's IP as a rank on
    another host resolved it. None when GLOO_SOCKET_IFNAME names the interfaces instead."""
    if launch.one_host:
        return "127.0.0.1"
    store.wait([route_key(rank) for rank in range(launch.world_size)], START_TIMEOUT)
    routes = [store.get(route_key(rank)).decode().split() for rank in range(launch.world_size)]
    address = routes[launch.rank][0]
    from_elsewhere = [master_ip for route, master_ip in routes if not _loopback(route)]
    return gloo_host(from_elsewhere[0] if _loopback(address) and from_elsewhere else address)


def _loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback
