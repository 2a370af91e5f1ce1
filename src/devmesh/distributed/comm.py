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
import functools
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from devmesh._log import get_logger
from devmesh.distributed import env, exchange, groups, stops
from devmesh.distributed.timeouts import Watch

if TYPE_CHECKING:
    from devmesh.mesh import DeviceMesh

__all__ = [
    "CommStats",
    "comm_stats",
    "process_group",
    "count_copy",
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "all_reduce_async",
    "all_gather_async",
    "Pending",
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
def comm_stats(*, include_torch: bool = False) -> Iterator[CommStats]:
    """Count every devmesh collective issued inside the ``with`` block (on this rank).

    ``include_torch=True`` counts torch's functional collectives too, under the mesh dim
    they run over: what torch's ``DTensor`` redistributions (a style handing DTensors on,
    as sequence parallelism's norms do) and ``loss_parallel()`` send."""
    stats = CommStats()
    _active.append(stats)
    torch_counts = contextlib.nullcontext()
    if include_torch:
        from devmesh.distributed.torch_collectives import counting

        torch_counts = counting(stats.add)
    try:
        with torch_counts:
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
    for agreements that :func:`~devmesh.distributed.consensus.failures` and
    :func:`~devmesh.distributed.consensus.differing` run on a group; with
    ``purpose``, that purpose's own group over the same ranks (made now if new: every rank
    of the group must ask)."""
    return _group(mesh, tuple(dims), purpose).group


def _watch(collective: str, mesh: DeviceMesh, dims: Sequence[int], g: _Group) -> Watch:
    """Numbers this collective on its group; a timeout then names who never entered it."""
    stops.refuse_if_broken()
    def label() -> str:
        return "+".join(mesh.layout.dim_name(d) for d in dims)

    groups.refuse_communication(lambda: f"{collective} over {label()}")
    return Watch(collective, g.ranks, label)


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
        if exchange.usable("all_gather", out, g.group, out.numel() * out.element_size()):
            work = exchange.all_gather(_on_wire(out), _on_wire(tensor.reshape(-1)), g.group)
        else:
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
    nbytes = stacked.numel() * stacked.element_size()
    with watch.guard():
        if exchange.usable("reduce_scatter", stacked, g.group, nbytes, _OPS[op]):
            work, reduce = exchange.reduce_scatter(out, stacked, _OPS[op], g.group)
            stops.wait(work, watch, polled=True)
            reduce()
        else:
            work = dist.reduce_scatter_single(out.view(-1), stacked.view(-1), op=_OPS[op],
                                              group=g.group, async_op=True)
            stops.wait(work, watch, polled=out.device.type == "cpu")
    _record("reduce_scatter", mesh, dims, nbytes)
    if op == "avg":
        out /= g.size
    return out


def all_reduce(
    tensor: torch.Tensor, mesh: DeviceMesh, dims: Sequence[int], op: str = "sum"
) -> torch.Tensor:
    """All-reduce ``tensor`` in place over the flattened group of ``dims``; returns it."""
    g = _group(mesh, dims)
    if g.size == 1 or not _by_exchange(tensor, g, op):
        return all_reduce_async(tensor, mesh, dims, op).wait()
    watch = _watch("all_reduce", mesh, dims, g)
    with watch.guard():
        exchange.all_reduce(tensor, _OPS[op], g.group,
                            lambda work: stops.wait(work, watch, polled=True))
    _record("all_reduce", mesh, dims, _nbytes(tensor))
    if op == "avg":
        tensor.div_(g.size)
    return tensor


def _by_exchange(tensor: torch.Tensor, g: _Group, op: str) -> bool:
    return tensor.is_contiguous() and exchange.usable("all_reduce", tensor, g.group,
                                                      _nbytes(tensor), _OPS[op])


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
    reduce = None
    with watch.guard():
        started = (exchange.all_reduce_start(tensor, _OPS[op], g.group)
                   if _by_exchange(tensor, g, op) else None)
        if started is not None:  # small: one exchange, reduced here once it is done
            work, reduce = started
        else:
            work = dist.all_reduce(tensor, op=_OPS[op], group=g.group, async_op=True)
    _record("all_reduce", mesh, dims, _nbytes(tensor))

    def finish() -> torch.Tensor:
        if reduce is not None:
            reduce()
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


def scatter_bytes(pieces: Sequence[Sequence[torch.Tensor]] | None, sizes: Sequence[int],
                  mesh: DeviceMesh, dims: Sequence[int], src_index: int,
                  device: torch.device) -> torch.Tensor:
    """From the ``src_index``-th rank of the group (mesh order), send the ``i``-th rank the
    bytes of ``pieces[i]`` (``uint8`` tensors of any strides, packed once into the message;
    only the source passes them), ``sizes[i]`` bytes in all (every rank passes ``sizes``).
    Returns this rank's bytes, flat. Torch's ``scatter`` needs equal pieces; this is one
    ``all_to_all_single`` in which only the source sends."""
    g = _group(mesh, dims)
    me = g.ranks.index(mesh.get_rank())
    order = list(g.from_c10d) if g.from_c10d is not None else list(range(g.size))
    source = me == src_index
    send = torch.empty(sum(sizes) if source else 0, dtype=torch.uint8, device=device)
    if source:
        assert pieces is not None
        offset = 0
        for i in order:
            for piece in pieces[i]:
                send[offset: offset + piece.numel()].view(piece.shape).copy_(piece)
                offset += piece.numel()
    if g.size == 1:
        return send
    recv = torch.empty(sizes[me], dtype=torch.uint8, device=device)
    if env.is_fake_world():  # torch's fake group fills an all-to-all's output from the input
        _record("scatter", mesh, dims, send.numel())  # (values are arbitrary there anyway)
        return recv
    watch = _watch("scatter", mesh, dims, g)
    with watch.guard():
        work = dist.all_to_all_single(
            recv, send, output_split_sizes=[sizes[me] if i == src_index else 0 for i in order],
            input_split_sizes=[sizes[i] if source else 0 for i in order], group=g.group,
            async_op=True)
        stops.wait(work, watch, polled=device.type == "cpu")
    _record("scatter", mesh, dims, send.numel())
    return recv


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
    if all(tensor.is_meta for _, tensor, _ in ops):
        # a dry run's messages (torch's fake process group, meta tensors): there are no
        # bytes to move, and torch's batch finds no backend for the meta device; counted
        for kind, tensor, _ in ops:
            _record(kind, mesh, (dim,), tensor.numel() * tensor.element_size())
        return [Pending(None, functools.partial(_same, tensor), watch) for _, tensor, _ in ops]
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
