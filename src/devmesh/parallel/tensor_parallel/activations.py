"""Activations at the boundary of a tensor-parallel module.

An activation reaches a parallelized module in one of three forms:

* a plain tensor: this rank's block, in the layout the plan says (``input_layouts``). Its
  gradient is *complete* for that block (devmesh's convention, as Megatron's): each boundary
  function here returns complete gradients on the way back;
* a torch ``DTensor`` (what a style with ``use_local_output=False`` hands on, as in torch): it
  carries its own layout, which wins over ``input_layouts``. Its autograd tracks gradient
  layouts, so a column-sharded consumer says its input gradient is ``Partial`` and torch
  reduces it once, in the cheapest form (a reduce-scatter where the producer was sharded);
* a devmesh ``ShardedTensor``: converted to a DTensor (same local block, no copy).

Plain-tensor boundaries go through :mod:`.functional` (one devmesh collective each, counted
by :mod:`devmesh.distributed.comm`); DTensor boundaries through torch's redistribution.

A plain block does not say how long the whole is. Where a style knows it — a feature dim split
as the weight is, ``Linear.out_features`` into a column-sharded output — it passes ``extent``,
``(dim, length)``, so uneven blocks (``torch.chunk``'s) are gathered, split and wrapped as
DTensors of the right global shape; without it a split dim is taken to split evenly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from devmesh.errors import ParallelizeError
from devmesh.mesh import DeviceMesh
from devmesh.parallel.param import is_dtensor
from devmesh.parallel.tensor_parallel import functional as PF
from devmesh.parallel.tensor_parallel.shared_inputs import converted_once
from devmesh.tensor import Partial, Placement, Replicate, Shard, ShardedTensor, as_placement

if TYPE_CHECKING:  # imported on first use: torch.distributed.tensor costs ~0.6 s to import
    from torch.distributed.tensor import DTensor

__all__ = ["to_torch_placement", "as_dtensor", "is_global", "layout_of", "replicated_input",
           "sharded_input", "finish_output", "convert"]


def to_torch_placement(p: Placement):
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    if isinstance(p, Shard):
        return TorchShard(p.dim)
    if isinstance(p, Partial):
        return TorchPartial(p.reduce_op)
    return TorchReplicate()


def is_global(x: object) -> bool:
    """A DTensor or ShardedTensor: an activation that carries its own layout."""
    return isinstance(x, ShardedTensor) or is_dtensor(x)


Extent = tuple[int, int] | None  # (tensor dim, its global length)


def as_dtensor(x: torch.Tensor | DTensor | ShardedTensor, mesh: DeviceMesh,
               placement: Placement, extent: Extent = None) -> DTensor:
    """``x`` as a DTensor on ``mesh`` (a plain tensor is taken to be in ``placement``, with
    the global length ``extent`` gives for its split dim)."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, ShardedTensor):
        x = x.to_dtensor()
    if isinstance(x, DTensor):
        if x.device_mesh.ndim != 1 or x.device_mesh.mesh.tolist() != mesh.mesh.tolist():
            raise ParallelizeError(
                f"an activation arrives as a DTensor on {x.device_mesh!r}, but this module is "
                f"parallelized over {mesh!r}; redistribute it onto that mesh first"
            )
        return x
    size = _length(extent, placement, x.ndim)
    if size is None:
        return DTensor.from_local(x, mesh, [to_torch_placement(placement)], run_check=False)
    shape = list(x.shape)
    shape[placement.dim % x.ndim] = size
    return DTensor.from_local(x, mesh, [to_torch_placement(placement)], run_check=False,
                              shape=torch.Size(shape), stride=_contiguous_stride(shape))


def _contiguous_stride(shape: list[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (computed, not read off an empty
    tensor of the global shape: a memory count of the step would see that one)."""
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def _length(extent: Extent, placement: Placement, ndim: int) -> int | None:
    """The global length of the dim ``placement`` splits, where ``extent`` gives it."""
    if extent is None or not isinstance(placement, Shard) or ndim == 0:
        return None
    dim, length = extent
    return length if dim % ndim == placement.dim % ndim else None


def layout_of(x: object, default: Placement) -> Placement:
    """The layout an activation is in: its own if it carries one, else the plan's."""
    if isinstance(x, ShardedTensor):
        return x.placements[0]
    if is_dtensor(x):
        return as_placement(x.placements[0])
    return default


def _same(a: Placement, b: Placement, ndim: int) -> bool:
    if isinstance(a, Shard) and isinstance(b, Shard):
        return a.dim % ndim == b.dim % ndim
    return a == b


def replicated_input(x, have: Placement, mesh: DeviceMesh) -> torch.Tensor:
    """The whole activation on every rank, for a consumer with column-sharded weights (whose
    input gradient is a partial sum over the TP ranks). Modules reading one input share its
    conversion (:mod:`.shared_inputs`): its gradient is reduced once for all of them."""
    if is_global(x):
        dt = as_dtensor(x, mesh, have)
        if not dt.placements[0].is_replicate():
            dt = dt.redistribute(mesh, [to_torch_placement(Replicate())])
        return dt.to_local(grad_placements=[to_torch_placement(Partial())])
    if isinstance(have, Shard):  # backward: one reduce-scatter
        return converted_once(x, mesh, have, lambda: PF.gather_for_parallel(x, mesh, have.dim))
    if isinstance(have, Partial):
        return converted_once(x, mesh, have, lambda: PF.copy_to_parallel(
            PF.reduce_from_parallel(x, mesh), mesh))
    return converted_once(x, mesh, have, lambda: PF.copy_to_parallel(x, mesh))  # one all-reduce


def sharded_input(x, have: Placement, want: Shard, mesh: DeviceMesh,
                  extent: Extent = None) -> torch.Tensor:
    """This rank's block of the activation split along ``want.dim``, for a consumer whose
    weights are split the same way (its input gradient is complete)."""
    if is_global(x):
        dt = as_dtensor(x, mesh, have)
        if not _same(as_placement(dt.placements[0]), want, dt.ndim):
            dt = dt.redistribute(mesh, [to_torch_placement(want)])
        return dt.to_local()
    return convert(x, have, want, mesh, use_local_output=True, extent=extent)


def finish_output(y: torch.Tensor, have: Placement, want: Placement, mesh: DeviceMesh,
                  use_local_output: bool, extent: Extent = None):
    """A module's local result (in layout ``have``) handed on in layout ``want``: the local
    block, or with ``use_local_output=False`` a DTensor."""
    if use_local_output:
        return convert(y, have, want, mesh, use_local_output=True, extent=extent)
    dt = as_dtensor(y, mesh, have, extent)
    if not _same(have, want, y.ndim):
        dt = dt.redistribute(mesh, [to_torch_placement(want)])
    return dt


def convert(x, have: Placement, want: Placement, mesh: DeviceMesh, *, use_local_output: bool,
            extent: Extent = None):
    """An activation from layout ``have`` (its own if it carries one) to ``want``.

    Plain in, plain out: the common sequence-parallel conversions are one devmesh collective
    (Shard -> Replicate: all-gather, with a slice as backward; Replicate -> Shard: a slice,
    with an all-gather as backward; Partial -> Replicate: all-reduce); anything else goes
    through torch's redistribution. With ``use_local_output=False`` the result is a DTensor."""
    if not isinstance(x, torch.Tensor) and not is_global(x):
        return x
    have = layout_of(x, have)
    if not use_local_output or is_global(x):
        dt = as_dtensor(x, mesh, have, extent)
        if not _same(have, want, dt.ndim):
            dt = dt.redistribute(mesh, [to_torch_placement(want)])
        return dt.to_local() if use_local_output else dt
    if _same(have, want, x.ndim):
        return x
    if isinstance(have, Shard) and isinstance(want, Replicate):
        return PF.gather_replicated(x, mesh, have.dim, _length(extent, have, x.ndim))
    if isinstance(have, Replicate) and isinstance(want, Shard):
        return PF.split_replicated(x, mesh, want.dim, _length(extent, want, x.ndim))
    if isinstance(have, Partial) and have.reduce_op == "sum" and isinstance(want, Replicate):
        return PF.reduce_from_parallel(x, mesh)
    if isinstance(have, Partial) and have.reduce_op == "sum" and isinstance(want, Shard):
        return PF.reduce_scatter_from_parallel(x, mesh, want.dim)
    return convert(x, have, want, mesh, use_local_output=False, extent=extent).to_local()
