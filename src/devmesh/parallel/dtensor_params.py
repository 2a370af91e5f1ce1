"""Parameters torch's tensor parallelism made (torch ``DTensor``\\ s) under devmesh's
``replicate``: held as devmesh's own blocks, shown to their modules as DTensors while they run.

torch's ``parallelize_module`` (torch's styles, or a style of one's own as torchtitan writes
for experts) leaves DTensor parameters, and torch's styles compute with them: ``F.linear`` on
a DTensor input needs a DTensor weight. devmesh's data parallelism, checkpoints, state dicts
and gradient clipping work on plain parameters holding this rank's block with a layout
attached. So each DTensor parameter is replaced by such a parameter (its layout read from the
DTensor), and while the model runs its modules hold a DTensor view of it instead
(``DTensor.from_local``, no copy): the view's backward hands the block's gradient to the
plain parameter — summing a replicated weight's partial gradient over the tensor-parallel
ranks where torch's DTensor would — and the usual gradient hooks average it over the
data-parallel ranks. A recomputation in backward (activation checkpointing) runs outside the
model's forward; hooks on the modules holding views show them there too.
"""

from __future__ import annotations

import torch
from torch import nn

from devmesh import _torch_compat
from devmesh.parallel.param import ParallelizeError, sharded_parameter
from devmesh.parallel.placement import place_parameter
from devmesh.parallel.swap import swap_parameter
from devmesh.tensor import ShardedTensor

__all__ = ["adopt_dtensor_parameters", "refuse_partial_dtensors", "show_dtensor_views",
           "hide_dtensor_views"]

_VIEWS = "_devmesh_dtensor_views"  # module attribute: name -> (mesh, placements, shape, stride)
_SHOWN = "_devmesh_dtensor_shown"  # module attribute: name -> the plain parameter held back


def refuse_partial_dtensors(module: nn.Module, ignored: set[int], what: str,
                            error: type[Exception] = ParallelizeError) -> None:
    """A DTensor parameter that is a partial sum has no block to hold or shard: raise
    ``error`` (checkpoints raise their own kind). Every rank holds the same kinds of
    parameters, so the refusal is raised on every rank alike."""
    from torch.distributed.tensor import DTensor, Partial

    for name, param in module.named_parameters():
        if (isinstance(param, DTensor) and id(param) not in ignored
                and any(isinstance(p, Partial) for p in param.placements)):
            raise error(
                f"{what}: parameter {name!r} is a DTensor with placements "
                f"{list(param.placements)}: a partial sum has no block to hold or shard; "
                "redistribute it to Replicate() or Shard(d) first")


def adopt_dtensor_parameters(module: nn.Module, ignored: set[int], what: str) -> bool:
    """Replace every DTensor parameter of ``module`` (not in ``ignored``) by a plain one
    holding its local block, laid out as the DTensor is; a tied one stays one parameter.
    Returns whether there was any; a partial sum is refused first."""
    from torch.distributed.tensor import DTensor

    refuse_partial_dtensors(module, ignored, what)
    made: dict[int, nn.Parameter] = {}
    for owner_name, owner in module.named_modules():
        for name, param in list(owner._parameters.items()):
            if not isinstance(param, DTensor) or id(param) in ignored:
                continue
            plain = made.get(id(param))
            if plain is None:
                block = ShardedTensor.from_dtensor(param.detach())
                plain = sharded_parameter(param.detach().to_local(), param.requires_grad,
                                          block.device_mesh, block.spec)
                made[id(param)] = plain
            place_parameter(owner, name, plain)
            owner.__dict__.setdefault(_VIEWS, {})[name] = (
                param.device_mesh, tuple(param.placements), param.shape, param.stride())
            if not getattr(owner, "_devmesh_watches_recompute", False):
                owner.register_forward_pre_hook(_show_for_recompute, prepend=True)
                owner.register_forward_hook(_hide_after_recompute, always_call=True)
                owner._devmesh_watches_recompute = True
    return bool(made)


def _show(owner: nn.Module) -> None:
    from torch.distributed.tensor import DTensor

    views = owner.__dict__.get(_VIEWS)
    if not views:
        return
    shown = owner.__dict__.setdefault(_SHOWN, {})
    for name, (mesh, placements, shape, stride) in views.items():
        plain = owner._parameters.get(name)
        if plain is None or isinstance(plain, DTensor):
            continue  # shown already
        shown[name] = plain
        swap_parameter(owner, name, DTensor.from_local(plain, mesh, placements,
                                                       run_check=False, shape=shape,
                                                       stride=stride))


def _hide(owner: nn.Module) -> None:
    for name, plain in owner.__dict__.pop(_SHOWN, {}).items():
        swap_parameter(owner, name, plain)


@_torch_compat.eager  # runs around the whole model, between compiled regions
def show_dtensor_views(module: nn.Module) -> None:
    """Before the model runs: each adopted parameter's module holds its DTensor view."""
    for owner in module.modules():
        _show(owner)


@_torch_compat.eager
def hide_dtensor_views(module: nn.Module) -> None:
    """After the model ran (or raised): the plain parameters back in their places, where the
    optimizer, state dicts and checkpoints find them."""
    for owner in module.modules():
        _hide(owner)


def _show_for_recompute(owner: nn.Module, args) -> None:
    """A module's forward inside a backward (a recomputation): show its views for it. In a
    compiled region nothing is done (a compiled graph recomputes in its own backward), and
    returning at once keeps the hook out of the graph."""
    if torch.compiler.is_compiling() or _torch_compat.current_graph_task_id() == -1:
        return
    if owner.__dict__.get(_SHOWN):
        return  # shown by the model's forward already
    _show(owner)
    owner.__dict__["_devmesh_recompute_shown"] = True


def _hide_after_recompute(owner: nn.Module, args, output) -> None:
    if torch.compiler.is_compiling():
        return
    if owner.__dict__.pop("_devmesh_recompute_shown", False):
        _hide(owner)
