"""What the coordinator and the ranks say to each other, as keys of one TCPStore.

Rounds are numbered; round ``q`` is one attempt at one optimizer step:

1. every rank ``(g, r)`` (replica group ``g``, rank ``r`` inside it) writes
   ``join/q/g/r`` = its committed step count and whether its gradients are of those weights, and waits for ``quorum/q``;
2. the coordinator closes the round when every group of the last quorum that is still alive
   (same processes, heartbeats fresh) has joined — or one timeout after the first join, for
   a group that is alive but does not answer — and writes ``quorum/q``: the members, the
   epoch of their process groups, the step, who heals from whom. When round ``q - 1``
   committed with every live group a member, in the same processes, none healing, the
   coordinator writes ``quorum/q`` with that commit, before the joins: the same members,
   one step on (a rank not at that step, restarted meanwhile, joins the next round; a
   member that fails before taking part breaks the others' all-reduce, which aborts);
3. the members heal (a group behind the step receives state from the source group), average
   their gradients over the members' process group, and write ``ok/q/g/r`` or
   ``fail/q/g/r``;
4. the coordinator writes ``decision/q`` = ``commit`` once every member rank said ok, or
   ``abort`` as soon as one failed, died, or one timeout passed after the first ok: every
   member steps its optimizer, or none does.

After each join and vote a rank numbers it as an event (``events``, counted by the store)
and writes ``event/n``: the coordinator waits for the next event's key instead of polling,
so a round closes and a step is decided as soon as the last rank has spoken (it still looks
every :data:`POLL_SECONDS` at the heartbeats, for the dead).

Heartbeats (``hb/g/r`` = ``pid:count``, every :data:`HEARTBEAT_SECONDS`) tell the
coordinator that a rank lives; one left unchanged for the timeout is dead. A rank whose
training ended writes ``finished/g/r`` = its committed steps as it stops beating, so a group
that comes back after the others finished is told to end, not that its peers died.

Over several hosts (a host cut off from the coordinator's, or the coordinator's host gone),
a rank whose heartbeats go unanswered for :func:`silence_seconds` ends itself instead of
waiting on in a store call that would never return, and the coordinator's launcher, its
own groups done, waits that long for a group on another host that neither finished nor
beats.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

#: The one timeout (seconds): a heartbeat older than this is a dead rank, a group this late
#: to a round or to its vote is left out of it, a collective waiting this long on a peer fails.
DEFAULT_TIMEOUT = 3.0
TIMEOUT_VARIABLE = "DEVMESH_REPLICA_TIMEOUT"
#: How often each rank tells the coordinator it lives.
HEARTBEAT_SECONDS = 0.2
#: How long the coordinator waits for a rank's next join or vote before it looks at the
#: heartbeats again.
POLL_SECONDS = 0.02

#: Set by ``devmesh run --replica-groups`` for each rank: the coordinator's store, this rank's
#: group and the number of groups.
ADDRESS_VARIABLE = "DEVMESH_REPLICA_COORDINATOR"
GROUP_VARIABLE = "DEVMESH_REPLICA_GROUP"
GROUPS_VARIABLE = "DEVMESH_REPLICA_GROUPS"

OPEN = "open"  # the round now taking joins


def join_key(round_: int, group: int, rank: int) -> str:
    return f"join/{round_}/{group}/{rank}"


def quorum_key(round_: int) -> str:
    return f"quorum/{round_}"


def vote_key(vote: str, round_: int, group: int, rank: int) -> str:
    return f"{vote}/{round_}/{group}/{rank}"


def decision_key(round_: int) -> str:
    return f"decision/{round_}"


EVENTS = "events"  # how many joins and votes the ranks have announced


def event_key(number: int) -> str:
    return f"event/{number}"


def announce(store) -> None:
    """Tell the coordinator that this rank wrote a join or a vote: the next event number,
    and its key, which the coordinator waits for."""
    store.set(event_key(store.add(EVENTS, 1)), "")


def heartbeat_key(group: int, rank: int) -> str:
    return f"hb/{group}/{rank}"


def finished_key(group: int, rank: int) -> str:
    return f"finished/{group}/{rank}"


def silence_seconds(timeout: float) -> float:
    """How long the other side is waited for before it is taken for gone: ten timeouts, at
    least 10 s (a restarted group beats again well within it; a store call on a cut link
    would otherwise wait for TCP to give up, many minutes)."""
    return max(10.0, 10 * timeout)


def timeout_from_environment(env=None) -> float:
    """The one timeout: ``DEVMESH_REPLICA_TIMEOUT`` seconds, else :data:`DEFAULT_TIMEOUT`."""
    env = os.environ if env is None else env
    text = env.get(TIMEOUT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_VARIABLE}={text!r}: give a positive number of seconds")
    return value


@dataclass(frozen=True)
class Quorum:
    """The coordinator's answer to one round."""

    round: int
    epoch: int  # the members' process groups: a new epoch, new groups
    members: tuple[int, ...]  # replica groups taking part, ascending
    step: int  # the committed steps of the most advanced member
    healers: tuple[int, ...]  # members behind ``step``: they receive state from ``source``
    source: int  # the member every healer receives from
    contributors: tuple[int, ...]  # the members whose gradients the step averages: not a
    # healer, nor a group healed in an aborted round of this step (its gradients are of the
    # weights it had before)
    error: str = ""  # why the members cannot step (none of them holds the committed state)
    finished: bool = False  # the groups that held the committed state ended their training
    # while the members were restarting: there is nothing left for the members to do

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: bytes | str) -> Quorum:
        data = json.loads(text)
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
