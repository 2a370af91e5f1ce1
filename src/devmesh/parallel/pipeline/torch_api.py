"""``torch.distributed.pipelining``'s stage and schedule classes on devmesh's runner, so
pipelining code written for torch runs with only its imports switched::

    from devmesh.parallel.pipeline import PipelineStage, Schedule1F1B   # was torch's

    stage = PipelineStage(part, stage_index, num_stages, torch.device("cpu"), group=pp_group)
    schedule = Schedule1F1B(stage, n_microbatches, loss_fn=loss_fn)
    schedule.step(x)                              # first stage
    schedule.step(target=y, losses=losses)        # last stage: per-micro-batch losses
    schedule.step()                               # the stages between
    schedule.eval(x_val) / schedule.eval(target=y_val, losses=val_losses) / schedule.eval()

The schedule's :class:`~devmesh.parallel.pipeline.PipelineRunner` is built at the first
``step`` (it agrees on the stages with its peers, which torch's constructors do not), on a
1-D ``pp`` mesh over the stage's ``group`` (the world when none is given). ``eval`` runs
forward only (validation), as does ``step`` on a schedule built without ``loss_fn``, as in
torch. Every class takes torch's parameters by torch's names and in torch's positions; what
devmesh does not do — chunk specs, ``dw_builder``, ``get_mesh``,
``backward_requires_autograd=False`` — is refused when the stage or schedule is built, with
the fix. ``scale_grads=False`` leaves each micro-batch's loss unscaled, as torch's (a loss
that sums, or torchtitan's own scaling).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from devmesh import _torch_compat
from devmesh.layout.liveness import Granularity, PipelineActivationLiveness, activation_liveness
from devmesh.layout.schedule import Schedule, build_schedule
from devmesh.mesh import DeviceMesh
from devmesh.parallel.pipeline.runner import PipelineRunner
from devmesh.parallel.pipeline.split import PipelineError
from devmesh.parallel.pipeline.stage import PipelineStage
from devmesh.parallel.pipeline.traced import as_devmesh_stage

__all__ = ["PipelineStage", "PipelineScheduleSingle", "PipelineScheduleMulti", "ScheduleGPipe",
           "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
           "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV",
           "get_schedule_class", "analyze_pipeline_activation_liveness",
           "PipelineActivationLiveness"]


class _Schedule:
    """A torch schedule class over devmesh's runner; subclasses name the schedule."""

    schedule_name = ""

    def __init__(self, stages: PipelineStage | Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 args_chunk_spec: Any = None, kwargs_chunk_spec: Any = None,
                 output_merge_spec: Any = None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False,
                 **options: Any) -> None:
        # defer_pp_recv: when torch posts its receives; devmesh posts each by its own rule
        # (ahead on gloo, with the last send before it on NCCL), with the same results
        stage_base, _ = _torch_compat.pipeline_stage_types()
        one = (isinstance(stages, (PipelineStage, stage_base, nn.Module))
               or not isinstance(stages, Iterable))
        self._stages = [as_devmesh_stage(s) for s in ([stages] if one else list(stages))]
        if (args_chunk_spec, kwargs_chunk_spec, output_merge_spec) != (None, None, None):
            raise PipelineError("chunk and merge specs are not supported: the batch is split "
                                "into micro-batches along dim 0, and outputs joined along it")
        if not backward_requires_autograd:
            raise PipelineError("backward_requires_autograd=False is not supported: devmesh "
                                "runs every stage's backward through autograd")
        unknown = {k for k, v in options.items() if v is not None and k != "use_full_backward"}
        if unknown:
            raise PipelineError(f"{type(self).__name__} options {sorted(unknown)} are not "
                                "supported by devmesh")
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self._scale_grads = scale_grads
        self._runner: PipelineRunner | None = None

    def schedule_data(self) -> Schedule:
        """The schedule this object runs, as devmesh's data (every rank's actions): what
        :func:`analyze_pipeline_activation_liveness` reads. Needs the process group of the
        stages (the world when they name none) for the number of pipeline ranks."""
        if not self._stages:
            raise PipelineError(f"this {type(self).__name__} holds no stage")
        ranks = dist.get_world_size(self._stages[0].group)
        return build_schedule(self.schedule_name, ranks, self._n_microbatches,
                              **self._virtual(self._stages[0].num_stages, ranks))

    def _build(self) -> PipelineRunner:
        groups = {id(s.group) for s in self._stages}
        num_stages = {s.num_stages for s in self._stages}
        if len(groups) != 1 or len(num_stages) != 1:
            raise PipelineError("this rank's stages must share one group and one num_stages")
        group = self._stages[0].group or dist.group.WORLD
        devices = {s.device.type for s in self._stages}
        if len(devices) != 1:
            raise PipelineError(f"this rank's stages must share one device type, got "
                                f"{sorted(devices)}")
        mesh = DeviceMesh.from_group(group, devices.pop(), mesh_dim_names=("pp",))
        ranks = mesh.size()
        schedule = build_schedule(self.schedule_name, ranks, self._n_microbatches,
                                  **self._virtual(num_stages.pop(), ranks))
        stages = {s.stage_index: s.submod for s in self._stages}
        return PipelineRunner(stages, mesh, schedule, self._loss_fn,
                              scale_grads=self._scale_grads,
                              forward_contexts={s.stage_index: s.forward_context
                                                for s in self._stages})

    def register_custom_function(self, computation_type: Any, custom_function: Any) -> None:
        """torch's hook for running an action kind with one's own function (DualPipeV's
        overlapped forward and backward, say), given torch's internal schedule context:
        refused, since devmesh's runner runs every action itself."""
        raise PipelineError(
            f"register_custom_function is not supported: devmesh's runner runs every action "
            f"itself, with no torch schedule context to hand over ({computation_type!s}); "
            "DualPipeV's paired forward and backward run one after the other, as torch's "
            "without a custom function")

    def _virtual(self, num_stages: int, ranks: int) -> dict[str, int]:
        if num_stages != ranks:
            raise PipelineError(f"{type(self).__name__} runs one stage per rank: "
                                f"{num_stages} stages on {ranks} ranks (use "
                                "ScheduleInterleaved1F1B for several stages per rank)")
        return {}

    def step(self, *args: Any, target: torch.Tensor | None = None,
             losses: list | None = None, return_outputs: bool = True,
             loss_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        """One training step over the batch: ``args`` (the first stage's inputs; tensors
        cut into micro-batches along dim 0) on the first stage's rank, ``kwargs`` (cut
        alike) for every stage of the rank that passes them, as torch's,
        ``target`` on the last's, ``loss_kwargs`` passed to the loss function. Fills
        ``losses`` with each micro-batch's loss and returns the model's output for the whole
        batch on the last stage's rank (``None`` elsewhere, or with
        ``return_outputs=False``; a tuple when the last stage returns one), as torch's
        ``step``. A schedule built without ``loss_fn`` runs forward only, as torch's."""
        if self._loss_fn is None:
            output = self.eval(*args, target=target, losses=losses, **kwargs)
            return output if return_outputs else None
        runner = self._get_runner()
        runner.step(*self._inputs(args), target, input_kwargs=kwargs,
                    loss_kwargs=loss_kwargs)
        return self._results(runner, losses, return_outputs)

    def eval(self, *args: Any, target: torch.Tensor | None = None,
             losses: list | None = None, **kwargs: Any) -> Any:
        """Forward only over the batch (validation), as torch's ``schedule.eval``: no
        gradients, no graph kept. With a ``target`` (and a ``loss_fn``) the last stage's
        rank fills ``losses``; returns the model's output there, ``None`` elsewhere."""
        runner = self._get_runner()
        runner.evaluate(*self._inputs(args), target if self._loss_fn is not None else None,
                        input_kwargs=kwargs)
        return self._results(runner, losses, True)

    def _get_runner(self) -> PipelineRunner:
        if self._runner is None:
            self._runner = self._build()
        return self._runner

    @staticmethod
    def _inputs(args: tuple) -> tuple:
        """The runner's ``inputs`` argument: one tensor, a tuple of several, or none."""
        return ((args[0] if len(args) == 1 else args) if args else None,)

    @staticmethod
    def _results(runner: PipelineRunner, losses: list | None, return_outputs: bool) -> Any:
        if not runner.microbatch_outputs:  # not the last stage's rank
            return None
        if losses is not None and runner.microbatch_outputs[0][1] is not None:
            losses[:] = [loss for _, loss in runner.microbatch_outputs]  # this step's only
        return runner.output() if return_outputs else None


class PipelineScheduleSingle(_Schedule):
    """The schedules with one stage per rank (torch's base class of the same name: code
    such as torchtitan's tells the two kinds apart with ``issubclass``)."""

    def __init__(self, stage: PipelineStage, n_microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 args_chunk_spec: Any = None, kwargs_chunk_spec: Any = None,
                 output_merge_spec: Any = None, scale_grads: bool = True, **options: Any
                 ) -> None:
        # torch names the first argument ``stage`` here, ``stages`` for several per rank
        super().__init__(stage, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec,
                         output_merge_spec, scale_grads, **options)


class PipelineScheduleMulti(_Schedule):
    """The schedules with several stages per rank (torch's base class of the same name).

    torch 2.15's tuning of FSDP inside such a pipeline — ``max_active_stages`` (how many
    stages' parameters stay gathered), ``unshard_lookahead`` (``"full"``, ``"auto"`` or one
    count per pipeline rank: how far ahead all-gathers start), ``defer_reduce_grad_wait`` and
    ``max_outstanding_sends`` — is taken and checked as torch checks it; devmesh's runner
    gathers a stage's parameters when one of its actions runs and posts its messages by its
    own rule, so they change no result (nor devmesh's memory)."""

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 args_chunk_spec: Any = None, kwargs_chunk_spec: Any = None,
                 output_merge_spec: Any = None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False,
                 max_active_stages: int = 3, unshard_lookahead: str | tuple[int, ...] = "full",
                 defer_reduce_grad_wait: bool = False, max_outstanding_sends: int | None = None,
                 **options: Any) -> None:
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec,
                         output_merge_spec, scale_grads, backward_requires_autograd,
                         defer_pp_recv, **options)
        _check_residency(max_active_stages, unshard_lookahead, max_outstanding_sends)
        self._max_active_stages = max_active_stages
        self._unshard_lookahead = unshard_lookahead

    def _virtual(self, num_stages: int, ranks: int) -> dict[str, int]:
        if num_stages % ranks or num_stages == ranks:
            raise PipelineError(f"{type(self).__name__} needs several stages per rank: "
                                f"{num_stages} stages on {ranks} ranks")
        return {"virtual": num_stages // ranks}

    def _build(self) -> PipelineRunner:
        lookahead = self._unshard_lookahead
        if isinstance(lookahead, tuple):  # one count per pipeline rank: checked on the group
            ranks = dist.get_world_size(self._stages[0].group) if self._stages else 0
            if len(lookahead) != ranks:
                raise PipelineError(f"unshard_lookahead tuple length must equal the pipeline "
                                    f"degree ({ranks}), got {len(lookahead)}")
        return super()._build()


def _check_residency(max_active_stages: Any, unshard_lookahead: Any,
                     max_outstanding_sends: Any) -> None:
    """torch's checks of its FSDP residency options, with torch's messages."""
    def positive(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    if not positive(max_active_stages):
        raise PipelineError(f"max_active_stages must be a positive integer, got "
                            f"{max_active_stages!r}")
    if isinstance(unshard_lookahead, tuple):
        for rank, count in enumerate(unshard_lookahead):
            if not positive(count) or count > max_active_stages:
                raise PipelineError(f"unshard_lookahead[{rank}] must be an integer within "
                                    f"[1, max_active_stages={max_active_stages}], got "
                                    f"{count!r}")
    elif unshard_lookahead not in ("full", "auto"):
        raise PipelineError(f"unshard_lookahead must be 'full', 'auto', or a tuple of "
                            f"integers (one per pipeline rank), got {unshard_lookahead!r}")
    if max_outstanding_sends is not None and not (
            isinstance(max_outstanding_sends, int) and not isinstance(max_outstanding_sends, bool)
            and max_outstanding_sends >= 0):
        raise PipelineError("max_outstanding_sends must be a non-negative integer")


class ScheduleGPipe(PipelineScheduleSingle):
    """All forwards, then all backwards (torch's ``ScheduleGPipe``)."""

    schedule_name = "gpipe"


class Schedule1F1B(PipelineScheduleSingle):
    """One forward, one backward in the steady state (torch's ``Schedule1F1B``)."""

    schedule_name = "1f1b"


class ScheduleInterleaved1F1B(PipelineScheduleMulti):
    """1F1B over several stages per rank, stage ``s`` on rank ``s % ranks`` (torch's
    ``ScheduleInterleaved1F1B``)."""

    schedule_name = "interleaved-1f1b"


class ScheduleLoopedBFS(PipelineScheduleMulti):
    """Every micro-batch's forward on a rank's first stage, then its next, then the
    backwards from its last stage down (torch's ``ScheduleLoopedBFS``)."""

    schedule_name = "looped-bfs"

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 output_merge_spec: Any = None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False,
                 max_active_stages: int = 3, unshard_lookahead: str | tuple[int, ...] = "full",
                 defer_reduce_grad_wait: bool = False, max_outstanding_sends: int | None = None
                 ) -> None:
        # torch's ScheduleLoopedBFS takes no chunk specs: its parameters, in its positions
        super().__init__(stages, n_microbatches, loss_fn, output_merge_spec=output_merge_spec,
                         scale_grads=scale_grads,
                         backward_requires_autograd=backward_requires_autograd,
                         defer_pp_recv=defer_pp_recv, max_active_stages=max_active_stages,
                         unshard_lookahead=unshard_lookahead,
                         defer_reduce_grad_wait=defer_reduce_grad_wait,
                         max_outstanding_sends=max_outstanding_sends)


class ScheduleInterleavedZeroBubble(PipelineScheduleMulti):
    """Interleaved 1F1B with every backward split into its input and weight halves, the
    weight halves deferred (torch's ``ScheduleInterleavedZeroBubble``)."""

    schedule_name = "interleaved-zero-bubble"


class _ScheduleInAV(PipelineScheduleMulti):
    """The schedules placing two stages per rank in a V: rank ``r`` builds the stages ``r``
    and ``2 * ranks - 1 - r``."""

    def _virtual(self, num_stages: int, ranks: int) -> dict[str, int]:
        if num_stages != 2 * ranks or len(self._stages) != 2:
            raise PipelineError(f"{type(self).__name__} needs exactly 2 stages per rank, "
                                f"stages r and {2 * ranks - 1} - r on rank r: got "
                                f"{len(self._stages)} of {num_stages} stages on {ranks} ranks")
        return {}


class ScheduleZBVZeroBubble(_ScheduleInAV):
    """Zero-bubble V (torch's ``ScheduleZBVZeroBubble``): two stages per rank placed in a V,
    each backward split into its input and weight halves."""

    schedule_name = "zbv-zero-bubble"


class ScheduleDualPipeV(_ScheduleInAV):
    """DualPipeV (torch's ``ScheduleDualPipeV``): two stages per rank placed in a V, the
    steady state pairing a forward of one stage with a whole backward of the other, run one
    after the other as torch's does without a custom overlap function. Needs at least as
    many micro-batches as stages, checked here as torch's constructor does."""

    schedule_name = "dualpipe-v"

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 args_chunk_spec: Any = None, kwargs_chunk_spec: Any = None,
                 output_merge_spec: Any = None, scale_grads: bool = True,
                 backward_requires_autograd: bool = True, defer_pp_recv: bool = False,
                 max_active_stages: int = 3, unshard_lookahead: str | tuple[int, ...] = "full",
                 defer_reduce_grad_wait: bool = False, max_outstanding_sends: int | None = None
                 ) -> None:
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec,
                         output_merge_spec, scale_grads, backward_requires_autograd,
                         defer_pp_recv, max_active_stages, unshard_lookahead,
                         defer_reduce_grad_wait, max_outstanding_sends)
        num_stages = self._stages[0].num_stages if self._stages else 0
        if n_microbatches < num_stages:
            raise PipelineError(f"ScheduleDualPipeV needs at least as many micro-batches as "
                                f"stages: got {n_microbatches} micro-batches for {num_stages} "
                                f"stages (use {num_stages} or more, or ScheduleZBVZeroBubble, "
                                "which takes any count)")


_BY_NAME = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B,
            "Interleaved1F1B": ScheduleInterleaved1F1B, "LoopedBFS": ScheduleLoopedBFS,
            "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
            "ZBVZeroBubble": ScheduleZBVZeroBubble, "DualPipeV": ScheduleDualPipeV}
_ELSEWHERE = {  # torch's other names: what devmesh has instead
    "PipelineScheduleSingle": "a schedule's name: GPipe or 1F1B",
    "PipelineScheduleMulti": "a schedule's name: Interleaved1F1B, LoopedBFS, "
                             "InterleavedZeroBubble, ZBVZeroBubble or DualPipeV",
}


def get_schedule_class(schedule_name: str) -> type[_Schedule]:
    """The schedule class called ``schedule_name`` (any case), as torch's
    ``get_schedule_class``: ``GPipe``, ``1F1B``, ``Interleaved1F1B``, ``LoopedBFS``,
    ``InterleavedZeroBubble``, ``ZBVZeroBubble`` or ``DualPipeV``. torch's other names raise a
    ``ValueError`` naming devmesh's alternative; unknown ones torch's phrase."""
    by_lower = {name.lower(): name for name in (*_BY_NAME, *_ELSEWHERE)}
    name = by_lower.get(str(schedule_name).lower())
    if name in _BY_NAME:
        return _BY_NAME[name]
    if name is not None:
        raise PipelineError(f"devmesh's pipelining adapter has no {name} schedule: use "
                            f"{_ELSEWHERE[name]}")
    raise PipelineError(f"Unknown schedule name '{schedule_name}'. The valid options are "
                        f"{list(_BY_NAME)}")


def analyze_pipeline_activation_liveness(
        schedule: _Schedule | Schedule, *, pp_rank: int, stage_indices: Sequence[int],
        granularity: Granularity) -> PipelineActivationLiveness:
    """When each activation of ``stage_indices`` is live on pipeline rank ``pp_rank`` and the
    fewest buffers (slots) that hold them all, as torch's function of the same name:
    ``num_slots`` is the rank's peak of micro-batch activations held at once. ``schedule``:
    one of devmesh's schedule objects (any, not only the multi-stage ones), or devmesh's
    schedule data (:class:`~devmesh.layout.schedule.Schedule`, no process group needed).
    Positions index the rank's actions in devmesh's order (see
    :mod:`devmesh.layout.liveness`)."""
    data = schedule if isinstance(schedule, Schedule) else schedule.schedule_data()
    return activation_liveness(data, pp_rank=pp_rank, stage_indices=stage_indices,
                               granularity=granularity)
