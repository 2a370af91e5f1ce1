"""Placing laid-out parameters in modules: a module's slot holds this rank's block, its
``state_dict()`` gives DTensors and its ``load_state_dict`` takes full tensors or blocks; a
parameter torch's own conversions replaced takes the layout of the one it replaced.

The per-parameter record itself (:class:`~devmesh.parallel.param.ParamLayout`) lives in
:mod:`devmesh.parallel.param`; this module is the one place that writes devmesh's parameters
into a module's ``_parameters``."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from devmesh.parallel.optim_state import watch_optimizers
from devmesh.parallel.param import (
    ParallelizeError,
    ShardedParameter,
    as_dtensor,
    block_of,
    get_layout,
    set_layout,
    split_layout,
)
from devmesh.parallel.swap import swap_parameter

__all__ = ["refuse_torch_fsdp_over_blocks", "place_parameter", "keep_layout",
           "replaced_parameters", "adopt_replaced_parameters", "state_dict_of_blocks"]

# set while devmesh reads a module's own state_dict() for its keys and buffers
_BLOCKS_ONLY = contextvars.ContextVar("devmesh_state_dict_of_blocks", default=False)


@contextlib.contextmanager
def state_dict_of_blocks() -> Iterator[None]:
    """``module.state_dict()`` inside leaves each split parameter as this rank's block
    instead of making its DTensor: devmesh's own state dicts read the module's for its keys
    (what hooks add or drop), its buffers and extra states, and take the parameters' values
    from their layouts, so a DTensor made there would be wasted — or refused, for a packed
    parameter that has no DTensor form."""
    token = _BLOCKS_ONLY.set(True)
    try:
        yield
    finally:
        _BLOCKS_ONLY.reset(token)


def refuse_torch_fsdp_over_blocks(module: nn.Module, module_name: str | None = None) -> None:
    """Refuse ``module`` if torch's ``fully_shard`` manages it while it holds blocks devmesh
    split (its tensor parallelism, or its own ``fully_shard``: called from both units' and
    styles' forwards): torch's FSDP2 takes each block for a whole parameter (a
    DTensor of the block's shape), so the training runs but saving fails after it
    (``model.state_dict()`` raised "the local_tensor argument only accepts torch.Tensor",
    devmesh's ``state_dict`` "got mixed torch.Tensor and DTensor"). torch marks every module its ``fully_shard`` manages; every rank has the same modules, so every
    rank raises alike, before this module's own collectives."""
    if not getattr(module, "_is_fsdp_managed_module", False):
        return
    split = [name for name, held in module.__dict__.get(_PLACED, {}).items()
             if split_layout(held) is not None]
    if split:
        where = (f"module {module_name!r} ({type(module).__name__})" if module_name
                 else f"a {type(module).__name__} module")
        raise ParallelizeError(
            f"{where} holds parameter(s) {split} split by devmesh's "
            "parallelize_module or fully_shard and is managed by torch's fully_shard, which "
            "takes each block for a whole parameter: the state dict and checkpoints would "
            "name one rank's block as the full tensor. Apply devmesh.parallel.fully_shard "
            "instead, once (it nests its shards inside the tensor-parallel blocks), or split "
            "the model with torch's parallelize_module and styles for torch's fully_shard")


def place_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Register ``param`` (laid out on a mesh) as ``module.<name>``.

    ``module.state_dict()`` then gives it as a torch ``DTensor`` on its mesh (this rank's
    block, not copied), as torch's FSDP2 and TP do, so ``torch.distributed.checkpoint``
    saves and loads it by its global layout (given the block as a plain tensor, DCP would
    take it for a replicated tensor and keep rank 0's block only). ``module.load_state_dict``
    takes such a DTensor, the full tensor — a pretrained checkpoint, a single-process
    ``state_dict()`` — keeping this rank's block, as ``devmesh.parallel.load_state_dict``
    does, or a tensor of this rank's block shape as it is."""
    swap_parameter(module, name, param)
    module.__dict__.setdefault(_PLACED, {})[name] = param
    if not getattr(module, _TAKES_FULL, False):
        module.register_load_state_dict_pre_hook(_take_local_blocks)
        module.register_state_dict_post_hook(_give_dtensors)
        setattr(module, _TAKES_FULL, True)
    if split_layout(param) is not None:
        watch_optimizers()  # and their states as DTensors too


_TAKES_FULL = "_devmesh_takes_full_tensors"
_PLACED = "_devmesh_placed"  # module attribute: name -> the parameter devmesh placed there


def keep_layout(old: torch.Tensor, new: torch.Tensor) -> None:
    """Give ``new`` (a parameter torch made in place of ``old``) ``old``'s layout and kind,
    keeping the object: an optimizer already holding ``new`` steps the parameter the model
    trains."""
    layout = get_layout(old)
    if layout is None or get_layout(new) is not None:
        return
    if isinstance(old, ShardedParameter) and type(new) is nn.Parameter:
        new.__class__ = ShardedParameter
    set_layout(new, layout.mesh, layout.spec, layout.shape)


def replaced_parameters(places: Iterable[tuple[nn.Module, str, torch.Tensor]]
                        ) -> dict[int, nn.Parameter]:
    """``places``: (module, name, the parameter devmesh holds there). For each slot where a
    conversion devmesh did not see (``child.to_empty()``) left another parameter: ``{id(held):
    the new one}``, the new one laid out as the held one (the first found, where a tied
    weight was replaced in several places)."""
    replaced: dict[int, nn.Parameter] = {}
    for module, name, held in places:
        new = module._parameters.get(name)
        if isinstance(new, nn.Parameter) and new is not held and id(held) not in replaced:
            keep_layout(held, new)
            replaced[id(held)] = new
    return replaced


def adopt_replaced_parameters(module: nn.Module) -> None:
    """Lay out the parameters that torch's conversions run on ``module`` itself replaced.

    ``child.to_empty(device=...)`` on a module inside an FSDP unit (or under ``replicate``)
    makes new, plain parameters in the child's slots: the child's class is torch's, so
    devmesh's conversion (:mod:`devmesh.parallel.conversion`) did not run. Each such slot's
    new parameter takes the layout of the one devmesh placed there, so loading a state dict
    into it cuts this rank's block; the unit holding the parameter takes the new objects at
    its next forward, as torch's FSDP2 re-reads its parameters by name."""
    placed = module.__dict__.get(_PLACED, {})
    replaced = replaced_parameters((module, name, held) for name, held in placed.items())
    for name, held in placed.items():
        placed[name] = replaced.get(id(held), held)


def _give_dtensors(module: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
    refuse_torch_fsdp_over_blocks(module, prefix.removesuffix(".") or None)
    adopt_replaced_parameters(module)
    if _BLOCKS_ONLY.get():
        return
    for name, param in module._parameters.items():
        if prefix + name in state and split_layout(param) is not None:
            state[prefix + name] = as_dtensor(param, param)


def _take_local_blocks(module: nn.Module, state: dict, prefix: str, local_metadata: dict,
                       strict: bool, missing: list, unexpected: list, errors: list) -> None:
    refuse_torch_fsdp_over_blocks(module, prefix.removesuffix(".") or None)
    adopt_replaced_parameters(module)
    for name, param in module._parameters.items():
        layout = get_layout(param) if param is not None else None
        value = state.get(prefix + name)
        if layout is None or not isinstance(value, torch.Tensor) or value.shape == param.shape:
            continue
        try:
            state[prefix + name] = block_of(value, param, prefix + name)
        except ParallelizeError as exc:
            errors.append(str(exc))
