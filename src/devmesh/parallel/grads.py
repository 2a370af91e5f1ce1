"""The global gradient norm of a parallelized model, and clipping by it.

Each mesh dim that splits a parameter is summed over once; replicated dims are not double
counted; the result is the same on every rank and in the gradients' dtype, as torch's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn

from devmesh.distributed import comm
from devmesh.parallel.param import get_layout

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(parameters: Iterable[nn.Parameter] | nn.Module, max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients by their global norm; returns the norm (same value on every rank)."""
    params = list(parameters.parameters() if isinstance(parameters, nn.Module) else parameters)
    grads = [p for p in params if p.grad is not None]
    groups: dict[tuple, list[nn.Parameter]] = defaultdict(list)
    meshes = {}
    for p in grads:
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
        part = sum((p.grad.detach().double().abs() ** norm_type).sum() for p in groups[key])
        part = torch.as_tensor(part, dtype=torch.float64).reshape(1)
        if key != ("local",) and key[1]:
            comm.all_reduce(part, meshes[key], key[1])
        total += part[0]
    norm = total ** (1.0 / norm_type)
    coef = max_norm / (float(norm) + 1e-6)
    if coef < 1:
        for p in grads:
            p.grad.detach().mul_(coef)
    return norm.to(grads[0].grad.dtype if grads else torch.float32)  # torch: the grads' dtype
