"""An opt-in recorder of every rank's collectives, for hangs in collectives devmesh does not
issue: a user's own ``dist.all_reduce``, torch's DTensor and FSDP, any backend.

More than half of real collective timeouts are ranks that diverged — one rank skipped a
collective or called another one — not the network; gloo then says only ``Timed out waiting
1800000ms`` (or ``Connection closed by peer``) on the rank that waited, and nothing on the
one that went elsewhere. torch's Flight Recorder keeps such records for NCCL only.

Turned on by ``devmesh run --trace-collectives`` or ``DEVMESH_TRACE_COLLECTIVES=1`` (read when
``devmesh`` is imported, so ``torchrun`` works too), each rank records its last
:data:`KEEP` collectives — operation, the group's ranks, its number on that group (the
sequence every rank of the group runs in the same order), shapes, and the user's source line
(the first frame outside torch and devmesh) — by wrapping ``torch.distributed``'s collective
functions and its functional collectives (DTensor's).

When a recorded collective fails with a timeout or a peer gone, its rank asks every rank for
its records through the rendezvous store (a daemon thread on each rank answers, and a rank
that exits posts its records on the way out), compares them group by group, and raises
:class:`~devmesh.errors.CollectiveTimeoutError` naming the divergence: the first number at
which the ranks of a group called different collectives, or from different lines, and which
ranks never called the collective the others wait in::

    all_reduce #6 over ranks [0, 1] at train.py:12 broke off ...
    ranks [0, 1] diverged at collective #4: rank 0 called all_reduce at train.py:12
    ((4,) float32); rank 1 called all_reduce at train.py:10 ((4,) float32)
    rank 0 waits in all_reduce #6 at train.py:12; rank 1 never called #6 (its last: #5,
    all_reduce at train.py:10; it exited)

Cost: a few microseconds of Python per collective (``bench/trace_collectives.py``), nothing
when off.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import inspect
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["VARIABLE", "KEEP", "install", "uninstall", "installed", "install_from_environment",
           "records", "note", "carrying", "compare"]

VARIABLE = "DEVMESH_TRACE_COLLECTIVES"
KEEP = 64  # records kept per rank
#: How long a rank whose collective failed waits for the others' records.
ANSWER_SECONDS = 5.0
_POLL_SECONDS = 0.5
_JOIN_SECONDS = 2.0  # at exit, for a listener in a store call (a store that went away)
_PREFIX = "devmesh/trace/"

# torch.distributed's collectives and point-to-point calls: a rank that skips one hangs others
_C10D = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
         "reduce_scatter_tensor", "broadcast", "barrier", "all_to_all", "all_to_all_single",
         "reduce", "gather", "scatter", "all_gather_object", "broadcast_object_list",
         "gather_object", "scatter_object_list", "monitored_barrier", "send", "recv")
# torch's functional collectives (DTensor's redistributions go through these)
# (names differ between torch releases: those present are wrapped)
_FUNCTIONAL = ("all_reduce", "broadcast", "all_gather_tensor", "all_gather_tensor_autograd",
               "all_gather_single", "all_gather_single_autograd", "reduce_scatter_tensor",
               "reduce_scatter_tensor_autograd", "reduce_scatter_single",
               "reduce_scatter_single_autograd", "all_to_all_single",
               "all_to_all_single_autograd", "all_reduce_coalesced",
               "all_gather_into_tensor_coalesced", "all_gather_single_coalesced",
               "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced",
               "permute_tensor")


@dataclass
class Record:
    """One collective as this rank called it."""

    op: str
    group: tuple[int, ...]  # the group's global ranks
    seq: int  # its number among this rank's collectives on that group, from 1
    shapes: str  # the first tensor's shape and dtype, e.g. "(4,) float32"
    where: str  # the user's source line, "train.py:42"
    state: str = "running"  # running, done, failed (async and functional ones: issued)


_lock = threading.Lock()
_records: collections.deque[Record] = collections.deque(maxlen=KEEP)
_counts: dict[tuple[int, ...], int] = {}
_noted: dict[str, int] = {}  # the collectives of :func:`note`, by operation
_originals: list[tuple[Any, str, Callable]] = []
_store: Any = None
_listener: threading.Thread | None = None
_listening_ends = threading.Event()
_posted = False


def installed() -> bool:
    return bool(_originals)


def records() -> list[Record]:
    """This rank's recorded collectives, oldest first."""
    with _lock:
        return list(_records)


def note(op: str, shapes: str) -> Record | None:
    """Record a collective devmesh issues on a process-group object of its own, outside
    ``torch.distributed``'s functions (the replica groups' all-reduces across groups, over a
    group made for each quorum): it shows among this rank's records, numbered on its own,
    and its caller sets its ``state`` (``shapes``: what it moves, in words). Such records
    name no ranks of this job's world (the groups are worlds of their own), so a hang
    report compares no ranks over them. ``None`` while the recorder is off."""
    if not _originals:
        return None
    with _lock:
        seq = _noted[op] = _noted.get(op, 0) + 1  # counted apart from any group of ranks
        record = Record(op, (), seq, shapes, _user_line())
        _records.append(record)
    return record


def install() -> None:
    """Record every collective this process calls from now on (idempotent)."""
    if _originals:
        return
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name in _C10D:
        original = getattr(c10d, name, None)
        if original is None:
            continue
        wrapped = _wrap(name, original, _group_finder(original))
        for module in (c10d, dist):
            if getattr(module, name, None) is original:
                _originals.append((module, name, original))
                setattr(module, name, wrapped)
    from devmesh import _torch_compat

    funcol = _torch_compat.functional_collectives()
    for name in _FUNCTIONAL:
        original = getattr(funcol, name, None)
        if original is not None:
            _originals.append((funcol, name, original))
            setattr(funcol, name, _wrap(name, original, _group_finder(original),
                                        functional=True))
    if hasattr(funcol, "wait_tensor"):
        _originals.append((funcol, "wait_tensor", funcol.wait_tensor))
        funcol.wait_tensor = _wrap_wait(funcol.wait_tensor)
    atexit.register(_post_at_exit)


def uninstall() -> None:
    """Stop recording; the records so far stay readable."""
    while _originals:
        module, name, original = _originals.pop()
        setattr(module, name, original)


def install_from_environment() -> None:
    """:func:`install` when ``DEVMESH_TRACE_COLLECTIVES`` is set to 1 (or true, yes)."""
    if os.environ.get(VARIABLE, "").strip().lower() in ("1", "true", "yes"):
        install()


def _group_finder(fn: Callable) -> Callable[[tuple, dict], Any]:
    """Where ``fn`` takes its group: a keyword, or a position."""
    names = list(inspect.signature(fn).parameters)
    index = names.index("group") if "group" in names else None

    def find(args: tuple, kwargs: dict) -> Any:
        if "group" in kwargs:
            return kwargs["group"]
        if index is not None and index < len(args):
            return args[index]
        return None
    return find


# process groups seen, by id, with the group itself held (so its id is never reused)
_ranks_cache: dict[int, tuple[Any, tuple[int, ...]]] = {}


def _ranks_of(group: Any) -> tuple[int, ...]:
    """The global ranks of a process group (``None``: the world), a rank list, or a
    functional collective's group (a mesh, a (mesh, dim) pair, a group name)."""
    import torch.distributed as dist

    if isinstance(group, (list, tuple)) and all(isinstance(r, int) for r in group):
        return tuple(group)
    if group is None:
        group = dist.group.WORLD
    found = _ranks_cache.get(id(group))
    if found is not None and found[0] is group:
        return found[1]
    try:
        if isinstance(group, dist.ProcessGroup):
            ranks = tuple(dist.get_process_group_ranks(group))
        else:  # a mesh, (mesh, dim) or a group name: resolve as torch's functional API does
            from devmesh import _torch_compat

            pg = _torch_compat.resolve_group(group)
            ranks = tuple(dist.get_process_group_ranks(pg))
    except Exception:  # noqa: BLE001 - a group it cannot name is recorded as unknown
        return ()
    if isinstance(group, dist.ProcessGroup):  # long-lived; a (mesh, dim) pair is made anew
        _ranks_cache[id(group)] = (group, ranks)
    return ranks


_SKIP: tuple[str, ...] = ()


def _user_line() -> str:
    """``file:line`` of the first frame outside torch and devmesh (and ``runpy``, which
    runs a script): where the user's code called the collective."""
    global _SKIP
    if not _SKIP:
        import runpy

        import torch

        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # devmesh/
        _SKIP = (os.path.dirname(torch.__file__) + os.sep, package + os.sep, runpy.__file__,
                 "<frozen ")
    frame = sys._getframe(2)
    while frame is not None:
        if not frame.f_code.co_filename.startswith(_SKIP):
            return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _shapes(args: tuple, kwargs: dict) -> str:
    import torch

    for value in list(args) + list(kwargs.values()):
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            value = value[0]
        if isinstance(value, torch.Tensor):
            return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return ""


_inside = threading.local()  # a recorded call in progress on this thread
_carried = threading.local()  # the collective devmesh's calls on this thread make (carrying)


@contextlib.contextmanager
def carrying(op: str) -> Iterator[None]:
    """Record the collectives called inside as parts of ``op``: devmesh's all-reduce over
    gloo, made of all-to-all exchanges (:mod:`~devmesh.distributed.exchange`), shows as
    ``all_reduce (as all_to_all_single)``, the collective the user's code asked for first.
    The outermost ``op`` names nested ones."""
    if getattr(_carried, "op", None) is not None:
        yield
        return
    _carried.op = op
    try:
        yield
    finally:
        _carried.op = None


def _wrap(name: str, original: Callable, find_group: Callable, *,
          functional: bool = False) -> Callable:
    @functools.wraps(original)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "call", False):  # torch's collectives calling each other
            return original(*args, **kwargs)
        group = _ranks_of(find_group(args, kwargs))
        carried = getattr(_carried, "op", None)
        op = name if carried is None else f"{carried} (as {name})"
        with _lock:
            seq = _counts[group] = _counts.get(group, 0) + 1
            record = Record(op, group, seq, _shapes(args, kwargs), _user_line())
            _records.append(record)
        _start_listener()
        _inside.call = True
        try:
            result = original(*args, **kwargs)
        except RuntimeError as exc:
            record.state = "failed"
            raise _explained(record, exc) from exc
        finally:
            _inside.call = False
        record.state = "issued" if functional or hasattr(result, "wait") else "done"
        return result
    recorded.__devmesh_traced__ = True  # type: ignore[attr-defined]
    return recorded


def _wrap_wait(original: Callable) -> Callable:
    """The wait of a functional collective (DTensor's): where a timeout surfaces. It does not
    say which collective it waits for; the latest one issued and not yet waited for is taken
    (a redistribution waits for each collective right after issuing it)."""
    @functools.wraps(original)
    def waited(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except RuntimeError as exc:
            with _lock:
                pending = [r for r in _records if r.state == "issued"]
            if not pending:
                raise
            record = pending[-1]
            record.state = "failed"
            raise _explained(record, exc) from exc
    return waited


# -- asking the other ranks ---------------------------------------------------------------------
def _default_store() -> Any:
    global _store
    if _store is None:
        import torch.distributed as dist

        if dist.is_initialized():
            from devmesh import _torch_compat

            _store = _torch_compat.default_store()
    return _store


def _start_listener() -> None:
    """A daemon thread that posts this rank's records when another rank asks for them."""
    global _listener
    if _listener is not None or _default_store() is None:
        return
    _listener = threading.Thread(target=_listen, name="devmesh-trace", daemon=True)
    _listener.start()


def _listen() -> None:
    store = _store
    while not _listening_ends.wait(_POLL_SECONDS):
        try:
            if store.check([_PREFIX + "request"]):
                _post(exited=False)
                return
        except Exception:  # noqa: BLE001 - the store went away: nobody will ask
            return


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _post(*, exited: bool) -> None:
    global _posted
    store = _store
    if store is None or _posted:
        return
    payload = {"rank": _rank(), "exited": exited, "records": [asdict(r) for r in records()]}
    store.set(_PREFIX + str(_rank()), json.dumps(payload))
    _posted = True


def _stop_listener() -> None:
    """End the listener before the interpreter does: CPython ends a daemon thread that is
    inside a store call at shutdown with ``pthread_exit``, which unwinds through torch's C++
    frames and aborts the process (SIGABRT, "terminate called without an active
    exception") after its work is done."""
    _listening_ends.set()
    if _listener is not None:
        _listener.join(timeout=_JOIN_SECONDS)


def _post_at_exit() -> None:
    _stop_listener()
    try:
        _post(exited=True)
    except Exception:  # noqa: BLE001 - the store's server exited first: nothing to tell
        pass


def _gather(world: int) -> dict[int, dict]:
    """Every rank's posted records that arrive within :data:`ANSWER_SECONDS`."""
    store = _store
    store.set(_PREFIX + "request", "1")
    _post(exited=False)
    keys = {r: _PREFIX + str(r) for r in range(world)}
    deadline = time.monotonic() + ANSWER_SECONDS
    found: dict[int, dict] = {}
    while time.monotonic() < deadline and len(found) < world:
        for r, key in keys.items():
            if r not in found and store.check([key]):
                found[r] = json.loads(store.get(key))
        time.sleep(0.05)
    return found


def _explained(record: Record, exc: RuntimeError) -> BaseException:
    """For a timeout or a peer gone: a CollectiveTimeoutError naming the divergence."""
    from devmesh.distributed.timeouts import is_timeout
    from devmesh.errors import CollectiveTimeoutError, is_peer_gone

    if not (is_timeout(exc) or is_peer_gone(exc)) or _store is None:
        return exc
    try:
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else len(record.group)
        posted = _gather(world)
    except Exception:  # noqa: BLE001 - no store: torch's error as it was
        return exc
    report, missing = compare(posted, record)
    waited = sorted(r for r in record.group if r not in missing)
    return CollectiveTimeoutError(
        f"{record.op} #{record.seq} over ranks {list(record.group)} at {record.where} "
        f"{'timed out' if is_timeout(exc) else 'broke off'} ({str(exc).splitlines()[0]}). "
        f"The ranks' collective records ({VARIABLE}):\n{report}",
        missing=missing, waited=waited)


def compare(posted: dict[int, dict], failed: Record) -> tuple[str, list[int]]:
    """The report on the ranks' records (``posted``: rank -> its post) around ``failed``, and
    the ranks that never called it: per group, the first collective number at which the
    ranks disagree (another operation or another source line), then who waits where."""
    by_rank = {r: [Record(**{**x, "group": tuple(x["group"])}) for x in p["records"]]
               for r, p in posted.items()}
    lines = []
    groups = sorted({rec.group for recs in by_rank.values() for rec in recs if rec.group})
    for group in groups:
        seqs: dict[int, dict[int, Record]] = collections.defaultdict(dict)
        for r in group:
            for rec in by_rank.get(r, ()):
                if rec.group == group:
                    seqs[rec.seq][r] = rec
        for seq in sorted(seqs):
            calls = seqs[seq]
            if len(calls) > 1 and len({(c.op, c.where) for c in calls.values()}) > 1:
                said = "; ".join(f"rank {r} called {c.op} at {c.where} ({c.shapes})"
                                 for r, c in sorted(calls.items()))
                lines.append(f"ranks {list(group)} diverged at collective #{seq}: {said}")
                break
    missing = []
    waiting = [r for r in failed.group if r in by_rank and any(
        rec.group == failed.group and rec.seq == failed.seq and rec.state != "done"
        for rec in by_rank[r])]
    for r in failed.group:
        mine = [rec for rec in by_rank.get(r, ()) if rec.group == failed.group]
        at = next((rec for rec in mine if rec.seq == failed.seq), None)
        if r not in by_rank:
            missing.append(r)
            lines.append(f"rank {r} did not answer (stuck in native code, or gone)")
        elif at is None:
            missing.append(r)
            last = f"#{mine[-1].seq}, {mine[-1].op} at {mine[-1].where}" if mine else "none"
            now = "it exited" if posted[r].get("exited") else "it is elsewhere in its code"
            lines.append(f"rank {r} never called #{failed.seq} on ranks {list(failed.group)} "
                         f"(its last there: {last}; {now})")
        elif r in waiting:
            lines.append(f"rank {r} waits in {at.op} #{at.seq} at {at.where} ({at.shapes})")
        else:
            lines.append(f"rank {r} ran {at.op} #{at.seq} at {at.where}")
    return "\n".join(lines), missing
