"""The global gradient norm of a parallelized model, and clipping by it.

Each mesh dim that splits a parameter is summed over once; replicated dims are not double
counted; the result is the same on every rank and in the gradients' dtype, as torch's.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn

from devmesh.distributed import comm
from devmesh.parallel.param import get_layout

__all__ = ["clip_grad_norm_", "grad_norm_power", "clip_by_norm"]


def clip_grad_norm_(parameters: Iterable[nn.Parameter] | nn.Module, max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients by their global norm; returns the norm (same value on every rank)."""
    params = list(parameters.parameters() if isinstance(parameters, nn.Module) else parameters)
    grads = [p for p in params if p.grad is not None]
    return clip_by_norm(grads, grad_norm_power(grads, norm_type), max_norm, norm_type)


def grad_norm_power(params: Iterable[nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
    """The sum of ``|g| ** norm_type`` over the global gradients of ``params`` (the largest
    ``|g|`` for the inf norm), in float64, the same on every rank of the params' meshes: a
    shard's part is reduced over the mesh dims that split it, replicated dims are counted
    once. Add (or max) the results of disjoint sets of parameters, then :func:`clip_by_norm`."""
    infinite = norm_type == math.inf
    groups: dict[tuple, list[nn.Parameter]] = defaultdict(list)
    meshes = {}
    for p in params:
        if p.grad is None:
            continue
        layout = get_layout(p)
        if layout is None:
            groups[("local",)].append(p)
            continue
        dims = tuple(sorted(m for d in layout.spec.dim_map for m in d))
        key = (repr(layout.mesh), dims)
        meshes[key] = layout.mesh
        groups[key].append(p)
    total = torch.zeros((), dtype=torch.float64)
    for key in sorted(groups, key=repr):
        magnitudes = [p.grad.detach().double().abs() for p in groups[key]]
        if infinite:
            part = max((g.max() for g in magnitudes if g.numel()), default=torch.tensor(0.0))
        else:
            part = sum((g ** norm_type).sum() for g in magnitudes)
        part = torch.as_tensor(part, dtype=torch.float64).reshape(1)
        if key != ("local",) and key[1]:
            comm.all_reduce(part, meshes[key], key[1], "max" if infinite else "sum")
        total = torch.maximum(total, part[0]) if infinite else total + part[0]
    return total


def clip_by_norm(params: Iterable[nn.Parameter], power: torch.Tensor, max_norm: float,
                 norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of ``params`` so that the norm whose :func:`grad_norm_power` is
    ``power`` becomes at most ``max_norm``; returns that norm in the gradients' dtype."""
    grads = [p for p in params if p.grad is not None]
    norm = power if norm_type == math.inf else power ** (1.0 / norm_type)
    coef = max_norm / (float(norm) + 1e-6)
    if coef < 1:
        for p in grads:
            p.grad.detach().mul_(coef)
    return norm.to(grads[0].grad.dtype if grads else torch.float32)  # torch: the grads' dtype
