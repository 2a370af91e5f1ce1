"""Tensor parallelism: ``parallelize_module(module, mesh, plan)`` with torch's style names.

* ``ColwiseParallel``: ``nn.Linear`` weight and bias split on dim 0 (output features), or
  ``nn.Embedding`` split on the embedding dim; input replicated (or ``Shard(seq)`` for sequence
  parallelism), output sharded on the last dim (or gathered with ``output_layouts=Replicate()``).
* ``RowwiseParallel``: ``nn.Linear`` weight split on dim 1 (input features), bias replicated and
  added once after the reduction; ``nn.Embedding`` split on the vocabulary; input sharded on
  the last dim, output reduced to replicated (or reduce-scattered to ``Shard(seq)``).
* ``SequenceParallel``: norm/dropout layers run on the sequence shard; their replicated
  parameters' gradients are summed over the TP group.
* ``PrepareModuleInput`` / ``PrepareModuleOutput``: change activation layouts at a boundary.

Parameters become plain ``nn.Parameter``s holding this rank's block, with their spec attached
(:mod:`devmesh.parallel.param`); full weights are broadcast from the mesh's first rank before
splitting, as torch's ``distribute_tensor`` does. Activations stay plain tensors; the layouts in
a plan say what each boundary holds.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from devmesh import comm
from devmesh.mesh import DeviceMesh
from devmesh.parallel import functional as PF
from devmesh.parallel.param import ParallelizeError, mark_partial_grad, set_layout
from devmesh.tensor import Placement, Replicate, Shard, distribute_tensor
from devmesh.tensor.spec import chunk_bounds

__all__ = [
    "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
    "PrepareModuleInput", "PrepareModuleOutput", "parallelize_module",
]


def _distribute_param(module: nn.Module, name: str, mesh: DeviceMesh, placement: Placement) -> None:
    param = module._parameters.get(name)
    if param is None:
        return
    sharded = distribute_tensor(param.detach(), mesh, [placement])
    new = nn.Parameter(sharded.to_local().contiguous(), requires_grad=param.requires_grad)
    set_layout(new, mesh, sharded.spec)
    module._parameters[name] = new


def _sum_grad_over(param: nn.Parameter, mesh: DeviceMesh) -> None:
    """Replicated parameter used on sequence shards: its gradient is partial over TP.

    The incoming gradient is summed over the TP group before it is accumulated (so gradient
    accumulation stays right), and the parameter is marked so that ``fully_shard``, which
    replaces it, sums the gradient of the gathered parameter instead."""
    if mesh.size() > 1 and param.requires_grad:
        mark_partial_grad(param, mesh)
        param.register_hook(lambda grad: comm.all_reduce(grad.clone(), mesh, (0,)))


def _to_parallel_input(x, have: Placement, mesh: DeviceMesh):
    """Bring an activation from ``have`` to replicated, for a consumer with sharded weights."""
    if not isinstance(x, torch.Tensor):
        return x
    if isinstance(have, Shard):
        return PF.gather_for_parallel(x, mesh, have.dim)
    if x.requires_grad or torch.is_floating_point(x):
        return PF.copy_to_parallel(x, mesh)
    return x


def _convert(x, have: Placement, want: Placement, mesh: DeviceMesh):
    if not isinstance(x, torch.Tensor) or have == want:
        return x
    if isinstance(have, Shard) and isinstance(want, Replicate):
        return PF.gather_replicated(x, mesh, have.dim)
    if isinstance(have, Replicate) and isinstance(want, Shard):
        return PF.split_replicated(x, mesh, want.dim)
    raise ParallelizeError(f"cannot convert an activation from {have} to {want}")


class ParallelStyle:
    """How one module is parallelized over a 1-D (tensor-parallel) mesh."""

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:  # pragma: no cover
        raise NotImplementedError


class ColwiseParallel(ParallelStyle):
    def __init__(self, *, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True) -> None:
        self.input_layout = input_layouts or Replicate()
        self.output_layout = output_layouts or Shard(-1)

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Linear):
            _distribute_param(module, "weight", mesh, Shard(0))
            _distribute_param(module, "bias", mesh, Shard(0))
        elif isinstance(module, nn.Embedding):
            _distribute_param(module, "weight", mesh, Shard(1))
        else:
            raise ParallelizeError(
                f"ColwiseParallel applies to nn.Linear and nn.Embedding, not {type(module).__name__}"
            )
        have, out = self.input_layout, self.output_layout
        module.register_forward_pre_hook(
            lambda m, args: (_to_parallel_input(args[0], have, mesh), *args[1:]))
        if isinstance(out, Replicate):
            module.register_forward_hook(lambda m, a, y: PF.gather_replicated(y, mesh, -1))
        elif not (isinstance(out, Shard) and out.dim == -1):
            raise ParallelizeError(
                f"ColwiseParallel output_layouts {out} is not supported; use Shard(-1) or "
                "Replicate()"
            )
        return module


class RowwiseParallel(ParallelStyle):
    def __init__(self, *, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True) -> None:
        self.input_layout = input_layouts or Shard(-1)
        self.output_layout = output_layouts or Replicate()

    def _reduce(self, y: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        out = self.output_layout
        if isinstance(out, Replicate):
            return PF.reduce_from_parallel(y, mesh)
        if isinstance(out, Shard):
            return PF.reduce_scatter_from_parallel(y, mesh, out.dim)
        raise ParallelizeError(f"RowwiseParallel output_layouts {out} is not supported")

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        style = self
        if isinstance(module, nn.Linear):
            _distribute_param(module, "weight", mesh, Shard(1))
            _distribute_param(module, "bias", mesh, Replicate())
            if module.bias is not None and isinstance(self.output_layout, Shard):
                _sum_grad_over(module.bias, mesh)

            def forward(x: torch.Tensor) -> torch.Tensor:
                if isinstance(style.input_layout, Replicate):
                    x = PF.split_replicated(x, mesh, -1)
                y = style._reduce(F.linear(x, module.weight), mesh)
                return y if module.bias is None else y + module.bias

        elif isinstance(module, nn.Embedding):
            _distribute_param(module, "weight", mesh, Shard(0))
            rows = module.weight.shape[0]
            start = _shard_start(module.num_embeddings, mesh)

            def forward(ids: torch.Tensor) -> torch.Tensor:
                local = ids - start
                outside = (local < 0) | (local >= rows)
                y = F.embedding(local.masked_fill(outside, 0), module.weight)
                y = y.masked_fill(outside.unsqueeze(-1), 0.0)
                return style._reduce(y, mesh)

        else:
            raise ParallelizeError(
                f"RowwiseParallel applies to nn.Linear and nn.Embedding, not {type(module).__name__}"
            )
        module.forward = forward  # type: ignore[method-assign]
        return module


def _shard_start(length: int, mesh: DeviceMesh) -> int:
    return chunk_bounds(length, mesh.size(), mesh.get_local_rank())[0]


class SequenceParallel(ParallelStyle):
    """Run a norm/dropout layer on the local sequence shard (``Shard(sequence_dim)``)."""

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        self.sequence_dim = sequence_dim

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        for name in list(module._parameters):
            _distribute_param(module, name, mesh, Replicate())
            _sum_grad_over(module._parameters[name], mesh)
        return module


class PrepareModuleInput(ParallelStyle):
    def __init__(self, *, input_layouts: Sequence[Placement | None] | Placement,
                 desired_input_layouts: Sequence[Placement | None] | Placement,
                 use_local_output: bool = True) -> None:
        as_tuple = lambda v: (v,) if isinstance(v, Placement) else tuple(v)  # noqa: E731
        self.have, self.want = as_tuple(input_layouts), as_tuple(desired_input_layouts)
        if len(self.have) != len(self.want):
            raise ParallelizeError("input_layouts and desired_input_layouts differ in length")

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def hook(m, args):
            out = list(args)
            for i, (have, want) in enumerate(zip(self.have, self.want)):
                if i < len(out) and have is not None and want is not None:
                    if isinstance(have, Shard) and isinstance(want, Replicate):
                        out[i] = PF.gather_for_parallel(out[i], mesh, have.dim)
                    else:
                        out[i] = _convert(out[i], have, want, mesh)
            return tuple(out)

        module.register_forward_pre_hook(hook)
        return module


class PrepareModuleOutput(ParallelStyle):
    def __init__(self, *, output_layouts: Placement, desired_output_layouts: Placement,
                 use_local_output: bool = True) -> None:
        self.have, self.want = output_layouts, desired_output_layouts

    def apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(lambda m, a, y: _convert(y, self.have, self.want, mesh))
        return module


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh,
    parallelize_plan: ParallelStyle | Mapping[str, ParallelStyle],
) -> nn.Module:
    """Apply tensor-parallel styles to ``module`` (or to submodules by name; ``*`` matches one
    path segment, as in torch) over the 1-D ``device_mesh``."""
    if device_mesh.ndim != 1:
        raise ParallelizeError(
            f"parallelize_module needs a 1-D tensor-parallel mesh, got {device_mesh!r}; slice it, "
            "e.g. mesh['tp']"
        )
    if isinstance(parallelize_plan, ParallelStyle):
        return parallelize_plan.apply(module, device_mesh)
    names = dict(module.named_modules())
    for pattern, style in parallelize_plan.items():
        matches = [n for n in names if n and fnmatch.fnmatchcase(n, pattern)
                   and n.count(".") == pattern.count(".")]
        if not matches:
            raise ParallelizeError(
                f"parallelize_plan key {pattern!r} matches no submodule; submodules are "
                f"{', '.join(n for n in names if n)}"
            )
        for name in matches:
            style.apply(names[name], device_mesh)
    return module
