"""What passes into and between pipeline stages, as values: a batch cut into micro-batches, a
stage's output as the tensors the next stage takes, the outputs a backward starts from with their gradients, and the zero loss that
lets a failed micro-batch's backward still run every collective its copies run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from devmesh.parallel.pipeline.messages import MAX_TENSORS
from devmesh.parallel.pipeline.split import PipelineError

__all__ = ["cut_micro_batches", "zero_loss", "differentiable", "detached", "stage_tensors", "kind_of", "one_tensor"]


def zero_loss(output: object) -> torch.Tensor:
    """A zero that depends on every floating-point tensor of ``output`` needing a gradient
    (a DTensor through its local block): its backward runs the stage's whole backward, with
    zero gradients."""
    from torch.distributed.tensor import DTensor

    found: list[torch.Tensor] = []
    stack = [output]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and value.requires_grad:
                found.append(value.to_local() if isinstance(value, DTensor) else value)
        elif isinstance(value, (tuple, list)):
            stack.extend(value)
        elif isinstance(value, Mapping):
            stack.extend(value.values())
    if not found:
        return torch.zeros(())
    return torch.stack([(tensor * 0).sum().float() for tensor in found]).sum()


def differentiable(outs: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...] | None
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """The outputs a backward starts from, with their gradients: the last stage's loss
    (``grads`` is ``None``: no gradient comes), or each floating-point output that requires
    grad, with the gradient the next stage sent for it."""
    if grads is None:
        return [o for o in outs if o.requires_grad], [None for o in outs if o.requires_grad]
    floats = [o for o in outs if o.is_floating_point()]
    pairs = [(o, g) for o, g in zip(floats, grads, strict=True) if o.requires_grad]
    return [o for o, _ in pairs], [g for _, g in pairs]


def detached(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(detached(v) for v in value)
    return value


def stage_tensors(value: object, what: str) -> tuple[torch.Tensor, ...]:
    """A stage's output as the tensors that go to the next stage: one tensor, or a tuple
    or list of tensors (passed on as the next stage's positional arguments)."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor)
                                                            for v in value):
        return tuple(value)
    raise PipelineError(
        f"{what} returned {kind_of(value)}: a pipeline stage passes a tensor, or a tuple of "
        f"1 to {MAX_TENSORS} tensors, to the next stage (the next stage's forward takes "
        "them as its positional arguments); compute other values in the stage that uses "
        "them")


def kind_of(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def one_tensor(value: object, what: str) -> torch.Tensor:
    """``value`` if it is a tensor (the loss function's result), else refused with the fix."""
    if isinstance(value, torch.Tensor):
        return value
    raise PipelineError(f"{what} returned {kind_of(value)}, not a tensor: it must return one "
                        "number per micro-batch (a reduction of 'mean' or 'sum')")


def cut_micro_batches(inputs: torch.Tensor | tuple[torch.Tensor, ...] | None,
                      targets: torch.Tensor | None, input_kwargs: Mapping[str, Any] | None,
                      *, microbatches: int, first_stage_here: bool, last_stage_here: bool,
                      training: bool, has_loss_fn: bool) -> dict[str, tuple]:
    """Each micro-batch's inputs (a tuple of tensors: the first stage's positional
    arguments), keyword inputs and targets, cut along dim 0; refused, with the fix, where
    this rank's stages need what was not given."""
    m = microbatches
    chunks: dict[str, tuple] = {}
    for name, batch in (("inputs", inputs), ("targets", targets)):
        if batch is None:
            continue
        several = name == "inputs" and isinstance(batch, (tuple, list))
        parts = tuple(batch) if several else (batch,)
        if not parts or not all(isinstance(t, torch.Tensor) and t.ndim > 0 for t in parts):
            raise PipelineError(
                f"the {name} must be {'tensors' if name == 'inputs' else 'one tensor'} "
                f"with a batch dim, got {kind_of(batch)}"
                + (": the first stage takes a tensor or a tuple of tensors (its forward's "
                   "positional arguments)" if name == "inputs" else ""))
        for part in parts:
            if part.shape[0] % m:
                raise PipelineError(f"{m} micro-batches do not divide the batch of "
                                    f"{part.shape[0]} {name}: use a batch that is a "
                                    f"multiple of {m}, or another micro-batch count")
        cut = [part.chunk(m) for part in parts]
        chunks[name] = tuple(zip(*cut, strict=True)) if name == "inputs" else cut[0]
    if input_kwargs:  # tensors cut along dim 0 as the inputs; other values go to all
        for key, value in input_kwargs.items():
            if isinstance(value, torch.Tensor) and (value.ndim == 0 or value.shape[0] % m):
                raise PipelineError(f"{m} micro-batches do not divide the keyword input "
                                    f"{key!r} of shape {tuple(value.shape)} along dim 0: "
                                    f"give it a batch dim that is a multiple of {m}")
        cut = {k: v.chunk(m) if isinstance(v, torch.Tensor) else (v,) * m
               for k, v in input_kwargs.items()}
        chunks["kwargs"] = tuple({k: v[mb] for k, v in cut.items()} for mb in range(m))
    if first_stage_here and "inputs" not in chunks:
        raise PipelineError("the first stage's rank needs the inputs: step(inputs, ...)")
    if last_stage_here and "targets" not in chunks and training:
        raise PipelineError("the last stage's rank needs the targets: schedule.step(target=y) "
                            "(runner.step(inputs, targets))")
    if "targets" in chunks and not has_loss_fn:
        raise PipelineError("targets were given, but the runner has no loss function: "
                            "build it with one (PipelineRunner(..., loss_fn))")
    return chunks
