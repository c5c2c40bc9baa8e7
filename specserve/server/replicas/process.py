"""Replicas as local processes (multiprocessing's "spawn" context): the child runs `serve_replica`; on the
router's side one thread sends it commands and one reads its updates and notices when it exits.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Callable

from specserve.config import EngineConfig
from specserve.server.replicas.loop import EngineFactory, serve_replica
from specserve.server.replicas.protocol import ReplicaFailed, ReplicaReady, StopCommand

logger = logging.getLogger(__name__)

_CLOSE = object()  # tells the sender thread to end


class ReplicaStartError(RuntimeError):
    """A replica exited, failed or timed out before its engine was ready."""


def launch_local_replicas(config: EngineConfig, num_replicas: int, engine_factory: EngineFactory | None,
                          log_level: str) -> list["ProcessReplica"]:
    """Start the processes (each loads its model in parallel with the others); the host's cores are split
    evenly between them so that they do not oversubscribe it."""
    num_threads = max(1, _num_cpus() // num_replicas)
    return [ProcessReplica(i, config, engine_factory, num_threads, log_level) for i in range(num_replicas)]


class QueuedReplicaIO:
    """The server's side of one replica's traffic: commands go into `_outbox`, which a sender thread drains
    (`_send_loop`), and a reader thread (`_read_loop`) reports the replica's updates and its end."""

    index: int
    _outbox: queue.Queue | queue.SimpleQueue
    _threads: list[threading.Thread]

    def start_io(self, on_update: Callable[[object], None], on_exit: Callable[[str, bool], None]) -> None:
        """Start the sender and reader threads; `on_exit(reason, failed)` is called once, when the replica
        has exited (failed: it reported an engine error first)."""
        self._threads = [
            threading.Thread(target=self._send_loop, name=f"specserve-replica-{self.index}-send", daemon=True),
            threading.Thread(target=self._read_loop, args=(on_update, on_exit),
                             name=f"specserve-replica-{self.index}-read", daemon=True)]
        for thread in self._threads:
            thread.start()

    def send(self, command) -> None:
        """Never blocks: the sender thread delivers it, so a busy replica cannot stall the caller."""
        self._outbox.put(command)

    def _close_outbox(self) -> None:
        """Ends the sender thread once what is queued before it has gone out."""
        self._outbox.put(_CLOSE)

    def _next_batch(self) -> tuple[list, bool]:
        """(every command queued now, waiting for the first; whether the outbox was closed): one message
        to the replica for everything queued meanwhile."""
        batch = [self._outbox.get()]
        while True:
            try:
                batch.append(self._outbox.get_nowait())
            except queue.Empty:
                break
        return [cmd for cmd in batch if cmd is not _CLOSE], _CLOSE in batch


class ProcessReplica(QueuedReplicaIO):
    """One replica in a child process, with a pipe each way."""

    def __init__(self, index: int, config: EngineConfig, engine_factory: EngineFactory | None, num_threads: int,
                 log_level: str) -> None:
        self.index = index
        context = multiprocessing.get_context("spawn")
        child_commands, self._commands = context.Pipe(duplex=False)
        self._updates, child_updates = context.Pipe(duplex=False)
        self.process = context.Process(
            target=_child_main, name=f"specserve-replica-{index}",
            args=(index, config, engine_factory, child_commands, child_updates, num_threads, log_level))
        self.process.start()
        # The child holds these ends now; closing ours lets each side see EOF when the other goes away.
        child_commands.close()
        child_updates.close()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def wait_ready(self, timeout: float) -> ReplicaReady:
        """Block until the child reports its engine built; ReplicaStartError (ValueError for a configuration
        the engine refuses) otherwise."""
        ready = wait([self._updates, self.process.sentinel], timeout)
        message = None
        if self._updates.poll():
            try:
                message = self._updates.recv()
            except (EOFError, OSError):
                pass
        if isinstance(message, ReplicaReady):
            return message
        if isinstance(message, ReplicaFailed):
            error = ValueError if message.error_type == "ValueError" else ReplicaStartError
            raise error(f"replica {self.index}: {message.message}")
        if not ready:
            raise ReplicaStartError(f"replica {self.index} was not ready after {timeout:.0f} s")
        self.process.join(5)
        raise ReplicaStartError(f"replica {self.index} {describe_exit(self.process.exitcode)} before its engine "
                                "was ready")

    def stop(self) -> None:
        if self._threads:
            self.send(StopCommand())
            return
        try:  # never started serving: nothing else writes to the pipe
            self._commands.send([StopCommand()])
        except OSError:
            pass

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()

    def join(self, timeout: float) -> None:
        """Wait for the child to exit, killing it after `timeout` seconds; then end the threads."""
        self.process.join(timeout)
        if self.process.is_alive():
            logger.warning("replica %d did not exit within %.0f s; killing it", self.index, timeout)
            self.process.kill()
            self.process.join(5)
        self._close_outbox()
        for thread in self._threads:
            thread.join(5)
        self._commands.close()
        self._updates.close()

    # ---- threads ----------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            batch, closing = self._next_batch()
            try:
                if batch:
                    self._commands.send(batch)
            except OSError:  # the child is gone; the reader reports it
                return
            if closing:
                return

    def _read_loop(self, on_update, on_exit) -> None:
        failure = None
        while True:
            ready = wait([self._updates, self.process.sentinel])
            if self._updates not in ready:
                break  # exited; what it sent before is drained below
            try:
                message = self._updates.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, ReplicaFailed):
                failure = message
            else:
                on_update(message)
        failure = self._drain(on_update) or failure
        self.process.join(5)
        reason = describe_exit(self.process.exitcode)
        if failure is not None:
            reason = f"failed ({failure.error_type}: {failure.message})"
        on_exit(reason, failure is not None)

    def _drain(self, on_update) -> ReplicaFailed | None:
        failure = None
        try:
            while self._updates.poll():
                message = self._updates.recv()
                if isinstance(message, ReplicaFailed):
                    failure = message
                else:
                    on_update(message)
        except (EOFError, OSError):
            pass
        return failure


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


def _num_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _child_main(index: int, config: EngineConfig, engine_factory: EngineFactory | None, commands: Connection,
                updates: Connection, num_threads: int, log_level: str) -> None:
    # The router stops its replicas itself, after draining them; a Ctrl-C or SIGTERM sent to the whole process
    # group must not kill them first. A replica still exits on its own when the router's pipe closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format=f"%(levelname)s replica {index} %(name)s: %(message)s")
    start = time.monotonic()

    def receive(block: bool) -> list | None:
        try:
            if not block and not commands.poll():
                return []
            received = commands.recv()
            while commands.poll():
                received.extend(commands.recv())
            return received
        except (EOFError, OSError):
            return None

    def send(message) -> None:
        if isinstance(message, ReplicaReady):
            logging.getLogger(__name__).info("ready in %.1f s (pid %d, %d threads)", time.monotonic() - start,
                                             message.pid, num_threads)
        try:
            updates.send(message)
        except OSError:  # the router is gone; the next receive sees the closed pipe and ends the loop
            pass

    status = serve_replica(config, engine_factory, receive, send, num_threads)
    updates.close()
    sys.exit(status)
