"""Checkpoints of parallelized models: one file of full tensors, written atomically, read
without running anything.

``save_checkpoint`` is collective: every rank gathers the full parameters (and the optimizer
state tensors that have their parameter's shape, such as Adam's moments, gathered with the
parameter's spec), and rank 0 writes one file through :func:`devmesh._files.atomic_file` — a
crash never leaves a half-written checkpoint, the old one stays intact, and no planted file or
symlink is followed. Rank 0 tells every rank whether the write succeeded, so a failed write
raises on every rank instead of leaving the others waiting.

The file holds only tensors and plain data (numbers, strings, lists, dicts), so
``load_checkpoint`` reads it with ``torch.load(weights_only=True)``: a file whose pickle would
build other objects or call functions is refused before anything runs. Every rank reads the
file and keeps its own blocks, so a checkpoint loads into any parallel layout of the same model
(or a plain one). A load is all or nothing: model and optimizer state are checked in full
before the first tensor is written.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from devmesh._files import atomic_file
from devmesh.errors import CheckpointError, CheckpointNotFoundError
from devmesh.parallel.param import as_sharded, get_layout
from devmesh.parallel.state_dict import apply_load, local_block, prepare_load, state_dict

__all__ = ["save_checkpoint", "load_checkpoint", "FORMAT"]

FORMAT = "devmesh-checkpoint/1"
_PLAIN = (str, int, float, bool, type(None), torch.Tensor, torch.dtype, torch.Size)


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _check_plain(value: Any, where: str) -> None:
    """``extra`` must be data torch's safe loader reads back: no arbitrary objects."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise CheckpointError(f"{where} has a key {k!r}: keys must be str or int")
            _check_plain(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
    elif not isinstance(value, _PLAIN):
        raise CheckpointError(
            f"{where} is a {type(value).__name__}: a checkpoint holds tensors and plain data "
            "(numbers, strings, lists, dicts) only, so that loading it never runs code; store "
            "its state instead (e.g. a dict of numbers)"
        )


def _optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    names = _names(model)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[str, dict[str, Any]] = {}
    for p in params:
        if id(p) not in names:
            raise CheckpointError("the optimizer holds a parameter that is not in the model")
        entry = {}
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == p.shape and get_layout(p):
                sharded = as_sharded(p)
                assert sharded is not None
                entry[key] = type(sharded)(value.detach(), sharded.device_mesh,
                                           sharded.spec).full_tensor()
            else:
                entry[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
        state[names[id(p)]] = entry
    groups = [{k: v for k, v in g.items() if k != "params"} | {
        "params": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def _agree_on_outcome(error: str | None) -> None:
    """Rank 0's outcome, on every rank: raise everywhere if the write failed."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        # the text travels as bytes, not a pickle: nothing is unpickled from a peer
        data = (error or "").encode()
        length = torch.tensor([len(data)])
        dist.broadcast(length, src=0)
        buffer = torch.zeros(int(length.item()), dtype=torch.uint8)
        if dist.get_rank() == 0 and data:
            buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if buffer.numel():
            dist.broadcast(buffer, src=0)
        error = bytes(buffer.tolist()).decode(errors="replace") or None
    if error:
        raise CheckpointError(f"save_checkpoint failed on rank 0: {error}; the previous "
                              "checkpoint, if any, is untouched")


def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    *, extra: dict[str, Any] | None = None) -> None:
    """Collective: write ``model`` (and ``optimizer``) as full tensors to ``path``.
    ``extra`` (epoch, data position, RNG state as tensors, ...) must be plain data."""
    if extra is not None:
        _check_plain(extra, "extra")
    state: dict[str, Any] = {"format": FORMAT, "model": state_dict(model, full=True)}
    if optimizer is not None:
        state["optimizer"] = _optimizer_state(model, optimizer)
    if extra is not None:
        state["extra"] = extra
    error = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            with atomic_file(path, "wb") as f:
                torch.save(state, f)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = f"{type(exc).__name__}: {exc}"
    _agree_on_outcome(error)


def _read(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"no checkpoint at {path}")
    if os.path.getsize(path) == 0:
        raise CheckpointError(f"{path} is empty (0 bytes): not a checkpoint")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} is truncated or corrupted: it is not the zip archive "
                              "torch.save writes")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = next((line.strip() for line in str(exc).splitlines()
                       if "WeightsUnpickler error" in line), "an object torch's safe loader "
                      "does not allow")
        raise CheckpointError(
            f"{path} was refused without running anything: it asks to build objects or call "
            f"functions that a checkpoint never contains ({reason}). A devmesh checkpoint "
            "holds tensors and plain data; do not load this file with weights_only=False "
            "unless you trust whoever wrote it"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is truncated or corrupted and cannot be read "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or "model" not in state:
        looks_plain = isinstance(state, dict) and all(
            isinstance(v, torch.Tensor) for v in state.values())
        hint = (" It looks like a plain torch.save(model.state_dict()) file: load it with "
                "devmesh.parallel.load_state_dict(model, torch.load(path, weights_only=True))"
                if looks_plain else "")
        raise CheckpointError(f"{path} is not a devmesh checkpoint (no {FORMAT!r} marker)."
                              + hint)
    return state


def _prepare_optimizer(path: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                       saved: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state dict this rank will load, checked against the optimizer."""
    names = _names(model)
    by_name = dict(model.named_parameters())
    current = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    stored = [list(g.get("params", [])) for g in saved.get("param_groups", [])]
    if current != stored:
        raise CheckpointError(
            f"{path}: the optimizer's parameter groups differ from the saved ones (saved "
            f"{[len(g) for g in stored]} parameters per group, this optimizer "
            f"{[len(g) for g in current]}); build the optimizer over the same parameters"
        )
    index = {name: i for i, name in enumerate(n for g in current for n in g)}
    local_state = {}
    for name, entry in saved.get("state", {}).items():
        if name not in index:
            raise CheckpointError(f"{path}: optimizer state for unknown parameter {name!r}")
        p = by_name[name]
        layout = get_layout(p)
        out = {}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                shape = tuple(layout.spec.global_shape) if layout else tuple(p.shape)
                if tuple(value.shape) != shape:
                    raise CheckpointError(
                        f"{path}: optimizer state {name}.{key} has shape "
                        f"{tuple(value.shape)}, the parameter's is {shape}")
                value = local_block(p, value, name).reshape(p.shape).clone()
            out[key] = value
        local_state[index[name]] = out
    groups = [g | {"params": [index[n] for n in g["params"]]} for g in saved["param_groups"]]
    return {"state": local_state, "param_groups": groups}


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
                    ) -> dict[str, Any] | None:
    """Load ``path`` into ``model`` (and ``optimizer``), each rank taking its own blocks.
    Returns the ``extra`` dict that was saved, if any. Nothing is changed unless everything
    fits: a refused, truncated or foreign file, or a model or optimizer that does not match,
    raises :class:`~devmesh.errors.CheckpointError` (or ``StateDictError``) first."""
    state = _read(path)
    writes, _ = prepare_load(model, state["model"], strict=True)
    optimizer_state = None
    if optimizer is not None:
        if "optimizer" not in state:
            raise CheckpointError(f"{path} holds no optimizer state")
        optimizer_state = _prepare_optimizer(path, model, optimizer, state["optimizer"])
    apply_load(writes)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    return state.get("extra")
