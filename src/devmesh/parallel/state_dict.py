"""State dicts of parallelized models: full tensors gathered from the specs, and loads where
every rank copies its own block, all or nothing.

* ``state_dict(model, full=True)``: full tensors on every rank (one collective per sharded
  parameter), or ``full=False``: ``ShardedTensor``s without communication; tied parameters
  appear under every name, as in ``nn.Module.state_dict()``;
* ``load_state_dict(model, state, strict=True)``: checked in full (keys, exact shapes,
  buffers) before the first copy, torch's wording in the errors.

Names are those of the model without its wrappers (:func:`state_dict_name`), as torch's
``nn.Module.state_dict()`` writes them for activation-checkpointed blocks and torch's DCP
(``get_model_state_dict``) for compiled ones: a checkpoint moves between a model with and
without activation checkpointing or ``torch.compile``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from devmesh._torch_compat import IncompatibleKeys
from devmesh.distributed import consensus
from devmesh.errors import ParallelizeError, StateDictError
from devmesh.parallel.param import (
    as_sharded,
    get_layout,
    is_dtensor,
    layout_of,
    local_block,
    local_of,
)
from devmesh.parallel.placement import adopt_replaced_parameters, state_dict_of_blocks
from devmesh.tensor import ShardedTensor

__all__ = ["state_dict", "local_state_dict", "load_state_dict", "prepare_load", "apply_load",
           "local_block", "state_dict_name", "named_parameters", "module_of"]

# module names wrappers insert: torch's checkpoint_wrapper, torch.compile's OptimizedModule
_WRAPPER_NAMES = frozenset({"_checkpoint_wrapped_module", "_orig_mod"})


def state_dict_name(name: str) -> str:
    """``name`` without the parts wrappers insert (``_checkpoint_wrapped_module``,
    ``_orig_mod``): ``layers.0._checkpoint_wrapped_module.attn.weight`` is saved as
    ``layers.0.attn.weight``, the name the unwrapped model has."""
    parts = name.split(".")
    if _WRAPPER_NAMES.isdisjoint(parts):
        return name
    return ".".join(part for part in parts if part not in _WRAPPER_NAMES)


def named_parameters(model: nn.Module, *, remove_duplicate: bool = False
                     ) -> list[tuple[str, nn.Parameter]]:
    """``model.named_parameters()`` under their state-dict names (:func:`state_dict_name`);
    a tied parameter under each of its names unless ``remove_duplicate``."""
    return [(state_dict_name(name), p)
            for name, p in model.named_parameters(remove_duplicate=remove_duplicate)]


def module_of(model: Any, caller: str) -> nn.Module:
    """The module a function given ``model`` works on: the module itself, or a pipeline
    runner's ``module`` (this rank's stages under the whole model's names: a checkpoint is
    the union of every rank's). Anything else is refused by name, rather than failing deep
    inside with an ``AttributeError``."""
    if isinstance(model, nn.Module):
        return model
    module = getattr(model, "module", None)
    if isinstance(module, nn.Module):
        return module
    raise ParallelizeError(f"{caller} takes the model (an nn.Module, or a pipeline runner), "
                           f"got {type(model).__name__}")


def _pipeline_runner(model: Any) -> bool:
    """A pipeline runner: not a module, but holding this rank's stages as one."""
    return not isinstance(model, nn.Module) and isinstance(getattr(model, "module", None),
                                                          nn.Module)


def state_dict(model: nn.Module, *, full: bool = True, rank0_only: bool = False
               ) -> dict[str, torch.Tensor | ShardedTensor]:
    """Parameters and buffers by name: full tensors (``full=True``) or ShardedTensors. A tied
    parameter appears under every name it has, as in ``nn.Module.state_dict()``. A packed
    parameter's ShardedTensor (a fused gate/up weight split part by part) is of its view
    with the packed dim cut into its parts, ``(E, 2, I, H)`` for ``(E, 2I, H)``: only that
    shape has this rank's block as one box; :func:`load_state_dict` takes it back. Given a
    pipeline runner: its ``state_dict(full=...)`` (the whole model with ``full=True``).

    ``rank0_only=True`` (with ``full=True``, as FSDP's ``FullStateDictConfig``): every rank
    still takes part in each gather, but only rank 0 keeps the full tensors; the others drop
    each as soon as it is gathered and get ``{}``, so no rank but the writer ever holds the
    whole model (a pipeline runner's whole state is still gathered on every rank, then
    dropped on all but rank 0)."""
    if rank0_only and not full:
        raise ValueError("state_dict(rank0_only=True) keeps full tensors on rank 0: pass "
                         "full=True (a sharded state dict is each rank's own blocks)")
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    if _pipeline_runner(model):
        out = model.state_dict(full=full)
        return out if keep else {}
    model = module_of(model, "state_dict")
    if full:  # inside `if rank == 0:` (torch's way to save), say so
        consensus.warn_if_called_alone("state_dict(full=True)", _gathering_ranks(model))
    return local_state_dict(model, full=full, keep=keep)


def _gathering_ranks(model: nn.Module) -> list[int]:
    """The ranks that call ``state_dict(model, full=True)`` together: the ranks holding the
    model, as its split parameters tell — of each root mesh, those sharing this rank's
    coordinates off the dims the model's meshes span (the meshes that split a parameter or
    hold it as a partial sum, devmesh's layout or a DTensor's). Every holder computes the
    same set: a model split over ``mesh["dp"]`` here and ``mesh["tp"]`` there spans both
    dims, the whole mesh, though its groups differ from rank to rank; a pipeline stage
    sharded over ``mesh["dp"]`` of a ``(pp, dp)`` mesh spans its copies alone. Empty where
    nothing is split: a replicated model's full state dict is local, and rank 0 alone may
    take it (as of torch's DDP)."""
    if not dist.is_initialized():
        return []
    spans: dict[int, tuple[Any, set[int]]] = {}  # id(root mesh) -> (root, its dims spanned)
    for _, p in named_parameters(model):
        layout = layout_of(p)
        if layout is None:
            continue
        spec = layout.spec
        if not any(spec.shard_dim_of(d) is not None or spec.partial_op(d) is not None
                   for d in range(len(spec.mesh_shape))):
            continue
        root, dims = _root_dims(p.device_mesh if is_dtensor(p) else layout.mesh)
        spans.setdefault(id(root), (root, set()))[1].update(dims)
    ranks: set[int] = set()
    for root, dims in spans.values():
        me = root.get_coordinate()
        where = tuple(slice(None) if d in dims else me[d] for d in range(root.ndim))
        ranks.update(root.mesh[where].flatten().tolist())
    return sorted(ranks)


def _root_dims(mesh) -> tuple[Any, set[int]]:
    """``mesh``'s root mesh and the root's dims ``mesh`` spans (all of them where they cannot
    be told: a torch mesh flattened without names)."""
    root = getattr(mesh, "_root", None) or mesh._get_root_mesh()  # devmesh's, or torch's
    every = set(range(root.ndim))
    if root is mesh:
        return root, every
    if hasattr(mesh, "_dim_roots"):  # devmesh's: each dim's root dims
        return root, {d for roots in mesh._dim_roots for d in roots}
    names, root_names = mesh.mesh_dim_names or (), root.mesh_dim_names or ()
    if not names or not set(names) <= set(root_names):
        return root, every
    return root, {root_names.index(name) for name in names}


def local_state_dict(model: nn.Module, *, full: bool = True, keep: bool = True
                     ) -> dict[str, torch.Tensor | ShardedTensor]:
    """:func:`state_dict` of a module, without the check that every rank called it (a
    pipeline runner checks once, over its whole mesh); ``keep=False`` gathers each full
    tensor with the others and drops it (``{}``: another rank keeps them)."""
    _adopt_replaced(model)
    out: dict[str, torch.Tensor | ShardedTensor] = {}
    done: dict[int, torch.Tensor | ShardedTensor] = {}  # tied parameters: gathered once
    for name, p in named_parameters(model):
        if id(p) in done:
            out[name] = done[id(p)]  # an alias key, as nn.Module.state_dict() lists it
            continue
        sharded = as_sharded(p)
        if is_dtensor(p) and full:  # torch's tensor parallelism alone
            value = p.detach().full_tensor()
            # a snapshot, as of devmesh's parameters: a replicated DTensor's full tensor is
            # its local tensor itself, which training would change under the caller
            replicated = all(placement.is_replicate() for placement in p.placements)
            out[name] = value.clone() if replicated and keep else value
        elif is_dtensor(p):
            out[name] = ShardedTensor.from_dtensor(p.detach())
        elif sharded is None:
            out[name] = p.detach().clone() if keep else p
        elif full:
            out[name] = sharded.full_tensor().reshape(get_layout(p).full_shape)
        else:
            out[name] = sharded
        if not keep:  # gathered with the other ranks; another rank keeps it
            del out[name]
            done[id(p)] = None
            continue
        done[id(p)] = out[name]
    return _in_module_order(model, out) if keep else {}


def _in_module_order(model: nn.Module, params: dict[str, Any]) -> dict[str, Any]:
    """The state dict ``model.state_dict()`` gives, its parameters' values taken from
    ``params`` (gathered or sharded by devmesh): the same keys in the same order — persistent
    buffers only, ``_extra_state``, what registered state-dict hooks add or remove —
    buffers cloned (a snapshot, as the parameters are)."""
    out: dict[str, Any] = {}
    with state_dict_of_blocks():
        own = model.state_dict(keep_vars=True)
    for key, value in own.items():
        name = state_dict_name(key)
        if name in params:
            out[name] = params[name]
        elif isinstance(value, torch.Tensor):
            out[name] = value.detach().clone()
        else:
            out[name] = value
    return out


def _adopt_replaced(model: nn.Module) -> None:
    """Parameters a conversion of a plain child made (``child.to_empty()``) take their
    layouts first, so they are saved and loaded as the blocks they are."""
    for module in model.modules():
        adopt_replaced_parameters(module)


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``nn.Module.state_dict()`` saves (non-persistent ones excluded)."""
    out = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                out[state_dict_name(f"{prefix}.{name}" if prefix else name)] = buffer
    return out


def extra_states(model: nn.Module) -> dict[str, nn.Module]:
    """The modules that save an ``_extra_state`` (their class defines ``get_extra_state``),
    by the key ``nn.Module.state_dict()`` gives it."""
    out = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        if type(module).get_extra_state is not nn.Module.get_extra_state:
            key = f"{prefix}.{_EXTRA_STATE}" if prefix else _EXTRA_STATE
            out[state_dict_name(key)] = module
    return out


_EXTRA_STATE = "_extra_state"  # torch's key: torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX

Write = tuple[torch.Tensor | nn.Module, Any]
"""A tensor and the value to copy into it, or a module and the extra state to set."""


def prepare_load(model: nn.Module, state: Mapping[str, Any], *, strict: bool = True
                 ) -> tuple[list[Write], IncompatibleKeys]:
    """Check ``state`` against ``model`` and compute this rank's block of every entry,
    changing nothing: ``(writes, incompatible keys)``, where ``writes`` pairs each target
    tensor with the value to copy into it (and each module saving an ``_extra_state`` with
    the state to set). Raises :class:`StateDictError` (torch's wording)
    on a missing or unexpected key (``strict``), a shape that differs (exactly: no reshaping)
    or a value that is not a tensor. Keys may carry wrapper parts (a compiled model's
    ``state_dict()`` has ``_orig_mod.``): they are read without them."""
    _adopt_replaced(model)
    state = {state_dict_name(key): value for key, value in state.items()}
    params = dict(named_parameters(model))
    buffers = persistent_buffers(model)
    extras = extra_states(model)
    expected = set(params) | set(buffers) | set(extras)
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    problems = []
    if strict and unexpected:
        problems.append("Unexpected key(s) in state_dict: " + ", ".join(map(repr, unexpected)))
    if strict and missing:
        problems.append("Missing key(s) in state_dict: " + ", ".join(map(repr, missing)))
    writes: list[Write] = [(extras[name], state[name]) for name in sorted(set(extras) & set(state))]
    for name in sorted((set(params) | set(buffers)) & set(state)):
        value = state[name]
        if isinstance(value, ShardedTensor) or is_dtensor(value):
            value = value.full_tensor()  # a collective: loading runs on every rank
        if not isinstance(value, torch.Tensor):
            problems.append(f"{name} is a {type(value).__name__}, not a tensor")
            continue
        target = params.get(name, buffers.get(name))
        dtensor = is_dtensor(target)  # torch's tensor parallelism alone: shape is global
        sharded = as_sharded(target) if name in params and not dtensor else None
        shape = get_layout(target).full_shape if sharded is not None else tuple(target.shape)
        if sharded is not None and tuple(value.shape) == tuple(sharded.shape) != shape:
            value = value.reshape(shape)  # a packed parameter's ShardedTensor: its view
        if tuple(value.shape) != shape:
            problems.append(
                f"size mismatch for {name}: copying a param with shape {tuple(value.shape)} "
                f"from checkpoint, the shape in current model is {shape}"
            )
            continue
        block = local_block(target, value.reshape(sharded.shape) if sharded else value, name)
        destination = local_of(target) if dtensor else target  # a DTensor: its local tensor
        writes.append((destination, block.reshape(destination.shape)))
    if problems:
        raise StateDictError(
            f"Error(s) in loading state_dict for {type(model).__name__}: " + "; ".join(problems)
            + ". Nothing was loaded; the state must come from the same model"
            + ("" if strict else " (shapes must match even with strict=False)")
        )
    return writes, IncompatibleKeys(missing, unexpected)


def apply_load(writes: list[Write]) -> None:
    with torch.no_grad():
        for target, value in writes:
            if isinstance(target, nn.Module):
                target.set_extra_state(value)
            else:
                target.copy_(value)


def load_state_dict(model: nn.Module, state: Mapping[str, Any], *, strict: bool = True,
                    assign: bool = False) -> IncompatibleKeys:
    """Load full tensors (as ``state_dict(full=True)`` returns, or a plain single-process
    ``state_dict()``), ShardedTensors or DTensors (``model.state_dict()`` of a parallelized
    model, devmesh's or torch's) into a parallelized model: every rank copies its own block
    (no communication for full tensors; a sharded value is gathered first). All or nothing:
    parameters and buffers are all checked (names, exact shapes) before the first copy.
    ``strict=False`` loads what matches and returns the missing and unexpected keys, as
    ``nn.Module.load_state_dict`` does. ``assign=True`` (as torch's) makes each rank's
    block of the loaded values the parameters instead of copying into them: the way to
    load into a model built on the meta device and parallelized there (copying into
    meta parameters would keep nothing, and is refused). Given a pipeline runner: its
    ``load_state_dict`` (a whole model's state into the stages)."""
    if _pipeline_runner(model):
        if assign:
            raise StateDictError("a pipeline runner's load_state_dict copies into its "
                                 "stages: load with assign=True into each stage's module")
        return model.load_state_dict(state, strict=strict)
    model = module_of(model, "load_state_dict")
    if assign:  # the module's own load_state_dict takes devmesh's layouts, and assign
        return model.load_state_dict(state, strict=strict, assign=True)
    writes, incompatible = prepare_load(model, state, strict=strict)
    # only the tensors written (a DTensor's local block among them): a non-persistent
    # buffer left on meta is not loaded anyway
    on_meta = {id(t) for t, _ in writes if isinstance(t, torch.Tensor) and t.is_meta}
    meta = [name for name, value in [*model.named_parameters(), *model.named_buffers()]
            if id(value) in on_meta or id(local_of(value)) in on_meta] or (
        ["a tensor"] if on_meta else [])
    if meta:
        raise StateDictError(
            f"{type(model).__name__}'s parameters are on the meta device ({meta[0]}"
            f"{f' and {len(meta) - 1} more' if len(meta) > 1 else ''}): copying into them "
            "keeps nothing. Pass assign=True, or give them storage first "
            "(model.to_empty(device=...)) and then load")
    apply_load(writes)
    return incompatible

