"""Workers as Ray actors, one per rank 1..N-1, placed by a placement group of N bundles (bundle 0 stands for
the driver). Each actor joins the driver's torch.distributed group at the address the driver publishes
(its node's IP and a free port of its store).

Ray is an optional extra (`pip install specserve[ray]`); it is imported only here. An existing cluster is
joined when RAY_ADDRESS is set (`ray.init(address="auto")`); otherwise a local instance is started, and
shut down again with the engine.
"""
from __future__ import annotations

import os

from specserve.distributed.group import driver_store, gloo_host, worker_store
from specserve.distributed.worker import ShardSpec, run_worker

PLACEMENT_TIMEOUT_S = 120.0


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise ImportError("distributed_executor_backend='ray' needs Ray: pip install specserve[ray]") from exc
    return ray


class RayShardWorker:
    """The actor: runs one worker rank (worker.run_worker) until the driver's shutdown command."""

    def run(self, spec: ShardSpec, rank: int, host: str, port: int) -> None:
        import ray

        run_worker(spec, rank, worker_store(host, port, spec.size), gloo_host(ray.util.get_node_ip_address()))

    def pid(self) -> int:
        return os.getpid()


class RayWorkers:
    death_notice_s = 10.0  # Ray reports a lost actor after a while

    def __init__(self, spec: ShardSpec) -> None:
        self.ray = ray = import_ray()
        self.spec = spec
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            ray.init(address="auto" if os.environ.get("RAY_ADDRESS") else None)
        self.host = ray.util.get_node_ip_address()  # the driver's, where its store listens
        self.gloo_host = gloo_host(self.host)
        self.actors, self.runs, self.pid_refs = {}, {}, {}
        self.placement = None

    def launch(self):
        """Place and start the actors; returns the rendezvous store they join (torch.distributed.TCPStore)."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, spec = self.ray, self.spec
        bundle = {"CPU": float(spec.threads)}
        # Bundle 0 is the driver's, pinned to its host; SPREAD then puts the workers on other hosts as far
        # as the cluster allows (on one host, all of them there).
        bundles = [{**bundle, f"node:{self.host}": 0.001}] + [bundle] * (spec.size - 1)
        self.placement = placement_group(bundles, strategy="SPREAD")
        ready, _ = ray.wait([self.placement.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise RuntimeError(f"Ray could not place {spec.size} bundles of {bundle} (the first on this host) in "
                               f"{PLACEMENT_TIMEOUT_S:.0f} s (cluster resources: {ray.cluster_resources()})")
        store = driver_store(self.host, spec.size)
        actor = ray.remote(RayShardWorker)
        for rank in range(1, spec.size):
            strategy = PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=rank)
            self.actors[rank] = actor.options(num_cpus=spec.threads, scheduling_strategy=strategy,
                                              name=None, max_restarts=0).remote()
            self.pid_refs[rank] = self.actors[rank].pid.remote()  # before run, which holds the actor
            self.runs[rank] = self.actors[rank].run.remote(spec, rank, self.host, store.port)
        return store

    def pids(self) -> dict[int, int]:
        return {rank: self.ray.get(ref) for rank, ref in self.pid_refs.items()}

    def dead(self) -> dict[int, str]:
        """{rank: how it ended} of the actors whose run has ended."""
        out = {}
        for rank, ref in self.runs.items():
            done, _ = self.ray.wait([ref], timeout=0)
            if done:
                try:
                    self.ray.get(ref)
                    out[rank] = "(Ray actor) returned"
                except Exception as exc:  # RayActorError, or the worker's own exception
                    out[rank] = f"(Ray actor) failed: {type(exc).__name__}"
        return out

    def stop(self, timeout: float) -> None:
        ray = self.ray
        if self.runs and timeout > 0:
            ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=timeout)
        for actor in self.actors.values():
            ray.kill(actor)
        if self.placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement)
        if self.started_ray:
            ray.shutdown()
