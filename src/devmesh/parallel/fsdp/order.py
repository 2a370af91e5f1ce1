"""The order ``fully_shard`` units run their forward in, recorded per model, so each unit
starts the next one's all-gather while it computes (prefetch), and backward re-gathers the
one before."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from devmesh import _torch_compat
from devmesh.distributed import groups

if TYPE_CHECKING:
    from devmesh.parallel.fsdp.unit import FSDPUnit


class ForwardOrder:
    """The order in which units run their forward, recorded on the first pass, so that each
    unit can start the next one's all-gather (prefetch). Every rank runs the same code, so
    every rank issues the prefetches in the same order. A prefetch not consumed by the end of
    the outermost forward (a unit skipped this time) is waited on and dropped, so no stale
    parameters survive an optimizer step."""

    def __init__(self) -> None:
        self.order: list[FSDPUnit] = []
        self.recording: list[FSDPUnit] | None = None
        self.depth = 0
        self.generation = -1
        # where in the recorded order the forward is: a unit may run several times in one
        # forward (the modules of a group, a module called twice), each time followed by
        # its own next unit
        self.cursor = 0
        self.following: int | None = None  # the index after the unit that entered last

    def enter(self, unit: FSDPUnit) -> None:
        if self.depth == 0:
            self.cursor = 0
            self.recording = [] if not self.order or self.order[0] is not unit else None
            for other in self.order:
                other.begin_forward_of_step()
            if _torch_compat.current_graph_task_id() == -1:  # not a recompute inside backward
                for other in self._explicit_backward_targets():  # a prefetch never used
                    other.drop_regather()
        self.depth += 1
        if self.recording is not None:
            self.recording.append(unit)
            return
        self.following = None
        if unit in self.order:  # its next run in the record, else its first (order changed)
            at = (self.order.index(unit, self.cursor) if unit in self.order[self.cursor:]
                  else self.order.index(unit))
            self.cursor = self.following = at + 1

    def prefetch_after(self, unit: FSDPUnit) -> None:
        """Start the all-gather of the unit that ran after ``unit`` (which just entered)
        when the order was recorded."""
        if self.recording is not None or self.following is None:
            return
        if self.following < len(self.order):
            self.order[self.following].prefetch()

    def prefetch_backward_before(self, unit: FSDPUnit) -> None:
        """Backward runs units in reverse: start re-gathering the closest earlier unit whose
        backward needed its parameters in the previous step."""
        if unit not in self.order:
            return
        for other in reversed(self.order[: self.order.index(unit)]):
            if other.needed_regather and other.params:
                other.regather_ahead()
                return

    def exit(self, unit: FSDPUnit, failed: bool = False) -> None:
        self.depth -= 1
        if self.depth == 0:
            if self.recording is not None:  # a forward that raised records nothing
                self.order = [] if failed else self.recording
                self.recording = None
            for other in self._prefetch_targets():
                other.drop_forward_prefetch()

    def _prefetch_targets(self) -> list[FSDPUnit]:
        """The recorded units and those their explicit forward prefetch lists name."""
        named = [u for unit in self.order for u in unit.forward_prefetch if u not in self.order]
        return self.order + list(dict.fromkeys(named))

    def _explicit_backward_targets(self) -> list[FSDPUnit]:
        """The units the recorded units' explicit backward prefetch lists name: a unit whose
        backward did not run (its output unused) would otherwise keep a re-gather started
        before the optimizer step for its next backward."""
        return list(dict.fromkeys(u for unit in self.order for u in unit.backward_prefetch))


class ForwardOrders:
    """One :class:`ForwardOrder` per root: the unit that starts a forward (the outermost one)
    owns the record of that model's units, so two models (a copy, an EMA model) trained side
    by side each keep their own order and prefetches. A unit remembers the record its last
    forward used, for its backward.

    ``active``: the record of the forward running now (``None`` between forwards);
    ``open_groups``: units whose gather stays in their modules' places until each module of
    the group ran, closed at the latest when the outermost forward ends."""

    def __init__(self) -> None:
        self.active: ForwardOrder | None = None
        self.open_groups: list[FSDPUnit] = []

    def enter(self, unit: FSDPUnit) -> None:
        if self.active is None:
            if unit.root_order is None or unit.root_order.generation != groups.generation():
                unit.root_order = ForwardOrder()  # first forward, or a new world
                unit.root_order.generation = groups.generation()
            self.active = unit.root_order
        unit.forward_order = self.active
        self.active.enter(unit)

    def exit(self, unit: FSDPUnit) -> None:
        order = self.active
        assert order is not None
        order.exit(unit, failed=sys.exc_info()[0] is not None)  # an always_call hook after
        # an exception runs inside torch's `except` block
        if order.depth == 0:
            self.active = None
            # a group some of whose modules did not run: resharded at the end of the forward,
            # as FSDP2 does
            while self.open_groups:
                self.open_groups.pop().close_forward_gather()


# The one place the forward in progress is recorded: every unit's hooks read it through the
# functions below (a forward crosses units of any model, started by whichever runs first).
_FORWARDS = ForwardOrders()


def forward_running() -> bool:
    """Whether a unit's forward is running now (a unit entering otherwise starts one)."""
    return _FORWARDS.active is not None


def enter_forward(unit: FSDPUnit) -> None:
    _FORWARDS.enter(unit)


def exit_forward(unit: FSDPUnit) -> None:
    _FORWARDS.exit(unit)


def keep_open(unit: FSDPUnit) -> None:
    """``unit``'s gather stays in its modules' places until each of them ran, or until the
    outermost forward ends."""
    _FORWARDS.open_groups.append(unit)
