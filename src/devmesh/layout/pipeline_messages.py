"""The messages of a pipeline schedule, in the order they cross each pair of ranks.

NCCL ignores message tags: between two ranks, the ``k``-th receive one posts gets the ``k``-th
message the other sends. So a pipeline that runs on NCCL must post its receives from each peer
in the order that peer sends, and this module says what that order is: a rank sends in the
order of its own actions (a forward's activation to the next stage, preceded on each link's
first micro-batch of the step by a small header announcing its shapes; a backward's gradient
to the previous stage), and :func:`fifo_problem` checks that every receiver *uses* each
stream of them (a stage's activations, a stage's gradients) in that order too (true of every
built-in schedule at every size tested; a hand-made one may not be). Two stages on the same
rank exchange no message: the runner hands their tensors over in memory.
devmesh's runner posts every pipeline message with one tag on every backend, so that gloo
matches them the way NCCL does and the CPU tests exercise the order GPUs depend on.

Order is not enough on NCCL: its sends and receives run on one stream per rank, each batch
(``batch_isend_irecv``) only once the one before has finished, and a send finishes only when
its receiver's batch is running (the strict case: NCCL may finish a small send into its
peer's buffer early, which only removes waits). A rank that posts a receive ahead of a send its peer needs
first deadlocks both. :func:`nccl_deadlock` plays a schedule under those rules, with the
receives posted exactly as the runner posts them (:class:`ReceiveOrder`, :func:`upcoming`),
and names the ranks that would wait forever. With the ``"fused"`` policy — a receive goes in
the batch of the last send before it, as torch's pipelining fuses a forward's send with a
backward's receive — GPipe, 1F1B and zero-bubble never deadlock; with ``"ahead"`` (what the
runner does on gloo, whose sends never wait: the next two actions' receives, so each message
lands while the rank computes) 1F1B does. Interleaved 1F1B with more micro-batches than ranks
deadlocks under both: some receive would have to go ahead of a later send.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from devmesh.layout.schedule import Action, Schedule

__all__ = ["Message", "sent_by", "needed_by", "sequences", "fifo_problem", "ReceiveOrder",
           "forward_only", "upcoming", "sent_by_action", "nccl_deadlock", "nccl_placement",
           "nccl_problem", "message_plan"]

#: How many schedules' messages and placements are kept: a runner asks about its one
#: schedule often; a process that builds many (a search, a test) must not keep them all,
#: or every garbage collection walks them
_SCHEDULES_KEPT = 64


class Message(NamedTuple):  # a tuple: hashed in C, as the placement search does often
    """One message between stages: ``stage`` is the stage that receives it. A ``header``
    (``microbatch`` -1) announces the shapes of a link's activations for the step."""

    kind: str  # "header", "activation" or "gradient" ("zeros": a filler, in the model only)
    stage: int
    microbatch: int = -1

    def __str__(self) -> str:
        if self.kind in ("header", "zeros"):
            return f"{self.kind}@{self.stage}"
        return f"{self.kind[0]}{self.microbatch}@{self.stage}"


def forward_only(schedule: Schedule) -> Schedule:
    """The schedule's forwards alone, in its order (what an evaluation pass plays)."""
    return Schedule(schedule.name, schedule.ranks, schedule.stages, schedule.microbatches,
                    tuple(tuple(a for a in actions if a.kind == "F")
                          for actions in schedule.actions), schedule.placement)


def _first_forwards(actions: Iterable[Action]) -> dict[int, int]:
    """stage -> the micro-batch of its first forward in ``actions``."""
    first: dict[int, int] = {}
    for a in actions:
        if a.kind == "F":
            first.setdefault(a.stage, a.microbatch)
    return first


def sent_by_action(schedule: Schedule, action: Action) -> tuple[Message, ...]:
    """The data messages ``action`` sends (headers aside). None to a stage on the same rank
    (the turn of a V, or every stage on one rank): it gets its input in memory."""
    s, m = action.stage, action.microbatch
    if action.kind == "F" and s < schedule.stages - 1 and _apart(schedule, s, s + 1):
        return (Message("activation", s + 1, m),)
    if action.kind in ("B", "I") and s > 0 and _apart(schedule, s, s - 1):
        return (Message("gradient", s - 1, m),)
    return ()


def _apart(schedule: Schedule, stage: int, other: int) -> bool:
    """Do two stages live on different ranks (so that what passes between them is a
    message)?"""
    return schedule.rank_of(stage) != schedule.rank_of(other)


def sent_by(schedule: Schedule, rank: int) -> list[tuple[int, tuple[Message, ...]]]:
    """Per action of ``rank``, in order: the peer rank and the messages the action sends
    (empty when it sends none)."""
    first = _first_forwards(schedule.actions[rank])
    out: list[tuple[int, tuple[Message, ...]]] = []
    for a in schedule.actions[rank]:
        messages = sent_by_action(schedule, a)
        if not messages:
            out.append((-1, ()))
            continue
        if a.kind == "F" and first[a.stage] == a.microbatch:  # the link's first: its header
            messages = (Message("header", a.stage + 1),) + messages
        out.append((schedule.rank_of(messages[-1].stage), messages))
    return out


def needed_by(schedule: Schedule, action: Action) -> tuple[int, Message] | None:
    """The peer rank and the message ``action`` waits for, if any (none from a stage on the
    same rank: see :func:`sent_by_action`)."""
    s, m = action.stage, action.microbatch
    if action.kind == "F" and s > 0 and _apart(schedule, s, s - 1):
        return schedule.rank_of(s - 1), Message("activation", s, m)
    if action.kind in ("B", "I") and s < schedule.stages - 1 and _apart(schedule, s, s + 1):
        return schedule.rank_of(s + 1), Message("gradient", s, m)
    return None


@functools.lru_cache(maxsize=_SCHEDULES_KEPT)  # a schedule is immutable; asked often
def sequences(schedule: Schedule) -> dict[tuple[int, int], tuple[Message, ...]]:
    """(sender, receiver) -> every message the sender sends the receiver in a step, in the
    order it sends them."""
    out: dict[tuple[int, int], list[Message]] = {}
    for rank in range(schedule.ranks):
        for peer, messages in sent_by(schedule, rank):
            if messages:
                out.setdefault((rank, peer), []).extend(messages)
    return {pair: tuple(messages) for pair, messages in out.items()}


def fifo_problem(schedule: Schedule) -> str | None:
    """Why ``schedule`` cannot run with messages matched in order, if it cannot: some rank
    uses the messages of one of a peer's streams — one stage's activations, or one stage's
    gradients — in another order than the peer sends them.

    Streams may interleave differently on the two sides: in a V placement, rank 0 sends
    rank 1 both stage 1's activations and stage 2's gradients, and rank 1 may need a
    gradient sent after an activation it uses later. The receiver posts its receives in the
    sender's order anyway (:class:`ReceiveOrder`), so the earlier message's receive is
    simply posted first and waits, filled, until used. Within a stream the order must hold:
    a link's first activation is posted ahead in the last step's shape, and the sender's
    first must be the receiver's first."""
    for (sender, receiver), sent in sequences(schedule).items():
        used = [need[1] for a in schedule.actions[receiver]
                if (need := needed_by(schedule, a)) is not None and need[0] == sender]
        for stream in dict.fromkeys((m.kind, m.stage) for m in used):
            data = [m for m in sent if (m.kind, m.stage) == stream]
            mine = [m for m in used if (m.kind, m.stage) == stream]
            if data != mine:  # the same messages (a Schedule has each action once), reordered
                at = next(i for i, (x, y) in enumerate(zip(data, mine, strict=True)) if x != y)
                return (f"rank {receiver} uses rank {sender}'s {stream[0]}s for stage "
                        f"{stream[1]} in another order than rank {sender} sends them "
                        f"({stream[0]} {at}: sent {data[at]}, used {mine[at]}); messages "
                        "between two ranks are matched in order (NCCL ignores tags), so "
                        "reorder the schedule's actions")
    return None


def upcoming(schedule: Schedule, actions: tuple[Action, ...], start: int, policy: str,
             early: Mapping[int, tuple[Message, ...]] | None = None) -> list[Message]:
    """The messages whose receives a rank posts before ``actions[start]`` (with the sends of
    the action before it, in one batch). ``"ahead"``: those the next two actions wait for,
    so each message's receive is posted while the action before it computes (gloo: its data
    lands meanwhile; gloo's sends never wait for their receive). ``"fused"``: the next
    message any action waits for, as long as no action before that one sends — a receive
    then goes in the batch of the last send before it, never ahead of a send (NCCL: a send
    waits for its receiver, and a batch for the one before it). ``early``: receives moved
    ahead to the boundary before ``actions[start]`` (:func:`nccl_placement`)."""
    extra = list((early or {}).get(start, ()))
    if policy == "ahead":
        return [need[1] for a in actions[start:start + AHEAD]
                if (need := needed_by(schedule, a)) is not None] + extra
    if policy != "fused":
        raise ValueError(f"policy must be 'ahead' or 'fused', got {policy!r}")
    for a in actions[start:]:
        need = needed_by(schedule, a)
        if need is not None:
            return [need[1]] + extra
        if sent_by_action(schedule, a):
            break
    return extra


def _fused_receives(schedule: Schedule, actions: tuple[Action, ...]
                    ) -> tuple[Message | None, ...]:
    """:func:`upcoming`'s ``"fused"`` receive for every start at once (the model asks for
    each boundary): the message of the first action from there on that waits for one, or
    ``None`` if an action that sends comes first, or none waits."""
    out: list[Message | None] = [None] * (len(actions) + 1)
    for k in range(len(actions) - 1, -1, -1):
        need = needed_by(schedule, actions[k])
        if need is not None:
            out[k] = need[1]
        elif not sent_by_action(schedule, actions[k]):
            out[k] = out[k + 1]
    return tuple(out)


# -- which receives a rank posts when ------------------------------------------------------
AHEAD = 2  # "ahead": receives posted for the next two actions (gloo)
READY, SKIP, SPECULATE, UNKNOWN = "ready", "skip", "speculate", "unknown"


class ReceiveOrder:
    """Where a rank stands in each peer's sequence of messages to it within a step: its
    receives are posted in that order, one peer at a time, never skipping ahead.

    What can be posted depends on what the rank knows of each message's shape (the caller's
    ``state``): ``READY`` (post it), ``SKIP`` (it will not come: its link failed, or nothing
    differentiable crossed), ``SPECULATE`` (a link's first activation, shape not yet
    announced this step: post it in the previous step's shape, and post nothing more from
    that peer until the header says whether the shape held — if not, the sender fills that
    receive with zeros and sends the data next, which the caller then posts again), or
    ``UNKNOWN`` (the header must be read first)."""

    def __init__(self, schedule: Schedule, rank: int) -> None:
        self.rank = rank
        self.incoming = {sender: sent for (sender, receiver), sent in
                         sequences(schedule).items() if receiver == rank}
        self.sender = {m: sender for sender, sent in self.incoming.items() for m in sent}
        self.index = {m: i for sent in self.incoming.values() for i, m in enumerate(sent)}
        self.first_activation = {s: m for s, m in
                                 _first_forwards(schedule.actions[rank]).items() if s > 0}
        self.position = dict.fromkeys(self.incoming, 0)
        self.speculated: set[Message] = set()  # posted in an old shape, header not yet read

    def restart(self) -> None:
        """A new step: every sequence from its start."""
        self.position = dict.fromkeys(self.incoming, 0)
        self.speculated.clear()

    def is_first(self, message: Message) -> bool:
        return (message.kind == "activation"
                and self.first_activation.get(message.stage) == message.microbatch)

    def due(self, wanted: Iterable[Message], state: Callable[[Message], str]
            ) -> tuple[list[Message], Message | None]:
        """The receives to post now so that every ``wanted`` message has one, in each
        peer's order: the list, and the header that must be read before going further (or
        ``None`` when every wanted message is covered). A message already passed is not
        posted again."""
        posts: list[Message] = []
        for target in wanted:
            sender = self.sender.get(target)
            if sender is None:
                continue
            sent = self.incoming[sender]
            index = self.index[target]
            while self.position[sender] <= index:
                message = sent[self.position[sender]]
                if message in self.speculated:  # still waiting on its header
                    return posts, Message("header", message.stage)
                status = state(message)
                if status == SKIP:
                    self.position[sender] += 1
                elif status == READY:
                    posts.append(message)
                    self.position[sender] += 1
                elif status == SPECULATE:
                    posts.append(message)
                    self.speculated.add(message)
                    return posts, Message("header", message.stage)
                else:
                    return posts, Message("header", message.stage)
        return posts, None

    def header_read(self, stage: int, shape_held: bool) -> bool:
        """The header of ``stage``'s link was read; returns whether its first activation's
        receive was posted speculatively and must be posted again (the shape changed, or the
        sender failed: the posted receive gets zeros). The sequence goes on past it only if
        the shape held."""
        first = Message("activation", stage, self.first_activation.get(stage, -1))
        if first not in self.speculated:
            return False
        self.speculated.discard(first)
        if shape_held:
            self.position[self.sender[first]] += 1
            return False
        return True


_sent_by = functools.lru_cache(maxsize=_SCHEDULES_KEPT)(sent_by)


# -- NCCL's stream rules ------------------------------------------------------------------
Placement = dict[int, tuple[Message, ...]]  # boundary (index of the next action) -> receives


def nccl_deadlock(schedule: Schedule, policy: str = "fused", shapes: str = "held",
                  early: Mapping[int, Placement] | None = None) -> str | None:
    """Play one step of ``schedule`` as devmesh's runner posts it with ``policy`` (see
    :func:`upcoming`; NCCL's is ``"fused"``, with ``early[rank]`` the receives each rank
    moves ahead, :func:`nccl_placement`), no stage failing, under NCCL's rules: each rank's
    batches of sends and receives run one after
    another on its communication stream, each after the compute enqueued before it (its
    sends' data); a batch finishes once every peer batch holding its messages' other ends
    has started; an action computes once its message's batch has finished. ``shapes``: every
    link's shapes ``"held"`` from the step before (receives posted ahead in them), are
    ``"new"`` (the first step: each link's first activation waits for its header), or
    ``"changed"`` (the receive posted ahead gets zeros, the data follows). Returns which
    ranks would wait forever and on what, or ``None``."""
    play = _play(schedule, policy, shapes, early or {})
    if play.unmatched:
        return play.unmatched
    stuck: dict[int, str] = {}
    for rank, program in enumerate(play.programs):
        for index, node in enumerate(program):
            if (rank, index) not in play.finished and rank not in stuck:
                stuck[rank] = (f"a batch of {len(node.ops)} messages" if node.kind == "batch"
                               else f"action {node.kind}")
    if not stuck:
        return None
    return "deadlock on NCCL: " + "; ".join(f"rank {rank} waits at {what}"
                                            for rank, what in sorted(stuck.items()))


@functools.lru_cache(maxsize=_SCHEDULES_KEPT)
def nccl_placement(schedule: Schedule) -> dict[int, Placement] | None:
    """Per rank, the receives to post earlier than ``"fused"`` would, so that no step of
    ``schedule`` deadlocks on NCCL (shapes held, new or changed); ``None`` if none found.
    Nothing moves where ``"fused"`` alone plays through. Interleaved 1F1B with more
    micro-batches than ranks does not: a rank sends a gradient, then needs its peer's
    gradient, whose receive ``"fused"`` posts only with the rank's next send. Then each
    receive starts where the schedule's timing puts its send (:func:`_placement_by_time`)
    and what still deadlocks is repaired: play the step; where a rank's batch waits on a
    receive its peer would post only after a batch of its own that cannot finish, move that
    receive into the peer's stuck batch (a receive posted earlier only waits longer;
    nothing else changes), and play again; the repair alone, from ``"fused"``, is the
    fallback. Every placement returned has played through all three shape cases."""
    if _plays_through(schedule, {}):
        return {}  # "fused" alone is free of deadlock: move nothing
    for early in (_placement_by_time(schedule), {}):
        found = _repaired(schedule, early)
        if found is not None:
            return found
    return None


def _plays_through(schedule: Schedule, early: Mapping[int, Placement]) -> bool:
    """Whether every step of ``schedule`` (shapes held, new or changed) plays to its end
    with the receives ``early`` moved ahead."""
    for shapes in ("held", "new", "changed"):
        play = _play(schedule, "fused", shapes, early)
        if play.unmatched or len(play.finished) < sum(map(len, play.programs)):
            return False
    return True


def _repaired(schedule: Schedule, early: dict[int, Placement]) -> dict[int, Placement] | None:
    """:func:`nccl_placement`'s repair loop from the placement ``early`` (changed in place):
    the placement once every step plays to its end, or ``None``."""
    for _ in range(sum(map(len, schedule.actions)) + 1):
        for shapes in ("held", "new", "changed"):
            play = _play(schedule, "fused", shapes, early)
            if play.unmatched:
                return None
            moves = play.repairs()
            if moves:
                break
            if len(play.finished) < sum(map(len, play.programs)):
                return None  # stuck with no receive to move (not seen; never call it free)
        else:
            return early
        changed = False
        for rank, boundary, message in moves:
            placed = early.setdefault(rank, {})
            if message not in placed.get(boundary, ()):
                placed[boundary] = placed.get(boundary, ()) + (message,)
                changed = True
        if not changed:
            return None  # moving them did not help: give up rather than loop
    return None


def _placement_by_time(schedule: Schedule) -> dict[int, Placement]:
    """A first guess for :func:`nccl_placement`: each receive posted at the last boundary of
    its receiver's step that comes no later than its sender's send, in the schedule's own
    timing (:meth:`Schedule.simulate`). A rank then never waits at a receive its peer cannot
    reach yet, nor posts one after a send its peer needs first, whenever the step runs as
    simulated; the repair loop fixes what the speculative first activations change. For
    interleaved 1F1B this leaves a few repairs instead of one per micro-batch and rank: the
    search took 34 s for 8 ranks x 64 micro-batches x 4 virtual stages without it."""
    ends = {t.action: t.end for t in schedule.simulate()}
    sender_of = {m: a for rank in range(schedule.ranks) for a in schedule.actions[rank]
                 for m in sent_by_action(schedule, a)}
    early: dict[int, Placement] = {}
    for rank, actions in enumerate(schedule.actions):
        fused = _fused_receives(schedule, actions)
        boundary_times = [0.0] + [ends[a] for a in actions]
        for k, action in enumerate(actions):
            need = needed_by(schedule, action)
            if need is None:
                continue
            message = need[1]
            sent_at = ends[sender_of[message]]
            boundary = max(b for b in range(k + 1) if boundary_times[b] <= sent_at + 1e-9)
            posted = next(b for b in range(k + 1) if fused[b] == message)  # where "fused" posts
            if boundary < posted:
                placed = early.setdefault(rank, {})
                placed[boundary] = placed.get(boundary, ()) + (message,)
    return early


def nccl_problem(schedule: Schedule) -> str | None:
    """Why the runner cannot run ``schedule`` on NCCL without deadlock, if it cannot: no
    placement of its receives (training or forward-only) passes :func:`nccl_deadlock`."""
    for plan, what in ((schedule, "a training step"), (forward_only(schedule), "evaluate()")):
        if nccl_placement(plan) is None:
            found = next(filter(None, (nccl_deadlock(plan, "fused", shapes)
                                       for shapes in ("held", "new", "changed"))), "")
            return (f"schedule {schedule.name!r} ({schedule.stages} stages on "
                    f"{schedule.ranks} ranks, {schedule.microbatches} micro-batches) would "
                    f"deadlock on NCCL in {what}, however its receives are placed"
                    + (f" ({found})" if found else "")
                    + ": use another schedule or size, or a CPU mesh (gloo)")
    return None


def message_plan(schedule: Schedule, backend: str = "nccl") -> str:
    """Each rank's step as the runner plays it on ``backend`` ("gloo" or "nccl"), shapes as
    in the step before: its actions, and between them each batch of messages it starts
    (``{>a0@1 <g0@0}``: send the activation of micro-batch 0 to stage 1, receive the
    gradient for stage 0, in one ``batch_isend_irecv``); for NCCL, whether the step is free
    of deadlock and how many receives go early. ``devmesh plan --messages`` prints it."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    policy = "fused" if backend == "nccl" else "ahead"
    early = (nccl_placement(schedule) or {}) if backend == "nccl" else {}
    lines = [f"{schedule.name} on {backend}: each rank's actions and, between them, the "
             "messages it starts in one batch (> send, < receive)"]
    for rank in range(schedule.ranks):
        parts = []
        for node in _program(schedule, rank, policy, "held", early.get(rank, {})):
            if node.kind == "batch":
                parts.append("{" + " ".join(f"{'>' if d == 'send' else '<'}{m}"
                                            for d, _, m in node.ops) + "}")
            else:
                parts.append(node.kind)
        lines.append(f"rank {rank}: " + " ".join(parts))
    if backend == "nccl":
        problem = nccl_problem(schedule)
        moved = sum(len(m) for placed in early.values() for m in placed.values())
        lines.append(problem or "no deadlock under NCCL's rules (shapes held, new or changed; "
                     f"training and forward-only); {moved} receives posted early")
    return "\n".join(lines)


@dataclass
class _Node:
    kind: str  # "batch", or the action's name
    ops: list  # a batch's (direction, peer, message); an action's nodes it waits for
    boundary: int = 0  # where a batch is posted: before actions[boundary]


@dataclass
class _Play:
    """One step played under NCCL's rules: each rank's nodes, and which ran to the end."""

    programs: list[list[_Node]]
    finished: set = None
    started: set = None
    partner: dict = None  # (rank, index, op index) -> (rank, index) of the other end
    unmatched: str | None = None

    def repairs(self) -> list[tuple[int, int, Message]]:
        """The receives to move ahead, as (rank, boundary, message): one for each send
        that waits on a batch its peer has not started."""
        moves = []
        for rank, program in enumerate(self.programs):
            for index, node in enumerate(program):
                here = (rank, index)
                if node.kind != "batch" or here in self.finished or here not in self.started:
                    continue
                for op_index, (direction, peer, _) in enumerate(node.ops):
                    other = self.partner[(rank, index, op_index)]
                    if direction != "send" or other in self.started:
                        continue
                    # the receive waits in a batch the peer has not started: move it into
                    # the peer's first batch that has not finished
                    target = next(i for i, n in enumerate(self.programs[other[0]])
                                  if n.kind == "batch" and (other[0], i) not in self.finished)
                    message = next(m for d, p, m in self.programs[other[0]][other[1]].ops
                                   if d == "recv" and self.partner_of(other, m) == here)
                    moves.append((other[0], self.programs[other[0]][target].boundary,
                                  message))
        return list(dict.fromkeys(moves))

    def partner_of(self, node: tuple[int, int], message: Message) -> tuple[int, int]:
        ops = self.programs[node[0]][node[1]].ops
        op_index = next(i for i, (d, _, m) in enumerate(ops) if d == "recv" and m == message)
        return self.partner[(*node, op_index)]


def _play(schedule: Schedule, policy: str, shapes: str,
          early: Mapping[int, Placement]) -> _Play:
    if shapes not in ("held", "new", "changed"):
        raise ValueError(f"shapes must be 'held', 'new' or 'changed', got {shapes!r}")
    programs = [_program(schedule, rank, policy, shapes, early.get(rank, {}))
                for rank in range(schedule.ranks)]
    play = _Play(programs)
    # the i-th send from a to b meets the i-th receive b posts from a
    where: dict[tuple[str, int, int, int], tuple[int, int, int]] = {}
    counts: dict[tuple[str, int, int], int] = {}
    for rank, program in enumerate(programs):
        for index, node in enumerate(program):
            if node.kind != "batch":
                continue
            for op_index, (direction, peer, _) in enumerate(node.ops):
                pair = (rank, peer) if direction == "send" else (peer, rank)
                n = counts.get((direction, *pair), 0)
                counts[(direction, *pair)] = n + 1
                where[(direction, *pair, n)] = (rank, index, op_index)
    play.partner = {}
    partners: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for (direction, a, b, n), op in where.items():
        other = where.get(("recv" if direction == "send" else "send", a, b, n))
        if other is None:
            play.unmatched = (f"rank {op[0]}'s {direction} #{n} between ranks {a} and {b} is "
                              "never matched")
            return play
        play.partner[op] = other[:2]
        partners.setdefault(op[:2], set()).add(other[:2])
    # each node waits for the nodes it depends on: a batch for the batch before it on the
    # stream and the compute enqueued before it (its sends' data); a compute for the compute
    # before it and the batches holding its messages
    deps: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for rank, program in enumerate(programs):
        last = {"batch": None, "compute": None}
        for index, node in enumerate(program):
            stream = "batch" if node.kind == "batch" else "compute"
            before = [last[stream]] + ([last["compute"]] if stream == "batch" else [])
            deps[(rank, index)] = [n for n in before if n is not None] + (
                [] if stream == "batch" else list(node.ops))
            last[stream] = (rank, index)
    started: set[tuple[int, int]] = set()
    finished: set[tuple[int, int]] = set()
    waiting_on = {node: len(needs) for node, needs in deps.items()}
    dependents: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for node, needs in deps.items():
        for need in needs:
            dependents.setdefault(need, []).append(node)
    absent: dict[tuple[int, int], int] = {}  # a started batch -> partners not yet started
    ready = [node for node, count in waiting_on.items() if count == 0]
    while ready:  # start every node whose dependencies finished; finish what can
        node = ready.pop()
        started.add(node)
        done = [node]
        if programs[node[0]][node[1]].kind == "batch":
            absent[node] = sum(p not in started for p in partners.get(node, ()))
            done = [node] if absent[node] == 0 else []
            for p in partners.get(node, ()):
                if p in absent and p not in finished and p != node:
                    absent[p] -= 1
                    if absent[p] == 0:
                        done.append(p)
        for finishing in done:
            if finishing in finished:
                continue
            finished.add(finishing)
            for dependent in dependents.get(finishing, ()):
                waiting_on[dependent] -= 1
                if waiting_on[dependent] == 0:
                    ready.append(dependent)
    play.started, play.finished = started, finished
    return play


def _program(schedule: Schedule, rank: int, policy: str, shapes: str,
             early: Mapping[int, tuple[Message, ...]]) -> list[_Node]:
    """``rank``'s step as the runner enqueues it: batches of messages and computes, in
    order."""
    actions = schedule.actions[rank]
    order = ReceiveOrder(schedule, rank)
    read: set[int] = set()  # links whose header this rank has read

    def state(message: Message) -> str:
        if message.kind == "activation" and message.stage not in read:
            return SPECULATE if order.is_first(message) and shapes != "new" else UNKNOWN
        return READY

    program: list[_Node] = []
    batch_of: dict[Message, int] = {}

    def post(messages: list[Message], boundary: int,
             sends: list[tuple[int, Message]] = ()) -> None:
        ops = [("send", peer, m) for peer, m in sends]
        ops += [("recv", order.sender[m], m) for m in messages]
        for m in messages:
            batch_of[m] = len(program)
        if ops:
            program.append(_Node("batch", ops, boundary))

    fused = _fused_receives(schedule, actions) if policy == "fused" else None

    def wanted(start: int) -> list[Message]:
        if fused is None:
            return upcoming(schedule, actions, start, policy, early)
        return ([fused[start]] if fused[start] is not None else []) + list(early.get(start, ()))

    post(order.due(wanted(0), state)[0], 0)
    sends = _sent_by(schedule, rank)
    for k, action in enumerate(actions):
        need = needed_by(schedule, action)
        waits = []
        if need is not None:
            message = need[1]
            while True:  # the runner blocks on the header, then posts the rest
                posts, header = order.due([message], state)
                post(posts, k)
                if header is None:
                    break
                waits.append((rank, batch_of[header]))
                read.add(header.stage)
                order.header_read(header.stage, shape_held=shapes != "changed")
            waits.append((rank, batch_of[message]))
        program.append(_Node(str(action), waits))
        peer, messages = sends[k]
        if shapes == "changed" and messages and messages[0].kind == "header":
            # the zeros filling the receive posted in the old shape, before the data
            messages = (messages[0], Message("zeros", messages[0].stage)) + messages[1:]
        posts, _ = order.due(wanted(k + 1), state)
        post(posts, k + 1, [(peer, m) for m in messages])
    return program
