"""What runs inside one replica, whatever hosts it (a local process or a Ray actor): its own engine and step
loop, taking commands from the router and answering each iteration with one ReplicaUpdate.
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Callable

from specserve.config import EngineConfig
from specserve.server.async_engine import EngineSnapshot
from specserve.server.replicas.protocol import (
    AbortCommand, AddCommand, OutputEncoder, ReplicaFailed, ReplicaReady, ReplicaUpdate, StopCommand)

logger = logging.getLogger(__name__)

# Builds a replica's engine from the shared config; the default is LLMEngine. It crosses a process boundary,
# so it must be a module-level function.
EngineFactory = Callable[[EngineConfig], object]
# receive(block) -> the commands that have arrived (waiting for at least one when block), or None once the
# router is gone.
Receive = Callable[[bool], "list | None"]


def build_engine(config: EngineConfig):
    from specserve.engine.engine import LLMEngine

    return LLMEngine(config)


def serve_replica(config: EngineConfig, engine_factory: EngineFactory | None, receive: Receive,
                  send: Callable[[object], None], num_threads: int | None = None) -> int:
    """Build the engine, say ReplicaReady (or ReplicaFailed) and run its loop until told to stop or the router
    is gone. Returns the exit status: 0 after a stop, 1 after a failure (reported as the last message)."""
    if num_threads:
        import torch

        torch.set_num_threads(num_threads)
    try:
        engine = (engine_factory or build_engine)(config)
    except Exception as exc:  # noqa: BLE001 - reported to the router, which refuses to start
        logger.exception("the replica's engine could not be built")
        send(ReplicaFailed(type(exc).__name__, str(exc)))
        return 1
    send(ReplicaReady(engine.max_model_len, engine.model.config.vocab_size, os.getpid(), socket.gethostname()))
    try:
        ReplicaLoop(engine, send).run(receive)
    except Exception as exc:  # noqa: BLE001 - the engine's state is unknown now: the replica ends
        logger.exception("engine step failed; the replica stops")
        send(ReplicaFailed(type(exc).__name__, repr(exc)))
        return 1
    return 0


class ReplicaLoop:
    """One engine driven by router commands: apply what has arrived, step once if anything runs, report."""

    def __init__(self, engine, send: Callable[[object], None]) -> None:
        self.engine = engine
        self.send = send
        self.encoder = OutputEncoder()
        self.request_ids: set[str] = set()

    def run(self, receive: Receive) -> None:
        while True:
            commands = receive(not self.engine.has_unfinished_requests())
            if commands is None:
                logger.warning("the router is gone; the replica stops")
                self._abort_all()
                return
            update = ReplicaUpdate()
            for cmd in commands:
                if isinstance(cmd, StopCommand):
                    self._abort_all()
                    return
                self._apply(cmd, update)
            if self.engine.has_unfinished_requests():
                update.outputs = [self._encode(out) for out in self.engine.step()]
            update.snapshot = self._snapshot()
            self.send(update)

    def _apply(self, cmd, update: ReplicaUpdate) -> None:
        if isinstance(cmd, AddCommand):
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, arrival_time=cmd.arrival_time)
            except ValueError as exc:
                update.refused.append((cmd.request_id, str(exc)))
            except Exception as exc:  # noqa: BLE001 - whatever one request's admission raises fails it alone
                self._fail_add(cmd.request_id, exc, update)
            else:
                self.request_ids.add(cmd.request_id)
                update.accepted.append(cmd.request_id)
        elif isinstance(cmd, AbortCommand):
            if cmd.request_id in self.request_ids:
                self.request_ids.discard(cmd.request_id)
                self.engine.abort_request(cmd.request_id)
                self.encoder.forget(cmd.request_id)
        else:
            raise TypeError(f"unknown replica command {cmd!r}")

    def _fail_add(self, request_id: str, exc: Exception, update: ReplicaUpdate) -> None:
        logger.exception("admitting request %s failed", request_id)
        update.failed.append((request_id, f"the engine could not admit the request: {exc!r}"))
        try:
            self.engine.abort_request(request_id)  # whatever the failed add left behind
        except Exception:  # noqa: BLE001 - the add failed before the engine held anything to abort
            logger.exception("cleaning up after request %s failed", request_id)

    def _encode(self, out):
        if out.finished:
            self.request_ids.discard(out.request_id)
        return self.encoder.encode(out)

    def _abort_all(self) -> None:
        for request_id in list(self.request_ids):
            self.engine.abort_request(request_id)
        self.request_ids.clear()

    def _snapshot(self) -> EngineSnapshot:
        return EngineSnapshot.of(self.engine)
