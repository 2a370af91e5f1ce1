"""The coordinator: a TCPStore and one thread, owned by ``devmesh run --replica-groups``'s
launcher (not by a training rank, so no rank's death takes it down), that admits the live
replica groups to each step and decides whether the step is committed
(:mod:`devmesh.fault.protocol` is the protocol)."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from devmesh._log import get_logger
from devmesh.fault import protocol
from devmesh.fault.protocol import Quorum

__all__ = ["Coordinator"]

#: How long the first round waits for every group to start (importing torch, building the
#: model) before it goes on with the groups that came.
START_SECONDS = 300.0
#: How long the coordinator's waiter waits for the ranks' next event in one call (a store
#: wait that times out prints torch's warnings; a step can take minutes).
_EVENT_WAIT = timedelta(minutes=10)


class Coordinator:
    """Admit ``groups`` replica groups of ``ranks_per_group`` ranks to each step.

    Serves its store at ``host:port`` (:attr:`address`); :attr:`commits` lists each committed
    step with the groups whose gradients it averaged. ``stop()`` ends the thread and the store.
    """

    def __init__(self, groups: int, ranks_per_group: int, *, timeout: float | None = None,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        if groups < 1 or ranks_per_group < 1:
            raise ValueError(f"a coordinator needs at least one group of one rank, got "
                             f"{groups} groups of {ranks_per_group}")
        self.groups = groups
        self.ranks_per_group = ranks_per_group
        self.timeout = protocol.timeout_from_environment() if timeout is None else timeout
        self.host = host
        self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=60))
        self.port = self._store.port
        self.commits: list[tuple[int, tuple[int, ...]]] = []
        self._log = get_logger("replicas")
        self._beats: dict[tuple[int, int], tuple[str, float]] = {}  # last value, when it moved
        self._woken = threading.Event()  # set by the waiter at each of the ranks' events
        self._first_spoken: float | None = None  # when the round decided had its first join
        self._stopping = threading.Event()
        self._store.set(protocol.OPEN, "0")
        self._thread = threading.Thread(target=self._serve, name="devmesh-coordinator",
                                        daemon=True)
        self._waiter = threading.Thread(
            target=self._watch_events, name="devmesh-coordinator-events", daemon=True,
            args=(dist.TCPStore(host, self.port, is_master=False,
                                timeout=timedelta(seconds=60)),))
        self._waiter.start()
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        self._stopping.set()
        try:  # wake the waiter out of its wait for the ranks' next event
            protocol.announce(self._store)
        except Exception:  # the store is gone already
            pass
        self._thread.join(timeout=5)
        self._waiter.join(timeout=5)

    def wait_for(self, groups: list[int], grace: float) -> list[int]:
        """Wait until each of ``groups`` (run by other hosts' launchers) has finished its
        training, or has gone ``grace`` seconds without a heartbeat moving: the coordinator
        outlives them, so that one restarted late is still told where things stand. The
        groups that went silent, for the launcher to say so."""
        store = dist.TCPStore(self.host, self.port, is_master=False,
                              timeout=timedelta(seconds=60))
        seen: dict[int, tuple[list, float]] = {}  # last heartbeats and when they moved
        waiting, silent = set(groups), []
        while waiting:
            now = time.monotonic()
            for g in sorted(waiting):
                ranks = range(self.ranks_per_group)
                if store.check([protocol.finished_key(g, r) for r in ranks]):
                    waiting.discard(g)
                    continue
                beats = [store.get(k) if store.check([k]) else None
                         for k in (protocol.heartbeat_key(g, r) for r in ranks)]
                if g not in seen or seen[g][0] != beats:
                    seen[g] = (beats, now)
                elif now - seen[g][1] > grace:
                    waiting.discard(g)
                    silent.append(g)
            time.sleep(protocol.HEARTBEAT_SECONDS)
        return sorted(silent)

    # -- who lives -------------------------------------------------------------------------

    def _incarnations(self) -> dict[int, tuple[str, ...]]:
        """The groups whose every rank's heartbeat moved within the timeout, with their
        ranks' process ids (a restarted group is another incarnation)."""
        now = time.monotonic()
        keys = [protocol.heartbeat_key(g, r) for g in range(self.groups)
                for r in range(self.ranks_per_group)]
        present = [k for k in keys if self._store.check([k])]
        values = dict(zip(present, self._store.multi_get(present))) if present else {}
        alive: dict[int, tuple[str, ...]] = {}
        for g in range(self.groups):
            pids = []
            for r in range(self.ranks_per_group):
                value = values.get(protocol.heartbeat_key(g, r))
                if value is None:
                    break
                text = value.decode()
                last = self._beats.get((g, r))
                if last is None or last[0] != text:
                    self._beats[(g, r)] = (text, now)
                elif now - last[1] > self.timeout:
                    break
                pids.append(text.split(":")[0])
            else:
                alive[g] = tuple(pids)
        return alive

    # -- rounds ----------------------------------------------------------------------------

    def _joined(self, round_: int) -> dict[int, list[dict]]:
        """The groups all of whose ranks joined ``round_``, with what each said."""
        joined = {}
        for g in range(self.groups):
            keys = [protocol.join_key(round_, g, r) for r in range(self.ranks_per_group)]
            if self._store.check(keys):
                joined[g] = [json.loads(v) for v in self._store.multi_get(keys)]
        return joined

    def _serve(self) -> None:
        try:
            self._rounds()
        except Exception as exc:  # the store went away: the launcher is ending
            if not self._stopping.is_set():
                self._log.warning("the coordinator stopped: %s", exc)

    def _rounds(self) -> None:
        members: dict[int, tuple[str, ...]] = {}  # last quorum's groups and incarnations
        epoch, round_, aborted = 0, 0, False
        absent: set[int] = set()  # members missing from an aborted round they were given
        absent_since = 0.0  # when that round's first rank spoke
        quorum: Quorum | None = None  # the round's, when published before its joins
        while not self._stopping.is_set():
            if quorum is None:
                quorum = self._close_round(round_, members, epoch, aborted, absent,
                                           absent_since)
                if quorum is None:
                    return
                epoch = quorum.epoch
                members = {g: pids for g, pids in self._incarnations().items()
                           if g in quorum.members}
            decision = self._decide(round_, quorum, members)
            if decision is None:
                return
            aborted = decision == "abort"
            if not aborted and quorum.contributors:
                self.commits.append((quorum.step, quorum.contributors))
                self._log.info("step %d committed by groups %s (%d of %d groups; healed: %s)",
                               quorum.step, list(quorum.contributors),
                               len(quorum.contributors), self.groups,
                               list(quorum.healers) or "none")
            else:
                self._log.info("step %d aborted in round %d: it is retried without the "
                               "groups that failed", quorum.step, round_)
            absent = (set(quorum.members) - set(self._joined(round_))) if aborted else set()
            # (none joined it: they are waited for a timeout from now)
            absent_since = self._first_spoken or time.monotonic()
            if aborted:  # its healers got none of the committed steps: they hold nothing
                # (the source, never a healer, stays: members is never emptied here)
                members = {g: pids for g, pids in members.items() if g not in quorum.healers}
            following = self._next_quorum(round_, quorum, members) if not aborted else None
            if following is not None:
                self._store.set(protocol.quorum_key(round_ + 1), following.encode())
                self._store.set(protocol.OPEN, str(round_ + 1))
            # published once recorded: a rank (or a test) that reads the decision finds the
            # commit in commits; and after the next round's quorum, which it asks for next
            self._store.set(protocol.decision_key(round_), decision)
            self._forget(round_ - 2)
            round_ += 1
            quorum = following

    def _next_quorum(self, round_: int, quorum: Quorum,
                     members: dict[int, tuple[str, ...]]) -> Quorum | None:
        """The next round's quorum, published with this round's commit, before any rank
        joins it: the same groups, one step on, every one contributing — when nothing can
        change it (every live group is a member, in the same processes, and none healed in
        this round). A rank then finds its quorum waiting when it joins, instead of waiting
        for the last group's join and the coordinator's answer. A member that fails before
        it takes part is found by the others' all-reduce (a dead process's connections
        close; a hung one answers nothing for the timeout): they vote ``fail``, the round is
        aborted, and the next one, closed as usual, waits for the members that never joined
        it only until a timeout has passed since its first join."""
        if not quorum.contributors or quorum.healers or self._incarnations() != members:
            return None
        return Quorum(round=round_ + 1, epoch=quorum.epoch, members=quorum.members,
                      step=quorum.step + 1, healers=(), source=quorum.members[0],
                      contributors=quorum.members)

    def _close_round(self, round_: int, members: dict[int, tuple[str, ...]], epoch: int,
                     aborted: bool, absent: set[int], absent_since: float) -> Quorum | None:
        first_join: float | None = None
        while not self._stopping.is_set():
            joined = self._joined(round_)
            alive = self._incarnations()
            now = time.monotonic()
            if joined and first_join is None:
                first_join = now
            # the groups waited for: the last quorum's, while the same processes live; at
            # the start, every group
            holders = ({g for g, pids in members.items() if alive.get(g) == pids}
                       if members else set(range(self.groups)))
            # less those that never joined the aborted round they were given, once that
            # round's first rank spoke a timeout ago (a hung member is not waited for twice;
            # one merely slower than the others' failure is)
            expected = holders - (absent if now - absent_since > self.timeout else set())
            present = {g for g in joined if g in alive}
            late = first_join is not None and now - first_join > (
                self.timeout if members else START_SECONDS)
            steps = {g: max(j["step"] for j in joined[g]) for g in present}
            committed = self.commits[-1][0] + 1 if self.commits else 0
            behind = bool(present) and max(steps.values()) < committed
            if behind and holders:
                # only restarted groups came: a group holding the committed steps still
                # lives, so wait for it (it is the one to heal from), late or not
                self._wait_for_event()
                continue
            if present and (expected <= present or late):
                step = max(steps.values())
                finished = behind and self._finished(committed)
                error = "" if not behind or finished else (
                    f"no live replica group holds the {committed} steps committed (the "
                    f"groups present hold {step}): every group that had them is gone, so "
                    "there is no peer to heal from; restart the job from its last checkpoint")
                chosen = tuple(sorted(present))
                healers = tuple(g for g in chosen if steps[g] < step)
                source = min(g for g in chosen if steps[g] == step)
                contributors = tuple(g for g in chosen if steps[g] == step
                                     and all(j["fresh"] for j in joined[g]))
                changed = aborted or set(chosen) != set(members)
                quorum = Quorum(round=round_, epoch=epoch + 1 if changed else epoch,
                                members=chosen, step=step, healers=healers, source=source,
                                contributors=contributors, error=error, finished=finished)
                if changed:
                    left_out = sorted(set(range(self.groups)) - set(chosen))
                    self._log.info("quorum of round %d: groups %s (epoch %d)%s%s", round_,
                                   list(chosen), quorum.epoch,
                                   f", without {left_out}" if left_out else "",
                                   f"; {list(healers)} heal from group {source}"
                                   if healers else "")
                self._store.set(protocol.quorum_key(round_), quorum.encode())
                self._store.set(protocol.OPEN, str(round_ + 1))
                return quorum
            self._wait_for_event()
        return None

    def _finished(self, committed: int) -> bool:
        """Whether some group ended its training (every rank closed) holding ``committed``
        steps."""
        for g in range(self.groups):
            keys = [protocol.finished_key(g, r) for r in range(self.ranks_per_group)]
            if self._store.check(keys) and all(
                    int(v) >= committed for v in self._store.multi_get(keys)):
                return True
        return False

    def _decide(self, round_: int, quorum: Quorum,
                incarnations: dict[int, tuple[str, ...]]) -> str | None:
        """``commit`` once every member rank voted ok; ``abort`` as soon as one failed, a
        member's processes (``incarnations``) died, or one timeout passed after the first ok."""
        ranks = [(g, r) for g in quorum.members for r in range(self.ranks_per_group)]
        first_ok: float | None = None
        oks_keys = [protocol.vote_key("ok", round_, g, r) for g, r in ranks]
        joins = [protocol.join_key(round_, g, r) for g, r in ranks]
        spoken, self._first_spoken = False, None
        while not self._stopping.is_set():
            # when the round's first rank joined (a quorum published with the last commit
            # is decided from before any join): the time its missing members are late from
            if not spoken and any(self._store.check([key]) for key in joins):
                spoken, self._first_spoken = True, time.monotonic()
            if self._store.check(oks_keys):  # every vote in: one call, the healthy step's
                return "commit"
            failed = any(self._store.check([protocol.vote_key("fail", round_, g, r)])
                         for g, r in ranks)
            oks = sum(self._store.check([protocol.vote_key("ok", round_, g, r)])
                      for g, r in ranks)
            alive = self._incarnations()
            died = any(alive.get(g) != pids for g, pids in incarnations.items())
            now = time.monotonic()
            if oks and first_ok is None:
                first_ok = now
            decision = None
            if oks == len(ranks):
                decision = "commit"
            elif failed or died or (first_ok is not None and now - first_ok > self.timeout):
                decision = "abort"
            if decision is not None:
                return decision  # published by the caller, once recorded
            self._wait_for_event()
        return None

    def _wait_for_event(self) -> None:
        """Until a rank's next join or vote, or at most
        :data:`~devmesh.fault.protocol.POLL_SECONDS`: then the heartbeats are looked at."""
        self._woken.wait(protocol.POLL_SECONDS)
        self._woken.clear()  # what woke it is in the store: the caller reads it next

    def _watch_events(self, store: dist.TCPStore) -> None:
        """The waiter's thread: wait on its own connection for each event in turn (a
        wait that times out is cancelled by the store and waited again), wake the
        coordinator, and drop the event's key."""
        number = 1
        while not self._stopping.is_set():
            try:  # long: a wait that times out prints torch's warnings (stop() wakes it)
                store.wait([protocol.event_key(number)], _EVENT_WAIT)
            except dist.DistStoreError as exc:
                if "timeout" in str(exc).lower():
                    continue
                return  # the store went away: the launcher is ending
            self._woken.set()
            store.delete_key(protocol.event_key(number))
            number += 1

    def _forget(self, round_: int) -> None:
        """Delete the joins and votes of an old round (the coordinator has read them); its
        quorum and decision stay, small, for a rank that comes back to them late."""
        if round_ < 0:
            return
        for g in range(self.groups):
            for r in range(self.ranks_per_group):
                for key in (protocol.join_key(round_, g, r),
                            protocol.vote_key("ok", round_, g, r),
                            protocol.vote_key("fail", round_, g, r)):
                    self._store.delete_key(key)
