"""The buffers of a ``fully_shard`` unit's two collectives, packed and unpacked.

A unit moves all of its parameters in **one** all-gather and all of its gradients in **one**
reduce-scatter, however many parameters (and dtypes) it holds: one collective per unit is
what makes FSDP's communication cheap. This module lays the parameters out in those buffers:

* all-gather: each rank sends a row of bytes holding its padded shard of every parameter,
  each segment aligned to the widest element size so it can be viewed as its own dtype (a
  float32 norm beside bfloat16 weights shares the gather);
* reduce-scatter: row ``j`` holds what peer ``j`` will own of every gradient, then one "used
  here" flag per parameter, so a parameter no rank used keeps no gradient.

A parameter is split along one dim (dim 0 unless torch's ``shard_placement_fn`` chose
another); uneven sizes follow ``torch.chunk`` (:func:`devmesh.layout.spec.chunk_bounds`), and
shards are zero-padded to the largest chunk, since c10d's collectives take equal-sized pieces.
A shard is sent as its block's contiguous bytes, so a block cut along dim 1 arrives as that
block and the full parameter is the blocks concatenated along dim 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from devmesh.layout.spec import chunk_bounds


@dataclass
class ShardedParam:
    """One parameter of a unit: this rank's shard and the places holding it."""

    places: list[tuple[nn.Module, str]]  # every module attribute holding it (tied weights)
    sharded: nn.Parameter
    full_shape: tuple[int, ...]  # the (TP-local) shape FSDP shards
    padded_rows: int  # the largest block's length along ``dim``
    shape: tuple[int, ...]  # the parameter's own shape (differs for 0-d parameters)
    dim: int = 0  # the dim FSDP splits (torch's ``shard_placement_fn``; dim 0 by default)
    # a parameter torch's tensor parallelism made (a DTensor): its mesh, placements, global
    # shape and stride, so its gathered block goes back into the module as that DTensor
    dtensor: tuple | None = None

    @property
    def slice_numel(self) -> int:
        """Elements per index of ``dim``."""
        return math.prod(n for i, n in enumerate(self.full_shape) if i != self.dim)

    @property
    def padded_numel(self) -> int:
        return self.padded_rows * self.slice_numel

    def in_place(self, full: torch.Tensor) -> torch.Tensor:
        """What the modules hold while ``full`` (the gathered parameter) is in place: a view
        of it, or, for a parameter torch's tensor parallelism made, the DTensor of that
        block (torch's styles compute with DTensors; its backward hands the block's
        gradient to the unit, reduced over the tensor-parallel ranks where torch's would)."""
        view = full.view(self.shape)
        if self.dtensor is None:
            return view
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = self.dtensor
        return DTensor.from_local(view, mesh, placements, run_check=False, shape=shape,
                                  stride=stride)

    def block_shape(self, length: int) -> tuple[int, ...]:
        """The shape of a block holding ``length`` indices of ``dim``."""
        return self.full_shape[:self.dim] + (length,) + self.full_shape[self.dim + 1:]


def gather_dtypes(params: list[ShardedParam], param_dtype: torch.dtype | None
                  ) -> list[torch.dtype]:
    """Each parameter's dtype when gathered: ``param_dtype`` (mixed precision) for a
    floating-point parameter, else its own — an integer parameter (a quantized weight, a
    table of ids) keeps its dtype and its exact values, as under torch's FSDP2."""
    return [param_dtype if param_dtype is not None and p.sharded.dtype.is_floating_point
            else p.sharded.dtype for p in params]


def _segments(params: list[ShardedParam], dtypes: list[torch.dtype]) -> tuple[list[int], int]:
    """Byte offset of each parameter's padded shard in a rank's row of the gather buffer, and
    the row's length; every segment starts at a multiple of the widest element size."""
    align = max(d.itemsize for d in dtypes)
    offsets, end = [], 0
    for p, dtype in zip(params, dtypes, strict=True):
        offsets.append(end)
        end += -(-p.padded_numel * dtype.itemsize // align) * align
    return offsets, end


def _meta_or_default(tensors: list[torch.Tensor | None]) -> torch.device | None:
    """``meta`` when the tensors are (a dry run computes shapes only), else the default
    device, where the collective wrappers pick the buffers up."""
    return torch.device("meta") if any(t is not None and t.is_meta for t in tensors) else None


def pack_shards(params: list[ShardedParam], shards: list[torch.Tensor],
                dtypes: list[torch.dtype]) -> torch.Tensor:
    """This rank's row of the all-gather: each shard copied once, straight into place (and
    cast on the way), its padding zeroed."""
    offsets, row_bytes = _segments(params, dtypes)
    buffer = torch.empty(row_bytes, dtype=torch.uint8, device=_meta_or_default(shards))
    for p, shard, dtype, start in zip(params, shards, dtypes, offsets, strict=True):
        segment = buffer[start: start + p.padded_numel * dtype.itemsize].view(dtype)
        n = shard.numel()
        segment[:n].copy_(shard.detach().reshape(-1))
        segment[n:].zero_()
    return buffer


def unpack_gathered(params: list[ShardedParam], stacked: torch.Tensor,
                    dtypes: list[torch.dtype], k: int) -> list[torch.Tensor]:
    """The full parameters from the gathered rows (one per rank, padding dropped)."""
    offsets, _ = _segments(params, dtypes)
    out = []
    for p, dtype, start in zip(params, dtypes, offsets, strict=True):
        nbytes_per_row = p.slice_numel * dtype.itemsize
        if p.dim == 0 and p.padded_rows * k == p.full_shape[0] and p.padded_numel:
            # every rank's block is whole (no padding): the rows' segments, read in order,
            # are the parameter: one copy, no block by block
            segment = stacked[:, start: start + p.padded_numel * dtype.itemsize]
            out.append(segment.contiguous().view(dtype).view(p.full_shape))
            continue
        blocks = []
        for j in range(k):
            size = chunk_bounds(p.full_shape[p.dim], k, j)[1]
            if size * nbytes_per_row == 0:  # an empty block: a zero-byte row's offset need
                continue                    # not be aligned, so it cannot be viewed
            blocks.append(stacked[j, start: start + size * nbytes_per_row].view(dtype)
                          .view(p.block_shape(size)))
        if not blocks:
            out.append(torch.zeros(p.full_shape, dtype=dtype, device=stacked.device))
        elif p.dim == 0:  # the blocks are consecutive rows: one copy
            out.append(torch.cat([b.reshape(-1) for b in blocks]).view(p.full_shape))
        else:
            out.append(torch.cat(blocks, dim=p.dim))
    return out


def pack_gradients(params: list[ShardedParam], grads: list[torch.Tensor | None], k: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """The reduce-scatter's input: row ``j`` for peer ``j``, each gradient copied (and cast)
    once into place, then one flag per parameter (1: this rank has a gradient for it)."""
    total = sum(p.padded_numel for p in params)
    stacked = torch.empty(k, total + len(params), dtype=dtype, device=_meta_or_default(grads))
    stacked[:, total:] = torch.tensor([float(g is not None) for g in grads], dtype=dtype)
    offset = 0
    for p, grad in zip(params, grads, strict=True):
        row = p.slice_numel
        for j in range(k):
            start, size = chunk_bounds(p.full_shape[p.dim], k, j)
            target = stacked[j, offset: offset + p.padded_numel]
            if grad is None:
                target.zero_()
                continue
            target[: size * row].view(p.block_shape(size)).copy_(
                grad.narrow(p.dim, start, size))
            target[size * row:].zero_()
        offset += p.padded_numel
    return stacked


def gradient_numel(params: list[ShardedParam]) -> int:
    """Where the flags start in a row of :func:`pack_gradients`."""
    return sum(p.padded_numel for p in params)


def unpack_reduced(params: list[ShardedParam], mine: torch.Tensor, k: int, index: int,
                   unused_as_zeros: bool = False) -> list[torch.Tensor | None]:
    """This rank's reduced gradient of each parameter, in the parameter's dtype and shape;
    ``None`` for one no rank had a gradient for (its flag summed to zero; zeros instead for
    a trainable one with ``unused_as_zeros``, torch's ``set_reduce_scatter_unused_params``). A
    unit holding a complex parameter reduces in a complex dtype; a real parameter takes the
    real part."""
    flags = mine[gradient_numel(params):]
    if flags.is_meta:  # a dry run (devmesh.tools.dry_run): no values; every gradient counts
        used = [1.0] * len(params)
    else:
        used = (flags.real if flags.is_complex() else flags).tolist()
    out: list[torch.Tensor | None] = []
    offset = 0
    for p, used_somewhere in zip(params, used, strict=True):
        size = chunk_bounds(p.full_shape[p.dim], k, index)[1]
        local = mine[offset: offset + size * p.slice_numel].view(p.block_shape(size))
        if local.is_complex() and not p.sharded.dtype.is_complex:
            local = local.real
        zeros = unused_as_zeros and p.sharded.requires_grad  # a frozen one: never a gradient
        out.append(local.to(p.sharded.dtype).view(p.sharded.shape)
                   if used_somewhere > 0 or zeros else None)
        offset += p.padded_numel
    return out
