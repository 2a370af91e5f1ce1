"""The most bytes a rank's step holds at once: what a device's allocator must have ready at the
step's worst moment.

Every tensor an op makes is counted from the op until its storage is freed (a weak reference
to the storage tells), each storage once however many views share it, on top of what the
step starts with (the parameters, their shards, and the buffers). That is the sum of what is
alive at each op, with its highest point kept — the allocated peak a GPU's caching allocator
reports (``torch.cuda.max_memory_allocated``), which the dry run measures on ``meta``
tensors, whose storages have sizes but no bytes. It sees what no per-part count does: the
float32 logits and their gradient at the start of backward, FSDP's gathered units and the
next one prefetched, a checkpointed block's recomputation, the collectives' buffers.

Each count is also kept per moment of the step (``moment``, set by the one running it: which
action, which block): the highest point within each moment, from which a longer stage's peak
is extended (:func:`~devmesh.tools.dry_run.run.dry_run_by_blocks`).

Ops DTensor runs to propagate shapes (on fake tensors of the global shape) are not counted:
they allocate nothing on a device. torch's own ``MemTracker`` counts per module and attaches
hooks to each parameter's gradient accumulation, which a parameter FSDP hands to its module
as a view of a gathered buffer does not take; the count here needs neither.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Iterable

import torch
from torch.distributed.tensor import DTensor

from devmesh._torch_compat import FakeTensor, TorchDispatchMode, pytree

__all__ = ["LiveBytes"]

Moment = Hashable


class LiveBytes(TorchDispatchMode):
    """Inside: the bytes alive now (``now``), the most alive at once (``peak``), and the most
    alive at once within each ``moment`` (``peaks``)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.peak = 0
        self.moment: Moment = None
        self.peaks: dict[Moment, int] = {}
        self._alive: dict[int, tuple[weakref.ref, int]] = {}

    def hold(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count ``tensors`` the step starts with (made before it: parameters, buffers)."""
        for t in tensors:
            self._count(t)

    def _count(self, t: torch.Tensor) -> None:
        if isinstance(t, DTensor):
            t = t._local_tensor
        if isinstance(t, FakeTensor) or t.is_sparse or t.is_nested:
            return
        storage = t.untyped_storage()
        key = id(storage)
        known = self._alive.get(key)
        if known is not None and known[0]() is storage:
            return
        nbytes = storage.nbytes()

        def freed(_ref: weakref.ref, key: int = key, nbytes: int = nbytes) -> None:
            self.now -= nbytes
            self._alive.pop(key, None)

        self._alive[key] = (weakref.ref(storage, freed), nbytes)
        self.now += nbytes
        self.peak = max(self.peak, self.now)
        if self.now > self.peaks.get(self.moment, -1):
            self.peaks[self.moment] = self.now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs its local ops, which come back here
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self._count(out)
        else:
            for t in pytree.tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._count(t)
        return out

