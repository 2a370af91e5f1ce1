"""Helpers that need the global picture of sharded parameters: they read the attached spec.

* ``clip_grad_norm_``: the total gradient norm over all shards (each mesh dim that splits a
  parameter is summed over once; replicated dims are not double counted), then scaling;
* ``state_dict(model, full=True)``: full tensors on every rank (one collective per sharded
  parameter), or ``full=False``: ``ShardedTensor``s without communication;
  ``load_state_dict(model, state)`` puts full tensors back, each rank taking its block;
* ``describe(model)``: every parameter's global shape, spec, local shape and bytes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from devmesh import comm
from devmesh.layout import format_ranks
from devmesh.errors import StateDictError
from devmesh.parallel.param import ParallelizeError, as_sharded, get_layout
from devmesh.tensor import ShardedTensor

__all__ = ["clip_grad_norm_", "state_dict", "load_state_dict", "prepare_load", "apply_load",
           "local_block", "describe"]


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


def state_dict(model: nn.Module, *, full: bool = True) -> dict[str, torch.Tensor | ShardedTensor]:
    """Parameters and buffers by name: full tensors (``full=True``) or ShardedTensors. A tied
    parameter appears under every name it has, as in ``nn.Module.state_dict()``."""
    out: dict[str, torch.Tensor | ShardedTensor] = {}
    done: dict[int, torch.Tensor | ShardedTensor] = {}  # tied parameters: gathered once
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in done:
            out[name] = done[id(p)]  # an alias key, as nn.Module.state_dict() lists it
            continue
        sharded = as_sharded(p)
        if sharded is None:
            out[name] = p.detach().clone()
        elif full:
            out[name] = sharded.full_tensor().reshape(_global_shape(p, sharded))
        else:
            out[name] = sharded
        done[id(p)] = out[name]
    for name, b in model.named_buffers():
        out[name] = b.detach().clone()
    return out


def local_block(param: nn.Parameter, full: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """This rank's block of ``full``, a tensor laid out like ``param`` (its global shape)."""
    layout = get_layout(param)
    if layout is None:
        return full
    expected = tuple(layout.spec.global_shape)
    if tuple(full.shape) != expected:
        raise ParallelizeError(f"{name} has shape {tuple(full.shape)}, the model's full "
                               f"parameter is {expected}")
    for d, (start, size) in enumerate(layout.spec.local_bounds(layout.mesh.get_coordinate())):
        full = full.narrow(d, start, size)
    return full


def _persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``nn.Module.state_dict()`` saves (non-persistent ones excluded)."""
    out = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buffer
    return out


def prepare_load(model: nn.Module, state: Mapping[str, Any], *, strict: bool = True
                 ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], _IncompatibleKeys]:
    """Check ``state`` against ``model`` and compute this rank's block of every entry,
    changing nothing: ``(writes, incompatible keys)``, where ``writes`` pairs each target
    tensor with the value to copy into it. Raises :class:`StateDictError` (torch's wording)
    on a missing or unexpected key (``strict``), a shape that differs (exactly: no reshaping)
    or a value that is not a tensor."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = _persistent_buffers(model)
    expected = set(params) | set(buffers)
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    problems = []
    if strict and unexpected:
        problems.append("Unexpected key(s) in state_dict: " + ", ".join(map(repr, unexpected)))
    if strict and missing:
        problems.append("Missing key(s) in state_dict: " + ", ".join(map(repr, missing)))
    writes: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name in sorted(expected & set(state)):
        value = state[name]
        if isinstance(value, ShardedTensor):
            value = value.full_tensor()
        if not isinstance(value, torch.Tensor):
            problems.append(f"{name} is a {type(value).__name__}, not a tensor")
            continue
        target = params.get(name, buffers.get(name))
        sharded = as_sharded(target) if name in params else None
        shape = _global_shape(target, sharded) if sharded is not None else tuple(target.shape)
        if tuple(value.shape) != shape:
            problems.append(
                f"size mismatch for {name}: copying a param with shape {tuple(value.shape)} "
                f"from checkpoint, the shape in current model is {shape}"
            )
            continue
        block = local_block(target, value.reshape(sharded.shape) if sharded else value, name)
        writes.append((target, block.reshape(target.shape)))
    if problems:
        raise StateDictError(
            f"Error(s) in loading state_dict for {type(model).__name__}: " + "; ".join(problems)
            + ". Nothing was loaded; the state must come from the same model"
            + ("" if strict else " (shapes must match even with strict=False)")
        )
    return writes, _IncompatibleKeys(missing, unexpected)


def apply_load(writes: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for target, value in writes:
            target.copy_(value)


def load_state_dict(model: nn.Module, state: Mapping[str, Any], *, strict: bool = True
                    ) -> _IncompatibleKeys:
    """Load full tensors (as ``state_dict(full=True)`` returns, or a plain single-process
    ``state_dict()``) or ShardedTensors into a parallelized model: every rank copies its own
    block, no communication. All or nothing: parameters and buffers are all checked (names,
    exact shapes) before the first copy. ``strict=False`` loads what matches and returns
    the missing and unexpected keys, as ``nn.Module.load_state_dict`` does."""
    writes, incompatible = prepare_load(model, state, strict=strict)
    apply_load(writes)
    return incompatible


def _global_shape(p: nn.Parameter, sharded: ShardedTensor) -> tuple[int, ...]:
    shape = tuple(sharded.shape)
    return () if p.ndim == 0 and shape == (1,) else shape


def _shapes_by_rank(p: nn.Parameter) -> dict[int, tuple[int, ...]]:
    """Every rank's local shape of ``p``, computed from the spec (no communication)."""
    layout = get_layout(p)
    if layout is None:
        return {}
    out = {}
    for rank in layout.mesh.world_ranks():
        coordinate = layout.mesh.coordinate_of(rank)
        if coordinate is not None:
            out[rank] = layout.spec.local_shape(coordinate)
    return out


def describe(model: nn.Module, *, to_file: str | None = None) -> str:
    """A table of every parameter: global shape, spec, local shape on every rank, and the
    bytes each rank holds (from the specs, no communication); ``to_file`` draws the bytes per
    rank and parameter as a PNG."""
    rows = [("parameter", "global shape", "layout", "local shape (by rank)", "bytes here")]
    per_rank: dict[int, int] = defaultdict(int)
    by_param: dict[str, dict[int, int]] = {}
    total_global = 0
    for name, p in model.named_parameters():
        layout = get_layout(p)
        global_shape = tuple(layout.spec.global_shape) if layout else tuple(p.shape)
        what = str(layout.spec).split(": ", 1)[1] if layout else "not distributed"
        total_global += math.prod(global_shape) * p.element_size()
        shapes = _shapes_by_rank(p)
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for rank, shape in shapes.items():
            groups[shape].append(rank)
            per_rank[rank] += math.prod(shape) * p.element_size()
        by_param[name] = {r: math.prod(sh) * p.element_size() for r, sh in shapes.items()}
        if len(groups) <= 1:
            local = f"{tuple(p.shape)} on every rank"
        else:
            local = "; ".join(f"{shape} on {format_ranks(ranks)}"
                              for shape, ranks in sorted(groups.items(), key=lambda g: min(g[1])))
        rows.append((name, str(global_shape), what, local, f"{p.numel() * p.element_size():,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if per_rank:
        by_total: dict[int, list[int]] = defaultdict(list)
        for rank, nbytes in per_rank.items():
            by_total[nbytes].append(rank)
        lines.append("bytes per rank: " + "; ".join(
            f"{nbytes:,} on {format_ranks(ranks)}"
            for nbytes, ranks in sorted(by_total.items(), key=lambda g: min(g[1])))
            + f" (the full model: {total_global:,})")
    if to_file:
        _describe_png(by_param, sorted(per_rank), to_file)
    return "\n".join(lines)


def _describe_png(by_param: dict[str, dict[int, int]], ranks: list[int], path: str) -> None:
    from devmesh._files import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 1 + 0.6 * len(ranks)), 4.5))
    bottom = [0] * len(ranks)
    for name, sizes in by_param.items():
        heights = [sizes.get(r, 0) for r in ranks]
        ax.bar([str(r) for r in ranks], heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xlabel("rank")
    ax.set_ylabel("parameter bytes")
    ax.set_title("parameter bytes held by each rank")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    save_figure(fig, path)
