"""Pipeline schedules as data: per rank, the ordered list of what it computes.

An :class:`Action` is a forward (``F``), a full backward (``B``), or a backward split into
its input-gradient half (``I``, which the previous stage waits for) and its weight-gradient
half (``W``, which nobody waits for) — for one stage and one micro-batch. A
:class:`Schedule` holds each rank's actions in order; stage ``s`` lives on rank
``s % ranks`` (with virtual stages, rank ``r`` holds stages ``r, r + ranks, ...``), or, for a
schedule placed in a V (``placement="v"``: zero-bubble V, DualPipeV), down the ranks and back
up: rank ``r`` holds stages ``r`` and ``2 * ranks - 1 - r``, so the first and last stages share
rank 0 and the two stages at the turn share the last rank (they hand over in memory, no
message).

Nothing here runs a model: :meth:`Schedule.simulate` plays the schedule with given costs per
kind (respecting that a stage's forward needs the previous stage's, a backward the next
stage's) and gives each action's start and end, the makespan and the *bubble* — the
fraction of rank-time spent waiting — which the executor's measured bubble is compared
with. ``devmesh plan --pp`` prints and draws it without launching anything.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from devmesh.errors import ScheduleError

__all__ = ["Action", "Schedule", "ScheduleError", "stage_bounds", "gpipe", "one_f_one_b",
           "interleaved_1f1b", "looped_bfs", "zero_bubble", "interleaved_zero_bubble",
           "zbv_zero_bubble", "dualpipe_v", "SCHEDULES", "PLACEMENTS", "LOOPED", "IN_A_V",
           "build_schedule", "parse_schedule"]

DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}




@dataclass(frozen=True, order=True)
class Action:
    kind: str  # "F", "B", "I" or "W"
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}@{self.stage}"


@dataclass(frozen=True)
class Timed:
    action: Action
    rank: int
    start: float
    end: float


#: how stages map to ranks: "loop" (stage s on rank s % ranks) or "v" (down and back up)
PLACEMENTS = ("loop", "v")


@dataclass(frozen=True)
class Schedule:
    """``actions[r]``: what rank ``r`` computes, in order; ``placement``: which rank holds
    each stage (:data:`PLACEMENTS`, :meth:`rank_of`)."""

    name: str
    ranks: int
    stages: int
    microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    placement: str = "loop"

    def __post_init__(self) -> None:
        """A schedule is data a user may write by hand: refuse one the runner would play
        wrongly (a micro-batch's backward missing: its gradients silently left out) or not
        at all (an action waiting for one that comes after it: every rank would hang).
        Lists of actions are kept as tuples: a schedule is immutable and hashable."""
        if not isinstance(self.actions, (list, tuple)) or not all(
                isinstance(actions, (list, tuple)) for actions in self.actions):
            raise ScheduleError(f"schedule {self.name!r}: actions must be one list of actions "
                                "per rank")
        object.__setattr__(self, "actions", tuple(map(tuple, self.actions)))
        problem = _structure_problem(self)
        if problem:
            raise ScheduleError(f"schedule {self.name!r}: {problem}")
        self.simulate()  # raises ScheduleError naming the actions that wait on each other

    def __hash__(self) -> int:
        """Hashed once: the message model's caches look a schedule up for every action, and a
        dataclass's hash would walk all its actions each time. Not pickled (a string's hash
        differs between processes)."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.name, self.ranks, self.stages, self.microbatches, self.actions,
                           self.placement))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def splits_backward(self) -> bool:
        """Whether some backward is played in two (``I``: input gradients, then ``W``: weight
        gradients), as the zero-bubble schedules and DualPipeV do."""
        return any(action.kind == "I" for actions in self.actions for action in actions)

    def rank_of(self, stage: int) -> int:
        """The rank holding ``stage`` (see :data:`PLACEMENTS`)."""
        return _rank_of(stage, self.ranks, self.placement)

    def simulate(self, costs: Mapping[str | Action, float] | None = None,
                 latency: float = 0.0) -> list[Timed]:
        """Every action with its start and end when it costs ``costs[action]`` (e.g. the
        runner's measured ``compute_seconds``) or else ``costs[kind]``, an input made on
        another rank arrives ``latency`` after it is made (a message between stages), and a
        rank starts an action once it is free and its inputs are there. Raises
        :class:`ScheduleError` if some rank waits for an action that can never happen."""
        cost: dict = {**DEFAULT_COSTS, **(costs or {})}
        done: dict[tuple[str, int, int], float] = {}
        free = [0.0] * self.ranks
        position = [0] * self.ranks
        timeline: list[Timed] = []
        remaining = sum(map(len, self.actions))
        while remaining:
            progressed = False
            for r in range(self.ranks):
                while position[r] < len(self.actions[r]):
                    action = self.actions[r][position[r]]
                    ready = self._ready_time(action, done, latency)
                    if ready is None:
                        break
                    start = max(free[r], ready)
                    end = start + cost.get(action, cost[action.kind])
                    key = "B" if action.kind in ("B", "I") else action.kind
                    done[(key, action.stage, action.microbatch)] = end
                    if action.kind == "B":
                        done[("W", action.stage, action.microbatch)] = end
                    if action.kind == "W":
                        done[("Wdone", action.stage, action.microbatch)] = end
                    timeline.append(Timed(action, r, start, end))
                    free[r] = end
                    position[r] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:
                stuck = {r: str(self.actions[r][position[r]]) for r in range(self.ranks)
                         if position[r] < len(self.actions[r])}
                raise ScheduleError(f"schedule {self.name!r} cannot proceed: each rank waits "
                                    f"for an input that comes later ({stuck})")
        return timeline

    def _ready_time(self, action: Action, done: Mapping, latency: float) -> float | None:
        s, m = action.stage, action.microbatch
        if action.kind == "F":
            needs = [("F", s - 1, m)] if s > 0 else []
        elif action.kind in ("B", "I"):
            needs = [("F", s, m)] + ([("B", s + 1, m)] if s < self.stages - 1 else [])
        else:  # W: after this stage's input-gradient half
            needs = [("B", s, m)]
        times = []
        for need in needs:
            made = done.get(need)
            if made is None:
                return None
            crossing = self.rank_of(need[1]) != self.rank_of(s)
            times.append(made + (latency if crossing else 0.0))
        return max(times, default=0.0)

    def bubble(self, costs: Mapping[str | Action, float] | None = None,
               latency: float = 0.0) -> float:
        """The fraction of rank-time spent idle between the first start and the last end."""
        timeline = self.simulate(costs, latency)
        makespan = max(t.end for t in timeline)
        busy = sum(t.end - t.start for t in timeline)
        return 1.0 - busy / (self.ranks * makespan)

    def __str__(self) -> str:
        shape = " in a V" if self.placement == "v" else ""
        lines = [f"{self.name}: {self.stages} stages on {self.ranks} ranks{shape}, "
                 f"{self.microbatches} micro-batches"]
        for r, actions in enumerate(self.actions):
            lines.append(f"rank {r}: " + " ".join(map(str, actions)))
        return "\n".join(lines)


def stage_bounds(layers: int, stages: int) -> list[tuple[int, int]]:
    """The layers ``[start, end)`` of each of ``stages`` pipeline stages over ``layers``
    repeated blocks: as even as they go, the earlier stages taking one more where they do not
    divide (torchtitan's even split). The one rule for the runner's stages and the dry run's."""
    if not 1 <= stages <= layers:
        raise ValueError(f"{stages} pipeline stages over {layers} layers: each stage needs "
                         f"at least one layer, so use 1 to {layers} stages")
    per, extra = divmod(layers, stages)
    starts = [s * per + min(s, extra) for s in range(stages + 1)]
    return list(zip(starts[:-1], starts[1:], strict=True))


def _rank_of(stage: int, ranks: int, placement: str) -> int:
    """``stage % ranks``, or in a V, down the ranks on even rounds of ``ranks`` stages and
    back up on odd ones."""
    position = stage % ranks
    if placement == "v" and (stage // ranks) % 2:
        return ranks - 1 - position
    return position


def _placement_of(actions: Mapping[int, tuple[Action, ...]], ranks: int) -> str:
    """The placement the rank lines of a schedule written without its first line follow:
    the loop unless only the V fits."""
    def fits(placement: str) -> bool:
        return all(_rank_of(a.stage, ranks, placement) == rank
                   for rank, listed in actions.items() for a in listed)
    return "v" if not fits("loop") and fits("v") else "loop"


def _structure_problem(schedule: Schedule) -> str | None:
    """What makes ``schedule`` not a schedule, if anything: each forward once, on the rank
    that holds its stage, and either no backward at all (forward only, as an evaluation
    plays) or one per forward — a ``B``, or an ``I`` and a ``W``."""
    for name in ("ranks", "stages", "microbatches"):
        value = getattr(schedule, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{name} must be a positive integer, got {value!r}"
    if schedule.placement not in PLACEMENTS:
        return f"placement {schedule.placement!r} is not one of {PLACEMENTS}"
    if schedule.placement == "v" and schedule.stages % (2 * schedule.ranks):
        return (f"a V placement needs the stages ({schedule.stages}) to be a multiple of "
                f"twice the ranks ({2 * schedule.ranks}): down the ranks and back up")
    if len(schedule.actions) != schedule.ranks:
        return (f"actions holds {len(schedule.actions)} lists for {schedule.ranks} ranks: "
                "give one list of actions per rank")
    seen: set[Action] = set()
    kinds: dict[tuple[int, int], set[str]] = {}  # (stage, micro-batch) -> its action kinds
    for rank, actions in enumerate(schedule.actions):
        for action in actions:
            if not isinstance(action, Action):
                return f"rank {rank} has {action!r}: actions are Action(kind, stage, microbatch)"
            if not all(isinstance(v, int) and not isinstance(v, bool)
                       for v in (action.stage, action.microbatch)):
                return (f"rank {rank} has {action!r}: its stage and micro-batch must be "
                        "integers")
            if action.kind not in DEFAULT_COSTS:
                return f"{action} has kind {action.kind!r}: use 'F', 'B', 'I' or 'W'"
            if not 0 <= action.stage < schedule.stages:
                return (f"{action} names stage {action.stage}, outside 0..{schedule.stages - 1}")
            if not 0 <= action.microbatch < schedule.microbatches:
                return (f"{action} names micro-batch {action.microbatch}, outside "
                        f"0..{schedule.microbatches - 1}")
            if schedule.rank_of(action.stage) != rank:
                return (f"{action} is in rank {rank}'s list, but stage {action.stage} lives on "
                        f"rank {schedule.rank_of(action.stage)} ("
                        + ("placed in a V: rank r holds stages r and 2 x ranks - 1 - r"
                           if schedule.placement == "v" else "stage s on rank s % ranks")
                        + ")")
            if action in seen:
                return f"{action} appears twice in rank {rank}'s list: each action runs once"
            seen.add(action)
            kinds.setdefault((action.stage, action.microbatch), set()).add(action.kind)
    trains = any(a.kind != "F" for a in seen)
    for stage in range(schedule.stages):
        for m in range(schedule.microbatches):
            has = kinds.get((stage, m), set())
            unit = f"micro-batch {m} of stage {stage}"
            if "F" not in has:
                return f"{unit} has no forward (F{m}@{stage}): every stage runs every micro-batch"
            if not trains:
                continue
            if "B" in has and has & {"I", "W"}:
                return (f"{unit} has a whole backward (B) and a split one (I, W): give it one "
                        "or the other")
            if has == {"F"}:
                return (f"{unit} has no backward (B{m}@{stage}, or I{m}@{stage} and "
                        f"W{m}@{stage}): its gradients would be left out of the step (a "
                        "schedule has a backward for every forward, or none at all)")
            if has in ({"F", "I"}, {"F", "W"}):
                missing = "W" if "I" in has else "I"
                return (f"{unit} has no {missing}{m}@{stage}: a split backward needs its "
                        "input-gradient half (I) and its weight-gradient half (W)")
    return None


def _check(ranks: int, microbatches: int, virtual: int = 1) -> None:
    for name, value in (("ranks (stages)", ranks), ("micro-batches", microbatches),
                        ("virtual stages per rank", virtual)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {value!r}")


def gpipe(ranks: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards (GPipe): simplest, holds every micro-batch's
    activations at once."""
    _check(ranks, microbatches)
    actions = tuple(tuple([Action("F", r, m) for m in range(microbatches)]
                          + [Action("B", r, m) for m in range(microbatches)])
                    for r in range(ranks))
    return Schedule("gpipe", ranks, ranks, microbatches, actions)


def one_f_one_b(ranks: int, microbatches: int) -> Schedule:
    """1F1B: after ``ranks - 1 - r`` warm-up forwards, rank ``r`` alternates one forward and
    one backward, so at most ``ranks - r`` micro-batches' activations are alive at once; the
    same bubble as GPipe."""
    _check(ranks, microbatches)
    out = []
    for r in range(ranks):
        warmup = min(ranks - 1 - r, microbatches)
        seq = [Action("F", r, m) for m in range(warmup)]
        for i in range(warmup, microbatches):
            seq += [Action("F", r, i), Action("B", r, i - warmup)]
        seq += [Action("B", r, m) for m in range(microbatches - warmup, microbatches)]
        out.append(tuple(seq))
    return Schedule("1f1b", ranks, ranks, microbatches, tuple(out))


def interleaved_1f1b(ranks: int, microbatches: int, virtual: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM's): each rank holds ``virtual`` stages (rank ``r``:
    stages ``r, r + ranks, ...``); micro-batches go through the rank's stages in rounds,
    which divides the bubble by about ``virtual``.

    A round is ``ranks`` micro-batches when ``ranks`` divides ``microbatches`` (Megatron's
    rule); otherwise the micro-batches are cut into ``max(1, microbatches // ranks)`` equal
    rounds, as torch's ``ScheduleInterleaved1F1B`` does since its flexible interleaving: 6
    micro-batches on 4 ranks are one round of 6, 10 are two of 5, 3 one of 3 — every count
    torch accepts runs here, in torch's order; the rest (9 on 4 ranks: two rounds cannot be
    equal) are refused with the nearest counts that work."""
    return _interleaved("interleaved-1f1b", ranks, microbatches, virtual, split=False)


def interleaved_zero_bubble(ranks: int, microbatches: int, virtual: int = 2) -> Schedule:
    """Interleaved zero-bubble (torch's ``ScheduleInterleavedZeroBubble``, after ZB-1P of
    Qi et al.): interleaved 1F1B's stages and rounds, each backward split into ``I`` and
    ``W``: a rank's warm-up is one action shorter per rank after it (its ``I`` comes back
    sooner than a whole backward), and from its ``r``-th backward on, rank ``r`` runs a
    deferred ``W`` after each ``I``, the rest at the end — in torch's order."""
    return _interleaved("interleaved-zero-bubble", ranks, microbatches, virtual, split=True)


def _interleaved(name: str, ranks: int, microbatches: int, virtual: int, split: bool
                 ) -> Schedule:
    """The interleaved schedules' order (torch's), whole backwards or split ones."""
    _check(ranks, microbatches, virtual)
    rounds = max(1, microbatches // ranks)
    if microbatches % rounds:
        fits = [m for m in range(max(1, microbatches - ranks), microbatches + ranks + 1)
                if m % max(1, m // ranks) == 0]
        below = max((m for m in fits if m < microbatches), default=None)
        above = min(m for m in fits if m > microbatches)
        choice = f"{below} or {above}" if below else f"{above}"
        raise ScheduleError(
            f"{name} runs the micro-batches through each rank's stages in equal "
            f"rounds of at least {ranks} (the pipeline ranks): {microbatches} micro-batches "
            f"make {rounds} rounds, which cannot be equal; use {choice} micro-batches "
            f"(a multiple of {ranks} always fits)")
    per_round = microbatches // rounds
    total = microbatches * virtual  # forwards per rank, and backwards

    def chunk(k: int, backward: bool) -> int:  # which of the rank's stages the k-th uses
        index = (k // per_round) % virtual
        return virtual - 1 - index if backward else index

    out = []
    for r in range(ranks):
        # the last rank starts its first backward after a round on each earlier stage of
        # its own; each rank before it two actions later per hop (a forward and a backward
        # to come back), one under zero-bubble
        hops = 1 if split else 2
        warmup = min((ranks - r - 1) * hops + (virtual - 1) * per_round, total)
        given: dict[tuple[str, int], int] = {}  # (kind, stage) -> micro-batches so far
        seq: list[Action] = []

        def add(kind: str, local: int) -> None:  # the stage's next micro-batch of the kind
            stage = local * ranks + r
            seq.append(Action(kind, stage, given.get((kind, stage), 0)))
            given[(kind, stage)] = given.get((kind, stage), 0) + 1

        backwards: list[int] = []  # the local stage of each backward, in order
        weighted = 0  # how many of them have had their W
        for k in range(total + warmup):
            if k < total:
                add("F", chunk(k, False))
            if k >= warmup:
                backwards.append(chunk(k - warmup, True))
                add("I" if split else "B", backwards[-1])
                if split and k - warmup >= r:  # a deferred W after each I from here
                    add("W", backwards[weighted])
                    weighted += 1
        for local in backwards[weighted:] if split else ():
            add("W", local)
        out.append(tuple(seq))
    return Schedule(name, ranks, ranks * virtual, microbatches, tuple(out))


def looped_bfs(ranks: int, microbatches: int, virtual: int = 2) -> Schedule:
    """Looped breadth-first (Lamy-Poirier, 2022; torch's ``ScheduleLoopedBFS``): each rank
    holds ``virtual`` stages as in interleaved 1F1B, and runs every micro-batch's forward on
    its first stage, then on its next, and so on; then the backwards from its last stage
    down, each stage's micro-batches in reverse order (the last forward's backward first,
    as torch orders them). GPipe over looped stages: every activation alive at once, in
    exchange for a rank moving on to its next stage without waiting for a round."""
    _check(ranks, microbatches, virtual)
    out = []
    for r in range(ranks):
        seq = [Action("F", chunk * ranks + r, m)
               for chunk in range(virtual) for m in range(microbatches)]
        seq += [Action("B", chunk * ranks + r, m)
                for chunk in reversed(range(virtual)) for m in reversed(range(microbatches))]
        out.append(tuple(seq))
    return Schedule("looped-bfs", ranks, ranks * virtual, microbatches, tuple(out))


def zero_bubble(ranks: int, microbatches: int) -> Schedule:
    """A zero-bubble-style schedule (after ZB-H1 of Qi et al., 2023): each backward is split
    into its input-gradient half ``I``, which the previous stage waits for, and its
    weight-gradient half ``W``, which nobody waits for. The order is what a greedy list
    scheduler produces with unit costs: whenever a rank is free it runs a ready ``I`` first,
    else a ready ``F`` (at most ``ranks - r`` forwards ahead of their ``I``, as 1F1B), else a
    pending ``W`` — the weight gradients fill the time 1F1B spends waiting, at the price of
    keeping each deferred ``W``'s saved tensors until it runs."""
    _check(ranks, microbatches)
    done: dict[tuple[str, int, int], int] = {}  # action -> end time
    seqs: list[list[Action]] = [[] for _ in range(ranks)]
    next_f = [0] * ranks
    next_i = [0] * ranks
    pending_w: list[list[int]] = [[] for _ in range(ranks)]
    total = 3 * ranks * microbatches
    time = 0
    while sum(map(len, seqs)) < total:
        started = []
        for r in range(ranks):
            if seqs[r] and done.get(_key(seqs[r][-1]), time + 1) > time:
                continue  # still busy (unit costs: an action ends one step after it starts)
            i, f = next_i[r], next_f[r]
            last = r == ranks - 1
            if i < f and ("F", r, i) in done and (last or done.get(("I", r + 1, i), time + 1)
                                                  <= time):
                action = Action("I", r, i)
                next_i[r] += 1
                pending_w[r].append(i)
            elif (f < microbatches and f - i < ranks - r
                  and (r == 0 or done.get(("F", r - 1, f), time + 1) <= time)):
                action = Action("F", r, f)
                next_f[r] += 1
            elif pending_w[r]:
                action = Action("W", r, pending_w[r].pop(0))
            else:
                continue
            seqs[r].append(action)
            started.append(action)
        for action in started:
            done[_key(action)] = time + 1
        time += 1
    return Schedule("zero-bubble", ranks, ranks, microbatches, tuple(map(tuple, seqs)))


def zbv_zero_bubble(ranks: int, microbatches: int) -> Schedule:
    """Zero-bubble V (ZB-V, Qi et al. 2024, section 6; torch's ``ScheduleZBVZeroBubble``):
    two stages per rank placed in a V — rank ``r`` holds stages ``r`` and
    ``2 * ranks - 1 - r``, so a micro-batch goes down the ranks and back up, and the last
    rank hands its first stage's output to its second in memory — with every backward split
    into ``I`` and ``W``. With forward, ``I`` and ``W`` equally long it leaves no bubble
    after the warm-up once there are ``2 * ranks - 1`` micro-batches or more, at the peak
    activation memory of 1F1B (the paper's design).

    The order is torch's, phase by phase, on rank ``r``: warm-up forwards on its first
    stage (two per rank below it, and one), then its two stages' forwards alternating, then
    on its second stage forward, ``I`` and ``W`` in turn; the steady state runs forward,
    ``I`` and ``W`` of the first stage, then of the second; the cool-down the ``I`` left
    before their ``W``. As torch, the order is made for at least ``2 * ranks - 1``
    micro-batches and the actions of the ones beyond ``microbatches`` dropped."""
    _check(ranks, microbatches)
    planned = max(2 * ranks - 1, microbatches)
    out = []
    for r in range(ranks):
        down, up = r, 2 * ranks - 1 - r
        made: dict[tuple[str, int], int] = {}  # (kind, stage) -> micro-batches given so far
        seq: list[Action] = []

        def add(kind: str, stage: int) -> None:  # the stage's next micro-batch of this kind
            seq.append(Action(kind, stage, made.get((kind, stage), 0)))
            made[(kind, stage)] = made.get((kind, stage), 0) + 1

        def split_backward(stage: int) -> None:  # I, then W of the same micro-batch
            add("I", stage)
            seq.append(Action("W", stage, seq[-1].microbatch))

        for _ in range(2 * (ranks - r) - 1):
            add("F", down)
        for _ in range(r):
            add("F", up)
            add("F", down)
        for _ in range(ranks - r):
            add("F", up)
            split_backward(up)
        while made.get(("F", up), 0) < made[("F", down)] or made[("F", down)] < planned:
            if made[("F", down)] < planned:
                add("F", down)
            split_backward(down)
            add("F", up)
            split_backward(up)
        weights = {stage: made.get(("I", stage), 0) for stage in (down, up)}  # W given
        for _ in range(r):
            add("I", down)
            add("I", up)
        for _ in range(ranks - r):
            add("I", down)
            seq.append(Action("W", down, weights[down]))
            weights[down] += 1
        for stage in (up, down):
            seq += [Action("W", stage, m) for m in range(weights[stage], made[("I", stage)])]
        out.append(tuple(a for a in seq if a.microbatch < microbatches))
    return Schedule("zbv-zero-bubble", ranks, 2 * ranks, microbatches, tuple(out), "v")


def dualpipe_v(ranks: int, microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe cut in half to one V; torch's
    ``ScheduleDualPipeV``): zero-bubble V's placement — rank ``r`` holds stages ``r`` and
    ``2 * ranks - 1 - r`` — with a steady state that pairs a forward of one stage with a
    whole backward (``B``) of the other, ``F`` down then ``B`` up, ``F`` up then ``B``
    down: on GPUs the pair is written so that one's communication (a mixture-of-experts
    all-to-all) hides under the other's compute; devmesh, like torch without a custom
    overlap function, runs the two one after the other. Only the warm-up's last phase and
    the cool-down's second half split backwards into ``I`` and ``W``, so a stage mixes
    whole and split backwards, and fewer weight halves wait with their saved tensors.

    The order is torch's, phase by phase, on rank ``r`` of ``R``: ``2 (R - r - 1)`` forwards
    on the first stage; ``r + 1`` pairs of forwards, first stage then second; ``R - r - 1``
    times ``I``, ``W`` and ``F`` on the second stage; the steady state's pairs; ``R - r - 1``
    times ``B`` up then the pair ``F`` up, ``B`` down; ``r + 1`` backwards of both stages,
    split into ``I`` from the middle one on; the remaining first-stage ``I`` each after a
    pending ``W``; the pending ``W`` last. Needs at least as many micro-batches as stages
    (``2 * ranks``), as torch's."""
    _check(ranks, microbatches)
    if microbatches < 2 * ranks:
        raise ScheduleError(
            f"dualpipe-v needs at least as many micro-batches as stages (2 x {ranks} ranks = "
            f"{2 * ranks}), got {microbatches}: use {2 * ranks} micro-batches or more, or "
            "zbv-zero-bubble, which takes any count")
    out = []
    for r in range(ranks):
        down, up = r, 2 * ranks - 1 - r
        given: dict[tuple[str, int], int] = {}  # (F or backward, stage) -> micro-batches
        pending: list[Action] = []  # the W owed by each I, oldest first
        seq: list[Action] = []

        def add(kind: str, stage: int) -> None:  # the stage's next micro-batch of the kind
            key = ("F" if kind == "F" else "back", stage)  # B and I share the count
            seq.append(Action(kind, stage, given.get(key, 0)))
            given[key] = given.get(key, 0) + 1
            if kind == "I":
                pending.append(Action("W", stage, seq[-1].microbatch))

        def owed_weights() -> None:  # the oldest pending W, if any
            if pending:
                seq.append(pending.pop(0))

        for _ in range(2 * (ranks - r - 1)):
            add("F", down)
        for _ in range(r + 1):
            add("F", down)
            add("F", up)
        for _ in range(ranks - r - 1):
            add("I", up)
            owed_weights()
            add("F", up)
        for _ in range(microbatches - 2 * ranks + r + 1):
            for forward, backward in ((down, up), (up, down)):
                add("F", forward)
                add("B", backward)
        for _ in range(ranks - r - 1):
            add("B", up)
            add("F", up)
            add("B", down)
        split = False
        for i in range(r + 1):  # split from the middle on: before up on odd ranks, after on even
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            add("I" if split else "B", up)
            split = split or i == (r + 1) // 2
            add("I" if split else "B", down)
        for _ in range(ranks - r - 1):
            owed_weights()
            add("I", down)
        seq += pending
        out.append(tuple(seq))
    return Schedule("dualpipe-v", ranks, 2 * ranks, microbatches, tuple(out), "v")


def _key(action: Action) -> tuple[str, int, int]:
    return (action.kind, action.stage, action.microbatch)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved-1f1b": interleaved_1f1b,
             "looped-bfs": looped_bfs, "zero-bubble": zero_bubble,
             "interleaved-zero-bubble": interleaved_zero_bubble,
             "zbv-zero-bubble": zbv_zero_bubble, "dualpipe-v": dualpipe_v}
#: the built-in schedules that run several stages per rank (``virtual``)
LOOPED = frozenset({"interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble"})
#: the built-in schedules that place two stages per rank in a V (``placement="v"``)
IN_A_V = frozenset({"zbv-zero-bubble", "dualpipe-v"})


def build_schedule(name: str, ranks: int, microbatches: int, virtual: int = 2) -> Schedule:
    """The schedule called ``name`` (one of :data:`SCHEDULES`); ``virtual``: stages per rank,
    for the schedules in :data:`LOOPED` (ignored by the others)."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)} "
                            "(or write your own: parse_schedule, Schedule)")
    if name in LOOPED:
        return SCHEDULES[name](ranks, microbatches, virtual)
    return SCHEDULES[name](ranks, microbatches)


_HEADER = re.compile(r"(?P<name>.+): (?P<stages>\d+) stages on (?P<ranks>\d+) ranks"
                     r"(?P<v> in a V)?, (?P<microbatches>\d+) micro-batch(es)?")
_RANK_LINE = re.compile(r"rank (?P<rank>\d+):(?P<actions>.*)")
_ACTION = re.compile(r"(?P<kind>[A-Za-z])(?P<microbatch>\d+)@(?P<stage>\d+)")


def parse_schedule(text: str, name: str = "hand-written") -> Schedule:
    """The schedule ``text`` writes as ``str(schedule)`` prints one, so that a schedule
    written or edited by hand can be checked, drawn and run (``devmesh plan --schedule
    FILE``): an optional first line ``NAME: S stages on R ranks, M micro-batches`` (``R ranks
    in a V`` for a V placement), then one line per rank, ``rank R: F0@0 F1@0 I0@0 W0@0 ...``
    (kind, micro-batch, ``@`` stage). Without the first line there are as many ranks as rank
    lines, as many stages and micro-batches as the largest named plus one, the placement the
    lines follow (the loop unless only the V fits), and the schedule is called ``name``.
    Blank lines and ``#`` comments are skipped. Raises :class:`ScheduleError` naming the line
    that cannot be read, or what makes the schedule wrong (:class:`Schedule`'s checks)."""
    header = None
    ranks: dict[int, tuple[Action, ...]] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        rank_line = _RANK_LINE.fullmatch(line)
        if rank_line is None:
            found = _HEADER.fullmatch(line)
            if found is None or header is not None or ranks:
                raise ScheduleError(
                    f"line {number} ({line!r}) is neither a first line 'NAME: S stages on R "
                    "ranks, M micro-batches' nor 'rank R: F0@0 B0@0 ...'")
            header = found
            continue
        rank = int(rank_line["rank"])
        if rank in ranks:
            raise ScheduleError(f"line {number}: rank {rank} is listed twice")
        actions = []
        for token in rank_line["actions"].split():
            action = _ACTION.fullmatch(token)
            if action is None:
                raise ScheduleError(f"line {number}: {token!r} is not an action: write KIND "
                                    "MICROBATCH@STAGE, e.g. F0@1 (kinds F, B, I, W)")
            actions.append(Action(action["kind"], int(action["stage"]),
                                  int(action["microbatch"])))
        ranks[rank] = tuple(actions)
    if not ranks:
        raise ScheduleError("no 'rank R: ...' line: write one line of actions per rank")
    everything = [a for actions in ranks.values() for a in actions]
    if header is None:
        count = len(ranks)
        sizes = (max((a.stage for a in everything), default=0) + 1,
                 max((a.microbatch for a in everything), default=0) + 1)
        placement = _placement_of(ranks, count)
    else:
        name, count = header["name"], int(header["ranks"])
        sizes = (int(header["stages"]), int(header["microbatches"]))
        placement = "v" if header["v"] else "loop"
    missing = sorted(set(range(count)) - set(ranks))
    extra = sorted(set(ranks) - set(range(count)))
    if missing or extra:
        raise ScheduleError(f"the schedule has {count} ranks, so it needs lines for ranks "
                            f"0..{count - 1}" + (f"; missing: {missing}" if missing else "")
                            + (f"; beyond them: {extra}" if extra else ""))
    return Schedule(name, count, sizes[0], sizes[1], tuple(ranks[r] for r in range(count)),
                    placement)
