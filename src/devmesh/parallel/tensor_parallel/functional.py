"""Autograd functions for activations in tensor/sequence parallelism (Megatron's f and g).

Activations are plain tensors; their layout is implied by the module plan. Each function here
is one redistribution of this rank's block along the tensor-parallel mesh — one collective in
forward and its dual in backward, chosen by who consumes the result — run by the same planned
executor as every other redistribution (:func:`devmesh.tensor.redistribute.redistribute_local`),
so its collectives, padding and copies are those the planner predicts and ``comm_stats``
counts:

* ``copy_to_parallel``: identity forward, all-reduce backward (a replicated input feeding
  column-sharded weights produces partial input-gradients);
* ``reduce_from_parallel``: all-reduce forward (partial sums of a row-sharded matmul), identity
  backward;
* ``gather_for_parallel(dim)``: all-gather forward (sequence-parallel input to a column-sharded
  matmul), reduce-scatter backward;
* ``reduce_scatter_from_parallel(dim)``: reduce-scatter forward (row-sharded matmul into a
  sequence-parallel region), all-gather backward;
* ``gather_replicated(dim)``: all-gather forward for replicated consumers, slice backward;
* ``split_replicated(dim)``: slice forward, all-gather backward.

Activations split along a sequence dim must split evenly (checked where this rank can see it).
The two ``*_replicated`` functions also take the global ``size`` of ``dim``: a feature dim
follows the weight's split, which is uneven as ``torch.chunk`` makes it when the degree does
not divide the features (7 output features on 4 ranks: 2, 2, 2, 1; 6: 2, 2, 2, 0); the
executor pads each rank's block to the largest for the all-gather and cuts it back after.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from devmesh.errors import ParallelizeError
from devmesh.layout.spec import ShardingSpec
from devmesh.mesh import DeviceMesh
from devmesh.tensor.redistribute import redistribute_local

__all__ = [
    "copy_to_parallel", "reduce_from_parallel", "gather_for_parallel",
    "reduce_scatter_from_parallel", "gather_replicated", "split_replicated",
]


def _check_divisible(t: torch.Tensor, dim: int, k: int, what: str) -> None:
    if t.shape[dim] % k:
        raise ParallelizeError(
            f"{what}: dim {dim} of size {t.shape[dim]} must be divisible by the tensor-parallel "
            f"degree {k} (pad the sequence or choose another degree)"
        )


_REPLICATE, _PARTIAL = "replicate", "partial"


def _spec(mesh: DeviceMesh, shape: Sequence[int], layout: int | str) -> ShardingSpec:
    """The layout of a tensor of global ``shape`` over the mesh's first dim: split along tensor
    dim ``layout``, ``"replicate"`` or ``"partial"`` (summed)."""
    return _cached_spec(tuple(mesh.shape), tuple(shape), layout)


@functools.lru_cache(maxsize=1024)
def _cached_spec(mesh_shape: tuple[int, ...], shape: tuple[int, ...], layout: int | str
                 ) -> ShardingSpec:
    """A spec is checked when made (~30 us): an activation of a given shape and layout is
    made once, not at every layer of every step."""
    dim_map: list[tuple[int, ...]] = [()] * len(shape)
    if isinstance(layout, int):
        dim_map[layout] = (0,)
    return ShardingSpec(mesh_shape, shape, tuple(dim_map),
                        partial=((0, "sum"),) if layout == _PARTIAL else ())


def _move(x: torch.Tensor, mesh: DeviceMesh, shape: Sequence[int], src: int | str,
          dst: int | str, grad: int | str | None = None) -> torch.Tensor:
    """This rank's block of a tensor of global ``shape`` moved from layout ``src`` to ``dst``;
    the gradient arrives as ``grad`` (default: ``dst``, partial read as replicated)."""
    return redistribute_local(x, mesh, _spec(mesh, shape, src), _spec(mesh, shape, dst),
                              None if grad is None else _spec(mesh, shape, grad))


def _gathered_shape(x: torch.Tensor, dim: int, k: int, size: int | None) -> list[int]:
    shape = list(x.shape)
    shape[dim] = shape[dim] * k if size is None else size
    return shape


def copy_to_parallel(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    if mesh.size() == 1:
        return x
    return _move(x, mesh, x.shape, _REPLICATE, _REPLICATE, grad=_PARTIAL)


def reduce_from_parallel(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return _move(x, mesh, x.shape, _PARTIAL, _REPLICATE) if mesh.size() > 1 else x


def gather_for_parallel(x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    if mesh.size() == 1:
        return x
    dim %= x.ndim
    shape = _gathered_shape(x, dim, mesh.size(), None)
    return _move(x, mesh, shape, dim, _REPLICATE, grad=_PARTIAL)


def reduce_scatter_from_parallel(x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    if mesh.size() == 1:
        return x
    dim %= x.ndim
    _check_divisible(x, dim, mesh.size(), "reduce-scatter")
    return _move(x, mesh, x.shape, _PARTIAL, dim)


def gather_replicated(x: torch.Tensor, mesh: DeviceMesh, dim: int, size: int | None = None
                      ) -> torch.Tensor:
    """The whole of ``x`` from every rank's block along ``dim``; ``size``, the whole's length
    there, where the blocks may be uneven."""
    if mesh.size() == 1:
        return x
    dim %= x.ndim
    return _move(x, mesh, _gathered_shape(x, dim, mesh.size(), size), dim, _REPLICATE)


def split_replicated(x: torch.Tensor, mesh: DeviceMesh, dim: int, size: int | None = None
                     ) -> torch.Tensor:
    """This rank's block of ``x`` along ``dim``: even unless ``size`` (``x``'s length there) is
    given, then as ``torch.chunk`` cuts it."""
    if mesh.size() == 1:
        return x
    dim %= x.ndim
    if size is None:
        _check_divisible(x, dim, mesh.size(), "split")
    elif x.shape[dim] != size:
        raise ParallelizeError(
            f"split: dim {dim} has size {x.shape[dim]}, but the module's weight is split from "
            f"{size} (give the module an input of the size it was built for)"
        )
    return _move(x, mesh, x.shape, _REPLICATE, dim)
