"""The source rank's values of the parameters a plan splits: each rank's blocks, in buckets.

``parallelize_module`` splits each parameter from one rank's values (``src_data_rank``, as
torch's ``distribute_tensor``), so that ranks which initialised their models differently
still hold one model. Torch scatters each parameter on its own: a model of hundreds of
layers pays hundreds of latency-bound collectives for a few megabytes. Here the parameters
go in buckets of about :data:`BUCKET_BYTES` sent by the source, packed as bytes (any mix of
dtypes), one collective each in which the source sends every rank only its own blocks — a
1/n share of a split parameter, the whole of a replicated one — as ``scatter`` does. The
styles say before they run how they split each parameter (``ParallelStyle.splits``); the
parameters of a style that does not (one's own) are sent whole, and each rank splits its
copy. A bucket is sent when the first of its parameters is split, and its buffer goes once
each of its parameters has been split (their blocks are copies), so a bucket is all that is
held besides the model.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from devmesh.distributed import comm
from devmesh.mesh import DeviceMesh
from devmesh.tensor import ShardingSpec

__all__ = ["BUCKET_BYTES", "SourceValues"]

#: About how many bytes the source sends in one collective (a parameter larger than this goes
#: alone).
BUCKET_BYTES = 8 * 1024 * 1024
_ALIGN = 16  # each block's bytes start at a multiple: any dtype can view them


@dataclass(frozen=True)
class _Planned:
    param: torch.Tensor
    spec: ShardingSpec  # the blocks it is cut into (a replicated spec: whole on every rank)
    view: tuple[int, ...]  # the shape it is cut in (a packed parameter's parts apart)

    def block_shape(self, index: int) -> tuple[int, ...]:
        return self.spec.local_shape((index,))

    def block_bytes(self, index: int) -> int:
        return math.prod(self.block_shape(index)) * self.param.element_size()


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class SourceValues:
    """Rank ``src``'s values of the planned parameters (the same shapes, dtypes and plans,
    in the same order, on every rank of the 1-D ``mesh``: the plan's agreement checked it),
    this rank's block of each received once through :meth:`take`. ``planned``: each
    parameter with the spec of the blocks it is split into and the shape it is split in."""

    def __init__(self, planned: Iterable[tuple[torch.Tensor, ShardingSpec, tuple[int, ...]]],
                 mesh: DeviceMesh, src: int) -> None:
        device = comm.mesh_device(mesh)
        self._queue = deque(_Planned(p, spec, view) for p, spec, view in planned
                            if p.device == device and not p.is_sparse)
        self._waiting = {id(item.param) for item in self._queue}
        self._received: dict[int, tuple[torch.Tensor, ShardingSpec]] = {}
        self._mesh, self._src, self._device = mesh, src, device
        # sent between blocks, never read (on the device: no copy from the host for it)
        self._padding = torch.zeros(_ALIGN, dtype=torch.uint8, device=device)

    def take(self, param: torch.Tensor) -> tuple[torch.Tensor, ShardingSpec] | None:
        """This rank's block of ``param`` (in its planned shape, sending buckets until it
        arrives) and the spec it was cut by, or ``None`` for a parameter not sent this way
        (split from the source on its own)."""
        if id(param) not in self._waiting:
            return None
        while id(param) not in self._received:
            self._send_next_bucket()
        self._waiting.discard(id(param))
        return self._received.pop(id(param))

    def _send_next_bucket(self) -> None:
        n = self._mesh.size()
        bucket: list[_Planned] = []
        size = 0
        while self._queue:
            item = self._queue[0]
            sent = sum(_padded(item.block_bytes(i)) for i in range(n))
            if bucket and size + sent > BUCKET_BYTES:
                break
            bucket.append(self._queue.popleft())
            size += sent
        sizes = [sum(_padded(item.block_bytes(i)) for item in bucket) for i in range(n)]
        me = self._mesh.get_local_rank(0)
        pieces = None
        if me == self._src:
            pieces = [[] for _ in range(n)]
            for item in bucket:
                for i, data in enumerate(_blocks_as_bytes(item, n)):
                    pieces[i].append(data)
                    pad = _padded(data.numel()) - data.numel()
                    if pad:
                        pieces[i].append(self._padding[:pad])
        mine = comm.scatter_bytes(pieces, sizes, self._mesh, (0,), self._src, self._device)
        offset = 0
        for item in bucket:
            shape, nbytes = item.block_shape(me), item.block_bytes(me)
            block = mine[offset: offset + nbytes].view(item.param.dtype).view(shape)
            self._received[id(item.param)] = (block, item.spec)
            offset += _padded(nbytes)


def _blocks_as_bytes(item: _Planned, n: int) -> list[torch.Tensor]:
    """Each of the ``n`` ranks' blocks of ``item`` on the source, as bytes (views where their
    strides allow)."""
    whole = item.param.detach().reshape(item.view)
    out = []
    for index in range(n):
        block = whole
        for dim, (start, size) in enumerate(item.spec.local_bounds((index,))):
            block = block.narrow(dim, start, size)
        if block.dim() == 0:
            block = block.reshape(1)
        try:
            out.append(block.view(torch.uint8))
        except RuntimeError:  # strides a byte view cannot take
            out.append(block.contiguous().view(torch.uint8))
    return out
