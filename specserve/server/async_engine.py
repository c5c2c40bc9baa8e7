"""An asyncio front end over `LLMEngine`: one thread owns the engine and steps it; coroutines add and abort
requests through a queue and receive each request's outputs on their own asyncio queue.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import AsyncIterator, Protocol

from specserve.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

_ACCEPTED = object()  # first item on a stream once the engine has taken the request
# Threads that compile requests' grammars before they reach the engine thread: compiling takes from a millisecond
# to seconds, and more at once would only share the same cores.
NUM_ADMISSION_THREADS = 2


class QueueFullError(RuntimeError):
    """Too many requests are waiting to be scheduled; the client should retry later."""


class EngineDeadError(RuntimeError):
    """The engine thread failed or has shut down; no request can run."""


class RequestAbortedError(RuntimeError):
    """The server aborted the request (shutdown) before it finished."""


class RequestFailedError(RuntimeError):
    """The engine ended the request with an error while it went on serving: one of its own (`from_input` when
    its input, a grammar or an image, caused it) or a failed step the engine reset itself after."""

    def __init__(self, message: str, from_input: bool = False) -> None:
        super().__init__(message)
        self.from_input = from_input


class StatLogger(Protocol):
    """Told about every output and abort, on the engine thread (with several replicas: on the event loop, with
    the index of the replica that produced the output)."""

    def record_output(self, output: RequestOutput, replica: int | None = None) -> None: ...

    def record_abort(self, request_id: str, replica: int | None = None) -> None: ...


@dataclass(frozen=True)
class EngineSnapshot:
    """What the engine thread last published: scheduler load and a copy of the engine's counters."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    metrics: object = None  # EngineMetrics copy (None before the first publish)
    kv_cache_blocks_in_use: int = 0
    kv_cache_blocks: int = 0
    kv_cache_bytes_per_token: float = 0.0  # the target's KV and its drafter's, in the cache's dtype
    kv_cache_dtype: str = ""

    @classmethod
    def of(cls, engine) -> "EngineSnapshot":
        """An LLMEngine's load and a copy of its counters, now."""
        stats = engine.scheduler.get_stats()
        m = engine.get_metrics()
        return cls(stats.num_running, stats.num_waiting, stats.kv_cache_usage,
                   replace(m, accepted_per_position=list(m.accepted_per_position)), stats.kv_cache_blocks_in_use,
                   stats.kv_cache_blocks, engine.kv_bytes_per_token, engine.config.kv_cache_dtype)


class RequestStream:
    """One request's outputs, delivered from the engine thread onto the caller's event loop."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def put(self, item) -> None:
        """Thread-safe: called from the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass


@dataclass
class _Add:
    stream: RequestStream
    prompt: object
    params: object
    arrival_time: float
    grammar: object = None  # params.structured_outputs, compiled


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Stop:
    reason: str = "server shutting down"


class OutputStreams:
    """Reading a request's RequestStream, shared by AsyncLLM and the replica router; the class supplies
    `add_request` and `abort`."""

    async def outputs(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes; outputs that piled up are merged (they are cumulative).
        Leaving early (break, cancellation, client gone) aborts the request."""
        try:
            while not stream.finished:
                item = await stream.queue.get()
                while not stream.queue.empty() and not _is_final(item):
                    item = stream.queue.get_nowait()
                if isinstance(item, BaseException):
                    stream.finished = True
                    raise item
                stream.finished = item.finished
                if item.finished and item.error is not None:
                    raise RequestFailedError(item.error, item.error_from_input)
                yield item
        finally:
            if not stream.finished:
                stream.finished = True
                self.abort(stream.request_id)

    async def generate(self, request_id: str, prompt, params) -> AsyncIterator[RequestOutput]:
        """add_request + outputs in one call."""
        stream = await self.add_request(request_id, prompt, params)
        async for out in self.outputs(stream):
            yield out


class AsyncLLM(OutputStreams):
    """Serve an `LLMEngine` (or anything with its add/abort/step and compile_grammar methods) to asyncio code.

    A request's grammar is compiled on admission threads before the request reaches the engine thread, so a
    grammar slow to compile holds up only its own request. Whatever a request's admission raises fails that
    request alone. `max_waiting_requests` bounds the requests that are queued but not yet scheduled (those
    compiling included); past it `add_request` raises QueueFullError. None = unbounded.
    """

    def __init__(self, engine, max_waiting_requests: int | None = None, stat_logger: StatLogger | None = None):
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0 or None, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.stat_logger = stat_logger
        self.snapshot = EngineSnapshot()
        self.error: BaseException | None = None
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}  # owned by the engine thread
        self._lock = threading.Lock()
        self._num_pending_adds = 0
        self._accepting = False
        self._thread: threading.Thread | None = None
        self._admission = ThreadPoolExecutor(NUM_ADMISSION_THREADS, thread_name_prefix="specserve-admission")

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._accepting = True
        self._publish_snapshot()
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def num_in_flight(self) -> int:
        return len(self._streams) + self._num_pending_adds

    async def shutdown(self, drain_timeout: float = 0.0, join_timeout: float = 10.0) -> None:
        """Refuse new requests, let in-flight ones finish for up to `drain_timeout` seconds, abort the rest
        (their streams raise RequestAbortedError) and stop the engine thread."""
        self._accepting = False
        self._admission.shutdown(wait=False, cancel_futures=True)
        if self._thread is None or not self._thread.is_alive():
            return
        deadline = time.monotonic() + drain_timeout
        while self.num_in_flight() and time.monotonic() < deadline and self._thread.is_alive():
            await asyncio.sleep(0.05)
        self._commands.put(_Stop())
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, join_timeout)
        if self._thread.is_alive():
            logger.warning("the engine thread did not stop within %.0f s (it is a daemon thread)", join_timeout)

    # ---- requests (event loop side) ---------------------------------------------------------------
    async def add_request(self, request_id: str, prompt, params) -> RequestStream:
        """Compile the request's grammar, queue the request and wait until the engine has taken it; raises the
        engine's ValueError for a request it refuses, RequestFailedError when admitting it failed otherwise,
        QueueFullError when too many are waiting, EngineDeadError when stopped."""
        self._check_can_add()
        arrival_time = time.time()
        with self._lock:
            self._num_pending_adds += 1
        try:
            grammar = await self._compile_grammar(params)
            self._check_running()  # it may have stopped meanwhile: nobody would answer the add
        except BaseException:
            with self._lock:
                self._num_pending_adds -= 1
            raise
        stream = RequestStream(request_id, asyncio.get_running_loop())
        self._commands.put(_Add(stream, prompt, params, arrival_time, grammar))
        try:
            first = await stream.queue.get()
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        if isinstance(first, BaseException):
            stream.finished = True
            raise first
        return stream

    def _check_can_add(self) -> None:
        self._check_running()
        limit = self.max_waiting_requests
        if limit is not None and self._num_pending_adds + self.snapshot.num_waiting >= limit:
            raise QueueFullError(f"{limit} requests are already waiting to be scheduled; retry later")

    def _check_running(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine failed: {self.error!r}")
        if not self._accepting:
            raise EngineDeadError("the server is shutting down" if self._thread else "the engine is not started")

    async def _compile_grammar(self, params):
        """params.structured_outputs compiled on an admission thread (None without one); the engine's ValueError
        for a spec it refuses, RequestFailedError for any other failure."""
        structured = getattr(params, "structured_outputs", None)
        if structured is None:
            return None
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._admission, self.engine.compile_grammar, structured)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - one request's grammar fails that request alone
            logger.exception("compiling a request's structured_outputs failed")
            raise RequestFailedError(f"compiling structured_outputs failed: {exc!r}") from exc

    def abort(self, request_id: str) -> None:
        """Thread-safe and idempotent: frees the request's KV blocks on the engine thread."""
        self._commands.put(_Abort(request_id))

    # ---- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                if not self._handle_commands(block=not busy):
                    return
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
                self._publish_snapshot()
        except BaseException as exc:  # noqa: BLE001 - even the engine's own recovery failed: fail everything
            logger.exception("the engine failed and could not recover; failing all requests")
            self.error = exc
            self._accepting = False
            self._fail_all(EngineDeadError(f"the engine failed: {exc!r}"))

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued adds and aborts; False once told to stop."""
        while True:
            try:
                cmd = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _Abort):
                self._abort(cmd.request_id)
            else:
                self._stop(cmd.reason)
                return False

    def _add(self, cmd: _Add) -> None:
        stream = cmd.stream
        try:
            self.engine.add_request(stream.request_id, cmd.prompt, cmd.params, arrival_time=cmd.arrival_time,
                                    grammar=cmd.grammar)
        except ValueError as exc:
            stream.put(exc)
        except Exception as exc:  # noqa: BLE001 - whatever one request's admission raises fails it alone
            logger.exception("admitting request %s failed", stream.request_id)
            self._forget(stream.request_id)
            stream.put(RequestFailedError(f"the engine could not admit the request: {exc!r}"))
        else:
            self._streams[stream.request_id] = stream
            stream.put(_ACCEPTED)
        finally:
            with self._lock:
                self._num_pending_adds -= 1

    def _forget(self, request_id: str) -> None:
        """Drop whatever a failed add left of the request in the engine."""
        try:
            self.engine.abort_request(request_id)
        except Exception:  # noqa: BLE001 - the add failed before the engine held anything to abort
            logger.exception("cleaning up after request %s failed", request_id)

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is None:
            return
        self.engine.abort_request(request_id)
        if self.stat_logger is not None:
            self.stat_logger.record_abort(request_id)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted while the step ran
                continue
            if self.stat_logger is not None:
                self.stat_logger.record_output(out)
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _stop(self, reason: str) -> None:
        for request_id in list(self._streams):
            stream = self._streams[request_id]
            self._abort(request_id)
            stream.put(RequestAbortedError(reason))
        self._drain_pending(EngineDeadError(reason))
        self._publish_snapshot()

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.put(exc)
        self._streams.clear()
        self._drain_pending(exc)

    def _drain_pending(self, exc: BaseException) -> None:
        """Answer adds still queued behind a stop or a failure, so no caller waits forever."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                cmd.stream.put(exc)
                with self._lock:
                    self._num_pending_adds -= 1

    def _publish_snapshot(self) -> None:
        self.snapshot = EngineSnapshot.of(self.engine)


def _is_final(item) -> bool:
    return isinstance(item, BaseException) or item.finished
