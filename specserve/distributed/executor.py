"""The driver's side of tensor parallelism: start the workers, send them each command, stop them.

Workers are local processes (`mp`, the default), Ray actors (`ray`, ray_workers.py) or the other ranks of a
torchrun launch (torchrun.py). Every command runs under one lock, broadcast first and then run on the
driver's own shard. If anything fails inside a command (a worker died: its sockets close and the pending
collective raises), the ranks can no longer be trusted to be in step: the executor stops every worker and
refuses further commands, naming the rank that failed and how. Workers are also stopped when the executor
is garbage collected or the process exits.
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist

from specserve import process_env
from specserve.distributed.group import TensorParallelGroup, driver_store
from specserve.distributed.worker import SHUTDOWN, ShardSpec, error_key, ready_key
from specserve.types import FatalEngineError

BACKENDS = ("mp", "ray")
STOP_TIMEOUT_S = 5.0  # a worker's time to exit after the shutdown command, before it is terminated


class WorkerFailure(FatalEngineError):
    """A tensor-parallel worker died or failed; the engine's workers have been stopped."""


class ProcessWorkers:
    """Workers as local processes, reached over localhost. Each is a fresh interpreter (as multiprocessing's
    spawn start method gives, but without re-running the caller's main module, so a script needs no
    `if __name__ == "__main__"` guard); its arguments arrive pickled on stdin."""

    host = gloo_host = "127.0.0.1"
    death_notice_s = 10.0  # how long after its connection closed a worker may still not show in dead()

    def __init__(self, spec: ShardSpec) -> None:
        self.spec = spec
        self.processes: dict[int, subprocess.Popen] = {}

    def launch(self) -> dist.Store:
        """Start the workers; returns the rendezvous store they join."""
        store = driver_store(self.host, self.spec.size)
        command = [sys.executable, "-c", "from specserve.distributed.worker import process_main; process_main()"]
        for rank in range(1, self.spec.size):
            process = subprocess.Popen(command, stdin=subprocess.PIPE, env=process_env.apply(dict(os.environ)))
            self.processes[rank] = process
            process.stdin.write(pickle.dumps((self.spec, rank, self.host, store.port, list(sys.path))))
            process.stdin.close()
        return store

    def pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self.processes.items()}

    def dead(self) -> dict[int, str]:
        """{rank: how it ended} of the workers that are no longer running."""
        return {rank: f"process {p.pid} {_exit_description(p.returncode)}"
                for rank, p in self.processes.items() if p.poll() is not None}

    def stop(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for process in self.processes.values():
            _wait(process, max(0.0, deadline - time.monotonic()))
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
                _wait(process, 2.0)
            if process.poll() is None:
                process.kill()
                process.wait()


def _wait(process: subprocess.Popen, timeout: float) -> None:
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        pass


def _exit_description(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def make_workers(backend: str, spec: ShardSpec):
    if backend == "mp":
        return ProcessWorkers(spec)
    if backend == "ray":
        from specserve.distributed.ray_workers import RayWorkers

        return RayWorkers(spec)
    raise ValueError(f"distributed_executor_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


class _Session:
    """What stopping the workers needs, kept apart from the executor so a finalizer can hold it."""

    def __init__(self, group: TensorParallelGroup, workers, threads_before: int) -> None:
        self.group, self.workers, self.threads_before = group, workers, threads_before
        self.connected = False
        self.stopped = False


def _stop(session: _Session, graceful: bool) -> None:
    if session.stopped:
        return
    session.stopped = True
    if graceful and session.connected:
        try:
            session.group.broadcast_object((SHUTDOWN, ()))
        except RuntimeError:  # a worker is already gone
            graceful = False
    session.workers.stop(STOP_TIMEOUT_S if graceful else 0.0)
    session.group.close()
    torch.set_num_threads(session.threads_before)


class TensorParallelExecutor:
    """Rank 0's handle on the workers of one tensor-parallel engine (ProcessWorkers, RayWorkers or
    TorchrunWorkers: launch() → the rendezvous store, gloo_host, pids(), dead(), stop(timeout))."""

    def __init__(self, spec: ShardSpec, workers) -> None:
        self.spec = spec
        self.group = TensorParallelGroup(0, spec.size)
        self.workers = workers
        self.failure: Exception | None = None  # why the engine stopped: a WorkerFailure, or a RuntimeError
        self._lock = threading.Lock()
        self._session = _Session(self.group, self.workers, torch.get_num_threads())
        self._finalizer = weakref.finalize(self, _stop, self._session, True)  # also runs at exit
        torch.set_num_threads(spec.threads)
        try:
            self.store = self.workers.launch()
        except BaseException:
            self.shutdown(graceful=False)
            raise

    def connect(self) -> None:
        """Wait until every worker has built its shard, then join the group; raises WorkerFailure for a
        worker that failed or died on the way."""
        for rank in range(1, self.spec.size):
            while not self.store.check([ready_key(rank)]):
                dead = self.workers.dead()
                if rank in dead or self.store.check([error_key(rank)]):
                    raise self._failed({rank: dead.get(rank, "failed")}, "while starting")
                time.sleep(0.05)
        self.group.connect(self.store, self.workers.gloo_host)
        self._session.connected = True

    def run(self, name: str, args: tuple, local):
        """Broadcast command (name, args) to the workers, then return local() (the driver's part)."""
        with self._lock:
            if self.failure is not None:
                raise type(self.failure)(f"the tensor-parallel engine has stopped: {self.failure}")
            if self._session.stopped:
                raise RuntimeError("the tensor-parallel engine was shut down")
            try:
                self.group.broadcast_object((name, args))
                return local()
            except BaseException as exc:
                raise self._after_error(exc) from exc

    def _after_error(self, exc: BaseException) -> FatalEngineError:
        """Stop every worker after a failed command; the error to raise (a WorkerFailure when a worker caused
        it). Either way the engine cannot go on: the workers are gone."""
        lost = _lost_connection(exc)
        # a dying worker may not show as dead yet (Ray reports a lost actor after a while)
        notice = self.workers.death_notice_s
        deadline = time.monotonic() + (notice if lost else min(notice, 2.0))
        dead = self.workers.dead()
        while not dead and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = self.workers.dead()
        failed = {rank: dead.get(rank, "failed") for rank in range(1, self.spec.size)
                  if rank in dead or self._check(error_key(rank))}
        if failed:
            return self._failed(failed, "during a step")
        if lost:
            self.failure = WorkerFailure(f"a tensor-parallel worker's connection closed during a step "
                                         f"({str(exc).splitlines()[0]}); the engine has stopped its workers")
            self.shutdown(graceful=False)
            return self.failure
        self.failure = FatalEngineError(f"a step failed on the driver ({exc!r}), and the workers were stopped")
        self.shutdown(graceful=False)
        return self.failure

    def _failed(self, failed: dict[int, str], when: str) -> WorkerFailure:
        lines = []
        for rank, how in sorted(failed.items()):
            detail = self._error_text(rank)
            lines.append(f"tensor-parallel worker rank {rank} {how} {when}" + (f":\n{detail}" if detail else ""))
        self.failure = WorkerFailure("; ".join(lines) + "; the engine has stopped its workers")
        self.shutdown(graceful=False)
        return self.failure

    def _check(self, key: str) -> bool:
        try:
            return self.store.check([key])
        except RuntimeError:
            return False

    def _error_text(self, rank: int) -> str:
        if not self._check(error_key(rank)):
            return ""
        text = self.store.get(error_key(rank)).decode(errors="replace").strip()
        return text.splitlines()[-1] if text else ""  # the exception line; the traceback is on its stderr

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers (the shutdown command first when graceful, then terminate what remains)."""
        self._finalizer.detach()
        _stop(self._session, graceful)

    @property
    def worker_pids(self) -> dict[int, int]:
        return self.workers.pids()


def _lost_connection(exc: BaseException) -> bool:
    """Whether a collective failed because a peer's connection closed (gloo's transport error)."""
    return isinstance(exc, RuntimeError) and "gloo/transport" in str(exc)


def threads_per_rank(size: int) -> int:
    """Torch threads for each of `size` ranks on this host, so that they do not oversubscribe its cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // size)
