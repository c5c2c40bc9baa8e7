"""Replicas as Ray actors (`--data-parallel-backend ray`): a placement group with one CPU bundle per replica,
each actor running `serve_replica` on a thread of its own while the router long-polls it for updates.
Ray is imported only here, and only when this backend is asked for.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from specserve.config import EngineConfig
from specserve.server.replicas.loop import EngineFactory, serve_replica
from specserve.server.replicas.process import QueuedReplicaIO, ReplicaStartError
from specserve.server.replicas.protocol import ReplicaFailed, ReplicaReady, StopCommand

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0
POLL_S = 1.0  # how long one poll call waits in the actor for an update


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise ImportError("--data-parallel-backend ray needs Ray, an optional extra: "
                          "pip install specserve[ray]") from exc
    return ray


@dataclass
class ReplicaExited:
    """The actor's last update: its loop ended with this status (0: stopped, 1: failed)."""

    status: int


class ReplicaActor:
    """The actor's body (ray.remote is applied at launch, so importing this module needs no Ray)."""

    def __init__(self, index: int, config: EngineConfig, engine_factory: EngineFactory | None, num_threads: int,
                 log_level: str) -> None:
        logging.basicConfig(level=log_level.upper(), format=f"%(levelname)s replica {index} %(name)s: %(message)s")
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # batches of commands
        self._updates: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, args=(config, engine_factory, num_threads),
                                        name="specserve-replica", daemon=True)
        self._thread.start()

    def _serve(self, config, engine_factory, num_threads) -> None:
        status = serve_replica(config, engine_factory, self._receive, self._updates.put, num_threads)
        self._updates.put(ReplicaExited(status))

    def _receive(self, block: bool) -> list:
        try:
            received = list(self._commands.get(block=block))
        except queue.Empty:
            return []
        while True:
            try:
                received.extend(self._commands.get_nowait())
            except queue.Empty:
                return received

    def submit(self, commands: list) -> None:
        self._commands.put(commands)

    def poll(self, timeout: float) -> list:
        """The updates since the last poll, waiting up to `timeout` seconds for the first."""
        try:
            updates = [self._updates.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                updates.append(self._updates.get_nowait())
            except queue.Empty:
                return updates


def launch_ray_replicas(config: EngineConfig, num_replicas: int, engine_factory: EngineFactory | None,
                        log_level: str, address: str | None) -> tuple[list["RayReplica"], Callable[[], None]]:
    """Connect to Ray (or start a local instance), reserve the placement group and create the actors;
    returns them with the function that releases the group (and the local Ray instance, if we started one)."""
    ray = import_ray()
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    started_here = not ray.is_initialized()
    if started_here:
        # An explicit address wins; then RAY_ADDRESS; else Ray's own search: a cluster started on this host
        # with `ray start`, or a new local instance. ray.init replaces the SIGTERM handler with an immediate
        # exit; the server's own (drain, then stop the replicas) is put back.
        on_sigterm = signal.getsignal(signal.SIGTERM)
        ray.init(address=address or ("auto" if os.environ.get("RAY_ADDRESS") else None))
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, on_sigterm)
    group = placement_group([{"CPU": 1}] * num_replicas, strategy="SPREAD")

    def release() -> None:
        remove_placement_group(group)
        if started_here:
            ray.shutdown()

    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        release()
        raise ReplicaStartError(f"the Ray cluster has no room for {num_replicas} replicas of one CPU each after "
                                f"{PLACEMENT_TIMEOUT_S:.0f} s (cluster resources: {ray.cluster_resources()})") from None
    nodes = placement_group_table(group)["bundles_to_node_id"]
    actor_class = ray.remote(ReplicaActor)
    replicas = []
    for i in range(num_replicas):
        strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i)
        actor = actor_class.options(num_cpus=1, max_concurrency=4, scheduling_strategy=strategy).remote(
            i, config, engine_factory, _threads_per_replica(ray, nodes, nodes.get(i)), log_level)
        replicas.append(RayReplica(i, actor, ray))
    return replicas, release


def _threads_per_replica(ray, bundle_nodes: dict, node_id: str | None) -> int:
    """The node's CPUs split evenly between the replicas placed on it (Ray's one-CPU bundle is bookkeeping;
    torch would otherwise follow Ray's OMP_NUM_THREADS=1)."""
    cpus = {n["NodeID"]: n.get("Resources", {}).get("CPU", 1) for n in ray.nodes() if n.get("Alive")}
    on_node = Counter(bundle_nodes.values())[node_id] or 1
    return max(1, int(cpus.get(node_id, 1) // on_node))


class RayReplica(QueuedReplicaIO):
    """The router's side of one actor: a thread submitting command batches in order, one polling updates."""

    def __init__(self, index: int, actor, ray) -> None:
        self.index = index
        self.actor = actor
        self._ray = ray
        self._early: list = []  # updates that came with the ready message
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self.pid: int | None = None

    def wait_ready(self, timeout: float) -> ReplicaReady:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                updates = self._ray.get(self.actor.poll.remote(POLL_S))
            except self._ray.exceptions.RayActorError as exc:
                raise ReplicaStartError(f"replica {self.index}'s actor died before its engine was ready: "
                                        f"{_first_line(exc)}") from None
            if not updates:
                continue
            first, self._early = updates[0], updates[1:]
            if isinstance(first, ReplicaReady):
                self.pid = first.pid
                return first
            if isinstance(first, ReplicaFailed):
                error = ValueError if first.error_type == "ValueError" else ReplicaStartError
                raise error(f"replica {self.index}: {first.message}")
            raise ReplicaStartError(f"replica {self.index} sent {first!r} before its engine was ready")
        raise ReplicaStartError(f"replica {self.index} was not ready after {timeout:.0f} s")

    def stop(self) -> None:
        if self._threads:
            self.send(StopCommand())
            return
        try:  # never started serving: nothing else submits
            self._ray.get(self.actor.submit.remote([StopCommand()]))
        except self._ray.exceptions.RayError:
            pass

    def kill(self) -> None:
        self._ray.kill(self.actor)

    def join(self, timeout: float) -> None:
        """Wait for the actor's loop to end (its last update), then remove the actor."""
        reader = self._threads[1] if self._threads else None
        if reader is not None:
            reader.join(timeout)
        self._close_outbox()
        try:
            self._ray.kill(self.actor)
        except Exception:  # noqa: BLE001 - already gone
            pass
        for thread in self._threads:
            thread.join(5)

    def _send_loop(self) -> None:
        while True:
            batch, closing = self._next_batch()
            try:
                if batch:  # waiting for each batch keeps them in order on the threaded actor
                    self._ray.get(self.actor.submit.remote(batch))
            except self._ray.exceptions.RayError:
                return  # the actor is gone; the reader reports it
            if closing:
                return

    def _read_loop(self, on_update, on_exit) -> None:
        failure, pending = None, self._early
        reason = None
        while reason is None:
            for update in pending:
                if isinstance(update, ReplicaExited):
                    reason = "stopped" if update.status == 0 else "exited with status 1"
                elif isinstance(update, ReplicaFailed):
                    failure = update
                else:
                    on_update(update)
            if reason is not None:
                break
            try:
                pending = self._ray.get(self.actor.poll.remote(POLL_S))
            except self._ray.exceptions.RayError as exc:
                reason = f"was lost ({_first_line(exc)})"
        if failure is not None:
            reason = f"failed ({failure.error_type}: {failure.message})"
        on_exit(reason, failure is not None)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
