"""The whole pipelined model, seen from any rank: its state dict and loading one
(:func:`devmesh.pictures.describe` of a runner describes every stage).

A rank holds only its own stages, so anything about the whole model needs the other stages'
ranks. These helpers exchange over the pipeline dim only: the ranks of one pipeline (one per
stage) share what each holds; the data-parallel and tensor-parallel copies of a pipeline do
the same among themselves. What travels is bytes and JSON, never pickles.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from devmesh import _torch_compat
from devmesh._torch_compat import IncompatibleKeys
from devmesh.distributed import comm, consensus
from devmesh.errors import StateDictError
from devmesh.parallel.checkpoint.encoding import dtype_name, dtype_of
from devmesh.parallel.state_dict import (
    apply_load,
    extra_states,
    local_state_dict,
    named_parameters,
    persistent_buffers,
    prepare_load,
    state_dict_name,
)

if TYPE_CHECKING:
    from devmesh.parallel.pipeline.runner import PipelineRunner

__all__ = ["full_state_dict", "load_full_state_dict", "stage_ranks", "local_module"]


def stage_ranks(runner: PipelineRunner, stage: int) -> list[int]:
    """The global ranks holding ``stage``: every rank of the mesh at its pipeline index."""
    layout = runner.mesh.layout
    index = runner.schedule.rank_of(stage)
    return sorted(r for r in layout.rank_list()
                  if layout.coordinate_of(r)[runner.dim] == index)


def _pp_group(runner: PipelineRunner):
    return runner.mesh.get_group(runner.dim)


def full_state_dict(runner: PipelineRunner) -> dict[str, torch.Tensor]:
    """Every stage's full parameters and buffers, under the whole model's names, on every
    rank: each rank gathers its stages' full tensors (over their own meshes), then each
    pipeline index broadcasts its bytes to the others (one broadcast per index)."""
    # inside `if rank == 0:` (torch's way to save), say so
    consensus.warn_if_called_alone("runner.state_dict(full=True)", runner.mesh.layout.rank_list())
    mine: list[tuple[int, str, torch.Tensor]] = []
    for s in sorted(runner.stages):
        mine += [(s, k, v) for k, v in local_state_dict(_unwrapped(runner.stages[s]),
                                                        full=True).items()]
    odd = [k for _, k, v in mine if not isinstance(v, torch.Tensor)]
    if odd:  # broadcast as bytes of a tensor's dtype and shape
        raise StateDictError(f"the pipelined model's full state dict holds {odd}, not "
                             "tensors (a module's get_extra_state): only tensors can be "
                             "gathered over the pipeline; save it with "
                             "runner.state_dict(full=False) or a checkpoint")
    listing = json.dumps([[s, k, dtype_name(v.dtype), list(v.shape)] for s, k, v in mine])
    listings = [json.loads(t) for t in consensus.gather_texts(listing, _pp_group(runner))]
    keys = [k for entries in listings for _, k, _, _ in entries]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise StateDictError(f"pipeline stages on different ranks hold the same names "
                             f"{twice}: give each stage the whole model's names "
                             "(split_sequential does)")
    found: list[tuple[int, str, torch.Tensor]] = []
    device = comm.mesh_device(runner.mesh)
    for index, entries in enumerate(listings):
        sizes = [torch.Size(shape).numel() * dtype_of(dtype).itemsize
                 for _, _, dtype, shape in entries]
        if index == runner.index:
            data = torch.cat([v.detach().to(device).reshape(-1).view(torch.uint8)
                              for _, _, v in mine]
                             ) if mine else torch.zeros(0, dtype=torch.uint8, device=device)
        else:
            data = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        if len(data):
            comm.broadcast(data, runner.mesh, (runner.dim,), src_index=index)
        for (s, k, dtype, shape), piece in zip(entries, data.split(sizes), strict=True):
            # copied first: a piece starts where the one before it ended (an int64 buffer
            # after three float32 values), too unaligned to be viewed as its own dtype
            found.append((s, k, piece.clone().view(dtype_of(dtype)).reshape(shape)))
    return {k: v for _, k, v in sorted(found, key=lambda e: e[0])}


def load_full_state_dict(runner: PipelineRunner, state: Mapping[str, Any], *,
                         strict: bool = True) -> IncompatibleKeys:
    """Load a whole model's state dict (a plain model's ``state_dict()``, or
    :func:`full_state_dict`'s) into the stages: each rank copies its stages' blocks. With
    ``strict``, a name no stage has is an error, as is a stage name the state lacks; every
    rank of the pipeline raises, and nothing is loaded anywhere."""
    module = runner.module
    state = {state_dict_name(key): value for key, value in state.items()}  # as prepare_load
    names = set(dict(named_parameters(module))) | set(persistent_buffers(module)) | set(
        extra_states(module))
    union = {k for t in consensus.gather_texts(json.dumps(sorted(names)), _pp_group(runner))
             for k in json.loads(t)}
    unexpected = sorted(set(state) - union)
    with consensus.refused_everywhere(_pp_group(runner), "loading the pipelined model's state "
                                 "dict", StateDictError, outcome="failed"):
        if strict and unexpected:
            raise StateDictError("Error(s) in loading state_dict for the pipelined model: "
                                 f"Unexpected key(s) in state_dict: {unexpected} (no stage has "
                                 "them). Nothing was loaded")
        writes, mine = prepare_load(module, {k: v for k, v in state.items() if k in names},
                                    strict=strict)
    incompatible = IncompatibleKeys(mine.missing_keys, unexpected)
    apply_load(writes)
    return incompatible


def local_module(stages: Mapping[int, nn.Module]) -> nn.Module:
    """This rank's stages as one module, under the whole model's names: the stage itself
    when there is one, else an ``nn.Sequential`` of the stages' children in stage order. A
    ``torch.compile``d or DDP-wrapped stage counts as the module inside (:func:`_unwrapped`)."""
    stages = {s: _unwrapped(stage) for s, stage in stages.items()}
    if len(stages) == 1:
        return next(iter(stages.values()))
    children: dict[str, nn.Module] = {}
    for s in sorted(stages):
        if dict(stages[s].named_parameters(recurse=False)) or dict(
                stages[s].named_buffers(recurse=False)):
            raise StateDictError(f"stage {s} holds parameters of its own (not in a child "
                                 "module): the stages of one rank cannot be joined into one "
                                 "module; use split_sequential's stages")
        for name, child in stages[s].named_children():
            children[name] = _join(name, children[name], child) if name in children else child
    return _JoinedStages(OrderedDict(children), [stages[s] for s in sorted(stages)])


def _unwrapped(stage: nn.Module) -> nn.Module:
    """The module inside the wrappers a whole stage may come in — ``torch.compile(stage)``,
    torch's ``DistributedDataParallel(stage)``, either in the other — else ``stage``: names
    then carry no ``_orig_mod.`` or ``module.``, as torch's DCP state dicts of such models.
    """
    while True:
        compiled = _torch_compat.compiled_module_inner(stage)
        if compiled is not None:
            stage = compiled
        elif isinstance(stage, nn.parallel.DistributedDataParallel):
            stage = stage.module
        else:
            return stage


def _join(name: str, first: nn.Module, second: nn.Module) -> nn.Module:
    """Two stages' parts of one module of the model (``split_sequential`` at a dotted name,
    interleaved: ``blocks.0-3`` and ``blocks.8-11`` on one rank; a transformers model's
    ``model`` holding each stage's decoder layers) as one container under its name. A part
    holding no state (an ``Identity`` standing for another stage's norm, rotary tables in
    non-persistent buffers) gives way to the other; two parts of different kinds, or holding
    state of their own under one name, are refused."""
    if _stateless(first):
        return second
    if _stateless(second):
        return first
    if type(first) is not type(second) or _own_state(first) or _own_state(second):
        raise StateDictError(f"stages of this rank share the child name {name!r}: give each "
                             "stage the whole model's names (split_sequential does)")
    children: dict[str, nn.Module] = dict(first.named_children())
    for key, child in second.named_children():
        children[key] = _join(f"{name}.{key}", children[key], child) if key in children \
            else child
    return nn.Sequential(OrderedDict(children))


def _stateless(module: nn.Module) -> bool:
    """No parameter and no persistent buffer anywhere in ``module``."""
    return not any(True for _ in module.parameters()) and not persistent_buffers(module)


def _own_state(module: nn.Module) -> bool:
    return bool(module._parameters) or any(
        name not in module._non_persistent_buffers_set for name in module._buffers)


class _JoinedStages(nn.Sequential):
    """Several stages' children under one module. Conversions (``to_empty`` after building on
    the meta device, ``.to()``, ``.double()``) go through each stage, so a stage that
    ``fully_shard`` or ``replicate`` made keeps its parameters laid out and its state
    following the new tensors (:mod:`devmesh.parallel.conversion`); converting the children
    directly would bypass the stage and leave its units holding the old tensors."""

    def __init__(self, children: OrderedDict, stages: list[nn.Module]) -> None:
        super().__init__(children)
        self._stages = stages  # a plain list: not submodules, so names stay the children's

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001 - torch's signature
        if not recurse:
            return super()._apply(fn, recurse)
        for stage in self._stages:
            stage._apply(fn)
        return self
