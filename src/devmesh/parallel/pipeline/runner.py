"""Running a pipeline schedule: each rank plays its program (computes on its stages, posts
of messages between them: :mod:`~devmesh.layout.pipeline_program`), sending activations
forward and gradients backward to the neighbouring stages' ranks. docs/design/pipelines.md
tells the whole design; what this module holds:

- **The build**: every check the ranks agree on before the first message — one schedule
  (a micro-batch count from each copy's own data would mismatch FSDP's collectives), the
  stages matching it, tied copies equal, the messages usable in the order they are sent
  (NCCL ignores tags: :mod:`~devmesh.layout.pipeline_messages`), on a GPU mesh free of
  deadlock under NCCL's stream rules, and the step's programs valid.
- **A step**: the micro-batches cut (:mod:`.stage_values`), the program played
  (:mod:`.actions` computes, :mod:`.messages` posts), the failure flag agreed at the end
  (:mod:`.step_failures`). A step costs one collective besides its messages: that flag (two
  where the mesh has dims beside the pipeline's: a stage's copies agree at the start too).
- **Failures**: a stage that fails (data, its forward, the loss, a backward) does not stop
  its rank: it plays the rest of its program without computing, sending zeros where it owes
  a message, so no neighbour waits; at the end of the step every rank of the mesh raises the
  same :class:`PipelineError`. What can fail before any compute is agreed among a stage's
  data- and tensor-parallel copies at the start, and every copy skips the step; a loss that
  fails lets the step go on with a zero loss (the loss runs none of the stage's
  collectives); an error between two of a stage's collectives on some copies only is
  announced (:mod:`~devmesh.distributed.stops`), and the copies waiting for it give up
  within a second (the world is broken then: restart).
- **Gradients**: each micro-batch's loss is divided by the number of micro-batches, so they
  add up to the whole batch's, as in one process (``scale_grads=False``, torch's argument,
  leaves them whole: a loss that sums, or one the caller scales, as torchtitan does). A
  stage that is data parallel (``replicate``, ``fully_shard``, torch's DDP and FSDP2)
  accumulates without synchronization and reduces once, in the backward its program marks
  (:mod:`.grad_sync`).

The NCCL path has not run on a GPU in this project's tests: its order and receive placement
run over gloo, and their freedom from deadlock is shown by the model of NCCL's streams.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from devmesh._torch_compat import IncompatibleKeys
from devmesh.distributed import comm, consensus, groups, stops
from devmesh.layout.pipeline_messages import fifo_problem, nccl_problem
from devmesh.layout.pipeline_program import Op, lower, program_problem
from devmesh.layout.schedule import Action, Schedule
from devmesh.mesh import DeviceMesh
from devmesh.parallel.fsdp import release_weight_gradient_gathers
from devmesh.parallel.grads import (
    checked_norm_type,
    clip_by_norm,
    grad_norm_power,
    reduce_norm_power,
)
from devmesh.parallel.pipeline.grad_sync import StageGradSync
from devmesh.parallel.pipeline.actions import StageActions
from devmesh.parallel.pipeline.messages import StageLinks
from devmesh.parallel.pipeline.layer_cuts import LayerCuts
from devmesh.parallel.pipeline.split import PipelineError, split_mismatch
from devmesh.parallel.pipeline.stage_values import cut_micro_batches
from devmesh.parallel.pipeline.step_failures import StepFailures
from devmesh.parallel.pipeline.step_state import StepState
from devmesh.parallel.pipeline.tied import TiedCopies, ties_of
from devmesh.parallel.pipeline.whole_model import (
    full_state_dict,
    load_full_state_dict,
    local_module,
)
from devmesh.parallel.state_dict import state_dict

__all__ = ["PipelineRunner"]


class PipelineRunner(StageActions, StepFailures):
    """This rank's stages of a pipelined model, and the schedule they follow.

    ``stages[s]`` must be given for every stage ``s`` this rank holds (``s % pp == coord``),
    where ``pp`` is the size of the mesh's ``pp_dim``. ``scale_grads`` (torch's argument):
    divide each micro-batch's loss by the number of micro-batches (a loss that averages:
    the whole batch's gradients); ``False`` leaves them whole (a loss that sums, or one the
    caller scales)."""

    def __init__(self, stages: dict[int, nn.Module], mesh: DeviceMesh, schedule: Schedule,
                 loss_fn: Callable[..., torch.Tensor] | None, *,
                 pp_dim: str = "pp", scale_grads: bool = True,
                 forward_contexts: Mapping[int, Callable[[int], AbstractContextManager]]
                 | None = None) -> None:
        names = mesh.mesh_dim_names or ()
        if pp_dim not in names:
            raise PipelineError(
                f"the mesh has no {pp_dim!r} dim (dims: {list(names)}): build it with one, "
                f"e.g. {_with_pp(mesh, names, pp_dim)} on these {mesh.size()} ranks")
        self.mesh = mesh
        self.dim = names.index(pp_dim)
        self.pp = mesh.shape[self.dim]
        self.index = mesh.get_coordinate()[self.dim]
        # the checks of the pipeline's build span the whole mesh: a stage's data- and
        # tensor-parallel copies run its collectives together, so copies that ran different
        # schedules (a micro-batch count from each copy's own data) would mismatch them
        everyone = self._everyone = comm.process_group(mesh, range(mesh.ndim))
        others = [d for d in range(mesh.ndim) if d != self.dim]
        # the ranks holding this rank's stages (its copies over the other dims): see _start
        self._copies = (comm.process_group(mesh, others)
                        if mesh.size() > self.pp else None)
        held = consensus.differing(str(schedule), everyone)
        if held:  # every check below depends on the schedule: agree on it first
            which = "; ".join(f"ranks {ranks}: {text.splitlines()[0]}"
                              for text, ranks in held.items())
            raise PipelineError(
                f"the ranks hold different schedules ({which}; where these agree, "
                "the actions' order differs): build the same schedule on every rank, e.g. "
                "from the global batch's micro-batch count, not a rank's own data")
        if schedule.ranks != self.pp:
            raise PipelineError(f"the schedule is for {schedule.ranks} pipeline ranks, the "
                                f"mesh's {pp_dim!r} dim has {self.pp}")
        out_of_order = fifo_problem(schedule)
        if out_of_order:  # the schedule is the same on every rank: each raises alike
            raise PipelineError(f"cannot run schedule {schedule.name!r}: {out_of_order}")
        if mesh.device_type != "cpu":  # NCCL's stream rules: the same verdict on every rank
            problem = nccl_problem(schedule)
            if problem:
                raise PipelineError(problem)
        mine = {s for s in range(schedule.stages) if schedule.rank_of(s) == self.index}
        problem = None
        if not isinstance(stages, Mapping):
            raise PipelineError(
                f"stages must map each of this rank's stage indices to its module, "
                f"{{s: parts[s] for s in range(schedule.stages) if schedule.rank_of(s) == "
                f"{self.index}}}, got a {type(stages).__name__}")
        if set(stages) != mine:
            problem = (f"pp index {self.index} holds stages {sorted(mine)} of this schedule, "
                       f"got modules for {sorted(stages)}")
        problem = problem or split_mismatch(stages, schedule.stages)
        self._sync = {s: StageGradSync(stages[s]) for s in stages}
        problem = problem or next(filter(None, (sync.problem(f"stage {s}")
                                                for s, sync in self._sync.items())), None)
        self._agree_or_raise(problem, "cannot build the pipeline", everyone)
        ties = ties_of(stages)
        differ = consensus.differing(repr([tie.stages for tie in ties]), mesh.get_group(self.dim))
        if differ:  # exchanging copies of different ties would hang: refused on every rank
            which = "; ".join(f"ranks {ranks}: {text}" for text, ranks in differ.items())
            raise PipelineError(
                f"the pipeline ranks found different tied parameters (the stages holding "
                f"each tie: {which}): build every rank's stages from the same model, split "
                "the same way")
        self._ties = TiedCopies(stages, ties, mesh, self.dim, schedule)
        self._agree_or_raise(self._ties.check_and_share_values(),
                             "the stages' copies of tied parameters differ")
        self.stages = stages
        self.schedule = schedule
        self.loss_fn = loss_fn
        self.scale_grads = scale_grads  # divide each micro-batch's loss by their number
        # per stage, the context its forward of a micro-batch runs in (torch's
        # PipelineStage.register_forward_context)
        self._forward_contexts = dict(forward_contexts or {})
        self.last = schedule.stages - 1
        self._links = StageLinks(mesh, self.dim, schedule)
        # names this runner's steps alike on every rank (see _scope)
        serials = groups.world_cache()
        key = ("pipeline runners", tuple(mesh.layout.rank_list()))
        self._serial = serials[key] = serials.get(key, -1) + 1
        self._steps = 0
        self.compute_seconds: dict[Action, float] = {}
        # the last stage's (output, loss) per micro-batch of the last step; loss None when
        # evaluate() had no targets
        self.microbatch_outputs: list[tuple[Any, torch.Tensor | None]] = []
        # the step as a program (plain data, checked on every rank alike): the computes,
        # the posts of messages between them, and the backward in which each stage's
        # gradients are reduced — its last B or W; where its backward cannot be split
        # (DDP's reducer: known now; a graph SplitBackward cannot cut: found in the step) an
        # I computes them and W nothing, and the program for those stages says its last B
        # or I (see devmesh.layout.pipeline_program)
        self._whole = frozenset(s for s, sync in self._sync.items() if sync.whole)
        for training in (True, False):
            problem = program_problem([lower(schedule, r, self._links.backend,
                                             training=training) for r in range(self.pp)])
            if problem:
                raise PipelineError(f"cannot run schedule {schedule.name!r}: {problem}")
        # a stage's mark depends only on whether its own backward is whole: both sets of
        # marks once, so a backward looks its mark up rather than lowering a program
        self._reducing = {whole: lower(schedule, self.index, self._links.backend,
                                       whole=frozenset(stages) if whole else frozenset()
                                       ).reducing for whole in (False, True)}
        actions = schedule.actions[self.index]
        self._reduce_shared_units_once(actions)
        # micro-batches whose backward is split (zero-bubble's I and W), on stages whose
        # graph is cut at the layers' outputs during those forwards (see layer_cuts)
        self._split = {(a.stage, a.microbatch) for a in actions if a.kind == "I"}
        self._cuts: dict[int, LayerCuts] = {}
        for s in {a.stage for a in actions if a.kind == "I"}:
            cut = not self._sync[s].whole and not _holds_torch_fsdp(stages[s])
            if cut or s == 0:  # uncut, the first stage's I still stops at its first layer
                self._cuts[s] = LayerCuts(stages[s], cut=cut)

    def _reduce_shared_units_once(self, actions: Sequence[Action]) -> None:
        """A ``fully_shard`` unit grouping modules of several of this rank's stages (the
        two stages of a V holding a tied embedding and head) reduces at the last of those
        stages' final backwards only; the earlier ones accumulate into it. (Each stage's
        final backward reducing would be right too — the second reduction adds what came
        after the first — but costs a reduce-scatter more per step.)"""
        position = {action: i for i, action in enumerate(actions)}
        split = {a.stage: a for a in self._reducing[False]}
        holders: dict[int, tuple[object, set[int]]] = {}
        for s, stage in self.stages.items():
            for module in stage.modules():
                unit = getattr(module, "_devmesh_fsdp", None)
                if unit is not None:
                    holders.setdefault(id(unit), (unit, set()))[1].add(s)
        for unit, stages in holders.values():
            if len(stages) < 2:
                continue
            last = max(stages, key=lambda s: position.get(split.get(s), -1))
            for s in stages - {last}:
                self._sync[s].hold_for_later(unit)

    @functools.cached_property
    def module(self) -> nn.Module:
        """This rank's part of the model as one module, under the whole model's names: build
        the optimizer over its parameters, and save or load checkpoints of it
        (:func:`~devmesh.parallel.save_checkpoint` saves the union of every rank's part)."""
        return local_module(self.stages)

    def state_dict(self, *, full: bool = True) -> dict[str, Any]:
        """``full=True``: the whole model's full tensors on every rank (collective: each
        pipeline index broadcasts its stages'); ``full=False``: this rank's stages as
        ShardedTensors, no communication."""
        return full_state_dict(self) if full else state_dict(self.module, full=False)

    def load_state_dict(self, state: Mapping[str, Any], *, strict: bool = True
                        ) -> IncompatibleKeys:
        """Load a whole model's state dict (a plain model's, or :meth:`state_dict`'s) into
        the stages; collective over the pipeline dim, all or nothing."""
        return load_full_state_dict(self, state, strict=strict)

    def clip_grad_norm_(self, max_norm: float, norm_type: float | str = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the whole model's gradients by their global norm, as
        ``torch.nn.utils.clip_grad_norm_`` on the unsplit model would: the norm sums over
        every stage (one tiny all-reduce over the pipeline dim) and counts a tied parameter
        once. Call after :meth:`step`; returns the norm, the same on every rank (so
        ``error_if_nonfinite`` raises on every rank alike)."""
        norm_type = checked_norm_type(norm_type)
        params = [p for p in self.module.parameters() if p.grad is not None]
        skip = self._ties.counted_once
        counted = [p for p in params if id(p) not in skip]
        power = reduce_norm_power(grad_norm_power(counted, norm_type), self.mesh,
                                  (self.dim,), norm_type)
        return clip_by_norm(params, power, float(max_norm), norm_type, error_if_nonfinite)

    # -- one step ---------------------------------------------------------------------------
    def step(self, inputs: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
             targets: torch.Tensor | None = None, *,
             input_kwargs: Mapping[str, Any] | None = None,
             loss_kwargs: Mapping[str, Any] | None = None) -> torch.Tensor | None:
        """Forward and backward of one batch, split into the schedule's micro-batches:
        ``inputs`` (a tensor, or a tuple of tensors for a first stage whose forward takes
        several) are needed on the first stage's rank; ``input_kwargs`` (given on any
        rank) are keyword arguments of each stage on this rank, as torch's
        ``schedule.step(x, **kwargs)`` passes them — tensors cut along dim 0, other values
        given to every micro-batch; ``targets`` are needed on the last's (``loss_kwargs``: more
        keyword arguments of the loss function, as torch's). A stage may return a tuple of
        tensors: they are the next stage's positional arguments. Gradients accumulate in the
        stages' parameters (call the optimizer after). Returns the batch's loss (the mean of
        the micro-batches' losses; their sum with ``scale_grads=False``) on the last stage's
        rank, ``None`` elsewhere. If any stage fails, every rank raises
        :class:`PipelineError` at the end of the step (the step's gradients are then partial:
        zero them before the next step)."""
        with self._scope():
            step = self._start(inputs, targets, input_kwargs, loss_kwargs, training=True)
            for sync in self._sync.values():
                sync.start_step()
            try:
                self._play(step)
            finally:
                for sync in self._sync.values():
                    sync.end_step()
            return self._finish(step)

    def evaluate(self, inputs: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
                 targets: torch.Tensor | None = None, *,
                 input_kwargs: Mapping[str, Any] | None = None,
                 loss_kwargs: Mapping[str, Any] | None = None) -> torch.Tensor | None:
        """Forward only, for validation or inference: the schedule's forwards in its order,
        no graph kept (run under ``torch.no_grad``), no gradient messages, the parameters'
        gradients untouched. Inputs as :meth:`step`; ``targets`` are optional: with them the
        last stage's rank returns the batch's loss, as :meth:`step` does, and without them
        ``None``. The model's output is :meth:`output` on the last stage's rank (torch's
        ``schedule.eval``; put dropout and batch norm in eval mode with ``module.eval()``
        yourself, as for any model)."""
        with self._scope():
            step = self._start(inputs, targets, input_kwargs, loss_kwargs, training=False)
            with torch.no_grad():
                self._play(step)
            return self._finish(step)

    def _scope(self) -> contextlib.AbstractContextManager[None]:
        """The step, named alike on every rank: a copy that stops in it says so, and the
        copies waiting for it give up (:mod:`~devmesh.distributed.stops`)."""
        self._steps += 1
        return stops.scope(f"pipeline {self._serial}, step {self._steps}")

    def output(self) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        """The last stage's output for the whole batch of the last :meth:`step` or
        :meth:`evaluate` (the micro-batches' outputs joined along dim 0; a tuple when the
        stage returns one), on the last stage's rank; ``None`` elsewhere."""
        outputs = [out for out, _ in self.microbatch_outputs]
        if not outputs:
            return None
        if isinstance(outputs[0], torch.Tensor):
            return torch.cat(outputs)
        return type(outputs[0])(torch.cat(parts) for parts in zip(*outputs, strict=True))

    def _start(self, inputs, targets, input_kwargs, loss_kwargs, *, training: bool) -> StepState:
        """The step's micro-batches, or the reason this rank cannot start it: the other
        stages hear of it at the end of the step; this stage's copies over the mesh's other
        dims (data- or tensor-parallel) hear of it now (one tiny all-reduce), and fail the
        step too: a copy that computed would wait in the stage's collectives (FSDP's
        all-gathers, DDP's all-reduce) for one that does not."""
        step = StepState({}, training=training, loss_kwargs=dict(loss_kwargs or {}))
        try:
            step.chunks = cut_micro_batches(
                inputs, targets, input_kwargs, microbatches=self.schedule.microbatches,
                first_stage_here=0 in self.stages, last_stage_here=self.last in self.stages,
                training=training, has_loss_fn=self.loss_fn is not None)
        except PipelineError as exc:
            step.fail(exc)
        if training and not torch.is_grad_enabled():  # this rank still plays its part
            step.fail(PipelineError("step() computes gradients, but gradients are off here "
                                    "(torch.no_grad() or inference_mode): call evaluate() "
                                    "for a forward-only pass"))
        if training and self.loss_fn is None:
            step.fail(PipelineError("step() trains, and the runner has no loss function: "
                                    "build it with one, or call evaluate() for a forward-only "
                                    "pass"))
        if self._copies is not None and consensus.failures(step.error, self._copies):
            step.halted = True  # the copy's own error is reported at the end of the step
        step.announced = step.halted  # every copy stopped here: none waits for another
        return step

    def _reduces(self, step: StepState, action: Action) -> bool:
        """Is ``action`` the backward in which its stage's gradients are reduced: the mark
        of the program for the stage's backward as it runs, whole (known at the build, or
        found in this step) or split? (A ``W`` computes only where its micro-batch's
        backward was split: the split program's mark.)"""
        whole = action.kind != "W" and (action.stage in self._whole
                                        or action.stage in step.whole_stages)
        return action in self._reducing[whole]

    def _play(self, step: StepState) -> None:
        """Run this rank's program: each compute, and each post of messages; every message
        this rank owes is sent even after a failure (zeros), so no neighbour waits
        forever."""
        self._links.start_step(training=step.training)  # each step announces its shapes
        self.compute_seconds = step.compute  # compute of each action, messages excluded
        play = {Op.FORWARD: self._forward, Op.BACKWARD: self._backward,
                Op.BACKWARD_INPUT: self._backward, Op.BACKWARD_WEIGHT: self._weight_grads}
        program = lower(self.schedule, self.index, self._links.backend,
                        training=step.training)
        for instruction in program.instructions:
            if instruction.op is Op.POST:  # the sends before it, the receives after it
                self._links.post(instruction.receives)
                continue
            play[instruction.op](step, instruction.action)
            if step.halted and not step.announced:
                self._announce_stop(step)
        self._links.wait_sends()
        release_weight_gradient_gathers()  # every W of the step has run

    def _finish(self, step: StepState) -> torch.Tensor | None:
        """Raise on every rank if any stage failed; else the step's results."""
        self._raise_if_any_stage_failed(step)
        if step.training:
            self._ties.add_gradients()
        # the last stage's model output and (unscaled) loss of each micro-batch, in order
        self.microbatch_outputs = [step.outputs[mb] for mb in sorted(step.outputs)]
        if not step.losses:
            return None
        return torch.stack(step.losses).sum()


def _with_pp(mesh: DeviceMesh, names: Sequence[str], pp_dim: str) -> str:
    """An ``init_device_mesh`` call that gives ``mesh``'s ranks a pipeline dim: its first
    dim split in two (``(4, 2)`` over (dp, tp) -> ``(2, 2, 2)`` over (pp, dp, tp)), or a
    pipeline over all of them."""
    shape, device = tuple(mesh.shape), mesh.device_type
    if names and shape[0] % 2 == 0:
        return (f"init_device_mesh({device!r}, {(2, shape[0] // 2, *shape[1:])}, "
                f"mesh_dim_names={(pp_dim, *names)!r})")
    return f"init_device_mesh({device!r}, ({mesh.size()},), mesh_dim_names=({pp_dim!r},))"


def _holds_torch_fsdp(stage: nn.Module) -> bool:
    """Does the stage hold torch's FSDP2 modules? They reduce at the end of each autograd
    call that ran their backward, so their stage's graph is not cut into pieces (a whole
    backward of a cut graph is several calls)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(module, FSDPModule) for module in stage.modules())
