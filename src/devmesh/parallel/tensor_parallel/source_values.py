"""The source rank's values of the parameters a plan splits, sent in buckets.

``parallelize_module`` splits each parameter from one rank's values (``src_data_rank``, as
torch's ``distribute_tensor``), so that ranks which initialised their models differently
still hold one model. One broadcast per parameter — torch's way — makes a model of
hundreds of layers pay hundreds of latency-bound collectives for a few megabytes. Here the
parameters go in buckets of about :data:`BUCKET_BYTES`, packed as bytes (any mix of
dtypes), one broadcast each, as DDP's ``sync_module_states`` sends a module's state. A
bucket is sent when the first of its parameters is split, and its buffer goes once each of
its parameters has been split (their blocks are copies), so a bucket is all that is held
besides the model.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch

from devmesh.distributed import comm
from devmesh.mesh import DeviceMesh

__all__ = ["BUCKET_BYTES", "SourceValues"]

#: About how many bytes one broadcast carries (a parameter larger than this goes alone).
BUCKET_BYTES = 32 * 1024 * 1024
_ALIGN = 16  # each parameter's bytes start at a multiple: any dtype can view them


class SourceValues:
    """The values of ``params`` (the same shapes and dtypes, in the same order, on every
    rank of ``mesh``: the plan's agreement checked it) on rank ``src`` of the 1-D
    ``mesh``, each received once through :meth:`take`."""

    def __init__(self, params: Iterable[torch.Tensor], mesh: DeviceMesh, src: int) -> None:
        device = comm.mesh_device(mesh)
        self._queue = deque({id(p): p for p in params if p.device == device
                             and not p.is_sparse}.values())
        self._waiting = {id(p) for p in self._queue}
        self._received: dict[int, torch.Tensor] = {}
        self._mesh, self._src, self._device = mesh, src, device

    def take(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s values on the source rank (sending buckets until its own arrives), or
        ``None`` for a parameter not sent this way (split from the source on its own)."""
        if id(param) not in self._waiting:
            return None
        while id(param) not in self._received:
            self._send_next_bucket()
        self._waiting.discard(id(param))
        return self._received.pop(id(param))

    def _send_next_bucket(self) -> None:
        bucket, size = [], 0
        while self._queue and (not bucket or size + self._queue[0].nbytes <= BUCKET_BYTES):
            param = self._queue.popleft()
            bucket.append((param, size))
            size += -(-param.nbytes // _ALIGN) * _ALIGN
        # (the padding between parameters is never read: it need not be zeroed)
        buffer = torch.empty(size, dtype=torch.uint8, device=self._device)
        if self._mesh.get_local_rank(0) == self._src:
            for param, offset in bucket:
                buffer[offset: offset + param.nbytes] = _as_bytes(param.detach())
        comm.broadcast(buffer, self._mesh, (0,), self._src)
        for param, offset in bucket:
            self._received[id(param)] = (buffer[offset: offset + param.nbytes]
                                         .view(param.dtype).view(param.shape))


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)
