"""An optimizer's state as DTensors, so torch's checkpointing saves all of it.

devmesh's split parameters are this rank's blocks as plain tensors, and so are the optimizer
states made from them (Adam's moments). Given such blocks, ``torch.distributed.checkpoint``
takes them for replicated tensors: it writes one rank's block under each key and ``dcp.load``
hands that block to every rank — silently. torch's FSDP2 has DTensor parameters, hence DTensor
states. Here every optimizer that steps a devmesh-split parameter gets two hooks:
``optimizer.state_dict()`` gives the states of split parameters as DTensors laid out as their
parameters (this rank's block, not copied), and ``optimizer.load_state_dict`` takes DTensors
back (this rank's block of them; another layout is gathered and cut). The optimizer is found
at its first step (torch's ``get_optimizer_state_dict`` takes one before loading), through
torch's global step hook, registered once when devmesh first splits a parameter; DTensor
states loaded before that step become blocks at it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from devmesh.parallel.optim_check import check_optimizer
from devmesh.parallel.param import as_dtensor, block_of, split_layout

__all__ = ["watch_optimizers"]

_seen: weakref.WeakSet = weakref.WeakSet()
_watching = False


def watch_optimizers() -> None:
    """From now on, optimizers stepping split parameters give and take DTensor states."""
    global _watching
    if not _watching:
        register_optimizer_step_pre_hook(_on_step)
        _watching = True


def _on_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _seen:
        return
    split = [p for p in _params(optimizer) if split_layout(p) is not None]
    if split:
        check_optimizer(optimizer, split)  # raises at every step of a refused optimizer
    _seen.add(optimizer)
    if split:
        optimizer.register_state_dict_post_hook(_states_as_dtensors)
        optimizer.register_load_state_dict_pre_hook(_states_as_blocks)
        _blocks_of_loaded_states(optimizer, split)


def _blocks_of_loaded_states(optimizer: torch.optim.Optimizer, split: list) -> None:
    """States given as DTensors by ``load_state_dict`` before this first step (before the
    hooks existed: ``opt.load_state_dict(torch.load(...))`` of a saved ``state_dict()``)
    become this rank's blocks now."""
    from torch.distributed.tensor import DTensor

    for param in split:
        values = optimizer.state.get(param, {})
        for key, value in list(values.items()):
            if isinstance(value, DTensor):
                values[key] = block_of(value, param, f"optimizer state {key}")


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _param_of_key(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict[Any, torch.Tensor]:
    """Which parameter each key of ``state_dict["state"]`` belongs to, as torch's
    ``load_state_dict`` pairs them: the groups' ``params`` entries (indices, or names from
    ``get_optimizer_state_dict``) in order, with the optimizer's parameters in order."""
    keys = [k for group in state_dict.get("param_groups", ()) for k in group["params"]]
    return dict(zip(keys, _params(optimizer), strict=True))


def _states_as_dtensors(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    param_of = _param_of_key(optimizer, state_dict)
    state = dict(state_dict["state"])  # new dicts: the values are the optimizer's own
    for key, values in state.items():
        param = param_of.get(key)
        if param is None or split_layout(param) is None:
            continue
        state[key] = {k: as_dtensor(v, param)
                      if isinstance(v, torch.Tensor) and v.shape == param.shape else v
                      for k, v in values.items()}
    return {**state_dict, "state": state}


def _states_as_blocks(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    from torch.distributed.tensor import DTensor

    param_of = _param_of_key(optimizer, state_dict)
    state = dict(state_dict.get("state", {}))
    for key, values in state.items():
        param = param_of.get(key)  # none: torch's own load_state_dict names the mismatch
        if param is not None and split_layout(param) is not None:
            state[key] = {k: block_of(v, param, f"optimizer state {key}.{k}")
                          if isinstance(v, DTensor) else v for k, v in values.items()}
    return {**state_dict, "state": state}
