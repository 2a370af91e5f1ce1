"""The global gradient norm of a parallelized model, and clipping by it.

Each mesh dim that splits a parameter is summed over once; replicated dims are not double
counted; the result is the same on every rank and in the gradients' dtype, as torch's.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn

from devmesh.distributed import comm
from devmesh.parallel.param import ParallelizeError, get_layout, laid_out_parameters

__all__ = ["clip_grad_norm_", "get_total_norm", "grad_norm_power", "reduce_norm_power",
           "clip_by_norm", "checked_norm_type", "route_torchs_clip_grad_norm"]


def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor | nn.Module,
                    max_norm: float, norm_type: float | str = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None
                    ) -> torch.Tensor:
    """Clip gradients by their global norm; returns the norm (same value on every rank).

    torch's signature, so code written for ``torch.nn.utils.clip_grad_norm_`` runs unchanged:
    ``error_if_nonfinite`` raises (on every rank alike, as the norm is global) when the norm
    is inf or nan; ``foreach`` is accepted and has no effect (the scaling is one multiply per
    local gradient either way)."""
    if isinstance(parameters, torch.Tensor):
        params = [parameters]
    else:
        params = list(parameters.parameters() if isinstance(parameters, nn.Module)
                      else parameters)
    grads = [p for p in params if p.grad is not None]
    norm_type = checked_norm_type(norm_type)
    return clip_by_norm(grads, grad_norm_power(grads, norm_type), float(max_norm), norm_type,
                        error_if_nonfinite)


def get_total_norm(tensors: Iterable[torch.Tensor] | torch.Tensor,
                   norm_type: float | str = 2.0, error_if_nonfinite: bool = False,
                   foreach: bool | None = None) -> torch.Tensor:
    """The norm of ``tensors`` viewed as one vector, where the gradients of parameters devmesh
    laid out count as the whole gradients they are blocks of (the same value on every rank).

    torch's ``torch.nn.utils.get_total_norm`` on the gradients, as torchtitan's
    ``clip_grad_norm_`` and transformers' ``Trainer`` call it before
    ``clip_grads_with_norm_``: a gradient of a devmesh parameter (found among the live
    parameters devmesh laid out) is reduced over the mesh dims that split it, any other
    tensor counts as it is. ``foreach`` is accepted and has no effect."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    norm_type = checked_norm_type(norm_type)
    owners = _gradient_owners(tensors)
    power = grad_norm_power(list(owners.values()), norm_type)
    rest = [t.detach().double().abs() for t in tensors if id(t) not in owners]
    if rest:
        if norm_type == math.inf:
            maxima = [r.max() for r in rest if r.numel()]
            if maxima:
                power = torch.maximum(power, torch.stack(maxima).max())
        else:
            power = power + sum((r ** norm_type).sum() for r in rest)
    norm = _norm_of(power, norm_type, error_if_nonfinite)
    return norm.to(tensors[0].dtype)  # torch's: the tensors' dtype


def _gradient_owners(tensors: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """``id(tensor) -> parameter`` for each of ``tensors`` that is the gradient of a
    parameter devmesh laid out, in the order given (the registry's order varies from run
    to run; the norm's sums must not)."""
    by_grad = {id(p.grad): p for p in laid_out_parameters() if p.grad is not None}
    return {id(t): by_grad[id(t)] for t in tensors if id(t) in by_grad}


_torchs: dict[str, object] = {}  # torch's own clip_grad_norm_ and get_total_norm, once routed


def route_torchs_clip_grad_norm() -> None:
    """Make ``torch.nn.utils.clip_grad_norm_`` and ``torch.nn.utils.get_total_norm`` measure
    a model devmesh sharded by its global norm (idempotent). Code written for torch's FSDP2
    calls torch's: there the gradients are DTensors and the norm is global, but a
    devmesh-sharded parameter's gradient is this rank's block, so torch's would clip each
    rank by the norm of its own blocks — training silently unlike one process. Parameters
    with a devmesh layout among those given (or their gradients, for ``get_total_norm``)
    send the call to :func:`clip_grad_norm_` or :func:`get_total_norm`; any other call is
    torch's own, unchanged."""
    if _torchs:
        return
    import torch.nn.utils as utils
    from torch.nn.utils import clip_grad

    torchs_clip = _torchs["clip_grad_norm_"] = clip_grad.clip_grad_norm_
    torchs_total = _torchs["get_total_norm"] = utils.get_total_norm

    @functools.wraps(torchs_clip)
    def routed_clip(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                    foreach=None):
        params = ([parameters] if isinstance(parameters, torch.Tensor)
                  else list(parameters))  # a generator is read once
        if any(get_layout(p) is not None for p in params):
            return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
        return torchs_clip(params, max_norm, norm_type, error_if_nonfinite, foreach)

    @functools.wraps(torchs_total)
    def routed_total(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if _gradient_owners(tensors):
            return get_total_norm(tensors, norm_type, error_if_nonfinite, foreach)
        return torchs_total(tensors, norm_type, error_if_nonfinite, foreach)

    for routed in (routed_clip, routed_total):
        routed.__devmesh_routed__ = True  # type: ignore[attr-defined]
    for module in (utils, clip_grad):
        if getattr(module, "clip_grad_norm_", None) is torchs_clip:
            module.clip_grad_norm_ = routed_clip
        if getattr(module, "get_total_norm", None) is torchs_total:
            module.get_total_norm = routed_total


def checked_norm_type(norm_type: float | str) -> float:
    """``norm_type`` as a float, refused unless positive (the same on every rank: call it
    before any collective). torch's 0 counts the tensors with a nonzero gradient and its
    -inf takes the smallest magnitude: neither is a norm to clip by."""
    value = float(norm_type)
    if not value > 0:
        raise ParallelizeError(
            f"clip_grad_norm_ takes a positive norm_type (1, 2, ... or inf), got {value}: "
            "torch's 0 counts the tensors with a nonzero gradient and -inf takes the "
            "smallest magnitude, neither a norm to clip a sharded model's gradients by")
    return value


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
        if infinite:  # torch.max and torch.maximum keep a nan, as torch's norm does
            maxima = [g.max() for g in magnitudes if g.numel()]
            part = torch.stack(maxima).max() if maxima else torch.tensor(0.0)
        else:
            part = sum((g ** norm_type).sum() for g in magnitudes)
        part = torch.as_tensor(part, dtype=torch.float64)
        if key != ("local",) and key[1]:
            part = reduce_norm_power(part, meshes[key], key[1], norm_type)
        total = torch.maximum(total, part) if infinite else total + part
    return total


def reduce_norm_power(power: torch.Tensor, mesh, dims: tuple[int, ...], norm_type: float
                      ) -> torch.Tensor:
    """Combine ranks' :func:`grad_norm_power` parts over the mesh ``dims``: a sum, or for the
    inf norm a max that keeps a nan (a max all-reduce alone would drop it on some ranks and
    not others; the nan travels as a flag in the same collective)."""
    if norm_type != math.inf:
        summed = power.reshape(1).clone()
        comm.all_reduce(summed, mesh, dims, "sum")  # a nan or inf sums to itself
        return summed[0]
    nan = torch.isnan(power)
    pair = torch.stack([torch.where(nan, math.inf, power), nan.double()])
    comm.all_reduce(pair, mesh, dims, "max")
    return torch.where(pair[1] > 0, math.nan, pair[0])


def clip_by_norm(params: Iterable[nn.Parameter], power: torch.Tensor, max_norm: float,
                 norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale the gradients of ``params`` so that the norm whose :func:`grad_norm_power` is
    ``power`` becomes at most ``max_norm``; returns that norm in the gradients' dtype. As
    torch: a nan norm makes every gradient nan and an inf one zeroes them, unless
    ``error_if_nonfinite``."""
    grads = [p for p in params if p.grad is not None]
    norm = _norm_of(power, norm_type, error_if_nonfinite)
    coef = max_norm / (float(norm) + 1e-6)
    if not coef >= 1:  # nan included, as torch's clamp(coef, max=1) keeps it
        for p in grads:
            p.grad.detach().mul_(coef)
    return norm.to(grads[0].grad.dtype if grads else torch.float32)  # torch: the grads' dtype


def _norm_of(power: torch.Tensor, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
    """The norm whose :func:`grad_norm_power` is ``power``; with ``error_if_nonfinite``
    torch's error where it is inf or nan (raised on every rank alike: the power is global)."""
    norm = power if norm_type == math.inf else power ** (1.0 / norm_type)
    if error_if_nonfinite and not math.isfinite(float(norm)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    return norm
