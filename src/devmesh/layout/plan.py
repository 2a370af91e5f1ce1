"""Planning a redistribution: any spec to any spec with the fewest collectives.

Pure (specs in, steps out), so ``explain_redistribute`` shows the plan without a mesh. The
plan runs in five phases, each skipped when it has nothing to do:

1. **all-to-all**: a mesh dim that moves from splitting one tensor dim to splitting another
   (``Shard(0) -> Shard(1)``) swaps pieces with one all-to-all instead of gather + chunk, when
   it is the innermost split of its source dim and the next split of its target dim.
2. **reductions**: partial mesh dims that the destination shards are reduce-scattered (several
   consecutive ones in one collective over their flattened group); the others are all-reduced,
   all of the same op in one collective.
3. **all-gather**: every mesh dim that must stop splitting a tensor dim, across all tensor dims,
   is gathered in *one* all-gather over the flattened group of those mesh dims. A nested split
   such as ``("tp", "dp")`` is gathered in that order, so the pieces arrive in tensor order:
   one collective where torch needs two and a reorder.
4. **chunk**: new splits are local slicing (no communication).
5. **make partial**: ``Replicate -> Partial`` is local too (zeros off the first rank for sum).

Byte counts are one rank's collective buffer (see :mod:`devmesh.distributed.comm`), padded blocks
included; for evenly divisible shapes they are the theoretical minimum.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from devmesh.layout.spec import ShardingSpec, ShardingSpecError

__all__ = ["Step", "Plan", "plan_redistribute", "explain_redistribute"]

COLLECTIVES = ("all_to_all", "reduce_scatter", "all_reduce", "all_gather")


@dataclass(frozen=True)
class Step:
    """One step of a plan: a collective over ``mesh_dims`` or a local operation."""

    kind: str  # all_to_all | reduce_scatter | all_reduce | all_gather | chunk | make_partial
    mesh_dims: tuple[int, ...]
    before: ShardingSpec
    after: ShardingSpec
    nbytes: int = 0
    tensor_dim: int | None = None  # reduce_scatter: the dim scattered; all_to_all: the target
    source_dim: int | None = None  # all_to_all: the dim gathered
    op: str | None = None

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVES

    def describe(self) -> str:
        names = ", ".join(self.before.name(m) for m in self.mesh_dims)
        over = f"over ({names})" if len(self.mesh_dims) > 1 else f"over {names}"
        if self.kind == "all_to_all":
            what = f"all_to_all {over}: dim {self.source_dim} -> dim {self.tensor_dim}"
        elif self.kind == "reduce_scatter":
            what = f"reduce_scatter({self.op}) {over} onto dim {self.tensor_dim}"
        elif self.kind == "all_reduce":
            what = f"all_reduce({self.op}) {over}"
        elif self.kind == "all_gather":
            what = f"all_gather {over}"
        elif self.kind == "chunk":
            what = f"local chunk by ({names}) (no communication)"
        else:
            what = f"make partial over ({names}) (local, no communication)"
        moved = f", {self.nbytes:,} bytes" if self.is_collective else ""
        return f"{what}{moved}  -> {self.after}"


@dataclass(frozen=True)
class Plan:
    src: ShardingSpec
    dst: ShardingSpec
    steps: tuple[Step, ...]

    @property
    def collectives(self) -> int:
        return sum(step.is_collective for step in self.steps)

    @property
    def nbytes(self) -> int:
        return sum(step.nbytes for step in self.steps)

    def __str__(self) -> str:
        lines = [f"redistribute {self.src}", f"         to {self.dst}"]
        if not self.steps:
            lines.append("  nothing to do")
        lines += [f"  {i + 1}. {step.describe()}" for i, step in enumerate(self.steps)]
        lines.append(f"  {self.collectives} collective(s), {self.nbytes:,} bytes per rank")
        return "\n".join(lines)


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _with_dim(spec: ShardingSpec, d: int, dims: tuple[int, ...]) -> ShardingSpec:
    dim_map = list(spec.dim_map)
    dim_map[d] = dims
    return dataclasses.replace(spec, dim_map=tuple(dim_map))


def plan_redistribute(src: ShardingSpec, dst: ShardingSpec, itemsize: int = 4) -> Plan:
    """The steps that turn a tensor laid out as ``src`` into ``dst`` on the same mesh."""
    # specs compare without their dim names; the cache key must not, or a plan made for
    # ('dp', 'tp') would describe itself with those names for a mesh named ('x', 'y')
    return _plan(src, dst, itemsize, src.mesh_dim_names, dst.mesh_dim_names)


@functools.lru_cache(maxsize=4096)
def _plan(src: ShardingSpec, dst: ShardingSpec, itemsize: int, _src_names, _dst_names) -> Plan:
    if src.mesh_shape != dst.mesh_shape:
        raise ShardingSpecError(
            f"cannot redistribute between meshes of shapes {src.mesh_shape} and {dst.mesh_shape}"
        )
    if src.global_shape != dst.global_shape:
        raise ShardingSpecError(
            f"cannot redistribute a tensor of shape {src.global_shape} to shape {dst.global_shape}"
        )
    steps: list[Step] = []
    cur = src
    for phase in (_all_to_all_phase, _reduction_phase, _all_gather_phase, _chunk_phase,
                  _make_partial_phase):
        for step in phase(cur, dst, itemsize):
            steps.append(step)
            cur = step.after
    assert cur == dst, (cur, dst)
    return Plan(src, dst, tuple(steps))


def _local_bytes(spec: ShardingSpec, itemsize: int) -> int:
    return itemsize * math.prod(spec.max_local_shape())


def _all_to_all_phase(cur: ShardingSpec, dst: ShardingSpec, itemsize: int) -> list[Step]:
    """1. Move a mesh dim from splitting one tensor dim to splitting another with one
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
            steps.append(Step("all_to_all", (m,), cur, after, _local_bytes(cur, itemsize),
                              tensor_dim=target, source_dim=d))
            cur, moved = after, True
    return steps


def _reduction_phase(cur: ShardingSpec, dst: ShardingSpec, itemsize: int) -> list[Step]:
    """2. Partial dims that the destination shards next are reduce-scattered (consecutive ones
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
            after = dataclasses.replace(
                cur, dim_map=tuple(dim_map),
                partial=tuple((m, o) for m, o in cur.partial if m not in run))
            k = math.prod(cur.mesh_shape[m] for m in run)
            steps.append(Step("reduce_scatter", tuple(run), cur, after,
                              k * _local_bytes(after, itemsize), tensor_dim=d,
                              op=pending[run[0]]))
            cur = after
            for m in run:
                del pending[m]
    for op in sorted(set(pending.values())):
        dims = tuple(sorted(m for m, o in pending.items() if o == op))
        after = dataclasses.replace(
            cur, partial=tuple((m, o) for m, o in cur.partial if m not in dims))
        steps.append(Step("all_reduce", dims, cur, after, _local_bytes(cur, itemsize), op=op))
        cur = after
    return steps


def _all_gather_phase(cur: ShardingSpec, dst: ShardingSpec, itemsize: int) -> list[Step]:
    """3. One all-gather for every mesh dim that must stop splitting its tensor dim (a single
    nested dim in tensor order, so the pieces arrive in place)."""
    gathers = {}
    for d in range(cur.ndim):
        keep = _common_prefix(cur.dim_map[d], dst.dim_map[d])
        if cur.dim_map[d][keep:]:
            gathers[d] = keep
    if not gathers:
        return []
    if len(gathers) == 1:
        (d, keep), = gathers.items()
        dims = cur.dim_map[d][keep:]
    else:
        dims = tuple(sorted(m for d, keep in gathers.items() for m in cur.dim_map[d][keep:]))
    after = cur
    for d, keep in gathers.items():
        after = _with_dim(after, d, cur.dim_map[d][:keep])
    k = math.prod(cur.mesh_shape[m] for m in dims)
    return [Step("all_gather", dims, cur, after, k * _local_bytes(cur, itemsize))]


def _chunk_phase(cur: ShardingSpec, dst: ShardingSpec, itemsize: int) -> list[Step]:
    """4. New splits are local slicing."""
    new_dims = tuple(m for d in range(cur.ndim) for m in dst.dim_map[d][len(cur.dim_map[d]):])
    if not new_dims:
        return []
    return [Step("chunk", new_dims, cur, dataclasses.replace(cur, dim_map=dst.dim_map))]


def _make_partial_phase(cur: ShardingSpec, dst: ShardingSpec, itemsize: int) -> list[Step]:
    """5. Replicate -> Partial is local (zeros off the first rank for sum)."""
    new_partial = tuple(m for m, op in dst.partial if cur.partial_op(m) != op)
    if not new_partial:
        return []
    return [Step("make_partial", new_partial, cur, dataclasses.replace(cur, partial=dst.partial))]


def explain_redistribute(src: ShardingSpec, dst: ShardingSpec, itemsize: int = 4) -> str:
    """The plan as text: every step, the collective, its mesh dims and bytes per rank."""
    return str(plan_redistribute(src, dst, itemsize))
