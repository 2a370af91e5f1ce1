"""Naming the ranks a timed-out collective waited for.

When one rank hangs in its own code, the others wait in the next collective until the
process group's timeout and then raise torch's ``Timed out waiting 30000ms for recv`` — on
every rank but the one at fault, which says nothing. devmesh numbers the collectives it
issues on each group (the same numbers on every rank of a program in step); a rank whose
collective times out writes "I was in collective #n" to the rendezvous store, waits a short
grace period for the others of its group to do the same, and raises
:class:`~devmesh.errors.CollectiveTimeoutError` naming the ranks that never wrote: they never
entered the collective (stuck elsewhere, or dead). This costs nothing until a timeout.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

import torch.distributed as dist

from devmesh.distributed import groups
from devmesh.errors import CollectiveTimeoutError

__all__ = ["Watch", "is_timeout"]

_sequence: dict[tuple[int, tuple[int, ...]], int] = {}
GRACE_SECONDS = 3.0  # how long a timed-out rank waits for the others of its group to say so


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's collective timeout (gloo: ``Timed out waiting``; NCCL's
    watchdog: ``Watchdog caught collective operation timeout``)."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("Timed out waiting" in text
                                               or "operation timeout" in text)


class Watch:
    """One collective about to run on the group ``ranks``: its number, and what to raise if
    it times out."""

    def __init__(self, collective: str, ranks: Sequence[int], label: Callable[[], str]) -> None:
        self.collective, self.ranks, self.label = collective, tuple(ranks), label
        key = (groups.generation(), self.ranks)  # a new world numbers from 1 again
        self.number = _sequence[key] = _sequence.get(key, 0) + 1

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Run the collective (or wait for it) inside this: a timeout names the culprits."""
        try:
            yield
        except RuntimeError as exc:
            error = self.explain(exc)
            if error is exc:
                raise
            raise error from exc

    def explain(self, exc: BaseException) -> BaseException:
        """The error to raise for ``exc``: a :class:`CollectiveTimeoutError` naming the ranks
        that never entered this collective, or ``exc`` itself if it is not a timeout (or the
        store cannot be reached)."""
        if not is_timeout(exc):
            return exc
        try:
            store = dist.distributed_c10d._get_default_store()
            rank = dist.get_rank()
            prefix = f"devmesh/timeout/{','.join(map(str, self.ranks))}/{self.number}/"
            store.set(prefix + str(rank), "1")
            deadline = time.monotonic() + GRACE_SECONDS
            arrived = {rank}
            while len(arrived) < len(self.ranks) and time.monotonic() < deadline:
                for r in self.ranks:
                    if r not in arrived and store.check([prefix + str(r)]):
                        arrived.add(r)
                time.sleep(0.05)
        except Exception as store_error:  # noqa: BLE001 - the store is gone too: torch's error
            exc.add_note(f"devmesh could not ask the other ranks which one never entered this "
                         f"collective: the store failed ({type(store_error).__name__}: "
                         f"{str(store_error).splitlines()[0] if str(store_error) else ''})")
            return exc
        missing = [r for r in self.ranks if r not in arrived]
        waited = sorted(arrived)
        if not missing:  # every rank timed out inside it: a slow or broken link, not a hang
            exc.add_note(f"devmesh: every rank of {list(self.ranks)} was inside this collective "
                         f"(#{self.number}) when it timed out")
            return exc
        return CollectiveTimeoutError(
            f"{self.collective} over {self.label()} (collective #{self.number} on ranks "
            f"{list(self.ranks)}) timed out: ranks {missing} never entered it — they are stuck "
            f"elsewhere in their code, or dead; ranks {waited} waited. Look at rank "
            f"{missing[0]}'s stack (py-spy dump, or faulthandler). torch's error: {exc}",
            missing=missing, waited=waited)
