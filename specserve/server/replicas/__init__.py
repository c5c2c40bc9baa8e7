"""Data parallelism for the server: several engine replicas (local processes or Ray actors) behind one router
with AsyncLLM's interface."""
from specserve.server.replicas.client import BACKENDS, ReplicaClient, ReplicaDiedError

__all__ = ["BACKENDS", "ReplicaClient", "ReplicaDiedError"]
