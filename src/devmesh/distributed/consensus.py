"""How devmesh's ranks agree before they raise: the consensus protocol
(``docs/design/consensus.md``).

A check that can fail on some ranks only — an argument one rank computed differently, a file
one rank cannot read, a pipeline stage that failed on one copy — must not raise on those ranks
alone: the others would wait in the next collective until its timeout. These functions turn a
rank's outcome into the same outcome on every rank of a group, in as few and as small
collectives as they can:

* :func:`failures` — who failed, and why (one all-reduce of a flag when nobody did);
* :func:`differing` — which ranks passed which value (one all-reduce of two integers when
  they agree);
* :func:`agree` — the same over a mesh's dims, raising :class:`~devmesh.errors.MeshMismatchError`;
* :func:`refused_everywhere` — a refusal of one rank's own arguments raised on every rank;
* :func:`refused_or_agreed` — that refusal and an agreement on a value in one collective;
* :func:`batched` — the refusals and agreements of many calls that do not communicate
  (a model's ``fully_shard`` calls) made once, at the end of a block;
* :func:`texts_through_store` and :func:`warn_if_called_alone` — exchanges through the
  rendezvous store for calls users make on one rank by mistake, bounded by a timeout.

Every agreement runs under a watch numbered on a count of its own per group
(:mod:`~devmesh.distributed.timeouts`): a timeout or a peer gone inside one names the ranks
that never reached it. Texts travel as bytes, never pickles.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from devmesh import _torch_compat
from devmesh.distributed import groups, stops, timeouts
from devmesh.distributed.comm import _group, all_gather, small_tensor_device
from devmesh.distributed.timeouts import AGREEMENTS, Watch

if TYPE_CHECKING:
    from devmesh.mesh import DeviceMesh

__all__ = ["agree", "describe_disagreement", "failures", "refused_everywhere",
           "refused_or_agreed", "settle_held", "batched", "differing",
           "gather_texts", "texts_through_store", "warn_if_called_alone", "ALONE_SECONDS"]


def agree(mesh: DeviceMesh, dims: Sequence[int], what: str, value: str) -> None:
    """Check that every rank of the group over ``dims`` passed the same ``value``.

    One all-gather of an 8-byte digest when they agree. When they do not, every rank sees it
    in the same gathered digests, so every rank goes on to gather the texts and raises the
    same :class:`~devmesh.errors.MeshMismatchError` naming which ranks passed what — an
    error on all ranks rather than on some (which would leave the others hanging).
    """
    from devmesh.errors import MeshMismatchError
    device = small_tensor_device(_group(mesh, dims).group)
    digest = hashlib.blake2b(value.encode(), digest_size=8).digest()
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64,
                        device=device)
    digests = all_gather(mine, mesh, dims).reshape(-1)
    if bool((digests == digests[0]).all()):
        return
    data = torch.tensor(list(value.encode()), dtype=torch.uint8, device=device)
    lengths = all_gather(torch.tensor([data.numel()], device=device), mesh, dims).reshape(-1)
    padded = torch.zeros(int(lengths.max()), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    texts = all_gather(padded, mesh, dims)
    ranks = mesh.layout.group_of(mesh.get_rank(), tuple(dims))
    by_value: dict[str, list[int]] = defaultdict(list)
    for rank, text, n in zip(ranks, texts, lengths.tolist(), strict=True):
        by_value[bytes(text[:n].tolist()).decode(errors="replace")].append(rank)
    listing = describe_disagreement(by_value)
    raise MeshMismatchError(f"{what}: the ranks disagree — {listing}")


def describe_disagreement(by_value: dict[str, list[int]]) -> str:
    """``ranks 0-3: value; ranks 4-7: other value``, long values cut to where they differ."""
    from devmesh.layout import format_ranks

    values = list(by_value)
    start = len(_common_prefix(values))
    if max(map(len, values)) > 240:  # long descriptions: show where they start to differ
        start = max(0, start - 40)
        shown = {v: ("…" if start else "") + v[start: start + 160] + "…" for v in values}
    else:
        shown = {v: v for v in values}
    return "; ".join(f"ranks {format_ranks(r)}: {shown[v]}" for v, r in by_value.items())


def _common_prefix(values: list[str]) -> str:
    first, last = min(values), max(values)
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    return first[:n]


def gather_texts(text: str, group: dist.ProcessGroup | None) -> list[str]:
    """Every rank's ``text``, on every rank: two small all-gathers (lengths, then bytes).
    Bytes, not pickles: nothing from a peer is unpickled."""
    size = dist.get_world_size(group)
    device = small_tensor_device(group)
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([data.numel()], device=device), group=group)
    longest = max(int(n) for n in lengths)
    padded = torch.zeros(max(longest, 1), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    out = [torch.zeros_like(padded) for _ in range(size)]
    dist.all_gather(out, padded, group=group)
    return [bytes(t[: int(n)].tolist()).decode(errors="replace") for t, n in zip(out, lengths,
                                                                                 strict=True)]


def failures(error: str | None, group: dist.ProcessGroup | None = None) -> dict[int, str]:
    """``{rank: error}`` of every rank of ``group`` that failed, the same dict on every rank.

    One all-reduce of a flag when every rank succeeded (on gloo a tiny all-reduce costs a
    quarter of a tiny all-gather); the flags and texts travel only after a failure. Call it
    where some ranks may have raised, before the next collective, and raise on every rank if
    the result is not empty: an error on some ranks alone is a hang for the others."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return {0: error} if error is not None else {}
    _before_agreeing()
    with _agreement("the failure check (an all-reduce of who failed)", group):
        device = small_tensor_device(group)
        count = torch.tensor([int(error is not None)], dtype=torch.int64, device=device)
        dist.all_reduce(count, group=group)
        if not int(count):
            return {}
        size = dist.get_world_size(group)
        flags = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(size)]
        dist.all_gather(flags, torch.tensor([int(error is not None)], device=device),
                        group=group)
        texts = gather_texts(error or "", group)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(size)
    return {r: t for r, t, f in zip(ranks, texts, flags, strict=True) if int(f)}


def _agreement(what: str, group: dist.ProcessGroup | None) -> contextlib.AbstractContextManager:
    """Guard one of devmesh's agreements on ``group`` (numbered on a count of their own): a
    timeout or a peer gone inside it raises :class:`~devmesh.errors.CollectiveTimeoutError`
    naming the ranks that never reached it, as devmesh's counted collectives do. Inside a
    watch of the caller's (a pipeline step's end), that watch names them."""
    if timeouts.guarded():
        return contextlib.nullcontext()
    ranks = tuple(dist.get_process_group_ranks(group) if group is not None
                  else range(dist.get_world_size()))
    from devmesh.layout import format_ranks

    return Watch(what, ranks, lambda: f"ranks {format_ranks(list(ranks))}",
                 series=AGREEMENTS).guard()


@contextlib.contextmanager
def refused_everywhere(group: dist.ProcessGroup | None, what: str,
                       error_type: type[Exception], *, outcome: str = "was refused"
                       ) -> Iterator[None]:
    """Run checks of this rank's own arguments inside: if any rank of ``group`` raised
    ``error_type`` there, every rank raises after one tiny all-reduce — its own error, or an
    ``error_type`` saying ``what {outcome} on other ranks`` and why. A refusal on some ranks
    alone (an argument one rank computed differently, a file one rank cannot read) would
    leave the others waiting in the next collective."""
    from devmesh.errors import rank_prefix

    if _batch is not None:  # batched(): a refusal raises here, every rank raises at its end
        yield
        return
    error: Exception | None = None
    try:
        yield
    except error_type as exc:
        error = exc
    failed = failures(None if error is None else str(error).removeprefix(rank_prefix()),
                      group)
    _raise_refusals(error, failed, what, outcome, error_type)


def _raise_refusals(error: Exception | None, failed: dict[int, str], what: str, outcome: str,
                    error_type: type[Exception]) -> None:
    if error is not None:
        raise error
    if failed:
        raise error_type(f"{what} {outcome} on other ranks — " + "; ".join(
            f"rank {rank}: {text}" for rank, text in sorted(failed.items())))


@contextlib.contextmanager
def refused_or_agreed(group: dist.ProcessGroup | None, what: str, error_type: type[Exception],
                      agreed: str, *, hold: bool = False) -> Iterator[list[str]]:
    """:func:`refused_everywhere` and :func:`differing` in one collective: the block checks
    this rank's own arguments and appends the value every rank must agree on to the list it
    is given. One all-reduce (the maximum of a failure flag, a 63-bit digest and its
    negation) when nobody failed and everyone agrees; after a refusal every rank raises as
    :func:`refused_everywhere` makes it, after a disagreement a
    :class:`~devmesh.errors.MeshMismatchError` saying ``agreed`` and which ranks passed what.
    A call made once per module of a model (``fully_shard``) pays one agreement, not two.

    With ``hold``, a call that passes its checks does not communicate: its value is held,
    with those of the other calls held over its group, until this rank's next collective
    of devmesh's (:func:`~devmesh.distributed.groups.hold_until_communicating`: the
    model's first forward, any collective or agreement, a process group made) or
    :func:`settle_held` (the root's ``fully_shard``), and then each group's calls are
    agreed in one all-reduce (a model's ``fully_shard`` calls cost one agreement per mesh,
    not one each). A rank refused settles at once — every group it holds calls over, the
    refusal flagged in each — and raises; the others find the refusal where they settle
    theirs, and raise naming it. A refusal beats a disagreement: the refused rank holds
    fewer calls than the others."""
    values: list[str] = []
    if _batch is not None:  # batched(): agreed at its end, a refusal raised there everywhere
        yield values
        _batch.append((group, agreed, values[0] if values else ""))
        return
    error: Exception | None = None
    if hold and dist.is_initialized() and dist.get_world_size(group) > 1:
        stops.refuse_if_broken()
        try:
            yield values
        except error_type as exc:
            error = exc
        held = _held_over(group, what, error_type)
        if error is not None:
            _settle_held(error)  # raises: this rank's error
        held.calls.append((agreed, values[0] if values else ""))
        groups.hold_until_communicating(_settle_held)
        return
    try:
        yield values
    except error_type as exc:
        error = exc
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        _raise_refusals(error, {}, what, "was refused", error_type)
        return
    _before_agreeing()
    _refused_or_agreed_once(group, what, error_type,
                            [(agreed, values[0] if values and error is None else "")], error,
                            held=False)


def _refused_or_agreed_once(group: dist.ProcessGroup | None, what: str,
                            error_type: type[Exception], calls: list[tuple[str, str]],
                            error: Exception | None, *, held: bool) -> None:
    """The one all-reduce of :func:`refused_or_agreed` over ``calls`` (what each agrees
    on, and this rank's value: one call, or those ``held``), then on a refusal or a
    disagreement the exchanges that say it, on every rank."""
    from devmesh.errors import MeshMismatchError, rank_prefix

    listing = json.dumps([value for _, value in calls]) if held else calls[0][1]
    digest = int.from_bytes(hashlib.blake2b(listing.encode(), digest_size=8).digest(),
                            "little") >> 1
    label = (f"the checks of the {what} calls held until now (an all-reduce)" if held
             else "the refusal and agreement check (an all-reduce)")
    with _agreement(label, group):
        device = small_tensor_device(group)
        checked = torch.tensor([int(error is not None), digest, -digest], dtype=torch.int64,
                               device=device)
        dist.all_reduce(checked, op=dist.ReduceOp.MAX, group=group)
    if int(checked[0]):  # somebody was refused: who, and why
        failed = failures(None if error is None else str(error).removeprefix(rank_prefix()),
                          group)
        _raise_refusals(error, failed, what, "was refused", error_type)
    if int(checked[1]) == -int(checked[2]):  # the largest digest is the smallest: all agree
        return
    if not held:
        with _agreement("the agreement's texts (two all-gathers)", group):
            texts = gather_texts(listing, group)
        ranks = dist.get_process_group_ranks(group) if group is not None else range(len(texts))
        by_value: dict[str, list[int]] = defaultdict(list)
        for rank, text in zip(ranks, texts, strict=True):
            by_value[text].append(rank)
        raise MeshMismatchError(f"{calls[0][0]}: the ranks disagree — "
                                f"{describe_disagreement(by_value)}")
    _raise_first_difference(calls, differing(listing, group))


@dataclass
class _HeldCalls:
    """The calls :func:`refused_or_agreed` holds back (``hold``) over one group."""

    group: dist.ProcessGroup | None
    what: str
    error_type: type[Exception]
    calls: list[tuple[str, str]] = field(default_factory=list)  # what each agrees on, value


# the calls held back, a group at a time in the order of their first call, and the world's
# generation they were held in (a world destroyed since has nothing to settle)
_held: list[_HeldCalls] = []
_held_in = -1


def _held_over(group: dist.ProcessGroup | None, what: str,
               error_type: type[Exception]) -> _HeldCalls:
    global _held_in
    if _held_in != groups.generation():
        _held.clear()
        _held_in = groups.generation()
    for held in _held:
        if held.group is group:
            return held
    _held.append(_HeldCalls(group, what, error_type))
    return _held[-1]


def _settle_held(error: Exception | None = None) -> None:
    """Agree on the calls held back, each group's in one all-reduce, in the order the
    groups were first used (the same on each of a group's ranks: they made the same calls).
    Every group is settled before anything is raised — a rank raising at its first group
    would leave the others of its later groups waiting — then this rank's own ``error``,
    else the first refusal or disagreement a group found, is raised."""
    from devmesh.errors import MeshMismatchError

    if not _held and error is None:  # every unit's forward asks: nothing held, no cost
        return
    held = [] if _held_in != groups.generation() else list(_held)
    _held.clear()
    found: Exception | None = error
    for entry in held:
        stops.refuse_if_broken()
        try:
            _refused_or_agreed_once(entry.group, entry.what, entry.error_type, entry.calls,
                                    error, held=True)
        except (entry.error_type, MeshMismatchError) as exc:
            found = found or exc
    if found is not None:
        raise found


def settle_held() -> None:
    """Agree now on the calls :func:`refused_or_agreed` holds back (``hold``), raising on
    every rank what one refused or where they differ: where a model's setup ends (its
    root's ``fully_shard``, its first forward). Collective over their groups, when any are
    held; nothing otherwise."""
    groups.settle_held()
    _settle_held()


def _before_agreeing() -> None:
    """Before an agreement: settle the calls held back, and refuse if the world is out of
    step."""
    if _held:
        settle_held()
    stops.refuse_if_broken()


# the agreements batched() holds back, in call order: (group, what they agree on, value)
_batch: list[tuple[dist.ProcessGroup | None, str, str]] | None = None


@contextlib.contextmanager
def batched(what: str, error_type: type[Exception]) -> Iterator[None]:
    """Collective over the world: the refusals and agreements of the calls inside
    (:func:`refused_or_agreed`, :func:`refused_everywhere`) made once, at the end of the
    block, instead of one collective per call. A model's setup (a ``fully_shard`` per block,
    then the root) then costs two collectives, not one per call.

    A call refused on some rank raises there at once, and ends that rank's block; the other
    ranks go on to the end of theirs. At the end one all-reduce of a failure flag over the
    world finds it, and every rank raises: the failing rank its own error, the others
    ``error_type`` naming it (``what`` failed on other ranks). Then, for each process group
    the calls agreed over (in the order the calls first used it), one all-reduce of a digest
    of all their values; where the ranks disagree, every rank of the group raises the
    :class:`~devmesh.errors.MeshMismatchError` of the first call whose values differ. The
    calls inside must not communicate (their checks run before their collectives, which
    would otherwise meet a rank that stopped early) and their groups must exist before the
    block (create them first); a refusal is raised at the end of the block, where the
    calls' work on the other ranks is done, not undone. Nested blocks are agreed by the
    outermost."""
    global _batch
    if _batch is not None:
        yield
        return
    _before_agreeing()  # calls held before the block agree first, where every rank is
    _batch = entries = []
    error: Exception | None = None
    try:
        with groups.silent(
                f"the {what} calls inside a batched block must not communicate (a rank "
                "refused there has left its block): make the meshes' process groups before "
                "the block (slice the mesh, or devmesh.distributed.comm.process_group), and "
                "communicate after it"):
            yield
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        error = exc
    finally:
        _batch = None
    _agree_on_batch(what, error_type, error, entries)


def _agree_on_batch(what: str, error_type: type[Exception], error: Exception | None,
                    entries: list[tuple[dist.ProcessGroup | None, str, str]]) -> None:
    from devmesh.errors import rank_prefix

    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    text = None if error is None else (
        f"{type(error).__name__}: {str(error).removeprefix(rank_prefix())}")
    failed = failures(text)
    if failed:
        if error is not None:
            raise error
        raise error_type(f"{what} failed on other ranks — " + "; ".join(
            f"rank {rank}: {t}" for rank, t in sorted(failed.items())))
    by_group: dict[int, tuple[dist.ProcessGroup | None, list[tuple[str, str]]]] = {}
    for group, agreed, value in entries:
        by_group.setdefault(id(group), (group, []))[1].append((agreed, value))
    for group, calls in by_group.values():
        _raise_first_difference(calls, differing(json.dumps([value for _, value in calls]),
                                                 group))


def _raise_first_difference(calls: list[tuple[str, str]],
                            held: dict[str, list[int]]) -> None:
    """Raise the :class:`~devmesh.errors.MeshMismatchError` of the first of ``calls`` whose
    values differ, from :func:`differing`'s answer over their listings (nothing if none)."""
    from devmesh.errors import MeshMismatchError

    for i, (agreed, _) in enumerate(calls):
        by_value: dict[str, list[int]] = defaultdict(list)
        for listing, ranks in held.items():
            values = json.loads(listing)
            by_value[values[i] if i < len(values) else "(no such call)"] += ranks
        if len(by_value) > 1:
            raise MeshMismatchError(f"{agreed}: the ranks disagree — "
                                    f"{describe_disagreement(dict(by_value))}")


def differing(value: str, group: dist.ProcessGroup | None = None) -> dict[str, list[int]]:
    """``{value: ranks}`` if the ranks of ``group`` passed different values, else ``{}`` (the
    same on every rank): one all-reduce of a 63-bit digest and its negation (the largest and
    the smallest digest) when they agree; otherwise the
    lowest rank passing each distinct value broadcasts it (a pipeline's stages send one
    listing per stage, not one per rank)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return {}
    _before_agreeing()
    with _agreement("the agreement check (an all-reduce of digests)", group):
        return _differing(value, group)


def _differing(value: str, group: dist.ProcessGroup | None) -> dict[str, list[int]]:
    size = dist.get_world_size(group)
    digest = hashlib.blake2b(value.encode(), digest_size=8).digest()
    mine = int.from_bytes(digest, "little") >> 1  # 63 bits: its negation fits an int64
    device = small_tensor_device(group)
    extremes = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    if int(extremes[0]) == -int(extremes[1]):  # the largest digest is the smallest: all equal
        return {}
    digests = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(size)]
    dist.all_gather(digests, torch.tensor([mine], dtype=torch.int64, device=device),
                    group=group)
    ranks = list(dist.get_process_group_ranks(group) if group is not None else range(size))
    me = ranks.index(dist.get_rank())
    members: dict[int, list[int]] = defaultdict(list)
    for index, d in enumerate(digests):
        members[int(d)].append(index)
    by_value: dict[str, list[int]] = {}
    for indices in members.values():
        text = _broadcast_text(value if me == indices[0] else "", ranks[indices[0]], group)
        by_value[text] = [ranks[i] for i in indices]
    return by_value


def _posted(value: str, ranks: Sequence[int], name: str, seconds: float
            ) -> tuple[dist.Store, list[str], list[int]]:
    """Post this rank's ``value`` under ``name`` in the rendezvous store, and wait at most
    ``seconds`` for every rank of ``ranks`` to post theirs: the store, the ranks' keys, and
    the ranks that had not posted by then (empty when all came)."""
    store = _torch_compat.default_store()
    prefix = f"devmesh/posted/{name}/"
    store.set(prefix + str(dist.get_rank()), value)
    keys = [prefix + str(rank) for rank in ranks]
    try:
        store.wait(keys, datetime.timedelta(seconds=seconds))
    except Exception:  # noqa: BLE001 - the store's timeout (DistStoreError, RuntimeError)
        return store, keys, [rank for rank, key in zip(ranks, keys,
                                                       strict=True) if not store.check([key])]
    return store, keys, []


def texts_through_store(text: str, ranks: Sequence[int], name: str, *, seconds: float
                        ) -> tuple[dict[int, str], list[int]]:
    """Every rank of ``ranks``'s ``text`` through the rendezvous store, waiting at most
    ``seconds`` for them: ``({rank: text}, [])``, or ``({}, ranks that never posted one)``.
    For an exchange a user may call on one rank by mistake (``if rank == 0:
    print(describe(runner))``), where a collective would wait for the process group's
    timeout, 30 minutes by default. ``name`` keys it: the same on every rank, new for each
    exchange (a caller that retries a failed exchange may reuse its name: a failed one
    leaves nothing behind). Text, not pickles: nothing read from the store is unpickled."""
    store, keys, missing = _posted(text, ranks, name, seconds)
    if missing:  # the exchange failed: take this rank's text back, so the next exchange
        # under the same name (a call refused does not count) cannot read it as new
        store.delete_key(keys[list(ranks).index(dist.get_rank())])
        return {}, missing
    return {rank: store.get(key).decode(errors="replace") for rank, key in zip(ranks, keys,
                                                                               strict=True)}, []


#: How long :func:`warn_if_called_alone` waits before it warns.
ALONE_SECONDS = 60.0


def warn_if_called_alone(what: str, ranks: Sequence[int] | None = None, *,
                         seconds: float | None = None,
                         timeout: datetime.timedelta | None = None) -> None:
    """Before the collectives of ``what`` (a call users make inside ``if rank == 0:``, the
    way torch code saves and prints): each rank of ``ranks`` (default: the world) posts its
    arrival in the rendezvous store and waits for the others' up to ``seconds``
    (:data:`ALONE_SECONDS`, or half the timeout where that is shorter); ranks missing then
    are named in a :class:`~devmesh.errors.WaitingForRanksWarning`, and the wait goes on —
    a rank only late (evaluating alone first) still joins — until ``timeout`` (the default
    group's, as the call's collectives would wait) has passed since the call: then
    :class:`~devmesh.errors.CollectiveTimeoutError` names the ranks that never called it,
    before any collective is entered (none is left posted). Costs one store round trip when
    every rank comes."""
    import warnings

    from devmesh.errors import CollectiveTimeoutError, WaitingForRanksWarning
    from devmesh.layout import format_ranks

    if not dist.is_initialized():
        return
    ranks = tuple(range(dist.get_world_size())) if ranks is None else tuple(ranks)
    if len(ranks) < 2:
        return
    calls = groups.world_cache()
    number = calls[("arrivals", what, ranks)] = calls.get(("arrivals", what, ranks), 0) + 1
    limit = (timeout or groups.timeout_of(None)).total_seconds()
    patience = min(ALONE_SECONDS if seconds is None else seconds, limit / 2)
    name = f"{what} on {format_ranks(list(ranks))} #{number}"
    _, _, missing = _posted("", ranks, name, patience)
    if not missing:
        return
    warnings.warn(
        f"{what} is a collective over ranks {format_ranks(list(ranks))}, and "
        f"{_ranks_have(missing)} not called it in {patience:g} s: if it runs "
        "inside `if rank == 0:`, call it on every rank and save or print on one. "
        "Waiting on, until the timeout names them", WaitingForRanksWarning,
        stacklevel=3)
    store, keys, missing = _posted("", ranks, name, limit - patience)
    if missing:  # take this rank's arrival back: a rank coming later must not take it as
        # company and enter the collectives alone; it waits and raises in turn
        with contextlib.suppress(Exception):
            store.delete_key(keys[ranks.index(dist.get_rank())])
        raise CollectiveTimeoutError(
            f"{what} is a collective over ranks {format_ranks(list(ranks))}, and "
            f"{_ranks_have(missing)} not called it within the timeout ({limit:g} s): they "
            "are elsewhere in their code, or exited. If it runs inside `if rank == 0:`, "
            "call it on every rank and save or print on one",
            missing=list(missing), waited=[r for r in ranks if r not in missing])


def _ranks_have(ranks: Sequence[int]) -> str:
    """``rank 1 has`` / ``ranks 1-3 have``."""
    from devmesh.layout import format_ranks

    return (f"rank {ranks[0]} has" if len(ranks) == 1
            else f"ranks {format_ranks(list(ranks))} have")


def _broadcast_text(text: str, src: int, group: dist.ProcessGroup | None) -> str:
    """Global rank ``src``'s ``text`` on every rank of ``group``: its length, then its bytes
    (nothing unpickled)."""
    data = text.encode()
    device = small_tensor_device(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    buffer = torch.zeros(int(length), dtype=torch.uint8, device=device)
    if dist.get_rank() == src:
        buffer[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if int(length):
        dist.broadcast(buffer, src=src, group=group)
    return buffer.cpu().numpy().tobytes().decode(errors="replace")
