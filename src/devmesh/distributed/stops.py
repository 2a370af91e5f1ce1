"""Ranks that stop in the middle of a step say so, and the ranks waiting for them give up.

A pipeline stage's data-parallel copies each get their own data, so one copy's forward can
fail where the others' does not (a token id only its embedding refuses). That copy stops
between two of the stage's collectives, and the others wait in the next one for a rank that
will not come — until the collective timeout (30 minutes by default) names it. Instead, a
rank that stops *announces* it in the rendezvous store: until the current scope (a pipeline
step) ends, it enters no collective on its copies' groups beyond those it already entered —
devmesh numbers each group's collectives (:mod:`~devmesh.distributed.timeouts`), so the
announcement is a number per group. A rank waiting in one of devmesh's collectives inside a
scope looks at the announcements every :data:`POLL_SECONDS` — only while it waits that long:
a collective done sooner costs nothing more — and gives up when a rank of its group will
never enter the collective it waits in: it raises
:class:`~devmesh.errors.CollectiveAbandonedError` naming that rank and its error, within a
second of the failure, and stops too (announcing it in turn, so a chain of waits unwinds).

gloo cannot cancel a collective: the one given up on stays posted, and would pair with the
group's next collective. So giving up breaks the world: outside that scope, every devmesh
collective raises :class:`~devmesh.errors.MeshBrokenError` (the job must restart, from its
last checkpoint) — on the rank that gave up, and on each rank that asks :func:`learn_broken`
(the pipeline's end of step does). Inside the scope collectives go on, so that the step's
own end (one all-reduce over the whole mesh, another group) can tell every rank.

Only waits on CPU tensors are polled: on a GPU (NCCL) a wait returns at once and a hang
shows at the next synchronization, where the collective timeout names the rank as before.
Nothing read from the store is unpickled: announcements are JSON.
"""

from __future__ import annotations

import contextlib
import datetime
import json
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

import torch.distributed as dist

from devmesh import _torch_compat
from devmesh.distributed import groups
from devmesh.distributed.timeouts import Watch, numbered
from devmesh.errors import CollectiveAbandonedError, MeshBrokenError

__all__ = ["POLL_SECONDS", "scope", "announce", "wait", "learn_broken", "refuse_if_broken"]

POLL_SECONDS = 0.5  # how often a rank waiting in a collective looks at the announcements
_PREFIX = "devmesh/stops/"
_BROKEN = _PREFIX + "broken"


@dataclass
class _Stops:
    """This rank's view of the current world's announcements."""

    scope: str | None = None  # the scope this rank is in (a pipeline step), by name
    read: list[dict] = field(default_factory=list)  # the current scope's announcements read
    broken: str | None = None  # why the world's collectives are out of step, once known
    broken_in: str | None = None  # the scope it broke in: its own end still runs


def _state() -> _Stops:
    return groups.world_cache().setdefault(("stops",), _Stops())  # a new world: a new view


def _store() -> dist.Store:
    return _torch_compat.default_store()


@contextlib.contextmanager
def scope(name: str) -> Iterator[None]:
    """Announcements made inside hold until it ends. Every rank that takes part names it the
    same (``"pipeline 0, step 3"``): a rank reads the announcements of its own scope only."""
    state = _state()
    outer, state.scope, state.read = state.scope, name, []
    try:
        yield
    finally:
        state.scope, state.read = outer, []


def announce(reason: str, among: Collection[int], *,
             still_used: Collection[tuple[int, ...]] = ()) -> None:
    """Tell the other ranks that this one stopped (``reason``: where, and its error): until
    the scope ends it enters no more collectives on the groups within ``among`` (the ranks
    of its copies), except the groups ``still_used`` (ranks in mesh order: the step's end).
    Outside a scope, nothing to say: no rank polls there."""
    state = _state()
    if state.scope is None or not dist.is_initialized():
        return
    inside, kept = set(among), {tuple(ranks) for ranks in still_used}
    entered = [[list(ranks), count] for ranks, count in numbered().items()
               if set(ranks) <= inside and ranks not in kept]
    record = json.dumps({"rank": dist.get_rank(), "reason": reason, "among": sorted(inside),
                         "still_used": [list(r) for r in still_used], "entered": entered})
    prefix = _PREFIX + state.scope + "/"
    with contextlib.suppress(Exception):  # no store: the others wait for the timeout, as before
        store = _store()
        store.set(prefix + str(store.add(prefix + "count", 1)), record)


def wait(work, watch: Watch | None, *, polled: bool) -> None:
    """``work.wait()``; inside a scope, with ``polled`` (a CPU tensor: gloo), checks every
    :data:`POLL_SECONDS` whether a rank of the watched group announced it will never enter
    this collective, and gives up then (:class:`CollectiveAbandonedError`)."""
    if watch is None or not polled or _state().scope is None:
        work.wait()
        return
    poll = datetime.timedelta(seconds=POLL_SECONDS)
    while True:
        try:
            work.wait(poll)
            return
        except RuntimeError as exc:  # gloo's "Operation timed out!": the poll, not a failure
            if "Operation timed out!" not in str(exc):
                raise
        _give_up_if_stopped(watch)


def _give_up_if_stopped(watch: Watch) -> None:
    state = _state()
    try:
        records = _read(state)
    except Exception:  # noqa: BLE001 - no store to ask: keep waiting, the timeout names them
        return
    me = dist.get_rank()
    for record in records:
        rank = record["rank"]
        if rank == me or not _never_enters(record, watch):
            continue
        collective = f"{watch.collective} over {watch.label()} (collective #{watch.number})"
        why = f"rank {rank} stopped before entering it — {record['reason']}"
        _mark_broken(f"rank {me} gave up on {collective}: {why}")
        raise CollectiveAbandonedError(
            f"{collective} on ranks {list(watch.ranks)} cannot finish: {why}. It stays "
            "posted, so this world's collectives are out of step from here on: restart the "
            "job (from the last checkpoint)", collective=collective, stopped=rank)


def _never_enters(record: dict, watch: Watch) -> bool:
    """Whether the rank that made the announcement ``record`` will never enter the
    collective ``watch`` numbers: it is of that group, the group is among the ones it
    stopped using, and it entered fewer of the group's collectives than this one's number
    (one it entered before it stopped can finish)."""
    if record["rank"] not in watch.ranks or not set(watch.ranks) <= set(record["among"]):
        return False
    if list(watch.ranks) in record["still_used"]:
        return False
    entered = {tuple(ranks): count for ranks, count in record["entered"]}
    return entered.get(watch.ranks, 0) < watch.number


def _read(state: _Stops) -> list[dict]:
    """The current scope's announcements, the new ones fetched (one store round trip when
    there are none)."""
    store = _store()
    prefix = _PREFIX + state.scope + "/"
    count = store.add(prefix + "count", 0)
    for index in range(len(state.read) + 1, count + 1):
        key = prefix + str(index)
        if not store.check([key]):
            break  # announced, not yet written: next poll
        state.read.append(json.loads(store.get(key)))
    return state.read


def _mark_broken(reason: str) -> None:
    state = _state()
    if state.broken is None:
        state.broken, state.broken_in = reason, state.scope
    with contextlib.suppress(Exception):  # the others learn it at the step's end
        _store().set(_BROKEN, reason)


def learn_broken() -> str | None:
    """Why the world's collectives are out of step, if a rank gave up on one (asks the store
    once; remembered)."""
    state = _state()
    if state.broken is None and dist.is_initialized():
        with contextlib.suppress(Exception):
            store = _store()
            if store.check([_BROKEN]):
                state.broken = store.get(_BROKEN).decode(errors="replace")
                state.broken_in = state.scope
    return state.broken


def refuse_if_broken() -> None:
    """Raise :class:`MeshBrokenError` if this rank knows the world's collectives are out of
    step (except in the scope it broke in: the step's own end still runs there)."""
    state = _state()
    if state.broken is not None and (state.scope is None or state.scope != state.broken_in):
        raise MeshBrokenError(
            f"this world's collectives are out of step ({state.broken}), so any collective "
            "now would pair with another: restart the job (from the last checkpoint)")
