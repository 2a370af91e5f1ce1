"""Which activations a pipeline rank holds when, and how few buffers hold them all.

A stage's forward of a micro-batch keeps what its backward needs (its activations) until the
backward that finishes with them: the full backward ``B``, or, when the backward is split, the
weight half ``W`` (the input half ``I`` still leaves them to ``W``). Over one rank's actions in
order, each (stage, micro-batch) pair is live over an inclusive interval of positions; live
intervals that never overlap can share one buffer (a *slot*). The greedy assignment by start
position is optimal for intervals, so the slot count is the rank's peak of activations held
at once — the number a memory estimate multiplies one micro-batch's activations by.

torch 2.15 offers the same analysis over its schedules (``analyze_pipeline_activation_liveness``,
whose names this module keeps); this one reads devmesh's :class:`~devmesh.layout.schedule.Schedule`
and needs no process group.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from devmesh.layout.schedule import Schedule

__all__ = ["PipelineActivationLiveness", "activation_liveness", "assign_slots"]

Granularity = Literal["microbatch", "stage_microbatch"]


@dataclass(frozen=True, eq=True)
class PipelineActivationLiveness:
    """The slots of one pipeline rank's activations (torch's fields and methods).

    ``slot_by_stage_and_microbatch[(stage, microbatch)]``: the slot id holding that
    activation; ``num_slots``: how many slots there are (the peak held at once). With
    ``granularity="microbatch"`` all the selected stages of one micro-batch share one
    lifetime (the earliest forward to the latest release) and one slot."""

    pp_rank: int
    granularity: Granularity
    stage_indices: tuple[int, ...]
    num_microbatches: int
    slot_by_stage_and_microbatch: Mapping[tuple[int, int], int]
    num_slots: int
    _activation_lifetime_by_stage_and_microbatch: Mapping[tuple[int, int], tuple[int, int]] = (
        field(repr=False))
    __hash__ = None  # type: ignore[assignment]  # holds mappings: equal by value, unhashable

    def slot_for(self, stage_index: int, microbatch_index: int) -> int:
        """The slot of one stage's activation of one micro-batch."""
        try:
            return self.slot_by_stage_and_microbatch[(stage_index, microbatch_index)]
        except KeyError as error:
            raise ValueError(f"No activation slot exists for stage {stage_index}, "
                             f"microbatch {microbatch_index}") from error

    def get_activation_lifetime(self, stage_index: int, microbatch_index: int
                                ) -> tuple[int, int]:
        """``(forward position, release position)``, inclusive, in the rank's actions."""
        try:
            return self._activation_lifetime_by_stage_and_microbatch[
                (stage_index, microbatch_index)]
        except KeyError as error:
            raise ValueError(f"No activation lifetime exists for stage {stage_index}, "
                             f"microbatch {microbatch_index}") from error


def assign_slots(intervals: Sequence[tuple[int, int]]) -> tuple[list[int], int]:
    """One slot per inclusive interval, reusing a slot only once its interval ended before
    the next starts: intervals taken by (start, end, input order), the lowest free slot
    first. Returns the slots in input order and their count."""
    live: list[tuple[int, int]] = []  # (end, slot)
    free: list[int] = []
    slots = [-1] * len(intervals)
    count = 0
    for index, (start, _end) in sorted(enumerate(intervals), key=lambda i: (*i[1], i[0])):
        while live and live[0][0] < start:
            heapq.heappush(free, heapq.heappop(live)[1])
        if free:
            slot = heapq.heappop(free)
        else:
            slot, count = count, count + 1
        slots[index] = slot
        heapq.heappush(live, (intervals[index][1], slot))
    return slots, count


def activation_liveness(schedule: Schedule, *, pp_rank: int, stage_indices: Sequence[int],
                        granularity: Granularity) -> PipelineActivationLiveness:
    """The activation lifetimes of ``stage_indices`` on pipeline rank ``pp_rank`` of
    ``schedule`` (positions index ``schedule.actions[pp_rank]``) and their slots.

    Raises ``ValueError`` (torch's type) for an unknown granularity, an empty or repeated
    stage selection, a rank outside the schedule, or a selected stage not run on that rank
    once per micro-batch, forward and release."""
    if granularity not in ("microbatch", "stage_microbatch"):
        raise ValueError(f"Unsupported activation granularity: {granularity!r} (use "
                         "'microbatch' or 'stage_microbatch')")
    tracked = tuple(stage_indices)
    if not tracked:
        raise ValueError("stage_indices must not be empty")
    if len(set(tracked)) != len(tracked):
        raise ValueError(f"stage_indices must be unique, got {list(tracked)}")
    if not 0 <= pp_rank < schedule.ranks:
        raise ValueError(f"Rank {pp_rank} is not present in the pipeline schedule (its "
                         f"{schedule.ranks} ranks are 0..{schedule.ranks - 1})")
    forwards: dict[tuple[int, int], int] = {}
    releases: dict[tuple[int, int], int] = {}
    for position, action in enumerate(schedule.actions[pp_rank]):
        if action.stage not in tracked:
            continue
        key = (action.stage, action.microbatch)
        if action.kind == "F":
            forwards[key] = position
        elif action.kind in ("B", "W"):
            releases[key] = position
    expected = {(s, m) for s in tracked for m in range(schedule.microbatches)}
    for what, found in (("Forward", forwards), ("Backward release", releases)):
        missing = sorted(expected - found.keys())
        if missing:
            raise ValueError(f"{what} actions do not match tracked activations: rank "
                             f"{pp_rank} has none for (stage, micro-batch) {missing[:4]}"
                             f"{' ...' if len(missing) > 4 else ''}; its stages are "
                             f"{sorted(_stages_of(schedule, pp_rank))}")
    keys = sorted(expected)
    if granularity == "microbatch":
        spans = [(min(forwards[(s, m)] for s in tracked), max(releases[(s, m)] for s in tracked))
                 for m in range(schedule.microbatches)]
        slots, count = assign_slots(spans)
        slot_of = {(s, m): slots[m] for s, m in keys}
        lifetime = {(s, m): spans[m] for s, m in keys}
    else:
        lifetimes = [(forwards[key], releases[key]) for key in keys]
        slots, count = assign_slots(lifetimes)
        slot_of = dict(zip(keys, slots))
        lifetime = dict(zip(keys, lifetimes))
    return PipelineActivationLiveness(
        pp_rank=pp_rank, granularity=granularity, stage_indices=tracked,
        num_microbatches=schedule.microbatches,
        slot_by_stage_and_microbatch=MappingProxyType(slot_of), num_slots=count,
        _activation_lifetime_by_stage_and_microbatch=MappingProxyType(lifetime))


def _stages_of(schedule: Schedule, rank: int) -> set[int]:
    return {s for s in range(schedule.stages) if schedule.rank_of(s) == rank}
