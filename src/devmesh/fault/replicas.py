"""The ranks' side of fault-tolerant replica groups: :class:`ReplicaGroups`.

Each replica group is a job of its own (its ranks, its process groups, its restarts: one
``devmesh run -n N`` started by ``devmesh run --replica-groups G``); across groups, rank
``r`` of every member group averages gradients with the others' rank ``r`` over a gloo or
NCCL group made for the quorum's epoch from the coordinator's store, so a group's death
breaks only that group, and the next epoch's group is made without it.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from devmesh._log import get_logger
from devmesh.distributed import trace
from devmesh.fault import protocol
from devmesh.fault.protocol import Quorum
from devmesh.fault.transfer import _local, receive_state, send_state

__all__ = ["ReplicaGroups", "StepResult"]

#: How long one store wait for the coordinator's answer lasts before it is waited again (a
#: round can wait minutes for a group starting or healing).
_KEY_WAIT = timedelta(minutes=1)


@dataclass(frozen=True)
class StepResult:
    """What :meth:`ReplicaGroups.step` committed."""

    committed: bool  #: whether the optimizer stepped (not when no member had gradients of
    #: the current weights: every member had just healed; compute the batch again)
    step: int  #: the step committed (0 for the first), the same on every member
    contributors: tuple[int, ...]  #: the groups whose gradients it averaged
    members: tuple[int, ...]  #: the groups that stepped (a healer steps without contributing)
    healed: bool  #: whether this group received its state from a live group first
    retries: int  #: rounds aborted before this one committed (a member failed mid-step)
    quorum_seconds: float = 0.0  #: seconds this rank waited on the coordinator in this
    #: step — for each round's quorum and decision (the other groups' lateness included):
    #: the quorum's own cost, next to the step's time

    @property
    def groups(self) -> int:
        """How many groups' batches the step averaged: the effective batch is this times a
        group's batch."""
        return len(self.contributors)


class _Heartbeat:
    """A thread telling the coordinator, every few tenths of a second, that this rank lives
    (its own connection to the store), and a second one watching that it is heard.

    A host cut off from the coordinator's (its link down, no reset coming back) leaves a
    store call unanswered for good — torch's TCPStore client retries it past its timeout —
    so the rank's own call would never return: when no heartbeat has been answered for
    ``silence`` seconds the watch says so on stderr and ends the process (exit code 1, for
    its ``devmesh run`` to restart it or give up). Both stop at exit too, if the script did
    not close its groups: CPython ends a daemon thread that is inside a store call at
    shutdown with ``pthread_exit``, which aborts the process through torch's C++ frames."""

    def __init__(self, address: str, group: int, rank: int, silence: float) -> None:
        host, _, port = address.rpartition(":")
        self._store = dist.TCPStore(host, int(port), is_master=False,
                                    timeout=timedelta(seconds=30))
        self._key = protocol.heartbeat_key(group, rank)
        self._who = f"replica group {group} rank {rank}: the coordinator at {address}"
        self._silence = silence
        self._answered = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="devmesh-heartbeat",
                                        daemon=True)
        self._watch = threading.Thread(target=self._watch_silence,
                                       name="devmesh-heartbeat-watch", daemon=True)
        self._thread.start()
        self._watch.start()
        atexit.register(self.stop)

    def _beat(self) -> None:
        count = 0
        pid = os.getpid()
        while not self._stop.is_set():
            try:
                self._store.set(self._key, f"{pid}:{count}")
                # a set is not answered (over a cut link it lands in the socket's buffer):
                # heard is when a call that is answered returns
                self._store.check([self._key])
            except Exception:  # the coordinator is gone: the next round says so
                return
            self._answered = time.monotonic()
            count += 1
            self._stop.wait(protocol.HEARTBEAT_SECONDS)

    def _watch_silence(self) -> None:
        while not self._stop.wait(0.5):
            quiet = time.monotonic() - self._answered
            if quiet > self._silence:
                print(f"[devmesh] {self._who} has not answered for {quiet:.0f} s: this host "
                      "is cut off from the coordinator's (its link down), or that host is "
                      "gone; this rank exits", file=sys.stderr, flush=True)
                os._exit(1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._watch.join(timeout=2)


class ReplicaGroups:
    """Average gradients over the live replica groups and step, surviving a group's failure.

    ``model`` and ``optimizer`` are this group's (sharded with ``fully_shard`` over the
    group's own mesh, or whole): every group builds them alike (same seed). Call
    :meth:`step` where ``optimizer.step()`` would be, after ``backward()``: it joins the
    step's quorum, heals this group from a live one if it is behind (a restarted group),
    averages the gradients over the groups present, and steps the optimizer when the
    coordinator commits the step — on every member or on none; a round a member fails in is
    retried without it. :attr:`step_count` is the number of committed steps, the same in
    every member, so a restarted group resumes at the others' step.

    The coordinator's address, this group's index and the number of groups come from
    ``devmesh run --replica-groups``; ``rank`` is this rank's index in its group (default:
    ``RANK`` of the group's own job).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 address: str | None = None, group: int | None = None, rank: int | None = None,
                 timeout: float | None = None) -> None:
        env = os.environ
        address = address or env.get(protocol.ADDRESS_VARIABLE)
        if address is None or (group is None and protocol.GROUP_VARIABLE not in env):
            raise RuntimeError(
                "ReplicaGroups needs its coordinator: start the script with devmesh run "
                "--replica-groups G -n N train.py (or pass address= and group=)")
        host, _, port = address.rpartition(":")
        self.model = model
        self.optimizer = optimizer
        self.group = int(env[protocol.GROUP_VARIABLE]) if group is None else group
        self.rank = int(env.get("RANK", "0")) if rank is None else rank
        self.timeout = protocol.timeout_from_environment() if timeout is None else timeout
        self.step_count = 0
        # 60 s to reach a coordinator whose host starts later than this one
        self._store = dist.TCPStore(host, int(port), is_master=False,
                                    timeout=timedelta(seconds=60))
        self._heartbeat = _Heartbeat(address, self.group, self.rank,
                                     protocol.silence_seconds(self.timeout))
        self._round = -1
        self._fresh = True  # whether the gradients are of the weights held now
        self._epoch: int | None = None
        self._members_group = None
        self._log = get_logger("replicas")

    # -- the quorum ------------------------------------------------------------------------

    def _wait(self, key: str) -> bytes:
        """A key the coordinator writes; a coordinator that is gone raises from the store."""
        while True:
            try:  # long: a store wait that times out prints torch's warnings
                self._store.wait([key], _KEY_WAIT)
                return self._store.get(key)
            except dist.DistStoreError as exc:
                if "timeout" not in str(exc).lower():
                    raise
            # still waiting: the round waits for a late group, or the previous step's
            # members still vote; the store answering is enough (one that stopped
            # answering, this host cut off, is the heartbeat's watch's to end)

    def _join(self) -> Quorum:
        """Join rounds until one admits this group; its quorum."""
        while True:
            opened = int(self._store.get(protocol.OPEN))
            self._round = max(self._round + 1, opened)
            self._store.set(protocol.join_key(self._round, self.group, self.rank),
                            json.dumps({"step": self.step_count, "fresh": self._fresh}))
            protocol.announce(self._store)
            quorum = Quorum.decode(self._wait(protocol.quorum_key(self._round)))
            if quorum.error:
                raise RuntimeError(f"replica group {self.group}: {quorum.error}")
            if quorum.finished:
                self._log.info("group %d came back after the other groups ended their "
                               "training: it has nothing left to do and ends", self.group)
                self._heartbeat.stop()
                raise SystemExit(0)
            if self.group in quorum.members and (self.group in quorum.healers
                                                  or quorum.step == self.step_count):
                return quorum
            # left out, or a quorum published before the round's joins (after a commit) for
            # this group's previous processes: a restarted group is not at its step, and the
            # round is aborted without it (its old processes are gone from the members' group)
            self._log.info("group %d was left out of round %d (late, or a rank of it "
                           "restarting); joining the next", self.group, self._round)

    def _members(self, quorum: Quorum):
        """The process group of rank ``self.rank`` of every member group, for this epoch."""
        if self._epoch != quorum.epoch:
            prefix = dist.PrefixStore(f"epoch{quorum.epoch}/rank{self.rank}", self._store)
            self._members_group = dist.ProcessGroupGloo(
                prefix, quorum.members.index(self.group), len(quorum.members),
                timedelta(seconds=self.timeout))
            self._epoch = quorum.epoch
        return self._members_group

    # -- one step --------------------------------------------------------------------------

    def _gradients(self) -> tuple[list[torch.Tensor], list[bool]]:
        """Each parameter's gradient (its local block), and whether it is a block of a
        DTensor's (written in place, not swapped)."""
        grads, blocks = [], []
        for param in self.model.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(_local(param.grad))
            blocks.append(grads[-1] is not param.grad)
        return grads, blocks

    def step(self) -> StepResult:
        """Average the gradients over the quorum's groups and step the optimizer once the
        coordinator commits; retried without a group that fails mid-step.

        A group that comes back (restarted) after every other group closed, its training
        ended, has no peer to heal from and nothing left to do: this raises ``SystemExit(0)``
        there, so its script ends without saving state it never received."""
        grads, blocks = self._gradients()
        retries, healed, waited = 0, False, 0.0
        self._fresh = True
        while True:
            began = time.perf_counter()
            quorum = self._join()
            waited += time.perf_counter() - began
            vote, averaged = "ok", None
            try:
                members = self._members(quorum)
                index = quorum.members.index
                if self.group in quorum.healers:
                    started = time.monotonic()
                    nbytes = receive_state(members, index(quorum.source), self.model,
                                           self.optimizer)
                    self.step_count, healed, self._fresh = quorum.step, True, False
                    self._log.info("group %d healed from group %d at step %d: %d bytes in "
                                   "%.2f s", self.group, quorum.source, quorum.step, nbytes,
                                   time.monotonic() - started)
                elif self.group == quorum.source:
                    for healer in quorum.healers:
                        send_state(members, index(healer), self.model, self.optimizer)
                contributing = self.group in quorum.contributors
                averaged = _average(grads, members, contributing, len(quorum.contributors))
            except Exception as exc:  # a peer died or hung: this epoch's group is broken
                vote = "fail"
                self._epoch = None
                self._log.info("group %d: round %d failed (%s)", self.group, self._round,
                               str(exc).splitlines()[0][:200])
            began = time.perf_counter()
            self._store.set(protocol.vote_key(vote, self._round, self.group, self.rank), "1")
            protocol.announce(self._store)
            decision = self._wait(protocol.decision_key(self._round)).decode()
            waited += time.perf_counter() - began
            if decision == "commit":
                committed = bool(quorum.contributors)
                if committed:
                    assert averaged is not None  # a commit needs every member's "ok" vote
                    _unpack(averaged, grads, blocks)
                    self.optimizer.step()
                    self.step_count = quorum.step + 1
                return StepResult(committed=committed, step=quorum.step,
                                  contributors=quorum.contributors, members=quorum.members,
                                  healed=healed, retries=retries, quorum_seconds=waited)
            retries += 1
            self._epoch = None

    def close(self) -> None:
        """End this rank's part: say how many steps it committed and stop the heartbeat (a
        group restarted after every group closed is then told to end, not to wait)."""
        try:
            self._store.set(protocol.finished_key(self.group, self.rank), str(self.step_count))
        except Exception:  # the coordinator is gone already
            pass
        self._heartbeat.stop()

    def __enter__(self) -> ReplicaGroups:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is None:
            self.close()
        else:  # failed: not finished, only gone
            self._heartbeat.stop()


def _average(grads: list[torch.Tensor], members, contributing: bool, contributors: int
             ) -> list[torch.Tensor]:
    """Copies of the gradients averaged over the quorum's contributing groups (a group that
    does not contribute adds zeros), each all-reduced on its own, all in flight at once
    (gloo runs them side by side on its threads: measured here, 16 gradients of 33 MB took
    41 ms so against 51 ms packed into one buffer, which costs a second copy too). ``grads``
    are left as they are: a round a member fails in is retried from them."""
    with torch.no_grad():
        averaged = [g.clone() if contributing else torch.zeros_like(g) for g in grads]
        # one record of the round in the collective recorder's (when it is on): a record
        # per gradient would crowd the user's own collectives out of its last few
        record = trace.note(_ACROSS, f"{len(averaged)} tensors, "
                            f"{sum(a.nbytes for a in averaged)} bytes")
        try:
            works = [members.allreduce([a]) for a in averaged]
            for work in works:
                work.wait()
        except Exception:  # a member died or hung: the round broke off
            if record is not None:
                record.state = "failed"
            raise
        if record is not None:
            record.state = "done"
        for a in averaged:
            a.div_(max(1, contributors))
    return averaged


_ACROSS = "all_reduce across replica groups"


def _unpack(averaged: list[torch.Tensor], grads: list[torch.Tensor],
            in_place: list[bool]) -> None:
    """The committed averages become the gradients: a plain gradient takes its copy's
    storage (no second copy); a DTensor's local block (another tensor object over the
    DTensor's storage) is copied into."""
    with torch.no_grad():
        for grad, mean, copy in zip(grads, averaged, in_place, strict=True):
            if copy:
                grad.copy_(mean)
            else:
                grad.set_(mean)
