"""``ExpertsTensorParallel``: a mixture of experts' stacked expert weights split over the
tensor-parallel mesh, every expert as a column/row pair — transformers' ``moe_tp_experts``
with its ``packed_colwise`` and ``rowwise`` expert weights.

The experts module holds each weight for all experts stacked, ``(experts, out, in)`` as
most of transformers' experts call ``F.linear(x, weight[e])`` (or ``(experts, in, out)``,
multiplied as ``x @ weight[e]``: Llama 4's, ``transposed=True``): the column weights
(SwiGLU's packed ``gate_up_proj``, ``(E, 2I, H)``) are split on their output dim, each packed
part apart, so a rank holds gate and up for the same ``I/tp`` features; the row weights
(``down_proj``, ``(E, H, I)``) on their input dim. The module's own forward then runs
unchanged on every rank with every token routed to it (the tokens are replicated over tp,
as after an attention block's row-wise projection), on its slice of every expert, and its
output is a partial sum that the style reduces. The router stays whole: the gradient of its
weights for the experts' output, like the tokens', is summed over the ranks before it
leaves the experts.

A weight's bias, named ``<weight>_bias`` (gpt-oss's ``gate_up_proj_bias``,
``down_proj_bias``, ``(E, out)``), goes with it: a column weight's is split as its output
features are, each rank adding its slice; a row weight's is added to the partial sums
before they are reduced, so only the first rank of the mesh adds it (the others add zeros
in its place) and its gradient, there alone, is summed over the ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from devmesh import _torch_compat
from devmesh.errors import ParallelizeError
from devmesh.mesh import DeviceMesh
from devmesh.parallel.placement import refuse_torch_fsdp_over_blocks
from devmesh.parallel.swap import swap_parameter
from devmesh.parallel.tensor_parallel import activations as A
from devmesh.parallel.tensor_parallel import functional as PF
from devmesh.parallel.tensor_parallel.styles import (
    _SAVED,
    Distribute,
    ParallelStyle,
    Split,
    _distribute_splits,
    _one,
    _restore_parameters,
)
from devmesh.tensor import Partial, Placement, Replicate, Shard

__all__ = ["ExpertsTensorParallel"]


class ExpertsTensorParallel(ParallelStyle):
    """Every expert of a stacked-experts module split over the tensor-parallel mesh.

    Args:
        colwise: the weights split on their output dim (dim -2 of ``(E, out, in)``), each
            with the number of equal parts packed in it: ``{"gate_up_proj": 2}`` (gate and
            up side by side), ``{"w1": 1, "w3": 1}`` for unpacked ones.
        rowwise: the weights split on their input dim (dim -1), ``("down_proj",)``.
        transposed: the weights are stored ``(E, in, out)`` and multiplied as
            ``x @ weight[e]`` (Llama 4's experts): the column weights are split on dim -1,
            the row weights on dim -2.
        output_layouts: the summed outputs ``Replicate()`` (an all-reduce: transformers'
            ``moe_tp_experts``), ``Shard(d)`` (a reduce-scatter), or ``Partial()``: this
            rank's partial sums unreduced, for the caller to add the shared experts' partial
            sums and reduce once (torchtitan's plan: a reduce-scatter to the sequence).
        use_local_output: hand on a plain tensor (default) or a torch DTensor.

    A weight's bias, ``<weight>_bias`` of shape ``(E, out)``, is split with a column
    weight and added once (on the mesh's first rank) with a row weight. Any other parameter
    of the module is refused: it would be used on every rank before the sum.
    """

    distributes_parameters = True

    def __init__(self, *, colwise: Mapping[str, int] | None = None,
                 rowwise: Sequence[str] = ("down_proj",),
                 output_layouts: Placement | None = None,
                 use_local_output: bool = True, transposed: bool = False) -> None:
        self.colwise = dict({"gate_up_proj": 2} if colwise is None else colwise)
        self.rowwise = tuple(rowwise)
        self.transposed = transposed
        # where the output and input features lie in each expert's matrix
        self._out_dim, self._in_dim = (-1, -2) if transposed else (-2, -1)
        self.output_layouts = _one(output_layouts, "ExpertsTensorParallel output_layouts") \
            or Replicate()
        self.use_local_output = use_local_output
        bad = {k: v for k, v in self.colwise.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ParallelizeError(f"ExpertsTensorParallel colwise={self.colwise!r}: each "
                                   "weight takes its number of packed parts, 1 or more")

    def check(self, module: nn.Module, name: str) -> None:
        own = dict(module.named_parameters(recurse=False))
        named = [*self.colwise, *self.rowwise]
        missing = [n for n in named if n not in own]
        if missing:
            raise ParallelizeError(
                f"ExpertsTensorParallel on {name!r}: {type(module).__name__} has no "
                f"parameter {missing} (it has {sorted(own)}); name its stacked expert "
                "weights with colwise={...: parts} and rowwise=(...)")
        flat = [n for n in named if own[n].ndim < 2]
        if flat:
            raise ParallelizeError(
                f"ExpertsTensorParallel on {name!r}: {flat} are not stacked matrices "
                f"({'(experts, in, out)' if self.transposed else '(experts, out, in)'})")
        for weight in named:
            bias = own.get(_bias(weight))
            want = (own[weight].shape[0], own[weight].shape[self._out_dim])
            if bias is not None and tuple(bias.shape) != want:
                raise ParallelizeError(
                    f"ExpertsTensorParallel on {name!r}: {_bias(weight)!r} has shape "
                    f"{tuple(bias.shape)}, not {want} (experts, output features of "
                    f"{weight!r}), the bias it would be taken for")
        biases = {_bias(w) for w in named if _bias(w) in own}
        other = sorted(set(own) - set(named) - biases) + sorted(
            n for n, _ in module.named_parameters() if "." in n)
        if other:
            raise ParallelizeError(
                f"ExpertsTensorParallel on {name!r}: {type(module).__name__} holds "
                f"{other} besides the split weights and their '<weight>_bias'; each rank "
                "would use it before the partial sums are reduced. Leave these experts "
                "whole (no 'tp' entry for them) or split them over an 'ep' mesh dim instead")

    def sharded_parameters(self, module: nn.Module) -> tuple[str, ...]:
        return (*self.colwise, *self.rowwise,
                *(_bias(w) for w in self.colwise if _bias(w) in module._parameters))

    def splits(self, module: nn.Module) -> list[Split]:
        out: list[Split] = []
        for attr, parts in self.colwise.items():
            out.append((attr, Shard(self._out_dim), parts))
            if module._parameters.get(_bias(attr)) is not None:
                out.append((_bias(attr), Shard(-1), parts))
        out += [(attr, Shard(self._in_dim), 1) for attr in self.rowwise]
        # a row-wise weight's bias is added once, after the reduction: whole on every rank
        out += [(_bias(w), Replicate(), 1) for w in self.rowwise
                if module._parameters.get(_bias(w)) is not None]
        return out

    def apply(self, module: nn.Module, mesh: DeviceMesh, distribute: Distribute) -> nn.Module:
        row_biases = tuple(_bias(w) for w in self.rowwise
                           if module._parameters.get(_bias(w)) is not None)
        _distribute_splits(self, module, distribute)
        module.register_forward_pre_hook(functools.partial(_experts_input, mesh, row_biases),
                                         with_kwargs=True)
        module.register_forward_hook(_restore_parameters_after, always_call=True)
        module.register_forward_hook(functools.partial(_experts_output, self, mesh))
        return module


def _bias(weight: str) -> str:
    """The name of a stacked expert weight's bias (gpt-oss's convention)."""
    return f"{weight}_bias"


def _row_biases_once(module: nn.Module, mesh: DeviceMesh, names: tuple[str, ...]) -> None:
    """For this forward, each row weight's bias is added by the mesh's first rank alone (the
    others see zeros): the partial sums are reduced after it. Its gradient, that rank's
    alone, is summed over the ranks in backward, so every rank's replica gets it."""
    saved = {}
    first = mesh.get_local_rank() == 0
    for name in names:
        param = module._parameters[name]
        saved[name] = param
        once = PF.copy_to_parallel(param, mesh) if param.requires_grad else param
        swap_parameter(module, name, once if first else once * 0)
    setattr(module, _SAVED, saved)


def _restore_parameters_after(module: nn.Module, args, y) -> None:
    _restore_parameters(module)


@_torch_compat.eager
def _experts_input(mesh: DeviceMesh, row_biases: tuple[str, ...], module: nn.Module, args,
                   kwargs):
    """Every floating-point input (the tokens, the routing weights) whole on every rank: its
    gradient from this rank's slice of the experts is a partial sum, summed over the ranks
    in backward. The row weights' biases added once."""
    refuse_torch_fsdp_over_blocks(module)
    if row_biases:
        _row_biases_once(module, mesh, row_biases)

    def summed(x):
        if A.is_global(x) or isinstance(x, torch.Tensor) and x.is_floating_point():
            return A.replicated_input(x, Replicate(), mesh)
        return x

    return tuple(summed(a) for a in args), {k: summed(v) for k, v in kwargs.items()}


@_torch_compat.eager
def _experts_output(style: ExpertsTensorParallel, mesh: DeviceMesh, module: nn.Module, args,
                    y):
    if not isinstance(y, torch.Tensor):
        raise ParallelizeError(
            f"ExpertsTensorParallel: {type(module).__name__}'s forward returned "
            f"{type(y).__name__}, not the tensor of the experts' summed outputs it reduces")
    return A.finish_output(y, Partial(), style.output_layouts, mesh, style.use_local_output)
