"""Collectives entered on process groups, counted: what a call costs in communication
rounds, devmesh's own agreements and torch's alike (``bench/setup.py`` counts a model's
setup with it).

Every collective of ``torch.distributed``'s Python API ends in a method of the process group
(``allreduce``, ``broadcast``, ``_allgather_base``, ...); while :func:`entered_collectives`
is active those methods are wrapped, process-wide, and each call counted under its method's
name. torch's functional collectives (DTensor's redistributions) run in C++ and are not
seen here: :mod:`devmesh.distributed.torch_collectives` counts those.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch.distributed as dist

__all__ = ["entered_collectives"]

_METHODS = ("allreduce", "allreduce_coalesced", "allgather", "_allgather_base",
            "all_gather_single", "allgather_coalesced", "allgather_into_tensor_coalesced",
            "broadcast", "scatter", "gather", "reduce", "reduce_scatter",
            "_reduce_scatter_base", "reduce_scatter_single", "reduce_scatter_tensor_coalesced",
            "alltoall", "alltoall_base", "all_to_all_single", "barrier", "monitored_barrier",
            "send", "recv")


@contextlib.contextmanager
def entered_collectives() -> Iterator[Counter]:
    """Count, by method, the collectives this process enters on any process group inside
    the block (not nested: one counter at a time)."""
    group = dist.ProcessGroup
    # the class's own descriptors, put back as they were (getattr's would not bind self)
    saved = {name: group.__dict__[name] for name in _METHODS if name in group.__dict__}
    counts: Counter = Counter()

    def counted(name: str):
        method = getattr(group, name)

        def call(*args, **kwargs):
            counts[name] += 1
            return method(*args, **kwargs)

        return call

    for name in saved:
        setattr(group, name, counted(name))
    try:
        yield counts
    finally:
        for name, descriptor in saved.items():
            setattr(group, name, descriptor)
