"""The rendezvous of ``devmesh run --nnodes N``: torch's c10d rendezvous, with each host's
``--node-rank`` deciding its ranks.

torch's c10d rendezvous (what ``torchrun --rdzv-backend c10d`` uses, and the one that lets a
host drop out and rejoin under ``--max-restarts``) numbers the hosts by sorting their
addresses: whichever host has the lowest address runs global ranks ``0..n-1``, whatever its
``--node-rank`` (torchrun warns that node_rank "is only used for static rdzv_backend"). So
a host's rank — in its ranks' ``RANK`` and ``GROUP_RANK``, in each output line's ``[rankN]``,
in ``mesh.hosts()``, in the error naming a failed host — was an accident of addressing.

The ``devmesh`` backend registered here runs torch's c10d rendezvous as it is (membership,
rounds, heartbeats, restarts) and then hands its agent the host's own node rank instead of
the sorted position. The ranks' bootstrap store (``MASTER_ADDR:MASTER_PORT``, served by
global rank 0) is published again by node 0, where rank 0 now runs. Node ranks are checked
to be ``0..N-1`` once each, on every host, before any rank starts: two hosts given the same
``--node-rank`` are refused naming both.
"""

from __future__ import annotations

import socket

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (RendezvousError, RendezvousHandler,
                                                  RendezvousInfo, RendezvousParameters,
                                                  rendezvous_handler_registry)
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

__all__ = ["BACKEND", "register"]

BACKEND = "devmesh"
_PREFIX = "devmesh/node-rank/"
_node_rank: int | None = None


class _ByNodeRank(RendezvousHandler):
    """torch's c10d rendezvous handler, answering with this host's node rank."""

    def __init__(self, inner: RendezvousHandler, node_rank: int, local_addr: str | None
                 ) -> None:
        self._inner, self._node_rank, self._local_addr = inner, node_rank, local_addr

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        # this round's store: each host says which node rank it takes; every host reads all
        store = dist.PrefixStore(_PREFIX, info.store)
        store.set(str(info.rank), f"{self._node_rank} {self._local_addr or socket.getfqdn()}")
        given = [store.get(str(r)).decode().split(" ", 1) for r in range(info.world_size)]
        ranks = [int(rank) for rank, _ in given]
        if sorted(ranks) != list(range(info.world_size)):
            taken: dict[int, list[str]] = {}
            for rank, address in given:
                taken.setdefault(int(rank), []).append(address)
            clashes = "; ".join(f"--node-rank {rank} on {', '.join(addresses)}"
                                for rank, addresses in sorted(taken.items())
                                if len(addresses) > 1 or not 0 <= rank < info.world_size)
            raise RendezvousError(
                f"devmesh run: each of the {info.world_size} hosts needs its own --node-rank "
                f"in 0..{info.world_size - 1}, but {clashes}")
        bootstrap = info.bootstrap_store_info
        if not self._inner.use_agent_store:  # global rank 0 serves it: node 0 publishes it
            bootstrap = RendezvousStoreInfo.build(
                self._node_rank, dist.PrefixStore("bootstrap/", store),
                local_addr=self._local_addr)
        return RendezvousInfo(info.store, self._node_rank, info.world_size, bootstrap)

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def _create(params: RendezvousParameters) -> RendezvousHandler:
    if _node_rank is None:
        raise RendezvousError("the devmesh rendezvous is started by devmesh run --nnodes N "
                              "--node-rank R, which names this host's rank")
    c10d = RendezvousParameters("c10d", params.endpoint, params.run_id, params.min_nodes,
                                params.max_nodes, params.local_addr, **params.config)
    inner = rendezvous_handler_registry.create_handler(c10d)
    return _ByNodeRank(inner, _node_rank, params.local_addr)


def register(node_rank: int) -> str:
    """Make the ``devmesh`` backend give this host the ranks of ``node_rank``; returns the
    backend's name for torchrun's ``--rdzv-backend``."""
    global _node_rank
    _node_rank = node_rank
    rendezvous_handler_registry.register(BACKEND, _create)
    return BACKEND
