"""The compute actions of a pipeline schedule on this rank's stages: ``F`` (a stage's forward
of one micro-batch, its loss on the last stage), ``B`` (its whole backward), ``I`` (the input
gradient only) and ``W`` (the weight gradients an ``I`` left). Each receives what it needs
from the neighbouring stage, computes, and sends what it owes — even after a failure, when it
sends zeros, so that no peer waits; the failure is kept in the step's state and raised on
every rank at the step's end (:class:`~devmesh.parallel.pipeline.runner.PipelineRunner`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from devmesh.layout.schedule import Action, Schedule
from devmesh.parallel.fsdp import parameters_grouped_with
from devmesh.parallel.pipeline.grad_sync import StageGradSync
from devmesh.parallel.pipeline.layer_cuts import LayerCuts
from devmesh.parallel.pipeline.messages import StageLinks, describe, layout_of
from devmesh.parallel.pipeline.split import PipelineError
from devmesh.parallel.pipeline.split_backward import SplitBackward
from devmesh.parallel.pipeline.stage_values import (
    detached,
    differentiable,
    one_tensor,
    stage_tensors,
    zero_loss,
)
from devmesh.parallel.pipeline.step_state import StepState

__all__ = ["StageActions"]

_NOT_RUN = object()  # a stage forward that a context cut short without an exception


class StageActions:
    """The runner's actions (mixed into :class:`PipelineRunner`, which sets what they use:
    its stages and schedule, the links to the neighbouring stages, each stage's gradient
    synchronization and layer cuts, and which backward of a stage is its last)."""

    stages: dict[int, nn.Module]
    schedule: Schedule
    loss_fn: Callable[..., torch.Tensor] | None
    scale_grads: bool
    last: int
    _links: StageLinks
    _sync: dict[int, StageGradSync]
    _cuts: dict[int, LayerCuts]
    _split: set[tuple[int, int]]
    _reduces: Callable[[StepState, Action], bool]  # the program's mark: see runner._reduces
    _forward_contexts: dict[int, Callable[[int], Any]]

    def _forward(self, step: StepState, action: Action) -> None:
        s, mb = action.stage, action.microbatch
        if s == 0:
            xs = step.chunks["inputs"][mb] if "inputs" in step.chunks else None
        else:
            xs = self._links.recv_activation(s, mb)
        outs = None
        # the stage's layer cuts, if this micro-batch's backward is split (see layer_cuts)
        cutter = self._cuts.get(s) if step.training and (s, mb) in self._split else None
        if xs is not None and not step.halted:
            start = time.perf_counter()
            try:
                if s > 0 and step.training:
                    for x in xs:
                        if x.is_floating_point():
                            x.requires_grad_(True)
                # as torch's: this rank's keyword inputs reach each of its stages (a mask or
                # positions every layer needs), not only the first stage
                keywords = step.chunks["kwargs"][mb] if "kwargs" in step.chunks else {}
                context = self._forward_contexts.get(s)
                out = _NOT_RUN
                with (context(mb) if context else contextlib.nullcontext()), \
                        self._sync[s].forward(), (cutter.recording() if cutter
                                                  else contextlib.nullcontext([])) as cuts:
                    out = self.stages[s](*xs, **keywords)
                if out is _NOT_RUN:
                    raise PipelineError(f"the forward context registered on stage {s} "
                                        "suppressed an exception from the stage module; "
                                        "forward contexts must not suppress exceptions")
                if s == self.last:
                    loss = None
                    if "targets" in step.chunks:
                        loss = self._contained_loss(step, out, mb, xs)
                        if loss is not None:
                            outs = (loss / self.schedule.microbatches if self.scale_grads
                                    else loss,)
                            step.losses.append(outs[0].detach())
                    step.outputs[mb] = (detached(out), None if loss is None else loss.detach())
                else:
                    outs = stage_tensors(out, f"stage {s}")
            except Exception as exc:  # noqa: BLE001 - raised on every rank after the step
                if cutter and cutter.cut and "leaf Variable that requires grad is being " \
                        "used in an in-place operation" in str(exc):
                    exc = PipelineError(
                        f"{exc} Under a split backward (zero-bubble's I and W) the runner "
                        "cuts the stage's graph at its layers' outputs, each becoming a "
                        "leaf as a stage's input is, and a layer changed its input in place: "
                        "make that operation out of place (x = x + y, not x += y; "
                        "nn.ReLU(inplace=False))", with_rank=False)
                step.fail(exc, f"stage {s}, forward of micro-batch {mb} on an input of "
                               f"{describe(layout_of(xs))}")
                outs = None
            step.compute[action] = time.perf_counter() - start
        if s != self.last:
            problem = self._links.send_activation(
                None if outs is None else tuple(o.detach() for o in outs), s + 1, mb)
            if problem and step.error is None:
                step.error, step.halted = problem, True
        if outs is not None and step.training:
            step.saved[(s, mb)] = {"x": xs, "out": outs, "cuts": cuts}

    def _contained_loss(self, step: StepState, output: object, mb: int,
                        inputs: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        """Micro-batch ``mb``'s loss; if the loss function fails (a target out of range on
        one data-parallel copy), the failure is reported at the end of the step and the
        step goes on with a zero loss on the output: the loss runs none of the stage's
        collectives, so the backward still runs each one the stage's copies run (a copy
        that stopped would leave the others waiting in them)."""
        try:
            loss = self._loss(output, step.chunks["targets"][mb], step.loss_kwargs)
            if step.training and not loss.requires_grad:
                raise PipelineError(
                    "the loss function returned a tensor that does not require "
                    "grad, so no gradient can reach the model (as loss.backward() "
                    "would raise in one process): compute it from the output with "
                    "differentiable operations (argmax, comparisons, .item() and "
                    ".detach() cut the graph); for a metric alone call evaluate()")
            return loss
        except Exception as exc:  # noqa: BLE001 - raised on every rank after the step
            step.fail(exc, f"stage {self.last}, forward of micro-batch {mb} on an input of "
                           f"{describe(layout_of(inputs))}", halt=False)
            return zero_loss(output) if step.training else None

    def _loss(self, output: object, target: torch.Tensor, keywords: dict[str, Any]
              ) -> torch.Tensor:
        loss = one_tensor(self.loss_fn(output, target, **keywords), "the loss function")
        if loss.ndim != 0:
            raise PipelineError(
                f"the loss function returned a tensor of shape {tuple(loss.shape)}; it must "
                "return one number per micro-batch (a reduction of 'mean' or 'sum')")
        return loss

    def _backward(self, step: StepState, action: Action) -> None:
        """``B``: the whole backward; ``I``: the input gradient only (``W`` does the rest)."""
        s, mb = action.stage, action.microbatch
        grads = None if s == self.last else self._links.recv_gradient(s, mb)
        entry = step.saved.get((s, mb))
        input_grads = None
        if entry is not None and not step.halted:
            outputs, seeds = differentiable(entry["out"], grads)
            entry["outputs"], entry["seeds"] = outputs, seeds
            inputs = [x for x in entry["x"] if x.is_floating_point()] if s > 0 else []
            sync = self._sync[s]
            start = time.perf_counter()
            try:
                if action.kind == "B" or sync.whole:  # whole: DDP reduces in one backward
                    sync.before_backward(self._reduces(step, action), outputs)
                    # a first stage with every parameter frozen (fine-tuning the top of
                    # a model) has nothing to compute, as in single-process training
                    if outputs:
                        torch.autograd.backward(outputs, seeds)
                    input_grads = tuple(x.grad for x in inputs)
                    entry["done"] = True  # W has nothing left
                elif outputs and (s > 0 or entry["cuts"]):  # weight side kept for W
                    # the first stage's input needs no gradient: its I runs down to its
                    # first layer's output (a cut), or W does it all
                    cuts = entry["cuts"]
                    if cuts and not self._cuts[s].cut:  # the first layer's output only
                        inputs, cuts = list(cuts[0].originals), ()
                    split = entry["split"] = SplitBackward(
                        outputs, seeds, inputs, self._weights(s), cuts)
                    if split.whole:  # this I is a whole backward: its W has nothing left
                        step.whole_stages.add(s)
                        sync.before_backward(self._reduces(step, action), outputs)
                        entry["done"] = True
                    # a whole backward of a cut graph is one autograd call per piece
                    with sync.one_reduction() if split.whole else contextlib.nullcontext():
                        gradients = split.input_grad()
                    input_grads = gradients if s > 0 else None  # stage 0 sends nothing
            except Exception as exc:  # noqa: BLE001 - raised on every rank after the step
                if s == self.last and "mixed torch.Tensor and DTensor" in str(exc):
                    exc = PipelineError(
                        f"{exc} If the loss function enters loss_parallel(), the backward "
                        "needs it too: enter it around the step instead — with "
                        "loss_parallel(): runner.step(...) (schedule.step), as torchtitan "
                        "does", with_rank=False)
                step.fail(exc, f"stage {s}, backward of micro-batch {mb}")
                input_grads = None
            step.compute[action] = time.perf_counter() - start
        if action.kind == "B":
            step.saved.pop((s, mb), None)
        if s > 0:
            self._links.send_gradient(input_grads, s, mb)

    def _weights(self, s: int) -> list[torch.Tensor]:
        """What a backward restricted to stage ``s``'s weights accumulates into: its
        parameters, and those a ``fully_shard`` unit groups with them on another stage of
        this rank (``fully_shard([stage_a, stage_b])``: the unit's reduction returns both
        stages' accumulated gradients, and autograd would drop the other's)."""
        stage = self.stages[s]
        return [*stage.parameters(), *parameters_grouped_with(stage)]

    def _weight_grads(self, step: StepState, action: Action) -> None:
        entry = step.saved.pop((action.stage, action.microbatch), None)
        if entry is None or entry.get("done") or step.halted:
            return
        params = [p for p in self._weights(action.stage) if p.requires_grad]
        self._sync[action.stage].before_backward(
            self._reduces(step, action), entry.get("outputs", ()))
        start = time.perf_counter()
        try:
            if "split" in entry:  # I kept what W needs: no input gradient computed again
                with self._sync[action.stage].one_reduction():
                    entry["split"].weight_grads()
            elif params and entry.get("outputs"):  # a first stage not split: all of it here
                torch.autograd.backward(entry["outputs"], entry["seeds"], inputs=params)
        except Exception as exc:  # noqa: BLE001 - raised on every rank after the step
            step.fail(exc, f"stage {action.stage}, weight gradients of micro-batch "
                           f"{action.microbatch}")
        step.compute[action] = time.perf_counter() - start
