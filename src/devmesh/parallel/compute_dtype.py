"""Mixed precision without FSDP: a model computing in ``MixedPrecisionPolicy.param_dtype``
while its parameters (the optimizer's master weights) keep their own dtype — what
``replicate(..., mp_policy=...)`` and ``parallelize`` on DDP and tensor-parallel meshes use.

FSDP computes in ``param_dtype`` because it gathers its parameters in it. A model that is
not sharded has nothing to gather, so each module holding parameters casts its own ones as
its forward starts — the cast copies stand in their slots while it runs (torch's tensor
parallelism's DTensors cast as DTensors) — and puts the parameters back as it ends.
Autograd carries each gradient back through the cast into the parameter's own dtype, so the
optimizer and the gradient reduction see float32 gradients of float32 weights; a block run
again by activation checkpointing casts again. A weight tied between modules (an embedding
and its head) is cast once per forward of the whole model: one copy, whose uses' gradients
sum in ``param_dtype`` before the cast back, as FSDP's one gathered copy and
``torch.autocast``'s cast cache sum them (cast per module, they summed in float32 and the
tied weight trained apart from torch's). Only tied weights share a copy: a block recomputed
by activation checkpointing runs outside the forward and casts anew, and a selectively
checkpointed block must replay the casts its forward made. Like FSDP's, the model's floating-point
inputs are cast to ``param_dtype`` (``cast_forward_inputs``) and its outputs to
``output_dtype``.

The casts a backward needs stay alive until it runs (a linear's weight, in ``param_dtype``):
half of the float32 parameters' bytes at most, as under ``torch.autocast``.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from devmesh import _torch_compat
from devmesh.parallel.fsdp.mixed_precision import MixedPrecisionPolicy
from devmesh.parallel.swap import swap_parameter

__all__ = ["compute_in", "is_compute_copy"]

_COPY = "_devmesh_compute_copy"  # marks a cast copy standing in a parameter's slot
_SAVED = "_devmesh_compute_saved"  # per module: a stack of the parameters its casts replace


def is_compute_copy(t: torch.Tensor) -> bool:
    """Whether ``t`` is a parameter's cast copy standing in its slot during a forward."""
    return getattr(t, _COPY, False)


def compute_in(module: nn.Module, policy: MixedPrecisionPolicy,
               ignored: set[int] | frozenset[int] = frozenset()) -> None:
    """Make ``module`` compute in ``policy.param_dtype`` (its floating-point parameters but
    those whose ids are in ``ignored``), cast its inputs and outputs as ``policy`` says."""
    dtype = policy.param_dtype
    if dtype is not None:
        casts = _TiedCasts(_tied(module))
        if casts.tied:
            module.register_forward_pre_hook(casts.open, prepend=True)
            module.register_forward_hook(casts.close, always_call=True)
        for sub in module.modules():
            names = tuple(n for n, p in sub._parameters.items()
                          if p is not None and p.is_floating_point() and id(p) not in ignored)
            if names:
                # innermost: cast after the module's other pre-hooks (a style's own swap of
                # its parameters), put back before its other hooks undo theirs
                sub.register_forward_pre_hook(functools.partial(_cast, names, dtype, casts))
                sub.register_forward_hook(_restore, always_call=True, prepend=True)
        if policy.cast_forward_inputs:
            module.register_forward_pre_hook(functools.partial(_cast_inputs, dtype),
                                              with_kwargs=True)
    if policy.output_dtype is not None:
        module.register_forward_hook(functools.partial(_cast_output, policy.output_dtype))


def _floating_to(dtype: torch.dtype, tree):
    return _torch_compat.pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def _tied(module: nn.Module) -> frozenset[int]:
    """The ids of the parameters held by more than one submodule of ``module``."""
    holders: dict[int, int] = {}
    for sub in module.modules():
        for param in sub._parameters.values():
            if param is not None:
                holders[id(param)] = holders.get(id(param), 0) + 1
    return frozenset(i for i, n in holders.items() if n > 1)


class _TiedCasts:
    """The cast copies of the tied parameters (ids in ``tied``) during one forward of the
    ``compute_in`` module, shared by every module holding one; outside that forward (a block
    recomputed in backward) each module casts its own."""

    def __init__(self, tied: frozenset[int]) -> None:
        self.tied = tied
        self.depth = 0
        self.copies: dict[int, torch.Tensor] = {}

    def open(self, module: nn.Module, args) -> None:
        self.depth += 1

    def close(self, module: nn.Module, args, output) -> None:
        self.depth -= 1
        if not self.depth:
            self.copies.clear()

    def of(self, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        shared = self.depth > 0 and id(param) in self.tied
        copy = self.copies.get(id(param)) if shared else None
        if copy is None:
            copy = param.to(dtype)
            setattr(copy, _COPY, True)
            if shared:
                self.copies[id(param)] = copy
        return copy


def _cast(names: tuple[str, ...], dtype: torch.dtype, casts: _TiedCasts, module: nn.Module,
          args) -> None:
    saved = {}
    for name in names:
        param = module._parameters.get(name)
        if param is None or param.dtype == dtype or is_compute_copy(param):
            continue
        copy = casts.of(param, dtype)
        saved[name] = param
        swap_parameter(module, name, copy)
    module.__dict__.setdefault(_SAVED, []).append(saved)


def _restore(module: nn.Module, args, output) -> None:
    stack = module.__dict__.get(_SAVED)
    if stack:
        for name, param in stack.pop().items():
            swap_parameter(module, name, param)


def _cast_inputs(dtype: torch.dtype, module: nn.Module, args, kwargs):
    return _floating_to(dtype, (args, kwargs))


def _cast_output(dtype: torch.dtype, module: nn.Module, args, output):
    return _floating_to(dtype, output)
