"""What each step of a plan moves and copies on one rank: the numbers the cost model prices.

This mirrors the executor (:mod:`devmesh.tensor.redistribute`) and the collectives
(:mod:`devmesh.distributed.comm`) copy for copy, so a test can compare the prediction with
``comm_stats``' byte and copy counters on real ranks. Pure: shapes and indices only.

Copies counted (bytes): padding an uneven block for a collective; packing pieces into one
send buffer (all-to-all, reduce-scatter when the pieces are not already laid out by block);
reordering a collective's result from c10d's sorted rank order into mesh order (a group over
mesh dims not in ascending order); reassembling gathered or exchanged pieces into the result
block unless they already arrive in place (a gather along dim 0 in tensor order); cloning for
an all-reduce or a local chunk.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Iterator, Sequence

from devmesh.layout.cost import wire_bytes
from devmesh.layout.plan_step import Step
from devmesh.layout.spec import chunk_bounds

__all__ = ["with_traffic", "overlap", "sub_bounds", "group_coordinates"]

Box = tuple[tuple[int, int], ...]

# Above this many ranks, the worst rank is looked for among one group and the last rank only.
_EXHAUSTIVE_RANKS = 64


def sub_bounds(length: int, sizes: Sequence[int], index: Sequence[int]) -> tuple[int, int]:
    """Bounds of the piece at ``index`` when ``length`` is split hierarchically by ``sizes``."""
    start = 0
    for k, i in zip(sizes, index, strict=True):
        offset, length = chunk_bounds(length, k, i)
        start += offset
    return start, length


def overlap(a: Box, b: Box) -> Box:
    """The intersection of two boxes of ``(start, size)`` per dim (size 0 where disjoint)."""
    out = []
    for (s, n), (t, m) in zip(a, b, strict=True):
        lo, hi = max(s, t), min(s + n, t + m)
        out.append((lo, max(hi - lo, 0)))
    return tuple(out)


def group_coordinates(coord: Sequence[int], dims: Sequence[int], mesh_shape: Sequence[int]
                      ) -> Iterator[tuple[int, ...]]:
    """The coordinates of ``coord``'s group over ``dims``, in mesh order (``dims`` major)."""
    for index in itertools.product(*[range(mesh_shape[m]) for m in dims]):
        peer = list(coord)
        for m, i in zip(dims, index, strict=True):
            peer[m] = i
        yield tuple(peer)


def in_c10d_order(dims: Sequence[int], mesh_shape: Sequence[int]) -> bool:
    """Whether a group over ``dims`` lists its ranks sorted (c10d's order): true when the
    dims of size > 1 ascend (for a mesh whose ranks are laid out row-major)."""
    real = [m for m in dims if mesh_shape[m] > 1]
    return real == sorted(real)


def _numel(box_or_shape) -> int:
    return math.prod(n if isinstance(n, int) else n[1] for n in box_or_shape)


def _all_gather(step: Step, coord, itemsize: int) -> tuple[int, int]:
    before, after, dims, shape = step.before, step.after, step.mesh_dims, step.before.mesh_shape
    gathered = [d for d in range(before.ndim) if before.dim_map[d] != after.dim_map[d]]
    local = list(before.local_shape(coord))
    padded = list(local)
    for d in gathered:
        region = after.local_bounds(coord)[d][1]
        for m in before.dim_map[d][len(after.dim_map[d]):]:
            region = -(-region // shape[m]) if region else 0
        padded[d] = region
    k = math.prod(shape[m] for m in dims)
    block = itemsize * math.prod(padded)
    copied = block if padded != local else 0
    if not in_c10d_order(dims, shape) or k == 1:  # reordered, or cloned for a group of one
        copied += k * block
    in_place = gathered == [0] and all(
        before.local_bounds(p)[0][1] == padded[0] for p in group_coordinates(coord, dims, shape))
    if not in_place:
        copied += itemsize * math.prod(after.local_shape(coord))
    return (k - 1) * block, copied


def _reduce_scatter(step: Step, coord, itemsize: int) -> tuple[int, int]:
    d, dims, shape = step.tensor_dim, step.mesh_dims, step.before.mesh_shape
    assert d is not None
    local = step.before.local_shape(coord)
    sizes = [shape[m] for m in dims]
    k = math.prod(sizes)
    piece = sub_bounds(local[d], sizes, [0] * len(sizes))[1]
    block = itemsize * math.prod(local) // local[d] * piece if local[d] else 0
    stacked = k * block
    copied = 0 if d == 0 and local[0] % k == 0 else stacked
    if not in_c10d_order(dims, shape) or k == 1:  # reordered, or cloned for a group of one
        copied += stacked
    return (k - 1) * block, copied


def _all_to_all(step: Step, coord, itemsize: int) -> tuple[int, int]:
    k = step.before.mesh_shape[step.mesh_dims[0]]
    local = itemsize * math.prod(step.before.local_shape(coord))
    result = itemsize * math.prod(step.after.local_shape(coord))
    return round(wire_bytes("all_to_all", k, local)), local + result


def _permute(step: Step, coord, itemsize: int) -> tuple[int, int]:
    before, after, dims, shape = step.before, step.after, step.mesh_dims, step.before.mesh_shape
    mine_before, mine_after = before.local_bounds(coord), after.local_bounds(coord)
    sent = received = 0
    for peer in group_coordinates(coord, dims, shape):
        sent += _numel(overlap(mine_before, after.local_bounds(peer)))
        if peer != tuple(coord):
            received += _numel(overlap(before.local_bounds(peer), mine_after))
    return itemsize * received, itemsize * (sent + _numel(mine_after))


def _all_reduce(step: Step, coord, itemsize: int) -> tuple[int, int]:
    k = math.prod(step.before.mesh_shape[m] for m in step.mesh_dims)
    local = itemsize * math.prod(step.before.local_shape(coord))
    return round(wire_bytes("all_reduce", k, local)), local  # the clone it reduces in place


def _local(step: Step, coord, itemsize: int) -> tuple[int, int]:
    if step.kind == "chunk":
        return 0, itemsize * math.prod(step.after.local_shape(coord))
    return 0, 0  # make_partial: zeros or the block itself


_TRAFFIC = {"all_gather": _all_gather, "reduce_scatter": _reduce_scatter,
            "all_reduce": _all_reduce, "all_to_all": _all_to_all, "permute": _permute}


def _coordinates(step: Step) -> list[tuple[int, ...]]:
    shape = step.before.mesh_shape
    if math.prod(shape) <= _EXHAUSTIVE_RANKS:
        return list(itertools.product(*[range(k) for k in shape]))
    zero = (0,) * len(shape)
    return list(group_coordinates(zero, step.mesh_dims, shape)) + [tuple(k - 1 for k in shape)]


def with_traffic(step: Step, itemsize: int) -> Step:
    """``step`` with its group size, bytes received and bytes copied on the worst rank."""
    group, wire, copied, nbytes = _traffic(step, itemsize)
    return dataclasses.replace(step, group_size=group, wire=wire, copied=copied, nbytes=nbytes)


@functools.lru_cache(maxsize=1 << 14)
def _traffic(step: Step, itemsize: int) -> tuple[int, int, int, int]:
    """Memoized by value (names aside: they only print): candidate plans of different
    redistributions share most of their steps."""
    traffic = _TRAFFIC.get(step.kind, _local)
    wire = copied = sent = 0
    for coord in _coordinates(step):
        w, c = traffic(step, coord, itemsize)
        wire, copied = max(wire, w), max(copied, c)
        if step.kind == "permute":  # its buffer is what it sends: copied = sent + result
            sent = max(sent, c - itemsize * math.prod(step.after.local_shape(coord)))
    group = math.prod(step.before.mesh_shape[m] for m in step.mesh_dims) if step.is_collective else 1
    nbytes = sent if step.kind == "permute" else step.nbytes
    return group, wire, copied, nbytes
