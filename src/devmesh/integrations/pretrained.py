"""Weights in the ecosystem's format, both ways: a transformers checkpoint folder
(``model.safetensors``, or shards listed by ``model.safetensors.index.json``, as
``save_pretrained`` writes them) read straight into a parallelized model — each rank reading
only the bytes of its own blocks, never the whole model — and a parallelized model written
as such a folder, which ``from_pretrained`` loads back.

Names are the model's state-dict names (:func:`devmesh.parallel.state_dict` 's keys), found
in the checkpoint as transformers' own loading finds them: renamed and merged by its
conversion mapping (a mixture of experts' per-expert tensors stacked into the model's
``gate_up_proj`` and ``down_proj``; :mod:`.checkpoint_names`), each rank reading only the
experts of its block. A tied parameter is read once, under whichever of its names the
checkpoint has (transformers saves a tied head under the embedding's name only).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from devmesh.distributed import consensus
from devmesh.errors import StateDictError
from devmesh.integrations.checkpoint_names import Stored, sources
from devmesh.parallel.checkpoint.blocks import packed_parts
from devmesh.parallel.param import is_dtensor, layout_of, local_block, local_of
from devmesh.parallel.state_dict import (
    named_parameters,
    persistent_buffers,
    state_dict,
)

__all__ = ["load_pretrained", "save_pretrained", "LoadedWeights", "SavesWhole"]

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class LoadedWeights:
    """What :func:`load_pretrained` read on this rank: ``tensors`` entries, ``bytes_read``
    of them (this rank's blocks only), of a checkpoint of ``checkpoint_bytes``."""

    tensors: int
    bytes_read: int
    checkpoint_bytes: int


def _files(folder: Path) -> dict[str, Path]:
    """Each tensor's name -> the safetensors file holding it."""
    index = folder / _INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / _SINGLE
    if not single.exists():
        raise StateDictError(f"{folder} holds neither {_SINGLE} nor {_INDEX}: give the folder "
                             "save_pretrained wrote (safetensors; a .bin checkpoint is not read)")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def load_pretrained(model: nn.Module, folder: str | os.PathLike, *, strict: bool = True
                    ) -> LoadedWeights:
    """Read a transformers checkpoint folder into ``model`` (parallelized or not): every
    parameter and persistent buffer takes this rank's block, read from the file by its
    offsets alone (a replicated tensor is read whole). All or nothing: names and shapes are
    checked before the first copy; with ``strict``, a tensor the model has and the
    checkpoint lacks (or the other way round) is an error naming it. Values are cast to the
    model's dtypes (a bfloat16 checkpoint into float32 master weights)."""
    # a refusal on one rank alone (a folder it cannot read, a model built differently)
    # would leave the others waiting in their next collective: every rank raises together
    with consensus.refused_everywhere(None, "load_pretrained", StateDictError):
        writes, read, files = _read_blocks(model, Path(folder), strict)
    with torch.no_grad():
        for destination, block in writes:
            destination.copy_(block)
    total = sum(_file_bytes(f) for f in set(files.values()))
    return LoadedWeights(len(writes), read, total)


def _read_blocks(model: nn.Module, root: Path, strict: bool
                 ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int, dict[str, Path]]:
    """This rank's block of every tensor ``model`` holds, read from the folder, with the
    tensor it goes into; raises (nothing read into the model) on any mismatch."""
    from safetensors import safe_open

    files = _files(root)
    targets: dict[str, torch.Tensor] = dict(named_parameters(model))
    targets.update(persistent_buffers(model))
    found, problems = sources(model, files, targets)
    by_id: dict[int, list[str]] = {}
    for name, tensor in targets.items():
        by_id.setdefault(id(tensor), []).append(name)
    missing = [names[0] for names in by_id.values() if not any(n in found for n in names)]
    unexpected = sorted(set(found) - set(targets))
    if strict and missing:
        problems.append(f"missing from the checkpoint: {sorted(missing)}")
    if strict and unexpected:
        problems.append(f"not in the model: {unexpected}")
    handles: dict[Path, object] = {}

    def open_(stored: Stored):
        if stored.file not in handles:
            handles[stored.file] = safe_open(str(stored.file), framework="pt").__enter__()
        return handles[stored.file].get_slice(stored.key)

    writes: list[tuple[torch.Tensor, torch.Tensor]] = []
    read = 0
    try:
        for names in by_id.values():
            name = next((n for n in names if n in found), None)
            if name is None:
                continue
            target, source = targets[name], found[name]
            layout = layout_of(target)
            full_shape = tuple(layout.full_shape) if layout is not None else tuple(target.shape)
            try:
                shape = source.shape(open_)
            except ValueError as exc:  # experts' tensors that do not stack
                problems.append(f"{name}: {exc}")
                continue
            if shape != full_shape:
                problems.append(f"{name}: the checkpoint's shape is {shape} "
                                f"({source.describe()}), the model's {full_shape}")
                continue
            destination = local_of(target) if is_dtensor(target) else target
            if layout is not None and layout.packed is not None:  # its piece of each part
                bounds = layout.spec.local_bounds(layout.mesh.get_coordinate())
                parts = [source.read(open_, list(zip(start, size, strict=True)))
                         for _, start, size in packed_parts(bounds, layout.packed, full_shape)]
                block = (torch.stack(parts, layout.packed[0]) if parts
                         else destination.new_empty(tuple(n for _, n in bounds)))
            elif layout is None or tuple(layout.spec.global_shape) != full_shape:
                block = source.read(open_, [(0, n) for n in full_shape])  # whole
                if layout is not None:
                    block = local_block(target, block.reshape(layout.spec.global_shape))
            else:
                block = source.read(open_, layout.spec.local_bounds(layout.mesh.get_coordinate()))
            read += block.numel() * block.element_size()
            writes.append((destination, block.reshape(destination.shape)))
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    if problems:
        raise StateDictError(f"cannot load {root} into {type(model).__name__}: "
                             + "; ".join(problems) + ". Nothing was loaded")
    return writes, read, files


def _file_bytes(path: Path) -> int:
    return path.stat().st_size


def save_pretrained(model: nn.Module, folder: str | os.PathLike, **kwargs) -> None:
    """Write ``model`` (parallelized) as a transformers checkpoint folder that
    ``from_pretrained`` loads back: collective — the ranks gather the full state dict
    tensor by tensor (:func:`devmesh.parallel.state_dict` with ``rank0_only=True``: only
    rank 0 keeps it, the others drop each tensor once gathered), rank 0 writes it through the model's own
    ``save_pretrained`` (its config, its tied-weight rules, its shards; ``kwargs`` go
    there) into a new folder beside ``folder``, then moves each file into place, so a
    failure leaves no half-written checkpoint file. Every rank returns once it is written
    (or raises if rank 0 could not write it)."""
    full = state_dict(model, full=True, rank0_only=True)
    if not dist.is_initialized():
        _write(model, Path(folder), full, kwargs)
        return
    with consensus.refused_everywhere(None, "save_pretrained", StateDictError,
                                      outcome="failed"):
        if dist.get_rank() == 0:
            _write(model, Path(folder), full, kwargs)


class SavesWhole:
    """What ``parallelize`` adds to a transformers model: its own ``save_pretrained``,
    called as users call it (every rank, no ``state_dict``), writes the whole model by
    :func:`save_pretrained` — collective, rank 0 writing — where transformers' would hand
    safetensors this rank's sharded tensors (and fail on them). Given a ``state_dict`` (as
    :func:`save_pretrained` itself passes it), it is transformers' own."""

    _devmesh_prefix = "SavesWhole"

    def save_pretrained(self, save_directory, *args, state_dict=None, **kwargs):
        if state_dict is not None or args:
            return super().save_pretrained(  # type: ignore[misc]
                save_directory, *args, state_dict=state_dict, **kwargs)
        kwargs.pop("is_main_process", None)  # rank 0 writes
        save_pretrained(self, save_directory, **kwargs)  # type: ignore[arg-type]
        return None


def _write(model: nn.Module, folder: Path, full: dict, kwargs: dict) -> None:
    save = getattr(model, "save_pretrained", None)
    if save is None:
        raise StateDictError(f"{type(model).__name__} has no save_pretrained: write a "
                             "transformers model (a PreTrainedModel)")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        try:
            save(str(staging), state_dict=full, **kwargs)
        except Exception as exc:  # transformers' own errors, said once on every rank
            raise StateDictError(f"save_pretrained into {folder} failed: {exc}") from exc
        folder.mkdir(exist_ok=True)
        for item in sorted(staging.iterdir()):
            os.replace(item, folder / item.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
