"""Running a plan on this rank's local block, and its autograd.

Each step of a :class:`~devmesh.layout.plan.Plan` maps to one call of
:mod:`devmesh.distributed.comm` (or a local slice). Uneven blocks are padded to the largest
block inside the collective and cut back right after, so padding never reaches the caller.
Every local copy is counted (``comm_stats().copied``) exactly where
:mod:`devmesh.layout.traffic` predicts it, so the planner's prices can be checked.

Autograd follows DTensor's convention: the gradient of a tensor has the same layout as the
tensor, with partial dims becoming replicated. The backward of ``redistribute(src -> dst)`` is
``redistribute(grad: dst -> src)`` with that rule applied to both ends, so all-gather and
reduce-scatter are each other's backward, all-to-all is its own (reversed), and the backward of
resolving a partial (all-reduce) is the identity.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from devmesh.distributed import comm
from devmesh.mesh import DeviceMesh
from devmesh.layout.plan import Plan, Step, plan_redistribute
from devmesh.layout.spec import ShardingSpec, chunk_bounds
from devmesh.layout.traffic import group_coordinates, overlap, sub_bounds

__all__ = ["execute", "redistribute_local"]


def _pad_to(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    if tuple(t.shape) == tuple(shape):
        return t
    pad: list[int] = []
    for have, want in reversed(list(zip(t.shape, shape, strict=True))):
        pad += [0, want - have]
    return comm.count_copy(F.pad(t, pad))


def _reduce_scatter(local: torch.Tensor, mesh: DeviceMesh, coord, step: Step) -> torch.Tensor:
    d, dims = step.tensor_dim, step.mesh_dims
    sizes = [mesh.shape[m] for m in dims]
    length = local.shape[d]
    k = math.prod(sizes)
    if d == 0 and length % k == 0 and local.is_contiguous():  # already laid out by block
        stacked = local.view(k, length // k, *local.shape[1:])
    else:
        pieces = []
        for index in itertools.product(*[range(n) for n in sizes]):
            start, size = sub_bounds(length, sizes, index)
            pieces.append(local.narrow(d, start, size))
        block = list(local.shape)
        block[d] = max(p.shape[d] for p in pieces)
        # one copy: each piece into its slot of a zeroed buffer (padding stays zero)
        stacked = local.new_zeros((k, *block)) if any(
            p.shape[d] != block[d] for p in pieces) else local.new_empty((k, *block))
        for slot, piece in zip(stacked, pieces, strict=True):
            slot.narrow(d, 0, piece.shape[d]).copy_(piece)
        comm.count_copy(stacked)
    out = comm.reduce_scatter(stacked, mesh, dims, step.op or "sum")
    mine = sub_bounds(length, sizes, [coord[m] for m in dims])[1]
    return out.narrow(d, 0, mine)


def _all_reduce(local: torch.Tensor, mesh: DeviceMesh, coord, step: Step) -> torch.Tensor:
    return comm.all_reduce(comm.count_copy(local.clone()), mesh, step.mesh_dims, step.op or "sum")


def _all_gather(local: torch.Tensor, mesh: DeviceMesh, coord, step: Step) -> torch.Tensor:
    before, after, dims = step.before, step.after, step.mesh_dims
    gathered_dims = [d for d in range(before.ndim) if before.dim_map[d] != after.dim_map[d]]
    padded = list(local.shape)
    for d in gathered_dims:
        region = after.local_bounds(coord)[d][1]
        for m in before.dim_map[d][len(after.dim_map[d]):]:
            region = -(-region // mesh.shape[m]) if region else 0
        padded[d] = region
    stacked = comm.all_gather(_pad_to(local, padded), mesh, dims)
    sizes = [mesh.shape[m] for m in dims]
    peers = []
    for i, index in enumerate(itertools.product(*[range(k) for k in sizes])):
        peer = list(coord)
        for m, c in zip(dims, index, strict=True):
            peer[m] = c
        peers.append((i, before.local_bounds(peer)))
    region = after.local_bounds(coord)
    if len(gathered_dims) == 1:  # pieces arrive in tensor order: concatenate
        d = gathered_dims[0]
        if d == 0 and all(bounds[0][1] == padded[0] for _, bounds in peers):
            # already contiguous in order (explicit sizes: -1 is ambiguous for empty blocks)
            return stacked.reshape(stacked.shape[0] * stacked.shape[1], *stacked.shape[2:])
        parts = [stacked[i].narrow(d, 0, bounds[d][1]) for i, bounds in peers]
        return comm.count_copy(torch.cat(parts, dim=d))
    out = local.new_empty([region[d][1] for d in range(before.ndim)])
    for i, bounds in peers:
        block = stacked[i]
        target = out
        for d in gathered_dims:
            block = block.narrow(d, 0, bounds[d][1])
            target = target.narrow(d, bounds[d][0] - region[d][0], bounds[d][1])
        target.copy_(block)
    return comm.count_copy(out)


def _all_to_all(local: torch.Tensor, mesh: DeviceMesh, coord, step: Step) -> torch.Tensor:
    (m,) = step.mesh_dims
    source, target = step.source_dim, step.tensor_dim
    k = mesh.shape[m]
    length = local.shape[target]
    chunks = [local.narrow(target, *chunk_bounds(length, k, j)) for j in range(k)]
    mine = chunk_bounds(length, k, coord[m])[1]
    recv_shapes = []
    for j in range(k):
        peer = list(coord)
        peer[m] = j
        shape = list(local.shape)
        shape[source] = step.before.local_bounds(peer)[source][1]
        shape[target] = mine
        recv_shapes.append(shape)
    parts = comm.all_to_all(chunks, mesh, (m,), recv_shapes)
    return comm.count_copy(torch.cat(parts, dim=source))


def _box_slice(t: torch.Tensor, box, origin) -> torch.Tensor:
    """The part of ``t`` (a block starting at global ``origin``) inside global ``box``."""
    for d, ((start, size), (offset, _)) in enumerate(zip(box, origin, strict=True)):
        t = t.narrow(d, min(max(start - offset, 0), t.shape[d]) if size == 0 else start - offset,
                     size)  # an empty overlap may start anywhere
    return t


def _permute(local: torch.Tensor, mesh: DeviceMesh, coord, step: Step) -> torch.Tensor:
    """Send each peer the part of this block its new block overlaps; assemble the new block
    from what the peers send (the group holds every element of it exactly once)."""
    before, after, dims = step.before, step.after, step.mesh_dims
    mine_before, mine_after = before.local_bounds(coord), after.local_bounds(coord)
    chunks, receiving, recv_shapes = [], [], []
    for peer in group_coordinates(coord, dims, tuple(mesh.shape)):
        chunks.append(_box_slice(local, overlap(mine_before, after.local_bounds(peer)),
                                 mine_before))
        box = overlap(before.local_bounds(peer), mine_after)
        receiving.append(box)
        recv_shapes.append([size for _, size in box])
    parts = comm.all_to_all(chunks, mesh, dims, recv_shapes)
    out = local.new_empty([size for _, size in mine_after])
    for box, part in zip(receiving, parts, strict=True):
        _box_slice(out, box, mine_after).copy_(part)
    return comm.count_copy(out)


def _chunk(local: torch.Tensor, mesh: DeviceMesh, coord, step: Step) -> torch.Tensor:
    out = local
    for d in range(step.before.ndim):
        new = step.after.dim_map[d][len(step.before.dim_map[d]):]
        if new:
            start, size = sub_bounds(out.shape[d], [mesh.shape[m] for m in new],
                                      [coord[m] for m in new])
            out = out.narrow(d, start, size)
    return comm.count_copy(out.clone(memory_format=torch.contiguous_format))


def _make_partial(local: torch.Tensor, mesh: DeviceMesh, coord, step: Step) -> torch.Tensor:
    zero = any(step.after.partial_op(m) == "sum" and coord[m] != 0 for m in step.mesh_dims)
    return torch.zeros_like(local) if zero else local


_APPLY = {
    "reduce_scatter": _reduce_scatter,
    "all_reduce": _all_reduce,
    "all_gather": _all_gather,
    "all_to_all": _all_to_all,
    "permute": _permute,
    "chunk": _chunk,
    "make_partial": _make_partial,
}


def execute(local: torch.Tensor, mesh: DeviceMesh, plan: Plan) -> torch.Tensor:
    """Apply ``plan`` to this rank's block (no autograd)."""
    coord = mesh.get_coordinate()
    assert coord is not None
    for step in plan.steps:
        local = _APPLY[step.kind](local, mesh, coord, step)
    return local


def _grad_spec(spec: ShardingSpec) -> ShardingSpec:
    return dataclasses.replace(spec, partial=()) if spec.partial else spec


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, mesh, src, dst, grad_spec, grad_out_spec,  # type: ignore[override]
                forward_dtype, backward_dtype):
        ctx.mesh, ctx.grad_spec, ctx.grad_out_spec = mesh, grad_spec, grad_out_spec
        ctx.input_dtype = local.dtype
        ctx.backward_dtype = backward_dtype or local.dtype
        if forward_dtype is not None:
            local = local.to(forward_dtype)
        return execute(local, mesh, plan_redistribute(src, dst, local.element_size()))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.to(ctx.backward_dtype)
        plan = plan_redistribute(ctx.grad_spec, ctx.grad_out_spec, grad.element_size())
        grad = execute(grad.contiguous(), ctx.mesh, plan).to(ctx.input_dtype)
        return grad, None, None, None, None, None, None, None


def redistribute_local(
    local: torch.Tensor, mesh: DeviceMesh, src: ShardingSpec, dst: ShardingSpec,
    grad_spec: ShardingSpec | None = None, *, grad_out_spec: ShardingSpec | None = None,
    forward_dtype: torch.dtype | None = None, backward_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """This rank's block of ``dst`` from its block of ``src``; differentiable. The gradient
    arriving for the result is in ``grad_spec`` (default ``dst`` with partial dims made
    replicated, DTensor's convention) and leaves in ``src``'s layout. ``forward_dtype``:
    the block is cast to it first (the result is in it); ``backward_dtype``: the gradient's
    collectives run in it (default: ``local``'s dtype), the gradient leaving in ``local``'s
    dtype — torch's ``redistribute`` arguments. ``grad_out_spec``: the layout the gradient
    leaves in (default ``src`` with partial dims made replicated; ``from_local``'s
    ``grad_placements`` sets it)."""
    grad_spec = grad_spec if grad_spec is not None else _grad_spec(dst)
    grad_out_spec = grad_out_spec if grad_out_spec is not None else _grad_spec(src)
    same_dtypes = forward_dtype in (None, local.dtype) and backward_dtype in (None, local.dtype)
    if src == dst and grad_spec == grad_out_spec and same_dtypes:
        return local
    return _Redistribute.apply(local, mesh, src, dst, grad_spec, grad_out_spec, forward_dtype,
                               backward_dtype)
