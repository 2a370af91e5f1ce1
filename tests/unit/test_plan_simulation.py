"""The planner checked by an independent simulation (issue 12, item 5): every rank's block is
a numpy array; each step of a plan is carried out using *only* the blocks of the ranks in the
step's group (the ranks that differ in the step's mesh dims), and after every step every block
must be the global tensor's block for that step's spec (summed over partial dims). A plan that
needed data from outside its collective's group, or left part of a block unwritten, fails.
Every candidate plan is checked, not only the cheapest, so a change of cost model cannot
expose an untested one."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from devmesh.layout.plan import candidate_plans
from devmesh.layout.spec import ShardingSpec as Spec


def _region(spec, coord):
    return tuple(slice(start, start + size) for start, size in spec.local_bounds(coord))


def _peers(coord, dims, mesh_shape):
    for index in itertools.product(*[range(mesh_shape[m]) for m in dims]):
        peer = list(coord)
        for m, i in zip(dims, index):
            peer[m] = i
        yield tuple(peer)


def _assemble(spec_after, coord, sources):
    """The after-block of ``coord`` from (before-bounds, block) pairs; every element must be
    written exactly once."""
    bounds = spec_after.local_bounds(coord)
    out = np.zeros([size for _, size in bounds])
    count = np.zeros(out.shape, dtype=int)
    for src_bounds, block in sources:
        lo = [max(a, b) for (a, _), (b, _) in zip(bounds, src_bounds)]
        hi = [min(a + s, b + t) for (a, s), (b, t) in zip(bounds, src_bounds)]
        if any(h <= l for l, h in zip(lo, hi)):
            continue
        dst = tuple(slice(l - a, h - a) for l, h, (a, _) in zip(lo, hi, bounds))
        src = tuple(slice(l - b, h - b) for l, h, (b, _) in zip(lo, hi, src_bounds))
        out[dst] = block[src]
        count[dst] += 1
    assert (count == 1).all(), "a block needed data from outside the collective's group"
    return out


def _step(step, blocks, mesh_shape):
    before, after, dims = step.before, step.after, step.mesh_dims
    new = {}
    for coord in blocks:
        peers = list(_peers(coord, dims, mesh_shape))
        if step.kind in ("all_gather", "all_to_all", "permute"):
            new[coord] = _assemble(after, coord, [(before.local_bounds(p), blocks[p])
                                                  for p in peers])
        elif step.kind in ("all_reduce", "reduce_scatter"):
            total = sum(blocks[p] for p in peers)
            region = after.local_bounds(coord)
            offset = before.local_bounds(coord)
            new[coord] = total[tuple(slice(a - b, a - b + s)
                                     for (a, s), (b, _) in zip(region, offset))]
        elif step.kind == "chunk":
            region, offset = after.local_bounds(coord), before.local_bounds(coord)
            new[coord] = blocks[coord][tuple(slice(a - b, a - b + s)
                                             for (a, s), (b, _) in zip(region, offset))]
        elif step.kind == "make_partial":
            zero = any(coord[m] != 0 for m in dims)
            new[coord] = np.zeros_like(blocks[coord]) if zero else blocks[coord]
        else:
            raise AssertionError(step.kind)
    return new


def _check(spec, blocks, x, mesh_shape):
    partial = [m for m, _ in spec.partial]
    for coord, block in blocks.items():
        total = sum(blocks[p] for p in _peers(coord, partial, mesh_shape)) if partial else block
        expected = x[_region(spec, coord)]
        assert total.shape == expected.shape and np.array_equal(total, expected), (spec, coord)


def _specs(mesh_shape, shape):
    out = []
    ndim = len(shape)
    for states in itertools.product(range(-2, ndim), repeat=len(mesh_shape)):
        per_dim = [[m for m, s in enumerate(states) if s == d] for d in range(ndim)]
        partial = tuple((m, "sum") for m, s in enumerate(states) if s == -1)
        for orders in itertools.product(*[itertools.permutations(d) for d in per_dim]):
            out.append(Spec(mesh_shape, shape, tuple(orders), partial))
    return out


@pytest.mark.parametrize("mesh_shape, shape", [
    ((2, 4), (8, 8)), ((2, 4), (7, 5)), ((2, 4), (2, 3)), ((2, 4), (8, 0)),
    ((3, 2), (5, 6)), ((2, 2, 2), (6, 5)), ((2, 2, 2), (3, 1)),
])
def test_every_plan_simulates_to_the_right_blocks(mesh_shape, shape):
    x = np.arange(math.prod(shape), dtype=float).reshape(shape) + 1
    coords = list(itertools.product(*[range(k) for k in mesh_shape]))
    specs = _specs(mesh_shape, shape)
    for src in specs:
        blocks = {c: x[_region(src, c)].copy() for c in coords}
        for m, _ in src.partial:  # a partial sum: the value on coordinate 0, zeros elsewhere
            for c in coords:
                if c[m] != 0:
                    blocks[c] = np.zeros_like(blocks[c])
        done = {(): blocks}  # plans from one source share first steps: simulate each once
        for dst in specs:
            for plan in candidate_plans(src, dst):  # the chosen plan and every one it beat
                for i, step in enumerate(plan.steps):
                    path = plan.steps[:i + 1]
                    if path not in done:
                        done[path] = _step(step, done[plan.steps[:i]], mesh_shape)
                        _check(step.after, done[path], x, mesh_shape)
                _check(dst, done[tuple(plan.steps)], x, mesh_shape)
