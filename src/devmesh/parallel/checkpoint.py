"""Checkpoints of parallelized models: one file of full tensors, written atomically.

``save_checkpoint`` is collective: every rank gathers the full parameters (and the optimizer
state tensors that have their parameter's shape, such as Adam's moments, gathered with the
parameter's spec), and rank 0 writes one ``torch.save`` file to a temporary name and renames it
over ``path`` — a crash never leaves a half-written checkpoint, and the old one stays intact.
Rank 0 tells every rank whether the write succeeded, so a failed write raises on every rank
instead of leaving the others waiting.

``load_checkpoint`` reads the file on every rank and keeps each rank's own blocks, so a
checkpoint loads into any parallel layout of the same model (or into a plain model).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from devmesh.errors import ParallelizeError
from devmesh.parallel.param import as_sharded, get_layout
from devmesh.parallel.utils import load_state_dict, local_block, state_dict

__all__ = ["save_checkpoint", "load_checkpoint"]


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    names = _names(model)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[str, dict[str, Any]] = {}
    for p in params:
        if id(p) not in names:
            raise ParallelizeError("the optimizer holds a parameter that is not in the model")
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
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise ParallelizeError(f"save_checkpoint failed on rank 0: {error}")


def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    *, extra: dict[str, Any] | None = None) -> None:
    """Collective: write ``model`` (and ``optimizer``) as full tensors to ``path``."""
    state: dict[str, Any] = {"model": state_dict(model, full=True)}
    if optimizer is not None:
        state["optimizer"] = _optimizer_state(model, optimizer)
    if extra is not None:
        state["extra"] = extra
    error = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        tmp = f"{path}.tmp"
        try:
            torch.save(state, tmp)
            os.replace(tmp, path)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = f"{type(exc).__name__}: {exc}"
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    _agree_on_outcome(error)


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
                    ) -> dict[str, Any] | None:
    """Load ``path`` into ``model`` (and ``optimizer``), each rank taking its own blocks.
    Returns the ``extra`` dict that was saved, if any."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    load_state_dict(model, state["model"])
    if optimizer is not None:
        if "optimizer" not in state:
            raise ParallelizeError(f"{path} holds no optimizer state")
        saved = state["optimizer"]
        by_name = dict(model.named_parameters())
        index = {}
        local_state = {}
        for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]):
            name = _names(model)[id(p)]
            index[name] = i
            entry = {}
            for key, value in saved["state"].get(name, {}).items():
                if isinstance(value, torch.Tensor) and get_layout(by_name[name]) is not None \
                        and value.shape == tuple(get_layout(by_name[name]).spec.global_shape):
                    value = local_block(by_name[name], value).reshape(p.shape).clone()
                entry[key] = value
            if entry:
                local_state[i] = entry
        groups = [g | {"params": [index[n] for n in g["params"]]} for g in saved["param_groups"]]
        optimizer.load_state_dict({"state": local_state, "param_groups": groups})
    return state.get("extra")
