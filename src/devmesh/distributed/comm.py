"""Every collective devmesh issues, counted per mesh dimension.

The tensor and parallel layers never call ``torch.distributed`` collectives directly: they call
these functions with a mesh and the mesh dims to communicate over. That gives one place to

* turn several mesh dims into one collective over their flattened group (the group of ranks
  that differ only in those coordinates, ordered major to minor as given), with the ordering
  fixed up when c10d's group order (sorted global ranks) differs from the mesh's;
* count calls and bytes per mesh dim (``with comm_stats() as stats``), so tests can assert
  communication volume and users can ask for it;
* number each group's collectives, so that a timeout names the ranks that never entered one
  (:mod:`~devmesh.distributed.timeouts`) and a wait gives up on a rank that said it stopped
  (:mod:`~devmesh.distributed.stops`).

Bytes are the collective's buffer size on one rank, as nccl-tests count them: the output of an
all-gather, the input of a reduce-scatter or all-to-all, the tensor of an all-reduce or
broadcast.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from devmesh._log import get_logger
from devmesh.distributed import groups, stops, timeouts
from devmesh.distributed.timeouts import AGREEMENTS, Watch

if TYPE_CHECKING:
    from devmesh.mesh import DeviceMesh

__all__ = [
    "CommStats",
    "comm_stats",
    "process_group",
    "refused_everywhere",
    "count_copy",
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "all_reduce_async",
    "all_gather_async",
    "Pending",
    "agree",
    "failures",
    "differing",
    "gather_texts",
    "mesh_device",
    "small_tensor_device",
    "send_async",
    "recv",
    "batch_p2p",
]

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN}


@dataclass
class CommStats:
    """Calls and bytes of every collective issued while the context was active.

    ``records[(collective, dims)] = [calls, bytes]`` where ``dims`` names the mesh dims the
    collective ran over (``"dp+tp"`` for one collective over the flattened group).
    """

    records: dict[tuple[str, str], list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    # bytes copied locally around collectives (packing, reordering, reassembling): what the
    # planner's traffic model predicts (devmesh.layout.traffic), so tests can compare the two
    copied: int = 0

    def add(self, collective: str, dims: str, nbytes: int) -> None:
        record = self.records[(collective, dims)]
        record[0] += 1
        record[1] += nbytes

    @property
    def calls(self) -> int:
        return sum(calls for calls, _ in self.records.values())

    @property
    def bytes(self) -> int:
        return sum(nbytes for _, nbytes in self.records.values())

    def by_collective(self) -> dict[str, tuple[int, int]]:
        out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for (collective, _), (calls, nbytes) in self.records.items():
            out[collective][0] += calls
            out[collective][1] += nbytes
        return {k: (v[0], v[1]) for k, v in out.items()}

    def __str__(self) -> str:
        lines = [f"{'collective':<16}{'mesh dims':<16}{'calls':>7}{'bytes':>14}"]
        for (collective, dims), (calls, nbytes) in sorted(self.records.items()):
            lines.append(f"{collective:<16}{dims:<16}{calls:>7}{nbytes:>14,}")
        lines.append(f"{'total':<32}{self.calls:>7}{self.bytes:>14,}")
        return "\n".join(lines)


_active: list[CommStats] = []


@contextlib.contextmanager
def comm_stats() -> Iterator[CommStats]:
    """Count every devmesh collective issued inside the ``with`` block (on this rank)."""
    stats = CommStats()
    _active.append(stats)
    try:
        yield stats
    finally:
        _active.remove(stats)


def count_copy(tensor: torch.Tensor) -> torch.Tensor:
    """Count ``tensor`` (a copy just made around a collective) in every active ``comm_stats``;
    returns it."""
    for stats in _active:
        stats.copied += tensor.numel() * tensor.element_size()
    return tensor


_log = get_logger("comm")


def _record(collective: str, mesh: DeviceMesh, dims: Sequence[int], nbytes: int) -> None:
    if _log.isEnabledFor(logging.DEBUG):  # DEVMESH_LOG=debug: every collective, as issued
        _log.debug("%s over %s (ranks %s): %d bytes", collective,
                   "+".join(mesh.layout.dim_name(d) for d in dims),
                   list(mesh.layout.group_of(mesh.get_rank(), tuple(dims))), nbytes)
    if not _active:
        return
    label = "+".join(mesh.layout.dim_name(d) for d in dims)
    for stats in _active:
        stats.add(collective, label, nbytes)


@dataclass(frozen=True)
class _Group:
    group: dist.ProcessGroup
    size: int
    ranks: tuple[int, ...]  # global ranks in mesh order
    # to_c10d[i] = position in c10d's (sorted) order of the i-th rank in mesh order
    to_c10d: tuple[int, ...] | None
    # from_c10d[j] = mesh-order index of the j-th rank in c10d order
    from_c10d: tuple[int, ...] | None


def _group(mesh: DeviceMesh, dims: Sequence[int], purpose: str | None = None) -> _Group:
    """This rank's group over ``dims`` (flattened, major to minor as given), cached;
    ``purpose``: a group of its own over those ranks (:func:`groups.get_group`)."""
    cache = groups.world_cache()
    key = ("comm.group", mesh.layout, mesh.get_rank(), tuple(dims), mesh.timeout, purpose)
    found = cache.get(key)
    if found is not None:
        return found
    ranks = mesh.layout.group_of(mesh.get_rank(), tuple(dims))
    # a dim with its own backend (backend_override) uses its group; otherwise, and for
    # several dims at once, the default backend's group over the ranks
    own = len(dims) == 1 and mesh.has_own_group(dims[0]) and purpose is None
    pg = mesh.get_group(dims[0]) if own else groups.get_group(
        ranks, timeout=mesh.timeout, purpose=purpose,
        desc=f"devmesh-{purpose}" if purpose else "devmesh")
    assert pg is not None
    ordered = sorted(ranks)
    if list(ranks) == ordered:
        result = _Group(pg, len(ranks), tuple(ranks), None, None)
    else:
        position = {r: j for j, r in enumerate(ordered)}
        to_c10d = tuple(position[r] for r in ranks)
        index = {r: i for i, r in enumerate(ranks)}
        result = _Group(pg, len(ranks), tuple(ranks), to_c10d, tuple(index[r] for r in ordered))
    cache[key] = result
    return result


def process_group(mesh: DeviceMesh, dims: Sequence[int], purpose: str | None = None
                  ) -> dist.ProcessGroup:
    """This rank's process group over ``dims`` of ``mesh`` (all of them: the mesh's ranks),
    for agreements that :func:`failures` and :func:`differing` run on a group; with
    ``purpose``, that purpose's own group over the same ranks (made now if new: every rank
    of the group must ask)."""
    return _group(mesh, tuple(dims), purpose).group


def _watch(collective: str, mesh: DeviceMesh, dims: Sequence[int], g: _Group) -> Watch:
    """Numbers this collective on its group; a timeout then names who never entered it."""
    stops.refuse_if_broken()
    return Watch(collective, g.ranks, lambda: "+".join(mesh.layout.dim_name(d) for d in dims))


def exchange_watch(what: str, mesh: DeviceMesh, dim: int | Sequence[int], *,
                   absent: str | None = None) -> Watch:
    """A watch over a run of point-to-point messages in which every rank along ``dim`` takes
    part (a pipeline step): each rank makes one per run, in the same order, and passes it to
    :func:`send_async` / :func:`recv_async` (and guards the run's closing collective with
    it). A message that times out then names the ranks that never timed out themselves: the
    one stuck in its own code (a stage's forward, say) or dead, not the neighbour that
    waited for it — every other rank ends up waiting, directly or down the chain. Several
    dims: a closing collective over all of them (``absent`` says what the ranks that never
    reached it were doing)."""
    stops.refuse_if_broken()
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    g = _group(mesh, dims)
    return Watch(what, g.ranks, lambda: "+".join(mesh.layout.dim_name(d) for d in dims),
                 absent=absent or "never timed out waiting for a message — they are stuck in "
                                  "their own code (a stage's forward or backward, the loss), "
                                  "or dead")


class Pending:
    """An asynchronous collective in flight; ``wait()`` returns its result (once computed).
    ``polled``: a collective on CPU tensors, whose wait gives up early when a rank of its
    group announced it stopped (:mod:`~devmesh.distributed.stops`); point-to-point messages
    are not (gloo closes a message's connection when a wait on it times out)."""

    def __init__(self, work, finish: Callable[[], torch.Tensor], watch: Watch | None = None,
                 *, polled: bool = False) -> None:
        self._work, self._finish, self._watch = work, finish, watch
        self._polled = polled
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            if self._work is not None:
                with self._watch.guard() if self._watch else contextlib.nullcontext():
                    stops.wait(self._work, self._watch, polled=self._polled)
                self._work = None
            self._result = self._finish()
        return self._result


# dtypes the collectives that only move data carry as their bytes: gloo knows no float8
# type ("Invalid scalar type"), and moving bytes needs none
_CARRIED_AS_BYTES = frozenset(
    dtype for dtype in (getattr(torch, name, None) for name in (
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"))
    if dtype is not None)


def _on_wire(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a broadcast, gather, all-to-all or message carries it: a float8 tensor
    as a ``uint8`` view of itself (what arrives in the view lands in the tensor)."""
    return tensor.view(torch.uint8) if tensor.dtype in _CARRIED_AS_BYTES else tensor


def all_gather(tensor: torch.Tensor, mesh: DeviceMesh, dims: Sequence[int]) -> torch.Tensor:
    """Gather ``tensor`` from every rank of the flattened group over ``dims``.

    Returns shape ``(k, *tensor.shape)`` with entry ``i`` from the ``i``-th rank in mesh order
    (``dims`` major to minor). Every rank must pass the same shape (pad uneven blocks).
    """
    return all_gather_async(tensor, mesh, dims).wait()


def all_gather_async(tensor: torch.Tensor, mesh: DeviceMesh, dims: Sequence[int]) -> Pending:
    """:func:`all_gather` started asynchronously (FSDP prefetches the next unit with it)."""
    g = _group(mesh, dims)
    if g.size == 1:
        return Pending(None, lambda: count_copy(tensor.unsqueeze(0).clone()))
    tensor = tensor.contiguous()
    out = torch.empty((g.size * tensor.numel(),), dtype=tensor.dtype, device=tensor.device)
    watch = _watch("all_gather", mesh, dims, g)
    with watch.guard():
        work = dist.all_gather_single(_on_wire(out), _on_wire(tensor.reshape(-1)),
                                       group=g.group, async_op=True)
    _record("all_gather", mesh, dims, out.numel() * out.element_size())

    def finish() -> torch.Tensor:
        stacked = out.view(g.size, *tensor.shape)
        return count_copy(stacked[list(g.to_c10d)]) if g.to_c10d is not None else stacked

    return Pending(work, finish, watch, polled=out.device.type == "cpu")


def reduce_scatter(
    stacked: torch.Tensor, mesh: DeviceMesh, dims: Sequence[int], op: str = "sum"
) -> torch.Tensor:
    """Reduce ``stacked`` (shape ``(k, *block)``, entry ``i`` for the ``i``-th rank in mesh
    order) over the group and return this rank's reduced block."""
    g = _group(mesh, dims)
    if g.size == 1:
        return count_copy(stacked[0].clone())
    if stacked.shape[0] != g.size:
        raise ValueError(f"reduce_scatter needs {g.size} blocks, got {stacked.shape[0]}")
    if g.from_c10d is not None:
        stacked = count_copy(stacked[list(g.from_c10d)])
    stacked = stacked.contiguous()
    out = torch.empty(stacked.shape[1:], dtype=stacked.dtype, device=stacked.device)
    watch = _watch("reduce_scatter", mesh, dims, g)
    with watch.guard():
        work = dist.reduce_scatter_single(out.view(-1), stacked.view(-1), op=_OPS[op],
                                          group=g.group, async_op=True)
        stops.wait(work, watch, polled=out.device.type == "cpu")
    _record("reduce_scatter", mesh, dims, stacked.numel() * stacked.element_size())
    if op == "avg":
        out /= g.size
    return out


def all_reduce(
    tensor: torch.Tensor, mesh: DeviceMesh, dims: Sequence[int], op: str = "sum"
) -> torch.Tensor:
    """All-reduce ``tensor`` in place over the flattened group of ``dims``; returns it."""
    return all_reduce_async(tensor, mesh, dims, op).wait()


def all_reduce_async(
    tensor: torch.Tensor, mesh: DeviceMesh, dims: Sequence[int], op: str = "sum",
    purpose: str | None = None,
) -> Pending:
    """Start an in-place all-reduce; overlap it with other work, then ``wait()``.
    ``purpose``: on that purpose's own group (see :func:`process_group`)."""
    g = _group(mesh, dims, purpose)
    if g.size == 1:
        return Pending(None, lambda: tensor)
    watch = _watch("all_reduce", mesh, dims, g)
    with watch.guard():
        work = dist.all_reduce(tensor, op=_OPS[op], group=g.group, async_op=True)
    _record("all_reduce", mesh, dims, _nbytes(tensor))

    def finish() -> torch.Tensor:
        if op == "avg":
            tensor.div_(g.size)
        return tensor

    return Pending(work, finish, watch, polled=tensor.device.type == "cpu")


def _nbytes(tensor: torch.Tensor) -> int:
    """The bytes a collective moves for ``tensor`` (a sparse one: its indices and values)."""
    if tensor.is_sparse:
        return _nbytes(tensor._indices()) + _nbytes(tensor._values())
    return tensor.numel() * tensor.element_size()


def all_to_all(
    chunks: Sequence[torch.Tensor], mesh: DeviceMesh, dims: Sequence[int],
    recv_shapes: Sequence[Sequence[int]],
) -> list[torch.Tensor]:
    """Send ``chunks[i]`` to the ``i``-th rank of the group (mesh order) and receive from each
    rank a block of the given shape; sizes may differ (uneven splits)."""
    g = _group(mesh, dims)
    if g.size == 1:
        return [count_copy(chunks[0].clone())]
    like = chunks[0]
    # One all_to_all_single over flat buffers: gloo's list all_to_all needs equal sizes,
    # all_to_all_single takes uneven splits on every backend.
    order = list(g.from_c10d) if g.from_c10d is not None else list(range(g.size))
    send = count_copy(_pack([chunks[i] for i in order]))
    recv_numels = [math.prod(recv_shapes[i]) for i in order]
    recv = torch.empty(sum(recv_numels), dtype=like.dtype, device=like.device)
    watch = _watch("all_to_all", mesh, dims, g)
    with watch.guard():
        work = dist.all_to_all_single(
            _on_wire(recv), _on_wire(send), output_split_sizes=recv_numels,
            input_split_sizes=[chunks[i].numel() for i in order], group=g.group, async_op=True)
        stops.wait(work, watch, polled=recv.device.type == "cpu")
    _record("all_to_all", mesh, dims, send.numel() * send.element_size())
    outputs: list[torch.Tensor] = [like] * g.size
    for i, piece in zip(order, torch.split(recv, recv_numels), strict=True):
        outputs[i] = piece.view(tuple(recv_shapes[i]))
    return outputs


def _pack(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """The pieces one after another in one flat buffer, each copied once (``torch.cat`` of
    ``reshape(-1)`` would copy a non-contiguous piece twice)."""
    out = torch.empty(sum(p.numel() for p in pieces), dtype=pieces[0].dtype,
                      device=pieces[0].device)
    offset = 0
    for piece in pieces:
        out[offset:offset + piece.numel()].view(piece.shape).copy_(piece)
        offset += piece.numel()
    return out


def broadcast(tensor: torch.Tensor, mesh: DeviceMesh, dims: Sequence[int], src_index: int = 0
              ) -> torch.Tensor:
    """Broadcast in place from the ``src_index``-th rank (mesh order) of the group."""
    g = _group(mesh, dims)
    if g.size == 1:
        return tensor
    watch = _watch("broadcast", mesh, dims, g)
    with watch.guard():
        work = dist.broadcast(_on_wire(tensor), src=g.ranks[src_index], group=g.group,
                              async_op=True)
        stops.wait(work, watch, polled=tensor.device.type == "cpu")
    _record("broadcast", mesh, dims, tensor.numel() * tensor.element_size())
    return tensor


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


# -- outcomes over a whole group (not a mesh): checkpoints agree on success this way ---------
def small_tensor_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the small tensors of devmesh's agreements (flags, digests, texts) go: the CPU
    when ``group`` has a CPU backend (gloo, or the ``cpu:gloo,cuda:nccl`` pair devmesh starts
    on GPUs), else the current accelerator — a group the user started as NCCL only takes
    no CPU tensors."""
    pg = group if group is not None else dist.group.WORLD
    kinds = sorted({device.type for device in pg._device_types})
    if not kinds or "cpu" in kinds:
        return torch.device("cpu")
    return torch.device(kinds[0], torch.get_device_module(kinds[0]).current_device())


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's tensors of ``mesh`` live on: the CPU, or the current device of
    the mesh's device type (the one ``init_device_mesh`` bound to the local rank)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type,
                        torch.get_device_module(mesh.device_type).current_device())


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
    stops.refuse_if_broken()
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

    error: Exception | None = None
    try:
        yield
    except error_type as exc:
        error = exc
    failed = failures(None if error is None else str(error).removeprefix(rank_prefix()),
                      group)
    if error is not None:
        raise error
    if failed:
        raise error_type(f"{what} {outcome} on other ranks — " + "; ".join(
            f"rank {rank}: {text}" for rank, text in sorted(failed.items())))


def differing(value: str, group: dist.ProcessGroup | None = None) -> dict[str, list[int]]:
    """``{value: ranks}`` if the ranks of ``group`` passed different values, else ``{}`` (the
    same on every rank): one all-reduce of a 63-bit digest and its negation (the largest and
    the smallest digest) when they agree; otherwise the
    lowest rank passing each distinct value broadcasts it (a pipeline's stages send one
    listing per stage, not one per rank)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return {}
    stops.refuse_if_broken()
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
    store = dist.distributed_c10d._get_default_store()
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


# -- point to point (pipeline stages): counted as "send" / "recv" over the mesh dim ----------
def _peer(mesh: DeviceMesh, dim: int, index: int) -> int:
    return _group(mesh, (dim,)).ranks[index]  # cached: a pipeline sends many messages


def send_async(tensor: torch.Tensor, mesh: DeviceMesh, dim: int, peer_index: int, tag: int,
               watch: Watch | None = None) -> Pending:
    """Start sending ``tensor`` to the ``peer_index``-th rank along mesh dim ``dim``; the
    caller keeps ``tensor`` alive until ``wait()``. ``watch``: see :func:`exchange_watch`."""
    g = _group(mesh, (dim,))
    tensor = tensor.contiguous()
    with watch.guard() if watch else contextlib.nullcontext():
        work = dist.isend(_on_wire(tensor), dst=_peer(mesh, dim, peer_index), group=g.group,
                          tag=tag)
    _record("send", mesh, (dim,), tensor.numel() * tensor.element_size())
    return Pending(work, lambda: tensor, watch)


def recv_async(shape: Sequence[int], dtype: torch.dtype, mesh: DeviceMesh, dim: int,
               peer_index: int, tag: int, device: torch.device | str = "cpu",
               watch: Watch | None = None) -> Pending:
    """Start receiving a tensor of ``shape`` and ``dtype`` on ``device`` (the sender's
    device type: NCCL sends CUDA tensors only) from the ``peer_index``-th rank along ``dim``;
    ``wait()`` returns it. ``watch``: see :func:`exchange_watch`."""
    g = _group(mesh, (dim,))
    buffer = torch.empty(tuple(shape), dtype=dtype, device=device)
    with watch.guard() if watch else contextlib.nullcontext():
        work = dist.irecv(_on_wire(buffer), src=_peer(mesh, dim, peer_index), group=g.group,
                          tag=tag)
    _record("recv", mesh, (dim,), buffer.numel() * buffer.element_size())
    return Pending(work, lambda: buffer, watch)


def batch_p2p(ops: Sequence[tuple[str, torch.Tensor, int]], mesh: DeviceMesh, dim: int,
              watch: Watch | None = None) -> list[Pending]:
    """Start ``ops`` — ``("send", tensor, peer)`` or ``("recv", buffer, peer)``, ``peer`` an
    index along mesh dim ``dim`` — as one batch (``batch_isend_irecv``: NCCL runs a batch's
    messages together, which two ranks that send to each other need; gloo starts them one by
    one). Every message has tag 0: between two ranks, the ``k``-th receive gets the ``k``-th
    send, on every backend (NCCL ignores tags). ``wait()`` on a receive returns its buffer;
    the caller keeps each sent tensor alive until its ``wait()``."""
    g = _group(mesh, (dim,))
    p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, _on_wire(tensor),
                      peer=_peer(mesh, dim, peer), group=g.group)
           for kind, tensor, peer in ops]
    with watch.guard() if watch else contextlib.nullcontext():
        works = dist.batch_isend_irecv(p2p)
    for kind, tensor, _ in ops:
        _record(kind, mesh, (dim,), tensor.numel() * tensor.element_size())
    if len(works) == len(ops):  # one work per message (gloo)
        return [Pending(work, functools.partial(_same, tensor), watch)
                for work, (_, tensor, _) in zip(works, ops, strict=True)]
    together = _AllOf(works)  # NCCL: one work for the whole batch
    return [Pending(together, functools.partial(_same, tensor), watch) for _, tensor, _ in ops]


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _AllOf:
    """Works that finish together (a coalesced batch), waited as one."""

    def __init__(self, works) -> None:
        self._works = list(works)

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        self._works.clear()
        return True


def recv(shape: Sequence[int], dtype: torch.dtype, mesh: DeviceMesh, dim: int,
         peer_index: int, tag: int, device: torch.device | str = "cpu",
         watch: Watch | None = None) -> torch.Tensor:
    """Receive a tensor of ``shape`` and ``dtype`` from the ``peer_index``-th rank along
    ``dim`` (blocking)."""
    return recv_async(shape, dtype, mesh, dim, peer_index, tag, device, watch).wait()
