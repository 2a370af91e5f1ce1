"""Which rank writes which block of a sharded checkpoint, and where in its file: pure
arithmetic over specs and rank arrays, the same on every rank without communication.

A tensor laid out on a mesh is a set of distinct blocks (the ``local_bounds`` of every mesh
coordinate); ranks whose coordinates differ only along replicating mesh dims hold the same
block. Each distinct block is written once, by one of its holders: the one with the fewest
bytes assigned so far, so that replicated tensors (DDP weights, the replicated half of HSDP,
buffers) spread over the ranks instead of all landing on rank 0. A tensor that is not laid out
on a mesh (a plain parameter, a buffer, Adam's step) is one block held by every rank.

Each rank writes its blocks, in the order of the tensor list, to its own data file; so every
rank can compute every block's file and offset, and rank 0 writes the metadata without
gathering anything.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from devmesh.layout.spec import ShardingSpec

__all__ = ["Block", "TensorLayout", "Placed", "distinct_blocks", "packed_parts", "place_blocks",
           "overlap"]


@dataclass(frozen=True)
class Block:
    """One distinct block of a tensor: where it starts, its size, which ranks hold it."""

    start: tuple[int, ...]
    size: tuple[int, ...]
    holders: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.size)


@dataclass(frozen=True)
class TensorLayout:
    """What the plan needs to know about one tensor to save: its key, global shape, element
    size, and how it is laid out, or ``spec=None`` for a tensor every rank holds whole.

    ``spec`` is over a mesh that may be a slice (or flattening) of a root mesh: ``ranks`` are
    the root's global ranks (row-major over ``root_shape``), and ``dim_roots[i]`` the root
    dims that make up the mesh's dim ``i`` (major to minor). A tensor on ``mesh["dp"]`` of a
    ``(dp, tp)`` root is then held, block for block, by every tp column."""

    key: str
    shape: tuple[int, ...]
    itemsize: int
    spec: ShardingSpec | None = None
    ranks: tuple[int, ...] = ()
    root_shape: tuple[int, ...] = ()
    dim_roots: tuple[tuple[int, ...], ...] = ()
    writer: int | None = None  # for ``spec=None``: only this rank holds it (``extra``: rank 0)
    #: ``(dim, parts)`` of a packed parameter: ``spec`` lays out the view of ``shape`` with
    #: that dim cut into ``(parts, part size)`` (:class:`~devmesh.parallel.param.ParamLayout`);
    #: each of a rank's parts is a block of its own in ``shape``, so the stored tensor is
    #: the parameter as single-process training has it
    packed: tuple[int, int] | None = None


@dataclass(frozen=True)
class Placed:
    """A block placed in a data file: written by ``rank`` at ``offset``."""

    key: str
    block: Block
    rank: int
    offset: int
    nbytes: int


def distinct_blocks(layout: TensorLayout, world_size: int) -> list[Block]:
    """The tensor's distinct non-empty blocks, each with the ranks holding it (mesh order)."""
    if layout.spec is None:
        if math.prod(layout.shape) == 0:
            return []
        holders = (layout.writer,) if layout.writer is not None else tuple(range(world_size))
        return [Block((0,) * len(layout.shape), tuple(layout.shape), holders)]
    by_bounds: dict[tuple[tuple[int, int], ...], list[int]] = {}
    root_shape = layout.root_shape or layout.spec.mesh_shape
    dim_roots = layout.dim_roots or tuple((d,) for d in range(len(root_shape)))
    for rank, root_coord in zip(layout.ranks, itertools.product(*map(range, root_shape)),
                                strict=True):
        coord = []
        for roots in dim_roots:  # the mesh coordinate: each dim's root coordinates, flattened
            index = 0
            for d in roots:
                index = index * root_shape[d] + root_coord[d]
            coord.append(index)
        by_bounds.setdefault(layout.spec.local_bounds(coord), []).append(rank)
    if layout.packed is not None:
        return [Block(start, size, tuple(r)) for b, r in by_bounds.items()
                for _, start, size in packed_parts(b, layout.packed, layout.shape)
                if all(size)]
    return [Block(tuple(s for s, _ in b), tuple(n for _, n in b), tuple(r))
            for b, r in by_bounds.items() if all(n for _, n in b)]


def packed_parts(view_bounds: Sequence[tuple[int, int]], packed: tuple[int, int],
                 shape: Sequence[int]) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """A packed tensor's block, given by its ``(start, size)`` per dim of the view (its
    packed dim cut into ``(parts, part size)``), as one box of ``shape`` per part it holds:
    ``(index of the part within the block, start, size)``."""
    dim, parts = packed
    part_size = shape[dim] // parts
    (first, count), (offset, length) = view_bounds[dim], view_bounds[dim + 1]
    before, after = view_bounds[:dim], view_bounds[dim + 2:]
    return [(i, tuple(s for s, _ in before) + ((first + i) * part_size + offset,)
             + tuple(s for s, _ in after),
             tuple(n for _, n in before) + (length,) + tuple(n for _, n in after))
            for i in range(count)]


def place_blocks(tensors: Sequence[Any], world_size: int) -> list[Placed]:
    """Every block of every tensor (anything with ``key``, ``itemsize`` and ``blocks``), its
    writer and offset: the least-loaded holder writes it (ties: the lowest rank), appending
    to its file in the order of ``tensors``."""
    written = [0] * world_size
    placed = []
    for tensor in tensors:
        for block in tensor.blocks:
            nbytes = block.numel * tensor.itemsize
            rank = min(block.holders, key=lambda r: (written[r], r))
            placed.append(Placed(tensor.key, block, rank, written[rank], nbytes))
            written[rank] += nbytes
    return placed


def overlap(a_start: Sequence[int], a_size: Sequence[int], b_start: Sequence[int],
            b_size: Sequence[int]) -> tuple[tuple[int, int], ...] | None:
    """``(start, stop)`` per dim of the intersection of two boxes, or ``None`` if empty."""
    box = []
    for s0, n0, s1, n1 in zip(a_start, a_size, b_start, b_size, strict=True):
        lo, hi = max(s0, s1), min(s0 + n0, s1 + n1)
        if hi <= lo:
            return None
        box.append((lo, hi))
    return tuple(box)
