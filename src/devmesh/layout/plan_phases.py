"""The phases candidate plans are built from: each turns the current spec a step closer to the
destination and returns the steps it took (none when it has nothing to do).

* **all-to-all**: a mesh dim that moves from splitting one tensor dim to splitting another
  (``Shard(0) -> Shard(1)``) swaps pieces with one all-to-all instead of gather + chunk, when
  it is the innermost split of its source dim and the next split of its target dim.
* **reductions**: partial mesh dims that the destination shards are reduce-scattered (several
  consecutive ones in one collective over their flattened group); the others are all-reduced,
  all of the same op in one collective.
* **all-gathers**, three ways: every mesh dim that must stop splitting in *one* collective
  (a nested split such as ``("tp", "dp")`` in that order, so pieces arrive in tensor order),
  one collective per tensor dim, or one per mesh dim (innermost first). Merging saves
  collectives but costs hops and, when pieces of several tensor dims arrive interleaved, a
  reorder copy; the cost model decides.
* **permute**: straight from the current split to the destination's with one all-to-all in
  which each rank sends every peer exactly the part of its block the peer's new block
  overlaps. ``[Shard(0), Shard(1)] -> [Shard(1), Shard(0)]`` then moves about an eighth of the
  tensor per rank where gather-then-chunk moves all of it.
* **chunk**: new splits are local slicing (no communication).
* **make partial**: ``Replicate -> Partial`` is local too (zeros off the first rank for sum).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from devmesh.layout.plan_step import Step
from devmesh.layout.spec import ShardingSpec

__all__ = ["STRATEGIES", "Phase", "permute_group"]

Phase = Callable[[ShardingSpec, ShardingSpec, int], list[Step]]


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _with_dim(spec: ShardingSpec, d: int, dims: tuple[int, ...]) -> ShardingSpec:
    dim_map = list(spec.dim_map)
    dim_map[d] = dims
    return dataclasses.replace(spec, dim_map=tuple(dim_map))


def local_bytes(spec: ShardingSpec, itemsize: int) -> int:
    """Bytes of the largest block (the padded size inside collectives)."""
    return itemsize * math.prod(spec.max_local_shape())


def all_to_all_phase(cur: ShardingSpec, dst: ShardingSpec, itemsize: int) -> list[Step]:
    """Move a mesh dim from splitting one tensor dim to splitting another with one
    all-to-all, when it is the innermost split of its source and the next of its target."""
    steps = []
    moved = True
    while moved:
        moved = False
        for m in range(len(cur.mesh_shape)):
            d, target = cur.shard_dim_of(m), dst.shard_dim_of(m)
            if d is None or target is None or d == target or cur.dim_map[d][-1] != m:
                continue
            wanted = dst.dim_map[target]
            if cur.dim_map[target] != wanted[: wanted.index(m)]:
                continue
            after = _with_dim(_with_dim(cur, d, cur.dim_map[d][:-1]), target,
                              cur.dim_map[target] + (m,))
            steps.append(Step("all_to_all", (m,), cur, after, local_bytes(cur, itemsize),
                              tensor_dim=target, source_dim=d))
            cur, moved = after, True
    return steps


def reduction_phase(cur: ShardingSpec, dst: ShardingSpec, itemsize: int) -> list[Step]:
    """Partial dims that the destination shards next are reduce-scattered (consecutive ones
    of one op together); the rest are all-reduced, one collective per op."""
    steps = []
    pending = {m: op for m, op in cur.partial if dst.partial_op(m) != op}
    for d in range(cur.ndim):
        have, want = cur.dim_map[d], dst.dim_map[d]
        if want[: len(have)] != have:
            continue
        run: list[int] = []
        for m in want[len(have):]:
            if m in pending and (not run or pending[m] == pending[run[0]]):
                run.append(m)
            else:
                break
        if run:
            dim_map = list(cur.dim_map)
            dim_map[d] = have + tuple(run)
            after = dataclasses.replace(  # one replace: a spec may not shard and be partial
                cur, dim_map=tuple(dim_map),
                partial=tuple((m, o) for m, o in cur.partial if m not in run))
            k = math.prod(cur.mesh_shape[m] for m in run)
            steps.append(Step("reduce_scatter", tuple(run), cur, after,
                              k * local_bytes(after, itemsize), tensor_dim=d,
                              op=pending[run[0]]))
            cur = after
            for m in run:
                del pending[m]
    for op in sorted(set(pending.values())):
        dims = tuple(sorted(m for m, o in pending.items() if o == op))
        after = dataclasses.replace(
            cur, partial=tuple((m, o) for m, o in cur.partial if m not in dims))
        steps.append(Step("all_reduce", dims, cur, after, local_bytes(cur, itemsize), op=op))
        cur = after
    return steps


def _gather(cur: ShardingSpec, drops: dict[int, int], dims: tuple[int, ...], itemsize: int
            ) -> Step:
    """One all-gather over ``dims`` that shortens tensor dim ``d``'s split to ``drops[d]``."""
    after = cur
    for d, keep in drops.items():
        after = _with_dim(after, d, cur.dim_map[d][:keep])
    k = math.prod(cur.mesh_shape[m] for m in dims)
    return Step("all_gather", dims, cur, after, k * local_bytes(cur, itemsize))


def _to_gather(cur: ShardingSpec, dst: ShardingSpec) -> dict[int, int]:
    """Tensor dim -> how many of its current splits stay (a common prefix with ``dst``)."""
    out = {}
    for d in range(cur.ndim):
        keep = _common_prefix(cur.dim_map[d], dst.dim_map[d])
        if cur.dim_map[d][keep:]:
            out[d] = keep
    return out


def merged_gather_phase(cur: ShardingSpec, dst: ShardingSpec, itemsize: int) -> list[Step]:
    """One all-gather for every mesh dim that must stop splitting its tensor dim (a single
    nested dim in tensor order, so the pieces arrive in place)."""
    gathers = _to_gather(cur, dst)
    if not gathers:
        return []
    if len(gathers) == 1:
        (d, keep), = gathers.items()
        dims = cur.dim_map[d][keep:]
    else:
        dims = tuple(sorted(m for d, keep in gathers.items() for m in cur.dim_map[d][keep:]))
    return [_gather(cur, gathers, dims, itemsize)]


def per_tensor_dim_gather_phase(cur: ShardingSpec, dst: ShardingSpec, itemsize: int
                                ) -> list[Step]:
    """One all-gather per tensor dim, the last tensor dim first (so the last gather, along
    dim 0, lands in place)."""
    steps = []
    for d, keep in sorted(_to_gather(cur, dst).items(), reverse=True):
        steps.append(_gather(cur, {d: keep}, cur.dim_map[d][keep:], itemsize))
        cur = steps[-1].after
    return steps


def per_mesh_dim_gather_phase(cur: ShardingSpec, dst: ShardingSpec, itemsize: int
                              ) -> list[Step]:
    """One all-gather per mesh dim, innermost split first, the last tensor dim first."""
    steps = []
    for d, keep in sorted(_to_gather(cur, dst).items(), reverse=True):
        for length in range(len(cur.dim_map[d]) - 1, keep - 1, -1):
            steps.append(_gather(cur, {d: length}, (cur.dim_map[d][length],), itemsize))
            cur = steps[-1].after
    return steps


def permute_group(cur: ShardingSpec, dst: ShardingSpec) -> tuple[int, ...]:
    """The mesh dims a permute exchanges over: those splitting ``cur`` beyond the prefix each
    tensor dim keeps. Ranks differing in a kept dim hold disjoint parts of every block this
    rank needs, and dims ``cur`` replicates hold this rank's data already."""
    return tuple(sorted(m for d, keep in _to_gather(cur, dst).items()
                        for m in cur.dim_map[d][keep:]))


def permute_phase(cur: ShardingSpec, dst: ShardingSpec, itemsize: int) -> list[Step]:
    """Straight to ``dst``'s splits with one all-to-all of overlapping pieces."""
    dims = permute_group(cur, dst)
    if not dims:
        return []
    after = dataclasses.replace(cur, dim_map=dst.dim_map)
    return [Step("permute", dims, cur, after, local_bytes(cur, itemsize))]


def chunk_phase(cur: ShardingSpec, dst: ShardingSpec, itemsize: int) -> list[Step]:
    """New splits are local slicing."""
    new_dims = tuple(m for d in range(cur.ndim) for m in dst.dim_map[d][len(cur.dim_map[d]):])
    if not new_dims:
        return []
    return [Step("chunk", new_dims, cur, dataclasses.replace(cur, dim_map=dst.dim_map))]


def make_partial_phase(cur: ShardingSpec, dst: ShardingSpec, itemsize: int) -> list[Step]:
    """Replicate -> Partial is local (zeros off the first rank for sum)."""
    new_partial = tuple(m for m, op in dst.partial if cur.partial_op(m) != op)
    if not new_partial:
        return []
    return [Step("make_partial", new_partial, cur, dataclasses.replace(cur, partial=dst.partial))]


# Each candidate plan is a sequence of phases; the planner builds them all and keeps the
# cheapest (equal plans from different strategies are compared once).
STRATEGIES: dict[str, tuple[Phase, ...]] = {
    "merged gather": (all_to_all_phase, reduction_phase, merged_gather_phase, chunk_phase,
                      make_partial_phase),
    "gather per tensor dim": (all_to_all_phase, reduction_phase, per_tensor_dim_gather_phase,
                              chunk_phase, make_partial_phase),
    "gather per mesh dim": (all_to_all_phase, reduction_phase, per_mesh_dim_gather_phase,
                            chunk_phase, make_partial_phase),
    "direct all-to-all": (reduction_phase, permute_phase, chunk_phase, make_partial_phase),
}
