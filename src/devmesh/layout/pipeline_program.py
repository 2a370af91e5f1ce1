"""A pipeline step lowered into one program per rank: plain data, checked before it runs.

A :class:`~devmesh.layout.schedule.Schedule` says what each rank computes. A
:class:`Program` says everything the rank does in one step, in order, as the runner
(:class:`~devmesh.parallel.pipeline.runner.PipelineRunner`) plays it:

- a *compute* instruction per action — ``F`` (a stage's forward of one micro-batch), ``B``
  (its whole backward), ``I`` (the input gradient only), ``W`` (the weight gradients an ``I``
  left) — and on the backward that is a stage's last to compute weight gradients in the
  step, ``reduce``: the stage's data-parallel gradient reduction (DDP's all-reduce, FSDP's
  reduce-scatter) runs in that backward, overlapping it, over every micro-batch's
  accumulated gradients; every other backward accumulates without communicating;
- a *post* instruction between computes: start the sends the compute before it queued
  (its activation to the next stage, or its input gradient to the previous one), in one
  ``batch_isend_irecv`` with the receives of the coming actions — two actions ahead on
  gloo, the next one fused with the last send before it on NCCL, plus the receives NCCL's
  stream rules make some schedules post earlier
  (:func:`~devmesh.layout.pipeline_messages.nccl_placement`).

Where a stage's backward cannot be split into ``I`` and ``W`` (DDP's reducer needs every
gradient in one autograd call; some graphs hold a node that cannot be cut), the ``I`` does
the whole backward and its ``W`` nothing, so the reduction moves to the stage's last ``B``
or ``I``: a program is lowered for a given set of such stages (``whole``).

:func:`program_problem` checks a step's programs before anything runs: every action is
computed once on its own rank; every message sent is received, in the order it is sent (NCCL
ignores tags); no receive is posted after the compute that needs it; on NCCL, no rank waits
forever under its stream rules; and each stage's gradients are reduced exactly once, after
every backward that adds to them. Unsharding and resharding a ``fully_shard`` stage's
parameters are not instructions: the stage's own hooks gather before each forward and
backward and free after, exactly as outside a pipeline, so a stage holds no more memory in a
pipeline than alone (torch's pipelining instead keeps a stage unsharded across its
micro-batches: fewer gathers, a whole stage's parameters held for the step).

``devmesh plan --schedule NAME --pp N --program gloo|nccl`` prints the programs, checked.
Nothing here imports torch.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from devmesh.layout.pipeline_messages import (
    Message,
    fifo_problem,
    forward_only,
    nccl_deadlock,
    nccl_placement,
    needed_by,
    sent_by,
    upcoming,
)
from devmesh.layout.schedule import Action, Schedule

__all__ = ["Op", "Instruction", "Program", "lower", "program_problem", "format_programs",
           "BACKENDS"]

BACKENDS = ("gloo", "nccl")


class Op(enum.Enum):
    """What one instruction does."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    POST = "post"  # start the queued sends with the coming actions' receives, in one batch


#: the compute instructions that add to a stage's weight gradients, by the stage's backward:
#: split into I and W (the weights' part in W), or whole (I does all of it)
_WEIGHT_GRADS = {False: (Op.BACKWARD, Op.BACKWARD_WEIGHT), True: (Op.BACKWARD, Op.BACKWARD_INPUT)}


@dataclass(frozen=True)
class Instruction:
    """One step of a rank's program: a compute (``action``; ``reduce`` on the backward in
    which the stage's gradients are reduced) or a post (``sends``: the messages the compute
    before it queued; ``receives``: the messages whose receives it posts, each peer's
    earlier messages first)."""

    op: Op
    action: Action | None = None
    reduce: bool = False
    sends: tuple[Message, ...] = ()
    receives: tuple[Message, ...] = ()

    def __str__(self) -> str:
        if self.op is Op.POST:
            parts = [f">{m}" for m in self.sends] + [f"<{m}" for m in self.receives]
            return "{" + " ".join(parts) + "}"
        return f"{self.action}{'+reduce' if self.reduce else ''}"


@dataclass(frozen=True)
class Program:
    """What ``rank`` does in one step of ``schedule`` on ``backend``: a training step, or
    with ``training`` false a forward-only pass (``evaluate``: the schedule's forwards, no
    gradient, no reduction). ``whole``: the stages whose backward is not split (see the
    module's docstring)."""

    schedule: Schedule
    rank: int
    backend: str
    training: bool
    whole: frozenset[int]
    instructions: tuple[Instruction, ...]

    @property
    def computes(self) -> tuple[Instruction, ...]:
        return tuple(i for i in self.instructions if i.op is not Op.POST)

    @property
    def reducing(self) -> frozenset[Action]:
        """The backward actions in which a stage's gradients are reduced."""
        return frozenset(i.action for i in self.instructions if i.reduce)

    def __str__(self) -> str:
        """One line: the computes, and each post's sends and the receives it adds (a post
        names again the receives an earlier one already covers, as the runner asks)."""
        parts, posted = [], set()
        for instruction in self.instructions:
            if instruction.op is Op.POST:
                new = tuple(m for m in instruction.receives if m not in posted)
                posted.update(new)
                instruction = Instruction(Op.POST, sends=instruction.sends, receives=new)
                if not (instruction.sends or instruction.receives):
                    continue
            parts.append(str(instruction))
        return " ".join(parts)


@functools.lru_cache(maxsize=256)  # immutable; a runner lowers its schedule once per kind of step
def lower(schedule: Schedule, rank: int, backend: str = "gloo", *, training: bool = True,
          whole: frozenset[int] = frozenset()) -> Program:
    """``rank``'s program for one step of ``schedule`` on ``backend`` (``"gloo"`` or
    ``"nccl"``); ``whole``: the stages whose backward cannot be split."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not 0 <= rank < schedule.ranks:
        raise ValueError(f"rank {rank} is not one of schedule {schedule.name!r}'s "
                         f"{schedule.ranks} ranks")
    plan = schedule if training else forward_only(schedule)
    actions = plan.actions[rank]
    policy = "fused" if backend == "nccl" else "ahead"
    early = (nccl_placement(plan) or {}).get(rank, {}) if backend == "nccl" else {}
    sends = sent_by(plan, rank)
    reducing = _last_weight_backwards(actions, whole) if training else set()
    out = [Instruction(Op.POST, receives=tuple(upcoming(plan, actions, 0, policy, early)))]
    for k, action in enumerate(actions):
        out.append(Instruction(Op(action.kind), action, reduce=action in reducing))
        out.append(Instruction(Op.POST, sends=sends[k][1],
                               receives=tuple(upcoming(plan, actions, k + 1, policy, early))))
    return Program(schedule, rank, backend, training, frozenset(whole), tuple(out))


def _last_weight_backwards(actions: Sequence[Action], whole: frozenset[int]) -> set[Action]:
    """Per stage, its last action that computes weight gradients."""
    last: dict[int, Action] = {}
    for action in actions:
        if Op(action.kind) in _WEIGHT_GRADS[action.stage in whole]:
            last[action.stage] = action
    return set(last.values())


def program_problem(programs: Sequence[Program]) -> str | None:
    """Why the programs of one step (every rank's, same schedule, backend and kind of step)
    cannot run, if they cannot; ``None`` when every check passes (see the module's
    docstring)."""
    if not programs:
        return "no programs"
    first = programs[0]
    plan = first.schedule if first.training else forward_only(first.schedule)
    if sorted(p.rank for p in programs) != list(range(plan.ranks)) or any(
            (p.schedule, p.backend, p.training) != (first.schedule, first.backend,
                                                    first.training) for p in programs):
        return (f"one program per rank of schedule {plan.name!r} is needed, all for the same "
                "schedule, backend and kind of step")
    for program in sorted(programs, key=lambda p: p.rank):
        problem = (_actions_problem(program, plan) or _receives_problem(program, plan)
                   or _reduction_problem(program))
        if problem:
            return f"rank {program.rank}: {problem}"
    problem = fifo_problem(plan) or _matching_problem(programs)
    if problem is None and first.backend == "nccl":
        placed = nccl_placement(plan)
        problem = next(filter(None, (nccl_deadlock(plan, "fused", shapes, placed or {})
                                     for shapes in ("held", "new", "changed"))), None)
    return problem


def _actions_problem(program: Program, plan: Schedule) -> str | None:
    """Every action of the rank's schedule computed once, in the schedule's order."""
    computed = tuple(i.action for i in program.computes)
    if computed != plan.actions[program.rank]:
        missing = set(plan.actions[program.rank]) - set(computed)
        return ("its computes are not the schedule's actions in order"
                + (f" (missing {', '.join(map(str, sorted(missing)))})" if missing else ""))
    if any(Op(i.action.kind) is not i.op for i in program.computes):
        return "a compute's op is not its action's kind"
    return None


def _receives_problem(program: Program, plan: Schedule) -> str | None:
    """Every message a compute waits for is posted by a post before it."""
    posted: set[Message] = set()
    for instruction in program.instructions:
        if instruction.op is Op.POST:
            posted.update(instruction.receives)
            continue
        need = needed_by(plan, instruction.action)
        if need is not None and need[1] not in posted:
            return f"{instruction.action} waits for {need[1]}, whose receive no post before it makes"
    return None


def _reduction_problem(program: Program) -> str | None:
    """Each stage's gradients reduced once, by a backward after every other backward that
    adds to them (a reduction before one leaves that micro-batch's gradient out of it)."""
    if not program.training:
        return ("a forward-only pass reduces no gradient" if program.reducing else None)
    stages = {i.action.stage for i in program.computes}
    for stage in sorted(stages):
        adding = [i for i in program.computes if i.action.stage == stage
                  and i.op in _WEIGHT_GRADS[stage in program.whole]]
        reducing = [i for i in program.computes if i.action.stage == stage and i.reduce]
        if len(reducing) != 1:
            return (f"stage {stage}'s gradients are reduced {len(reducing)} times in a step; "
                    "once is right, at its last backward that computes weight gradients")
        if reducing[0] is not adding[-1]:
            return (f"stage {stage}'s gradients are reduced in {reducing[0].action}, before "
                    f"{adding[-1].action} adds to them")
    return None


def _matching_problem(programs: Iterable[Program]) -> str | None:
    """Every message sent is wanted by its receiver and the other way round."""
    sent: dict[Message, int] = {}
    wanted: set[Message] = set()
    for program in programs:
        for instruction in program.instructions:
            for message in instruction.sends:
                if message.kind != "header":
                    sent[message] = program.rank
            wanted.update(instruction.receives)
    for message in sorted(set(sent) - wanted, key=str):
        return f"rank {sent[message]} sends {message}, which no rank receives"
    for message in sorted(wanted - set(sent), key=str):
        return f"a rank receives {message}, which no rank sends"
    return None


def format_programs(schedule: Schedule, backend: str = "gloo", rank: int | None = None) -> str:
    """Every rank's program (or ``rank``'s) for a training step, checked: what
    ``devmesh plan --schedule ... --program BACKEND`` prints."""
    programs = [lower(schedule, r, backend) for r in range(schedule.ranks)]
    evaluation = [lower(schedule, r, backend, training=False) for r in range(schedule.ranks)]
    lines = [f"{schedule.name} on {backend}, one training step: each rank's computes (F "
             "forward, B backward, I input gradient, W weight gradients; +reduce: the stage's "
             "gradients are reduced in it) and, between them, the messages it starts in one "
             "batch (> send, < receive)"]
    for program in programs:
        if rank is None or program.rank == rank:
            lines.append(f"rank {program.rank}: {program}")
    problem = program_problem(programs) or program_problem(evaluation)
    lines.append(f"not runnable: {problem}" if problem else
                 "checked: every action once, every message received in the order sent, each "
                 "stage's gradients reduced once after its last backward"
                 + (", no deadlock under NCCL's rules" if backend == "nccl" else "")
                 + " (training and forward-only)")
    return "\n".join(lines)
