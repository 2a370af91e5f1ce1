"""Reading the single-file checkpoints devmesh wrote before sharded checkpoints (format
``devmesh-checkpoint/1``: one ``torch.save`` file of full tensors).

The file is read with ``torch.load(weights_only=True)``: a file whose pickle would build other
objects or call functions is refused before anything runs. Every rank keeps its own blocks of
the full tensors; the caller applies the result only once every rank has read and checked it.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from typing import Any

import torch
from torch import nn

from devmesh.errors import CheckpointError, CheckpointNotFoundError
from devmesh.parallel.param import get_layout
from devmesh.parallel.state_dict import local_block, named_parameters, prepare_load

__all__ = ["prepare", "FORMAT"]

FORMAT = "devmesh-checkpoint/1"


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in named_parameters(model, remove_duplicate=True)}


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
    by_name = dict(named_parameters(model, remove_duplicate=True))
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


def prepare(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None
            ) -> tuple[tuple[list, dict[str, Any] | None], dict[str, Any] | None]:
    """Read and check a single-file checkpoint: ``((writes, optimizer state), extra)``."""
    state = _read(path)
    writes, _ = prepare_load(model, state["model"], strict=True)
    optimizer_state = None
    if optimizer is not None:
        if "optimizer" not in state:
            raise CheckpointError(f"{path} holds no optimizer state")
        optimizer_state = _prepare_optimizer(path, model, optimizer, state["optimizer"])
    return (writes, optimizer_state), state.get("extra")
