"""Process groups: created once per distinct rank list, shared by every mesh that needs them.

A communicator is expensive (NCCL: a connection per peer and GPU memory; gloo: a TCP mesh), so
devmesh creates one per distinct ``(ranks, backend, timeout)`` and hands the same object to
every mesh, sub-mesh and flattened view that asks for it. Slicing a mesh therefore never
creates a group.

Creation is cheap where it can be: only the members of a group take part in creating it
(``new_group(..., use_local_synchronization=True)``), and when the default group is bound to
a device (NCCL with ``device_id``) all groups of one mesh dimension come from a single
communicator split.

This module also holds the agreement check that turns "ranks passed different meshes" from a
silent hang into an error naming the ranks, within a bounded time.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence

import torch.distributed as dist
from torch.distributed import ProcessGroup

from devmesh import _torch_compat
from devmesh.errors import MeshMismatchError, MeshTimeoutError, MeshUsageError
from devmesh.layout import format_ranks

__all__ = [
    "GroupKey",
    "get_group",
    "create_dim_groups",
    "register_group",
    "created_count",
    "reused_count",
    "check_agreement",
    "as_timedelta",
    "reset",
]

# ranks, backend name, timeout, backend options (torch's ``Backend.Options``, by identity),
# and a purpose (a group of its own for one job, so its collectives never queue behind others)
GroupKey = tuple[tuple[int, ...], "str | None", "datetime.timedelta | None", object, "str | None"]

DEFAULT_AGREEMENT_TIMEOUT = datetime.timedelta(seconds=300)


_generations = itertools.count()


class _Cache:
    """Groups of the current world. Rebuilt when the default process group changes."""

    def __init__(self, world: object) -> None:
        self.world = world
        self.generation = next(_generations)
        self.groups: dict[GroupKey, ProcessGroup] = {}
        self.created = 0
        self.reused = 0  # asks answered from the cache (logged: groups created or reused)
        self.agreements = itertools.count()
        self.hosts = None  # host index of every rank, once gathered
        self.host_published = False  # this rank posted its host index in this world
        self.private: dict[str, ProcessGroup] = {}  # whole-world groups of one purpose each
        self.derived: dict[tuple, object] = {}  # what other modules derive from these groups


_cache: _Cache | None = None


def _current() -> _Cache:
    global _cache
    world = _torch_compat.default_group() if dist.is_initialized() else None
    if _cache is None or _cache.world is not world:
        _cache = _Cache(world)
    return _cache


def generation() -> int:
    """A number that changes whenever the world (default process group) changes: caches of
    anything derived from groups key on it."""
    return _current().generation


def world_cache() -> dict[tuple, object]:
    """A dict that lives as long as the current world: for caches of things derived from its
    groups, which must go with the world (a module-level cache would keep every earlier
    world's process groups, and their gloo threads and sockets, alive)."""
    return _current().derived


def reset() -> None:
    """Forget every cached group (call after ``destroy_process_group``)."""
    global _cache
    _cache = None


def as_timedelta(timeout: float | datetime.timedelta | None) -> datetime.timedelta | None:
    """Accept seconds or a ``timedelta``, as torch users pass either."""
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be positive seconds or a timedelta, got {timeout!r}")
    return datetime.timedelta(seconds=float(timeout))


def _key(ranks: Sequence[int], backend: str | None, timeout: datetime.timedelta | None,
         options: object = None, purpose: str | None = None) -> GroupKey:
    return (tuple(sorted(int(r) for r in ranks)), backend, timeout, options, purpose)


def created_count() -> int:
    """How many process groups devmesh created in this world (tests assert on it)."""
    return _current().created


def reused_count() -> int:
    """How many times a group was asked for and found already made, in this world."""
    return _current().reused


def register_group(
    group: ProcessGroup, *, backend: str | None = None, timeout: datetime.timedelta | None = None
) -> None:
    """Adopt an existing group (``from_group``, ``from_torch``) so meshes reuse it."""
    ranks = dist.get_process_group_ranks(group)
    _current().groups.setdefault(_key(ranks, backend, timeout), group)


def _is_world(ranks: tuple[int, ...]) -> bool:
    return len(ranks) == dist.get_world_size() and ranks == tuple(range(len(ranks)))


#: why communicating must not happen now (inside ``consensus.batched``: a rank whose checks
#: failed has left its block, and would never meet a collective the others entered)
_silent: str | None = None


@contextlib.contextmanager
def silent(reason: str) -> Iterator[None]:
    """Refuse, while inside, any collective or process-group creation of devmesh's, with
    ``reason`` as the fix (:func:`refuse_communication`)."""
    global _silent
    previous, _silent = _silent, reason
    try:
        yield
    finally:
        _silent = previous


def refuse_communication(what: Callable[[], str]) -> None:
    """Raise :class:`~devmesh.errors.MeshUsageError` naming ``what()`` if communication is
    refused now (:func:`silent`), instead of a collective some ranks never join. ``what``
    is called only then: every collective asks, and describing one costs a join of names.
    Otherwise settle the agreements held back (:func:`hold_until_communicating`) first."""
    if _silent is not None:
        raise MeshUsageError(f"{what()} communicates, and {_silent}")
    settle_held()


#: the agreements this rank holds back, to settle before its next communication: the
#: world's generation they were held in, and the function settling them
_held: tuple[int, Callable[[], None]] | None = None


def hold_until_communicating(settle: Callable[[], None]) -> None:
    """Call ``settle`` before this rank's next communication of devmesh's in this world (a
    collective, an agreement, a process group made): checks of calls that do not
    communicate (a model's ``fully_shard`` calls) are then made together, and still before
    any collective that a rank refused there would never join."""
    global _held
    _held = (generation(), settle)


def settle_held() -> None:
    """Run the settling function held (once), if it was held in this world."""
    global _held
    if _held is None:
        return
    (held_in, settle), _held = _held, None
    if held_in == generation():  # a world destroyed since has nothing left to settle
        settle()


def get_group(
    ranks: Sequence[int],
    *,
    backend: str | None = None,
    timeout: datetime.timedelta | None = None,
    desc: str = "devmesh",
    options: object = None,
    purpose: str | None = None,
) -> ProcessGroup | None:
    """The group over ``ranks`` (created on first use, by the members only); ``None`` if this
    rank is not a member. Every member must call it, non-members need not. ``options`` are
    torch's backend options (``backend_override``'s ``(name, options)``): a group made with
    them is shared only by meshes given the same options object. ``purpose`` names a group
    of its own over the same ranks, for collectives that must not share a queue with the
    others (they may run while a user's hook issues collectives on the usual group)."""
    cache = _current()
    key = _key(ranks, backend, timeout, options, purpose)
    if dist.get_rank() not in key[0]:
        return None
    group = cache.groups.get(key)
    if group is not None:
        cache.reused += 1
        return group
    if (_is_world(key[0]) and backend is None and timeout is None and options is None
            and purpose is None):
        group = dist.group.WORLD
    else:
        refuse_communication(lambda: f"making the process group of ranks "
                                     f"{format_ranks(key[0])}")
        group = dist.new_group(
            list(key[0]),
            timeout=timeout,
            backend=backend,
            pg_options=options,
            use_local_synchronization=True,
            group_desc=desc,
        )
        cache.created += 1
    assert group is not None
    cache.groups[key] = group
    return group


def private_world_group(purpose: str) -> ProcessGroup:
    """A gloo group over the whole world used for ``purpose`` only (e.g. a background
    checkpoint writer agreeing on its outcome), so its collectives never interleave with the
    training's collectives on other groups, even from another thread. Collective on first use:
    every rank must ask for it, in the same order as for its other groups."""
    cache = _current()
    group = cache.private.get(purpose)
    if group is None:
        group = dist.new_group(list(range(dist.get_world_size())), backend="gloo",
                               group_desc=f"devmesh-{purpose}")
        assert group is not None
        cache.private[purpose] = group
        cache.created += 1
    return group


def _can_split() -> bool:
    world = _torch_compat.default_group()
    return getattr(world, "bound_device_id", None) is not None


def create_dim_groups(
    rows: Sequence[Sequence[int]],
    *,
    backend: str | None = None,
    timeout: datetime.timedelta | None = None,
    desc: str = "devmesh",
    options: object = None,
) -> ProcessGroup | None:
    """Create (or reuse) the groups of one mesh dimension; return this rank's group.

    ``rows`` are all the groups of the dimension. When the rows partition the whole world,
    the default group is bound to a device, and none of the rows exists yet, one
    ``split_group`` call creates them all (``ncclCommSplit``); otherwise each rank creates
    only its own row, with its members.
    """
    cache = _current()
    keys = [_key(row, backend, timeout, options) for row in rows]
    me = dist.get_rank()
    mine = next((k for k in keys if me in k[0]), None)
    if mine is None:
        return None
    if mine in cache.groups:
        return cache.groups[mine]
    covered = sum(len(k[0]) for k in keys)
    if (
        _can_split()
        and backend is None
        and options is None
        and covered == dist.get_world_size()
        and not any(k in cache.groups for k in keys)
    ):
        group = dist.split_group(
            split_ranks=[list(k[0]) for k in keys], timeout=timeout, group_desc=desc
        )
        if group is not None:
            cache.created += 1
            cache.groups[mine] = group
            return group
    return get_group(mine[0], backend=backend, timeout=timeout, desc=desc, options=options)


def check_agreement(
    what: str, payload: str, *, timeout: datetime.timedelta | None = None
) -> None:
    """Check that every rank of the world passed the same ``payload`` for ``what``.

    Each rank posts its payload to the default store and waits (at most ``timeout``) for the
    others. Ranks that passed different values raise :class:`MeshMismatchError` listing which
    ranks passed what; ranks that never arrive are named in a :class:`MeshTimeoutError`.
    Skipped for a one-rank world and for torch's single-process ``fake`` backend.
    """
    world_size = dist.get_world_size()
    if world_size == 1 or dist.get_backend() == "fake":
        return
    timeout = timeout or DEFAULT_AGREEMENT_TIMEOUT
    store = _torch_compat.default_store()
    sequence = next(_current().agreements)
    prefix = f"devmesh/agree/{sequence}/"
    me = dist.get_rank()
    store.set(prefix + str(me), payload)
    keys = [prefix + str(r) for r in range(world_size)]
    previous_timeout = store.timeout
    store.set_timeout(timeout)
    try:
        raw = store.multi_get(keys)  # one round trip; blocks until every rank has posted
    except Exception:  # DistStoreError / RuntimeError: which ranks are missing?
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise MeshTimeoutError(
            f"{what}: rank(s) {format_ranks(missing)} did not arrive within "
            f"{timeout.total_seconds():g} s. Every rank of the world must create the same "
            "meshes in the same order; check that those ranks are alive and run the same code "
            "(and pass timeout= to wait longer)"
        ) from None
    finally:
        store.set_timeout(previous_timeout)
    values = [v.decode() for v in raw]
    if len(set(values)) > 1:
        by_value: dict[str, list[int]] = defaultdict(list)
        for rank, value in enumerate(values):
            by_value[value].append(rank)
        lines = [f"  ranks {format_ranks(ranks)}: {value}" for value, ranks in by_value.items()]
        raise MeshMismatchError(
            f"{what}: ranks disagree on the mesh; every rank must pass the same arguments.\n"
            + "\n".join(lines)
        )


def publish_host() -> None:
    """Post this rank's host index (once per world), so that :func:`world_hosts` is one store
    round trip. Mesh creation calls it on every rank."""
    cache = _current()
    if cache.host_published or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return
    _publish_host(_torch_compat.default_store())
    cache.host_published = True


def _publish_host(store) -> None:
    from devmesh.distributed.env import host_index

    store.set(f"devmesh/host/{dist.get_rank()}", str(host_index()))


def world_hosts():
    """The host index of every rank of the world (numpy array), gathered once per world.

    Every rank posts its host when it first creates a mesh, so after any mesh creation this
    is one store round trip; otherwise it waits until every rank has called it.
    """
    import numpy as np

    cache = _current()
    if cache.hosts is None:
        world_size = dist.get_world_size()
        if world_size == 1 or dist.get_backend() == "fake":
            from devmesh.distributed.env import host_index

            cache.hosts = np.full(world_size, host_index())
        else:
            store = _torch_compat.default_store()
            _publish_host(store)
            keys = [f"devmesh/host/{r}" for r in range(world_size)]
            cache.hosts = np.array([int(v) for v in store.multi_get(keys)])
    return cache.hosts


#: torch's default for a process group made without ``timeout=``.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def timeout_of(group: ProcessGroup | None = None) -> datetime.timedelta:
    """The timeout ``group``'s collectives run under (the default group's for ``None``), read
    from its CPU backend's options; torch's 30-minute default where they cannot be read."""
    import torch
    import torch.distributed as dist

    try:
        pg = group if group is not None else dist.group.WORLD
        timeout = pg._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return DEFAULT_TIMEOUT
    return timeout if isinstance(timeout, datetime.timedelta) else DEFAULT_TIMEOUT
