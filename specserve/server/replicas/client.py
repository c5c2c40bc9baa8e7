"""The router behind `--data-parallel-size M`: M engine replicas (local processes or Ray actors), each new
request sent to the least-loaded live one and its outputs streamed back, behind AsyncLLM's interface.
"""
from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import time
from dataclasses import dataclass, field

from specserve.config import EngineConfig
from specserve.server.async_engine import (
    EngineDeadError, EngineSnapshot, OutputStreams, QueueFullError, RequestAbortedError, RequestFailedError,
    RequestStream, StatLogger)
from specserve.server.replicas.loop import EngineFactory
from specserve.server.replicas.protocol import (
    AbortCommand, AddCommand, OutputAssembler, ReplicaReady, ReplicaUpdate)

logger = logging.getLogger(__name__)

BACKENDS = ("mp", "ray")


class ReplicaDiedError(RequestAbortedError):
    """The replica running a request died after the request's output had begun, so it was not retried."""


@dataclass
class ReplicaState:
    """The router's view of one replica."""

    index: int
    handle: object  # ProcessReplica or RayReplica
    info: ReplicaReady | None = None
    alive: bool = True
    exit_reason: str | None = None
    num_in_flight: int = 0  # requests routed here and not finished (counted by the router, so never stale)
    num_retried: int = 0  # requests moved to another replica when this one died
    num_failed: int = 0  # requests failed because this one died
    snapshot: EngineSnapshot = field(default_factory=EngineSnapshot)  # as the replica last reported it


@dataclass
class _Tracked:
    stream: RequestStream
    prompt: object
    params: object
    arrival_time: float
    accepted: asyncio.Future  # resolved when a replica takes the request
    replica: int = -1
    delivered: bool = False  # an output went onto the stream: the request can no longer move
    assembler: OutputAssembler = field(default_factory=OutputAssembler)


class ReplicaClient(OutputStreams):
    """Several engines behind AsyncLLM's interface (add_request, outputs, generate, abort, snapshot, start,
    shutdown). Routing: fewest requests in flight, then lowest KV-cache usage.

    A replica that dies is noticed at once (its process exits, its pipe closes, its actor is lost). Its requests
    that have no output yet go to another live replica; the others end with ReplicaDiedError, a 503 naming the
    replica. When its engine raised instead, none move: the request that caused it could take the next replica
    down too.
    """

    def __init__(self, config: EngineConfig, data_parallel_size: int, backend: str = "mp",
                 max_waiting_requests: int | None = None, stat_logger: StatLogger | None = None,
                 ray_address: str | None = None, engine_factory: EngineFactory | None = None,
                 log_level: str = "warning", start_timeout: float = 600.0) -> None:
        if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {data_parallel_size!r}")
        if backend not in BACKENDS:
            raise ValueError(f"data_parallel_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0 or None, got {max_waiting_requests}")
        self.config = config
        self.data_parallel_size = data_parallel_size
        self.backend = backend
        self.max_waiting_requests = max_waiting_requests
        self.stat_logger = stat_logger
        self.ray_address = ray_address
        self.engine_factory = engine_factory
        self.log_level = log_level
        self.start_timeout = start_timeout
        self.replicas: list[ReplicaState] = []
        self._release = None  # frees what the backend reserved (Ray's placement group)
        self._requests: dict[str, _Tracked] = {}  # owned by the event loop
        self._num_pending_adds = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._accepting = False
        self._stopping = False
        self._closed = False

    # ---- lifecycle ------------------------------------------------------------------------------
    def launch(self) -> ReplicaReady:
        """Start the replicas and wait until every engine is built (blocking); on any failure stop them all and
        raise (ValueError when an engine refused the configuration). Returns what replica 0 reported about
        its model (max_model_len, vocab_size)."""
        if self.replicas:
            return self.replicas[0].info
        start = time.monotonic()
        if self.backend == "ray":
            from specserve.server.replicas.ray_actor import launch_ray_replicas

            handles, self._release = launch_ray_replicas(self.config, self.data_parallel_size, self.engine_factory,
                                                         self.log_level, self.ray_address)
        else:
            from specserve.server.replicas.process import launch_local_replicas

            handles = launch_local_replicas(self.config, self.data_parallel_size, self.engine_factory,
                                            self.log_level)
        self.replicas = [ReplicaState(i, handle) for i, handle in enumerate(handles)]
        atexit.register(self._kill_all)
        try:
            for r in self.replicas:
                r.info = r.handle.wait_ready(max(1.0, self.start_timeout - (time.monotonic() - start)))
        except BaseException:
            self._kill_all()
            raise
        logger.info("%d replicas ready in %.1f s (%s backend): %s", len(self.replicas), time.monotonic() - start,
                    self.backend, ", ".join(f"{r.index}: pid {r.info.pid} on {r.info.host}" for r in self.replicas))
        return self.replicas[0].info

    def start(self) -> None:
        """Launch (if not yet) and begin serving; call it on the event loop that will serve requests."""
        if self._loop is not None:
            return
        self.launch()
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        for r in self.replicas:
            r.handle.start_io(self._on_thread(self._on_update, r.index), self._on_thread(self._on_exit, r.index))
        self._accepting = True

    def _on_thread(self, method, index: int):
        """A callback for a replica's reader thread that runs `method(index, ...)` on the event loop."""
        loop = self._loop

        def callback(*args) -> None:
            try:
                loop.call_soon_threadsafe(method, index, *args)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

        return callback

    @property
    def is_running(self) -> bool:
        return self._accepting and any(r.alive for r in self.replicas)

    def num_in_flight(self) -> int:
        return len(self._requests)

    async def shutdown(self, drain_timeout: float = 0.0, join_timeout: float = 10.0) -> None:
        """Refuse new requests, let in-flight ones finish for up to `drain_timeout` seconds, abort the rest
        (their streams raise RequestAbortedError), stop every replica and wait for it to exit."""
        self._accepting = False
        if self._closed or not self.replicas:
            return
        deadline = time.monotonic() + drain_timeout
        while self._requests and time.monotonic() < deadline and any(r.alive for r in self.replicas):
            await asyncio.sleep(0.05)
        self._stopping = True
        reason = "server shutting down"
        for t in list(self._requests.values()):
            self._fail(t, RequestAbortedError(reason), EngineDeadError(reason))
        for r in self.replicas:
            if r.alive:
                r.handle.stop()
        await asyncio.get_running_loop().run_in_executor(None, self._join_all, join_timeout)

    def _join_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for r in self.replicas:
            r.handle.join(max(0.1, deadline - time.monotonic()))
        self._closed = True
        atexit.unregister(self._kill_all)
        if self._release is not None:
            self._release()
            self._release = None

    def _kill_all(self) -> None:
        """Last resort (startup failure, interpreter exit without shutdown): no replica outlives the server."""
        for r in self.replicas:
            try:
                r.handle.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass
        for r in self.replicas:
            r.handle.join(5)
        self._closed = True
        atexit.unregister(self._kill_all)
        if self._release is not None:
            self._release()
            self._release = None

    # ---- load ---------------------------------------------------------------------------------------
    @property
    def snapshot(self) -> EngineSnapshot:
        """All replicas together: running and waiting requests of the live ones, the mean of their KV-cache
        usage (their caches are the same size) and the sum of their blocks, and the counters of every one (a
        dead replica's stay, so counters never go backwards)."""
        live = [r for r in self.replicas if r.alive]
        metrics = [r.snapshot.metrics for r in self.replicas if r.snapshot.metrics is not None]
        reported = [r.snapshot for r in self.replicas if r.snapshot.kv_cache_blocks]
        return EngineSnapshot(
            sum(r.snapshot.num_running for r in live), sum(r.snapshot.num_waiting for r in live),
            sum(r.snapshot.kv_cache_usage for r in live) / len(live) if live else 0.0,
            sum_metrics(metrics) if metrics else None,
            sum(r.snapshot.kv_cache_blocks_in_use for r in live), sum(r.snapshot.kv_cache_blocks for r in live),
            reported[0].kv_cache_bytes_per_token if reported else 0.0,
            reported[0].kv_cache_dtype if reported else "")

    def replica_states(self) -> list[dict]:
        """For /health: each replica's index, liveness, pid and host, requests in flight, why it stopped."""
        return [{"replica": r.index, "alive": r.alive, "pid": r.info.pid if r.info else None,
                 "host": r.info.host if r.info else None, "num_requests_in_flight": r.num_in_flight,
                 "exit_reason": r.exit_reason} for r in self.replicas]

    # ---- requests (event loop side) ---------------------------------------------------------------
    async def add_request(self, request_id: str, prompt, params) -> RequestStream:
        """Route a request and wait until its replica has taken it; raises the engine's ValueError for a request
        it refuses, QueueFullError when too many are waiting, EngineDeadError when no replica can take it."""
        self._check_can_add()
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        tracked = _Tracked(RequestStream(request_id, loop), prompt, params, time.time(), loop.create_future())
        self._num_pending_adds += 1
        tracked.accepted.add_done_callback(self._settled)
        self._requests[request_id] = tracked
        self._route(tracked)
        try:
            await tracked.accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            tracked.stream.finished = True
            raise
        return tracked.stream

    def _settled(self, _future) -> None:
        self._num_pending_adds -= 1

    def _check_can_add(self) -> None:
        if not self._accepting:
            raise EngineDeadError("the server is shutting down" if self._loop else "the replicas are not started")
        live = [r for r in self.replicas if r.alive]
        if not live:
            raise EngineDeadError("no replica is alive: " + "; ".join(
                f"replica {r.index} {r.exit_reason}" for r in self.replicas))
        limit = self.max_waiting_requests
        waiting = self._num_pending_adds + sum(r.snapshot.num_waiting for r in live)
        if limit is not None and waiting >= limit:
            raise QueueFullError(f"{limit} requests are already waiting to be scheduled; retry later")

    def abort(self, request_id: str) -> None:
        """Idempotent; from another thread it is handed to the event loop."""
        if self._loop is not None and threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self.abort, request_id)
            return
        tracked = self._requests.get(request_id)
        if tracked is None:
            return
        self._untrack(tracked)
        replica = self.replicas[tracked.replica]
        if replica.alive:
            replica.handle.send(AbortCommand(request_id))
        if self.stat_logger is not None:
            self.stat_logger.record_abort(request_id, replica=tracked.replica)

    def _route(self, tracked: _Tracked) -> None:
        """Send the request to the live replica with the fewest requests in flight (then the emptiest KV
        cache); the caller has checked that one lives."""
        replica = min((r for r in self.replicas if r.alive),
                      key=lambda r: (r.num_in_flight, r.snapshot.kv_cache_usage, r.index))
        tracked.replica = replica.index
        tracked.assembler = OutputAssembler()
        replica.num_in_flight += 1
        replica.handle.send(AddCommand(tracked.stream.request_id, tracked.prompt, tracked.params,
                                       tracked.arrival_time))

    def _untrack(self, tracked: _Tracked) -> None:
        if self._requests.pop(tracked.stream.request_id, None) is not None:
            self.replicas[tracked.replica].num_in_flight -= 1
        if not tracked.accepted.done():  # aborted while being added: nobody waits for the answer any more
            tracked.accepted.cancel()

    # ---- what the replicas send (event loop side) ---------------------------------------------------
    def _on_update(self, index: int, update: ReplicaUpdate) -> None:
        replica = self.replicas[index]
        for request_id in update.accepted:
            tracked = self._mine(index, request_id)
            if tracked is not None and not tracked.accepted.done():
                tracked.accepted.set_result(None)
        for request_id, message in update.refused:
            tracked = self._mine(index, request_id)
            if tracked is not None:
                self._fail(tracked, RequestAbortedError(f"replica {index} refused the request: {message}"),
                           ValueError(message))
        for request_id, message in update.failed:
            tracked = self._mine(index, request_id)
            if tracked is not None:
                self._fail(tracked, RequestFailedError(message), RequestFailedError(message))
        for delta in update.outputs:
            tracked = self._mine(index, delta.request_id)
            if tracked is None:  # aborted, or moved, meanwhile
                continue
            out = tracked.assembler.apply(delta)
            if self.stat_logger is not None:
                self.stat_logger.record_output(out, replica=index)
            tracked.delivered = True
            tracked.stream.queue.put_nowait(out)
            if out.finished:
                self._untrack(tracked)
        if update.snapshot is not None:
            replica.snapshot = update.snapshot

    def _mine(self, index: int, request_id: str) -> _Tracked | None:
        tracked = self._requests.get(request_id)
        return tracked if tracked is not None and tracked.replica == index else None

    def _on_exit(self, index: int, reason: str, failed: bool) -> None:
        replica = self.replicas[index]
        if not replica.alive:
            return
        replica.alive, replica.exit_reason = False, reason
        if self._stopping:
            logger.info("replica %d %s", index, reason)
            return
        orphans = [t for t in self._requests.values() if t.replica == index]
        live = any(r.alive for r in self.replicas)
        for tracked in orphans:
            if not tracked.delivered and not failed and live:
                replica.num_in_flight -= 1
                self._route(tracked)
                replica.num_retried += 1
            else:
                self._fail(tracked, *self._orphan_errors(index, reason, tracked, live))
                replica.num_failed += 1
        logger.error("replica %d %s; of its %d requests in flight %d moved to other replicas and %d failed; "
                     "%d of %d replicas remain", index, reason, len(orphans), replica.num_retried,
                     replica.num_failed, sum(r.alive for r in self.replicas), len(self.replicas))

    @staticmethod
    def _orphan_errors(index: int, reason: str, tracked: _Tracked, live: bool) -> tuple[Exception, Exception]:
        """(error for a request already streaming, error for one still being added)."""
        if tracked.delivered:
            why = "its output had already begun, so it was not retried on another replica"
        elif live:
            why = "one of its requests may have caused the failure, so none of them is retried"
        else:
            why = "no other replica is alive"
        message = f"replica {index} {reason} while running this request; {why}"
        return ReplicaDiedError(message), EngineDeadError(message)

    def _fail(self, tracked: _Tracked, streaming: Exception, adding: Exception) -> None:
        """End a tracked request with an error: `adding` if add_request still waits on it, else `streaming`
        on its stream."""
        if not tracked.accepted.done():
            tracked.accepted.set_exception(adding)
        else:
            tracked.stream.queue.put_nowait(streaming)
            if self.stat_logger is not None:
                self.stat_logger.record_abort(tracked.stream.request_id, replica=tracked.replica)
        self._untrack(tracked)


def sum_metrics(metrics: list):
    """Element-wise sum of several replicas' EngineMetrics (accepted_per_position by position)."""
    total = type(metrics[0])()
    for m in metrics:
        for name in total.__dataclass_fields__:
            if name == "accepted_per_position":
                per_pos = total.accepted_per_position
                per_pos.extend([0] * (len(m.accepted_per_position) - len(per_pos)))
                for i, value in enumerate(m.accepted_per_position):
                    per_pos[i] += value
            else:
                setattr(total, name, getattr(total, name) + getattr(m, name))
    return total
