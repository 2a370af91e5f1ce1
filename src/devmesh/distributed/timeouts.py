"""Naming the ranks a timed-out collective waited for.

When one rank hangs in its own code, the others wait in the next collective until the
process group's timeout and then raise torch's ``Timed out waiting 30000ms for recv`` — on
every rank but the one at fault, which says nothing. devmesh numbers the collectives it
issues on each group (the same numbers on every rank of a program in step); a rank whose
collective times out writes "I was in collective #n" to the rendezvous store, waits a short
grace period for the others of its group to do the same, and raises
:class:`~devmesh.errors.CollectiveTimeoutError` naming the ranks that never wrote: they never
entered the collective (stuck elsewhere, or dead). This costs nothing until a timeout.

A rank may hear of the timeout as a closed connection instead (gloo closes a timed-out rank's
connections, so its peers fail at once with ``Connection closed by peer``): that error takes
the same path, so every rank of the group names the culprit, not only the first to time out.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import torch.distributed as dist

from devmesh import _torch_compat
from devmesh.distributed import groups
from devmesh.errors import CollectiveTimeoutError, is_peer_gone, is_timeout

__all__ = ["Watch", "is_timeout", "numbered", "AGREEMENTS", "guarded"]

GRACE_SECONDS = 3.0  # how long a timed-out rank waits for the others of its group to say so
_SEQUENCE = "timeouts.sequence"  # world-cache key of a group's collective count
AGREEMENTS = "timeouts.agreements"  # the count of devmesh's agreements (consensus) on a group


_guards = threading.local()  # how many guards this thread is inside


def guarded() -> bool:
    """Whether this thread runs inside a :meth:`Watch.guard`: an inner watch would name the
    culprits of the same wait under another number (the pipeline's step end guards the
    failure check it runs)."""
    return getattr(_guards, "depth", 0) > 0


def numbered() -> dict[tuple[int, ...], int]:
    """How many collectives this rank has numbered on each group (its ranks in mesh order)
    in the current world: a rank that stops tells the others these
    (:mod:`~devmesh.distributed.stops`)."""
    return {key[1]: count for key, count in groups.world_cache().items()
            if isinstance(key, tuple) and key[:1] == (_SEQUENCE,)}


class Watch:
    """One collective about to run on the group ``ranks``: its number, and what to raise if
    it times out."""

    def __init__(self, collective: str, ranks: Sequence[int], label: Callable[[], str], *,
                 absent: str = "never entered it — they are stuck elsewhere in their code, or "
                               "dead", series: str = _SEQUENCE) -> None:
        self.collective, self.ranks, self.label = collective, tuple(ranks), label
        self.absent = absent  # what the ranks that never said they waited did, in words
        # the count this collective is numbered in: devmesh's counted collectives share one
        # (the stops compare it), its agreements keep their own (AGREEMENTS)
        self.series = series
        numbers = groups.world_cache()  # a new world numbers from 1 again
        key = (series, self.ranks)
        self.number = numbers[key] = numbers.get(key, 0) + 1

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Run the collective (or wait for it) inside this: a timeout names the culprits."""
        _guards.depth = getattr(_guards, "depth", 0) + 1
        try:
            yield
        except RuntimeError as exc:
            error = self.explain(exc)
            if error is exc:
                raise
            raise error from exc
        finally:
            _guards.depth -= 1

    def explain(self, exc: BaseException) -> BaseException:
        """The error to raise for ``exc``: a :class:`CollectiveTimeoutError` naming the ranks
        that never entered this collective, or ``exc`` itself if it is not a timeout (or the
        store cannot be reached)."""
        timed_out = is_timeout(exc)
        if not timed_out and not is_peer_gone(exc):
            return exc
        try:
            # a store this host cannot reach (its link down) answers nothing, and a store
            # call waits for an answer however long: the question gets a deadline of its own
            arrived = _within(self._ranks_inside, 2 * GRACE_SECONDS + 2.0)
        except Exception as store_error:  # noqa: BLE001 - the store is gone too: torch's error
            exc.add_note(f"devmesh could not ask the other ranks which one never entered this "
                         f"collective: the store{_store_address()} did not answer "
                         f"({type(store_error).__name__}: "
                         f"{str(store_error).splitlines()[0] if str(store_error) else ''})"
                         f"{_cut_off_host()}")
            return exc
        missing = [r for r in self.ranks if r not in arrived]
        waited = sorted(arrived)
        absent = self.absent + _unreachable_hosts(missing)
        if not missing:  # every rank was inside it: a slow or broken link, not a hang
            if timed_out:
                exc.add_note(f"devmesh: every rank of {list(self.ranks)} was inside this "
                             f"collective (#{self.number}) when it timed out")
            return exc
        return CollectiveTimeoutError(
            f"{self.collective} over {self.label()} (collective #{self.number} on ranks "
            f"{list(self.ranks)}) {'timed out' if timed_out else 'broke off'}: ranks "
            f"{missing} {absent}; ranks {waited} waited. Look at rank "
            f"{missing[0]}'s stack (py-spy dump, or faulthandler). torch's error: {exc}",
            missing=missing, waited=waited)

    def _ranks_inside(self) -> set[int]:
        """The ranks of the group that say (through the rendezvous store) they were inside
        this collective when it failed, after waiting up to :data:`GRACE_SECONDS` for them.

        The store may be served by rank 0's process (torch's ``env://``, a loopback launch
        without a launcher's store), so rank 0 does not return before the other ranks that
        were inside have read what they need, or a second grace period passed: leaving first
        would take the store down under them (and torchrun stops every rank as soon as one
        exits)."""
        store = _torch_compat.default_store()
        rank = dist.get_rank()
        prefix = (f"devmesh/timeout/{self.series}/{','.join(map(str, self.ranks))}/"
                  f"{self.number}/")
        store.set(prefix + str(rank), "1")
        arrived = self._wait_for(store, prefix, {rank})
        store.set(prefix + f"read/{rank}", "1")
        if rank == 0:
            self._wait_for(store, prefix + "read/", {rank}, among=arrived)
        return arrived

    def _wait_for(self, store: dist.Store, prefix: str, present: set[int], *,
                  among: set[int] | None = None) -> set[int]:
        """Poll ``prefix + rank`` for the ranks ``among`` (default: the group) until all are
        present or :data:`GRACE_SECONDS` pass; returns those present."""
        expected = set(self.ranks if among is None else among)
        deadline = time.monotonic() + GRACE_SECONDS
        while not expected <= present and time.monotonic() < deadline:
            for r in expected - present:
                if store.check([prefix + str(r)]):
                    present.add(r)
            time.sleep(0.05)
        return present


def _within(question: Callable[[], set[int]], seconds: float) -> set[int]:
    """``question()``, asked on a thread of its own; a :class:`TimeoutError` if it has no
    answer in ``seconds`` (the thread is left blocked; it does not keep the process alive)."""
    answer: dict[str, object] = {}

    def ask() -> None:
        try:
            answer["value"] = question()
        except BaseException as exc:  # noqa: BLE001 - handed to the asking thread
            answer["error"] = exc

    thread = threading.Thread(target=ask, name="devmesh-timeout-question", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"no answer in {seconds:.0f} s")
    if "error" in answer:
        raise answer["error"]  # type: ignore[misc]
    return answer["value"]  # type: ignore[return-value]


def _store_address() -> str:
    """`` at HOST:PORT`` of the rendezvous store, where the launcher says it."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f" at {host}:{port}" if host and port else ""


def _cut_off_host() -> str:
    """Over several hosts: this host may be cut off from the others."""
    from devmesh.distributed.env import host_index

    nodes = int(os.environ.get("GROUP_WORLD_SIZE", os.environ.get("NNODES", "1")) or 1)
    if nodes <= 1:
        return ""
    return (f"; this host (host {host_index()}) may be cut off from the others: check its "
            "network link")


def _unreachable_hosts(missing: list[int]) -> str:
    """Over several hosts: the hosts of the ranks that never entered (whole hosts named as
    possibly unreachable)."""
    try:
        hosts = groups.world_hosts()
    except Exception:  # noqa: BLE001 - only a better message is lost
        return ""
    if len(set(hosts.tolist())) <= 1:
        return ""
    theirs = sorted({int(hosts[r]) for r in missing})
    named = ", ".join(f"host {h}" for h in theirs)
    return f", or {named} cannot be reached (its link down)" if len(theirs) == 1 else (
        f", or hosts {named} cannot be reached")

