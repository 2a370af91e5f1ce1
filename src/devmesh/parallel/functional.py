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
"""

from __future__ import annotations

import torch

from devmesh import comm
from devmesh.mesh import DeviceMesh
from devmesh.parallel.param import ParallelizeError

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


def _gather(t: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    stacked = comm.all_gather(t.contiguous(), mesh, (0,))
    return torch.cat(list(stacked.unbind(0)), dim=dim)


def _reduce_scatter(t: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    k = mesh.size()
    _check_divisible(t, dim, k, "reduce-scatter")
    stacked = torch.stack(t.chunk(k, dim=dim))
    return comm.reduce_scatter(stacked, mesh, (0,), "sum")


def _split(t: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    k = mesh.size()
    _check_divisible(t, dim, k, "split")
    return t.chunk(k, dim=dim)[mesh.get_local_rank()].contiguous()


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh):  # type: ignore[override]
        ctx.mesh = mesh
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return comm.all_reduce(grad.contiguous().clone(), ctx.mesh, (0,)), None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh):  # type: ignore[override]
        return comm.all_reduce(x.contiguous().clone(), mesh, (0,))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


class _GatherForParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, dim):  # type: ignore[override]
        ctx.mesh, ctx.dim = mesh, dim
        return _gather(x, mesh, dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _reduce_scatter(grad, ctx.mesh, ctx.dim), None, None


class _ReduceScatterFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, dim):  # type: ignore[override]
        ctx.mesh, ctx.dim = mesh, dim
        return _reduce_scatter(x, mesh, dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _gather(grad, ctx.mesh, ctx.dim), None, None


class _GatherReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, dim):  # type: ignore[override]
        ctx.mesh, ctx.dim = mesh, dim
        return _gather(x, mesh, dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _split(grad, ctx.mesh, ctx.dim), None, None


class _SplitReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, dim):  # type: ignore[override]
        ctx.mesh, ctx.dim = mesh, dim
        return _split(x, mesh, dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _gather(grad, ctx.mesh, ctx.dim), None, None


def copy_to_parallel(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return _CopyToParallel.apply(x, mesh) if mesh.size() > 1 else x


def reduce_from_parallel(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return _ReduceFromParallel.apply(x, mesh) if mesh.size() > 1 else x


def gather_for_parallel(x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    return _GatherForParallel.apply(x, mesh, dim % x.ndim) if mesh.size() > 1 else x


def reduce_scatter_from_parallel(x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    return _ReduceScatterFromParallel.apply(x, mesh, dim % x.ndim) if mesh.size() > 1 else x


def gather_replicated(x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    return _GatherReplicated.apply(x, mesh, dim % x.ndim) if mesh.size() > 1 else x


def split_replicated(x: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    return _SplitReplicated.apply(x, mesh, dim % x.ndim) if mesh.size() > 1 else x
