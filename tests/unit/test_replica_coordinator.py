"""The replica groups' coordinator driven through its store, as ranks drive it: which groups
a round admits, at which step, who heals from whom (no training process is started)."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from devmesh.fault import Coordinator, protocol
from devmesh.fault.protocol import Quorum


class _Ranks:
    """Each group's one rank as the store sees it: a heartbeat per incarnation, joins, votes."""

    def __init__(self, coordinator: Coordinator, groups: int) -> None:
        self.store = dist.TCPStore(coordinator.host, coordinator.port, is_master=False,
                                   timeout=timedelta(seconds=10))
        self.pids = {g: f"{1000 + g}" for g in range(groups)}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        store = dist.TCPStore(*self.store_address, is_master=False,
                              timeout=timedelta(seconds=10))
        count = 0
        while not self._stop.is_set():
            for g, pid in list(self.pids.items()):
                if pid is not None:
                    store.set(protocol.heartbeat_key(g, 0), f"{pid}:{count}")
            count += 1
            self._stop.wait(0.05)

    @property
    def store_address(self) -> tuple[str, int]:
        return self.store.host, self.store.port

    def join(self, round_: int, group: int, step: int) -> None:
        self.store.set(protocol.join_key(round_, group, 0),
                       json.dumps({"step": step, "fresh": True}))

    def join_together(self, round_: int, steps: dict[int, int]) -> None:
        """Groups joining at once (one store request): the coordinator, reading the joins
        between two of them, would otherwise close a round on the first alone."""
        keys = [protocol.join_key(round_, group, 0) for group in steps]
        self.store.multi_set(keys, [json.dumps({"step": step, "fresh": True})
                                    for step in steps.values()])

    def quorum(self, round_: int) -> Quorum:
        self.store.wait([protocol.quorum_key(round_)], timedelta(seconds=10))
        return Quorum.decode(self.store.get(protocol.quorum_key(round_)))

    def decision(self, round_: int) -> str:
        self.store.wait([protocol.decision_key(round_)], timedelta(seconds=10))
        return self.store.get(protocol.decision_key(round_)).decode()

    def vote(self, round_: int, groups) -> str:
        for g in groups:
            self.store.set(protocol.vote_key("ok", round_, g, 0), "1")
        self.store.wait([protocol.decision_key(round_)], timedelta(seconds=10))
        return self.store.get(protocol.decision_key(round_)).decode()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def two_groups():
    coordinator = Coordinator(2, 1, timeout=1.0)  # a heartbeat thread stalled by a loaded
    ranks = _Ranks(coordinator, 2)  # machine for less than this is not taken for dead
    yield coordinator, ranks
    ranks.stop()
    coordinator.stop()


def _commit_step_zero(ranks: _Ranks) -> None:
    ranks.join(0, 0, 0)
    ranks.join(0, 1, 0)
    assert ranks.quorum(0).members == (0, 1)
    assert ranks.vote(0, (0, 1)) == "commit"


def _published_with_the_commit(ranks: _Ranks) -> None:
    """After step 0's commit, with both groups' processes unchanged, round 1's quorum is out
    before any join: both groups, at step 1."""
    assert ranks.store.check([protocol.quorum_key(1)])
    quorum = ranks.quorum(1)
    assert (quorum.members, quorum.step, quorum.contributors) == ((0, 1), 1, (0, 1))


def test_a_restarted_group_alone_waits_for_a_live_group_holding_the_committed_steps(
        two_groups):
    """A restarted group (step 0) joining a round before the group that holds the committed
    steps, late by more than the timeout, must not be admitted alone: it would commit step 0
    a second time and the groups' models would part. The round waits for the live holder,
    and the restarted group heals from it."""
    coordinator, ranks = two_groups
    _commit_step_zero(ranks)
    _published_with_the_commit(ranks)
    ranks.pids[1] = "2001"  # group 1 restarted: another incarnation, back at step 0
    # round 1's quorum was for its old processes (step 1): it joins the next round, and
    # round 1 is aborted, its members' processes having changed
    ranks.join(1, 1, 0)
    assert ranks.decision(1) == "abort"
    ranks.join(2, 1, 0)
    time.sleep(3.0)  # group 0, alive, is three timeouts late to the round
    assert not ranks.store.check([protocol.quorum_key(2)])
    ranks.join(2, 0, 1)
    quorum = ranks.quorum(2)
    assert (quorum.members, quorum.step, quorum.healers, quorum.source) == ((0, 1), 1, (1,), 0)
    assert quorum.error == ""


def test_a_round_whose_every_holder_of_the_committed_steps_is_gone_says_so(two_groups):
    """When every group that committed the steps is dead, no peer can heal the others: the
    round's answer says so (each rank raises it) instead of training on from step 0."""
    coordinator, ranks = two_groups
    _commit_step_zero(ranks)
    ranks.pids[0] = None  # group 0's heartbeat stops: dead after the timeout
    ranks.pids[1] = "2001"  # group 1 restarted
    ranks.join(1, 1, 0)  # round 1's quorum is not for it (step 1): it joins the next
    assert ranks.decision(1) == "abort"
    ranks.join(2, 1, 0)
    quorum = ranks.quorum(2)
    assert quorum.members == (1,) and quorum.step == 0
    assert "no live replica group holds the 1 steps committed" in quorum.error
    assert "restart the job from its last checkpoint" in quorum.error


def test_a_healer_whose_source_dies_in_the_heal_is_not_taken_for_a_holder(two_groups):
    """Group 1 restarts and heals from group 0, which dies during the heal: the round is
    aborted, and group 1 (the same processes, still at step 0) holds none of the committed
    steps. With group 0 restarted too, no live group holds them: the next round says so to
    every rank at once, rather than waiting for group 1 as if it held them."""
    coordinator, ranks = two_groups
    _commit_step_zero(ranks)
    ranks.pids[1] = "2001"
    ranks.join(1, 1, 0)
    assert ranks.decision(1) == "abort"
    ranks.join(2, 1, 0)
    ranks.join(2, 0, 1)
    quorum = ranks.quorum(2)
    assert (quorum.healers, quorum.source) == ((1,), 0)
    ranks.pids[0] = "2000"  # the source dies while group 1 receives its state; restarted
    assert ranks.decision(2) == "abort"
    ranks.join(3, 0, 0)
    ranks.join(3, 1, 0)
    # with no holder alive the round closes on the first restarted group it sees (both or
    # either: the joins and heartbeats race the coordinator's reads); every rank of round 3,
    # member or not, reads this quorum and raises its error
    quorum = ranks.quorum(3)
    assert set(quorum.members) <= {0, 1} and quorum.members and quorum.step == 0
    assert "no live replica group holds the 1 steps committed" in quorum.error


def test_a_late_live_group_is_left_out_and_the_others_step_on():
    """A member alive but not answering (hung) is left out after one timeout, not two: the
    round published with the last commit is aborted when the others' all-reduce with it
    fails (a timeout after they joined: they vote fail), and the next closes as soon as
    they join, without waiting a second timeout for the group that never joined."""
    coordinator = Coordinator(2, 1, timeout=2)
    ranks = _Ranks(coordinator, 2)
    try:
        _commit_step_zero(ranks)
        _published_with_the_commit(ranks)
        ranks.join(1, 1, 1)
        started = time.monotonic()
        protocol.announce(ranks.store)
        time.sleep(2.1)  # group 1's all-reduce with the hung group 0 times out
        ranks.store.set(protocol.vote_key("fail", 1, 1, 0), "1")
        assert ranks.decision(1) == "abort"
        ranks.join(2, 1, 1)
        quorum = ranks.quorum(2)
        assert quorum.members == (1,) and quorum.step == 1 and quorum.error == ""
        assert time.monotonic() - started < 3.5, time.monotonic() - started
    finally:
        ranks.stop()
        coordinator.stop()


def test_a_member_slower_than_another_members_death_stays_in_the_retried_round():
    """Group 2 dies as step 1 begins; group 1's all-reduce fails at once and the round
    published with step 0's commit is aborted before group 0, alive and only slower, has
    joined it. The retried round still takes group 0 (it joins within the timeout), and
    goes on without the dead group."""
    coordinator = Coordinator(3, 1, timeout=2)
    ranks = _Ranks(coordinator, 3)
    try:
        for g in range(3):
            ranks.join(0, g, 0)
        assert ranks.quorum(0).members == (0, 1, 2)
        assert ranks.vote(0, (0, 1, 2)) == "commit"
        ranks.pids[2] = None  # dead: its heartbeat stops
        ranks.join(1, 1, 1)
        protocol.announce(ranks.store)
        ranks.store.set(protocol.vote_key("fail", 1, 1, 0), "1")
        assert ranks.decision(1) == "abort"
        ranks.join(2, 1, 1)
        time.sleep(0.3)
        ranks.join(2, 0, 1)  # slower than group 1, by far less than the timeout
        quorum = ranks.quorum(2)
        assert quorum.members == (0, 1) and quorum.step == 1 and quorum.healers == ()
    finally:
        ranks.stop()
        coordinator.stop()


def test_a_group_back_after_the_others_finished_is_told_to_end(two_groups):
    """A group restarted while the others ended their training (each rank closed, saying
    its committed steps) has nothing to heal from and nothing to do: it is told it finished,
    not that its peers died."""
    coordinator, ranks = two_groups
    _commit_step_zero(ranks)
    ranks.store.set(protocol.finished_key(0, 0), "1")  # group 0 closed after step 0
    ranks.pids[0] = None
    ranks.pids[1] = "2001"
    ranks.join(1, 1, 0)
    assert ranks.decision(1) == "abort"
    ranks.join(2, 1, 0)
    quorum = ranks.quorum(2)
    assert quorum.finished and quorum.error == ""


def test_a_group_restarted_again_after_being_told_no_peer_is_told_again_not_left_waiting(
        two_groups):
    """After a round that said no live group holds the committed steps, the same group
    restarted once more (its agent's next attempt) is told so again at once: it is not a
    holder itself, so nothing is left to wait for."""
    coordinator, ranks = two_groups
    _commit_step_zero(ranks)
    ranks.pids[0] = None
    ranks.pids[1] = "2001"
    ranks.join(1, 1, 0)
    assert ranks.decision(1) == "abort"
    ranks.join(2, 1, 0)
    assert "no live replica group holds" in ranks.quorum(2).error
    ranks.pids[1] = "3001"  # restarted again: the round it was told in is aborted
    ranks.join(3, 1, 0)
    assert "no live replica group holds" in ranks.quorum(3).error


def test_no_quorum_is_published_ahead_while_a_group_outside_it_lives(two_groups):
    """A live group outside the last quorum (restarted, come back) must be admitted by a
    round that waits for joins: no quorum is published with the commit then."""
    coordinator, ranks = two_groups
    _commit_step_zero(ranks)
    ranks.join(1, 0, 1)  # group 1 hangs: group 0's all-reduce with it fails
    ranks.store.set(protocol.vote_key("fail", 1, 0, 0), "1")
    assert ranks.decision(1) == "abort"
    ranks.join(2, 0, 1)
    assert ranks.quorum(2).members == (0,)
    assert ranks.vote(2, (0,)) == "commit"
    time.sleep(0.2)
    assert not ranks.store.check([protocol.quorum_key(3)])
    ranks.join_together(3, {0: 2, 1: 1})  # group 1 back, one step behind
    quorum = ranks.quorum(3)
    assert (quorum.members, quorum.step, quorum.healers) == ((0, 1), 2, (1,))


def test_a_round_closes_and_a_step_is_decided_when_the_last_rank_speaks(monkeypatch):
    """Each rank announces its join and its vote as an event, and the coordinator wakes on
    it: with its look at the heartbeats set 30 s apart, healthy rounds still close and
    commit at once. (It used to sleep between looks, 20 ms, so a step waited for two of
    them: 70 ms a step in bench/replica_groups.py, a third of the small model's step.)"""
    monkeypatch.setattr(protocol, "POLL_SECONDS", 30.0)
    coordinator = Coordinator(2, 1, timeout=5)
    ranks = _Ranks(coordinator, 2)
    try:
        # both groups' heartbeats are in, so both are alive when they join (a loaded machine
        # may start the heartbeat thread late; the coordinator looks again only in 30 s)
        ranks.store.wait([protocol.heartbeat_key(g, 0) for g in (0, 1)], timedelta(seconds=10))
        for round_ in range(3):
            for g in (0, 1):
                ranks.join(round_, g, round_)
                protocol.announce(ranks.store)
            assert ranks.quorum(round_).members == (0, 1)  # waits at most 10 s
            for g in (0, 1):
                ranks.store.set(protocol.vote_key("ok", round_, g, 0), "1")
                protocol.announce(ranks.store)
            ranks.store.wait([protocol.decision_key(round_)], timedelta(seconds=10))
            assert ranks.store.get(protocol.decision_key(round_)) == b"commit"
        assert [step for step, _ in coordinator.commits] == [0, 1, 2]
    finally:
        ranks.stop()
        coordinator.stop()


def test_an_idle_coordinator_prints_nothing_and_stops_at_once(capfd):
    """A training step longer than a second is the rule on GPUs: while the ranks compute, the
    coordinator's wait for their next event must not time out over and over, each time
    printing torch's store warnings ("waitForInput ... timed out") to the job's terminal;
    and stopping it does not wait out that wait."""
    coordinator = Coordinator(2, 1, timeout=5)
    time.sleep(2.5)
    began = time.monotonic()
    coordinator.stop()
    stopped = time.monotonic() - began
    err = capfd.readouterr().err
    assert "timed out" not in err and "waitForInput" not in err, err
    assert stopped < 1.0, stopped
