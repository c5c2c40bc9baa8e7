"""One tensor-parallel process group (torch.distributed's gloo backend) and the collectives the ranks use.

The group is a standalone ProcessGroupGloo over a TCPStore the driver hosts, not torch.distributed's
global default group, so one process can hold several engines and tear each down on its own.
"""
from __future__ import annotations

import os
import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

# Workers wait for the driver's next step for as long as the engine is idle (a server between requests), so
# the group's timeout cannot be what detects failures; a rank that dies closes its sockets, which fails the
# other ranks' pending collective at once ("Connection closed by peer").
GROUP_TIMEOUT = timedelta(days=365)
# How long a worker waits to reach the driver's store when it starts.
STORE_TIMEOUT = timedelta(minutes=5)


def driver_store(host: str, size: int) -> dist.TCPStore:
    """The rendezvous store, hosted by the driver on a free port (store.port)."""
    return dist.TCPStore(host, 0, size, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False)


def worker_store(host: str, port: int, size: int) -> dist.TCPStore:
    """A worker's client of the driver's store."""
    return dist.TCPStore(host, port, size, is_master=False, timeout=STORE_TIMEOUT)


class TensorParallelGroup:
    """rank `rank` of `size` ranks; rank 0 is the driver. Collectives run on CPU tensors (gloo).

    Created unconnected, so a shard's layers can hold it while the model is built; `connect` joins the
    process group once every rank has built its shard.
    """

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.pg: dist.ProcessGroupGloo | None = None

    def connect(self, store: dist.Store, host: str | None = None) -> None:
        """Join the group (blocks until every rank joins). host: this rank's address for the other ranks;
        None: the interfaces GLOO_SOCKET_IFNAME names (comma-separated), else the host name's address."""
        options = dist.ProcessGroupGloo._Options()
        options._timeout = GROUP_TIMEOUT
        interfaces = os.environ.get("GLOO_SOCKET_IFNAME")
        if host:
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        elif interfaces:
            options._devices = [dist.ProcessGroupGloo.create_device(interface=name) for name in interfaces.split(",")]
        else:
            options._devices = [dist.ProcessGroupGloo.create_default_device()]
        self.pg = dist.ProcessGroupGloo(store, self.rank, self.size, options)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums a contiguous tensor over ranks, in place; returns it (the same values on every rank)."""
        self.pg.allreduce([tensor]).wait()
        return tensor

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's tensor (same shape and dtype on each) on the driver, in rank order; None elsewhere."""
        options = dist.GatherOptions()
        options.rootRank = 0
        if not self.is_driver:
            self.pg.gather([], [tensor], options).wait()
            return None
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        self.pg.gather([out], [tensor], options).wait()
        return out

    def broadcast_object(self, obj=None):
        """The driver's `obj` on every rank (pickled; tensors travel with it)."""
        if self.is_driver:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            length = torch.tensor([len(data)], dtype=torch.long)
        else:
            length = torch.zeros(1, dtype=torch.long)
        self._broadcast(length)
        buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.is_driver
                  else torch.empty(int(length), dtype=torch.uint8))
        self._broadcast(buffer)
        return obj if self.is_driver else pickle.loads(buffer.numpy().tobytes())

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.pg.broadcast([tensor], options).wait()

    def close(self) -> None:
        """Release the group's sockets (the other ranks' pending collectives then fail)."""
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.shutdown()
            except RuntimeError:
                pass



def gloo_host(address: str) -> str | None:
    """The address a rank on a multi-host group announces: its host's `address`, unless GLOO_SOCKET_IFNAME
    names the interfaces to use instead (then None, see TensorParallelGroup.connect)."""
    return None if os.environ.get("GLOO_SOCKET_IFNAME") else address
