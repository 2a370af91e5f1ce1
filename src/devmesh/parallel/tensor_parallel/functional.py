"""Autograd functions for activations in tensor/sequence parallelism (Megatron's f and g).

Activations are plain tensors; their layout is implied by the module plan. Each function here
is one collective in forward and its dual in backward, chosen by who consumes the result:

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
not divide the features (7 output features on 4 ranks: 2, 2, 2, 1; 6: 2, 2, 2, 0), so each
rank's block is padded to the largest for the all-gather and cut back after it.
"""

from __future__ import annotations

import torch

from devmesh.distributed import comm
from devmesh.mesh import DeviceMesh
from devmesh.errors import ParallelizeError
from devmesh.layout.spec import chunk_bounds

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


def _gather(t: torch.Tensor, mesh: DeviceMesh, dim: int, size: int | None = None
            ) -> torch.Tensor:
    k = mesh.size()
    if size is None or size % k == 0:
        stacked = comm.all_gather(t.contiguous(), mesh, (0,))
        return torch.cat(list(stacked.unbind(0)), dim=dim)
    block = -(-size // k)
    padding = list(t.shape)
    padding[dim] = block - t.shape[dim]
    stacked = comm.all_gather(torch.cat([t, t.new_zeros(padding)], dim=dim), mesh, (0,))
    return torch.cat([piece.narrow(dim, 0, chunk_bounds(size, k, i)[1])
                      for i, piece in enumerate(stacked.unbind(0))], dim=dim)


def _reduce_scatter(t: torch.Tensor, mesh: DeviceMesh, dim: int, size: None = None
                    ) -> torch.Tensor:
    k = mesh.size()
    _check_divisible(t, dim, k, "reduce-scatter")
    stacked = torch.stack(t.chunk(k, dim=dim))
    return comm.reduce_scatter(stacked, mesh, (0,), "sum")


def _split(t: torch.Tensor, mesh: DeviceMesh, dim: int, size: int | None = None
           ) -> torch.Tensor:
    k = mesh.size()
    if size is None:
        _check_divisible(t, dim, k, "split")
        return t.chunk(k, dim=dim)[mesh.get_local_rank()].contiguous()
    if t.shape[dim] != size:
        raise ParallelizeError(
            f"split: dim {dim} has size {t.shape[dim]}, but the module's weight is split from "
            f"{size} (give the module an input of the size it was built for)"
        )
    start, length = chunk_bounds(size, k, mesh.get_local_rank())
    return t.narrow(dim, start, length).contiguous()


def _all_reduce(t: torch.Tensor, mesh: DeviceMesh, dim: int, size: None = None
                ) -> torch.Tensor:
    return comm.all_reduce(t.contiguous().clone(), mesh, (0,))


def _identity(t: torch.Tensor, mesh: DeviceMesh, dim: int, size: None = None
              ) -> torch.Tensor:
    return t.view_as(t)


def _dual(name: str, forward, backward) -> type[torch.autograd.Function]:
    """An autograd function running ``forward(x, mesh, dim, size)`` and, on the way back,
    ``backward(grad, mesh, dim, size)``."""

    def fwd(ctx, x, mesh, dim, size):
        ctx.mesh, ctx.dim, ctx.size = mesh, dim, size
        return forward(x, mesh, dim, size)

    def bwd(ctx, grad):
        return backward(grad, ctx.mesh, ctx.dim, ctx.size), None, None, None

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


_CopyToParallel = _dual("_CopyToParallel", _identity, _all_reduce)
_ReduceFromParallel = _dual("_ReduceFromParallel", _all_reduce, _identity)
_GatherForParallel = _dual("_GatherForParallel", _gather, _reduce_scatter)
_ReduceScatterFromParallel = _dual("_ReduceScatterFromParallel", _reduce_scatter, _gather)
_GatherReplicated = _dual("_GatherReplicated", _gather, _split)
_SplitReplicated = _dual("_SplitReplicated", _split, _gather)


def copy_to_parallel(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return _CopyToParallel.apply(x, mesh, 0, None) if mesh.size() > 1 else x


def reduce_from_parallel(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return _ReduceFromParallel.apply(x, mesh, 0, None) if mesh.size() > 1 else x


def gather_for_parallel(x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    return _GatherForParallel.apply(x, mesh, dim % x.ndim, None) if mesh.size() > 1 else x


def reduce_scatter_from_parallel(x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    if mesh.size() == 1:
        return x
    return _ReduceScatterFromParallel.apply(x, mesh, dim % x.ndim, None)


def gather_replicated(x: torch.Tensor, mesh: DeviceMesh, dim: int, size: int | None = None
                      ) -> torch.Tensor:
    """The whole of ``x`` from every rank's block along ``dim``; ``size``, the whole's length
    there, where the blocks may be uneven."""
    return _GatherReplicated.apply(x, mesh, dim % x.ndim, size) if mesh.size() > 1 else x


def split_replicated(x: torch.Tensor, mesh: DeviceMesh, dim: int, size: int | None = None
                     ) -> torch.Tensor:
    """This rank's block of ``x`` along ``dim``: even unless ``size`` (``x``'s length there) is
    given, then as ``torch.chunk`` cuts it."""
    return _SplitReplicated.apply(x, mesh, dim % x.ndim, size) if mesh.size() > 1 else x
