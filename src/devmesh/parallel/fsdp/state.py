"""What a ``fully_shard`` unit's modules hold in their parameter slots, as one state with its
legal transitions in one table.

A unit's parameters are written into its modules' slots (every place a parameter is
registered, tied weights included) in one of three forms, and only
:meth:`FSDPUnit._place <devmesh.parallel.fsdp.unit.FSDPUnit._place>` moves between them,
checking each move against :data:`TRANSITIONS`:

``SHARDS``
    this rank's rows, the ``nn.Parameter`` objects the optimizer steps: between steps, and
    after a forward that resharded (backward re-gathers into tensors autograd saved, never
    into the slots);
``FORWARD``
    views of the forward's one all-gather, from the first module of the unit (or of its
    group, ``fully_shard([a, b])``) that runs until each of them ran or the outermost
    forward ended;
``UNSHARDED``
    views of gathered parameters outside a forward: ``unshard()``'s, or those kept between
    micro-batches without gradient sync and ``reshard_after_backward=False``, until the next
    forward uses them (no all-gather) or ``reshard()`` puts the shards back.

torch's FSDP2 keeps the same distinction per parameter (``ShardedState``: sharded,
sharded-post-forward, unsharded); devmesh's post-forward rows (``reshard_after_forward=n``)
never enter the slots, so they are not a state of the slots here.

A recomputation inside backward (activation checkpointing inside the unit) swaps gathered
views into the recomputed modules only, while the unit is in ``SHARDS``, and back after
each; that is per module, not the unit's state (see ``FSDPUnit.watch_recomputation``).
"""

from __future__ import annotations

import enum
from types import MappingProxyType

from devmesh.errors import FSDPStateError

__all__ = ["Slots", "TRANSITIONS", "FSDPStateError", "check_transition"]


class Slots(enum.Enum):
    """What the modules of a unit hold in their parameter slots."""

    SHARDS = "shards"
    FORWARD = "forward"
    UNSHARDED = "unsharded"


# state -> the states it may move to. A forward's gather is never turned into unshard()'s:
# unshard() during the unit's forward finds them in place and does nothing, and the
# forward's end puts the shards back first.
TRANSITIONS: MappingProxyType[Slots, frozenset[Slots]] = MappingProxyType({
    Slots.SHARDS: frozenset({Slots.SHARDS, Slots.FORWARD, Slots.UNSHARDED}),
    Slots.FORWARD: frozenset({Slots.SHARDS}),
    Slots.UNSHARDED: frozenset({Slots.UNSHARDED, Slots.FORWARD, Slots.SHARDS}),
})


def check_transition(unit: str, old: Slots, new: Slots) -> None:
    """Raise :class:`FSDPStateError` unless ``old -> new`` is in :data:`TRANSITIONS`."""
    if new not in TRANSITIONS[old]:
        allowed = ", ".join(sorted(s.name for s in TRANSITIONS[old]))
        raise FSDPStateError(
            f"fully_shard unit {unit}: its parameter slots hold {old.name} and cannot move to "
            f"{new.name} (from {old.name}: {allowed}); this is a devmesh bug unless the "
            "unit's forward hooks were called by hand — please report it with the traceback")
