"""Reductions and gathers over gloo made of one all-to-all each: one exchange, not a ring.

gloo runs an all-reduce, an all-gather or a reduce-scatter of all but the tiniest tensors as a
ring: n - 1 steps or more, each waiting for a peer's thread to receive, add and pass on. Where
a collective is latency-bound — small and mid-sized tensors, or more ranks than cores on a host
— those steps are its whole cost: on 8 ranks sharing 2 cores, gloo all-reduces 512 bytes in
about 23 ms and reduce-scatters 1 MiB in 24 ms, where one ``all_to_all_single`` of the same
bytes takes 4 (``bench/gloo_collectives.py``). The bytes a rank sends are the same: a
reduce-scatter or an all-gather moves (n - 1)/n of the whole tensor from each rank either way;
here they all leave at once.

* **reduce-scatter**: every rank sends each peer that peer's block; each then combines the n
  blocks it received.
* **all-gather**: every rank sends its block to each peer (its block repeated n times).
* **all-reduce**: a small tensor goes whole to every peer and each rank combines the n copies
  (one exchange); a larger one is reduce-scattered, then all-gathered (two).

The results are gloo's bit for bit: each element is combined in the order gloo's ring sums it
(:func:`_reduce`), so a model trains to the same values as with torch's collectives, and an
all-reduce leaves every replica the same bits. (gloo's reduce-scatter is its all-reduce of the
whole tensor, sliced: the same order.)

Used for CPU tensors on gloo groups up to :data:`MOST_BYTES` (beyond it the ring is as fast,
without the exchange's buffer of the whole tensor's size); everything else goes to torch's
collectives unchanged.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from devmesh import _torch_compat
from devmesh.distributed import trace

__all__ = ["MOST_BYTES", "WHOLE_BYTES", "usable", "reduce_scatter", "all_gather",
           "all_reduce_start", "all_reduce", "all_reduce_over"]

#: The largest tensor sent by exchange (an all-gather's output, a reduce-scatter's input, an
#: all-reduce's tensor); larger ones go through gloo's ring, which is as fast or faster there
#: (measured: ``bench/gloo_collectives.py``), without a second buffer of the tensor's size.
MOST_BYTES = {"reduce_scatter": 16 << 20, "all_gather": 4 << 20, "all_reduce": 4 << 20}
#: An all-reduce whose n copies fit in this many bytes is one exchange of the whole tensor.
WHOLE_BYTES = 1 << 20

def _transport(carries: str | None = None) -> Callable[[Callable], Callable]:
    """Run the function as the transport's own work, unseen by torch dispatch modes: its
    buffers are the exchange's scratch, as gloo's ring and NCCL keep theirs inside the
    backend, so the dry run's count of what a step holds (:mod:`devmesh.tools.dry_run.live`),
    made under NCCL's collectives, is what a real step on gloo holds too. ``carries``: the
    collective its exchanges make, as ``--trace-collectives`` records them."""
    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def unseen(*args, **kwargs):
            with (_torch_compat.disable_current_modes(),
                  trace.carrying(carries) if carries else contextlib.nullcontext()):
                return fn(*args, **kwargs)
        return unseen
    return decorate


_ORDERED = {dist.ReduceOp.SUM: torch.Tensor.add_}
_EXACT = {dist.ReduceOp.MAX: torch.amax, dist.ReduceOp.MIN: torch.amin}


@_transport()
@torch.no_grad()  # as gloo's: a tensor that requires grad (create_graph) is written in place
def _reduce(op: dist.ReduceOp, received: torch.Tensor, out: torch.Tensor, start: int,
            total: int) -> None:
    """Combine ``received`` (``n`` blocks of ``out``'s ``m`` elements: each rank's values of
    elements ``start`` to ``start + m`` of a ``total``-element tensor, in group rank order)
    into ``out`` as gloo's ring all-reduce does, bit for bit: it cuts the tensor into ``2n`` pieces of
    ``ceil(total / 2n)`` elements, and the ``c``-th pair of pieces is summed starting from
    rank ``c - 1`` and going down the ring (``x[c-1] + x[c-2] + ... + x[c]``, indices mod
    ``n``), one rounding per addition. Maxima and minima need no order. (Products and the
    other ops go to gloo.)"""
    out = out.view(-1)
    m = out.numel()
    received = received.view(-1, m)  # (views made here, unseen too: see _transport)
    if op in _EXACT:
        _EXACT[op](received, 0, out=out)
        return
    combine = _ORDERED[op]
    n = received.shape[0]
    span = 2 * -(-total // (2 * n))
    for c in range(n):
        lo, hi = max(start, c * span), min(start + m, (c + 1) * span)
        if lo >= hi:
            continue
        a, b = lo - start, hi - start
        piece = out[a:b]
        piece.copy_(received[(c - 1) % n, a:b])
        for k in range(2, n + 1):
            combine(piece, received[(c - k) % n, a:b])


# dtypes the local reductions take as gloo does (no bool or float8 arithmetic here)
_REDUCIBLE = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16,
                        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


def _is_gloo(group: dist.ProcessGroup) -> bool:
    try:
        return isinstance(group._get_backend(torch.device("cpu")), dist.ProcessGroupGloo)
    except (RuntimeError, AttributeError):  # no CPU backend on this group
        return False


def usable(collective: str, tensor: torch.Tensor, group: dist.ProcessGroup, nbytes: int,
           op: dist.ReduceOp | None = None) -> bool:
    """Whether ``collective`` moving ``nbytes`` of ``tensor`` over ``group`` goes by
    exchange: a dense CPU tensor on a gloo group, at most :data:`MOST_BYTES`, and for a
    reduction a sum, maximum or minimum of one of the reduced dtypes."""
    if (tensor.device.type != "cpu" or tensor.is_sparse
            or not 0 < nbytes <= MOST_BYTES[collective]):
        return False
    if op is not None and (op not in (*_ORDERED, *_EXACT) or tensor.dtype not in _REDUCIBLE):
        return False
    return _is_gloo(group)


@_transport("reduce_scatter")
def reduce_scatter(out: torch.Tensor, blocks: torch.Tensor, op: dist.ReduceOp,
                   group: dist.ProcessGroup) -> tuple[object, Callable[[], None]]:
    """Start reducing ``blocks`` (contiguous, shape ``(n, *out.shape)``, block ``j`` for the
    group's ``j``-th rank) into ``out``: returns the exchange's work and the function that
    reduces once it is done."""
    received = torch.empty_like(blocks)
    work = dist.all_to_all_single(received.view(-1), blocks.view(-1), group=group,
                                  async_op=True)
    n, m = blocks.shape[0], out.numel()
    return work, functools.partial(_reduce, op, received, out, dist.get_rank(group) * m, n * m)


@_transport("all_gather")
def all_gather(out: torch.Tensor, block: torch.Tensor, group: dist.ProcessGroup) -> object:
    """Start gathering every rank's ``block`` into ``out`` (flat, the group's size times
    ``block``'s elements, in rank order); returns the exchange's work."""
    n = dist.get_world_size(group)
    sent = block.detach().reshape(1, -1).expand(n, -1).contiguous()
    return dist.all_to_all_single(out.view(-1), sent.view(-1), group=group, async_op=True)


@_transport("all_reduce")
def all_reduce_start(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup
                     ) -> tuple[object, Callable[[], None]] | None:
    """Start an in-place all-reduce of a small ``tensor`` (contiguous) in one exchange: its
    work and the function that reduces once it is done; ``None`` when the group's copies of
    it exceed :data:`WHOLE_BYTES` (see :func:`all_reduce`)."""
    n = dist.get_world_size(group)
    if n * tensor.numel() * tensor.element_size() > WHOLE_BYTES:
        return None
    flat = tensor.detach().view(-1)
    received = torch.empty(n * flat.numel(), dtype=flat.dtype)
    work = all_gather(received, flat, group)
    return work, functools.partial(_reduce, op, received, flat, 0, flat.numel())


@_transport("all_reduce")
def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup,
               wait: Callable[[object], None]) -> None:
    """All-reduce ``tensor`` (contiguous) in place: one exchange if it is small
    (:func:`all_reduce_start`), otherwise a reduce-scatter and an all-gather by exchange.
    ``wait(work)`` waits for each exchange."""
    started = all_reduce_start(tensor, op, group)
    if started is not None:
        work, reduce = started
        wait(work)
        reduce()
        return
    n = dist.get_world_size(group)
    flat = tensor.detach().view(-1)
    per = -(-flat.numel() // n)
    if per * n == flat.numel():  # n equal blocks: sent from the tensor and gathered into it
        blocks = flat
    else:
        blocks = torch.empty(n * per, dtype=flat.dtype)
        blocks[:flat.numel()] = flat
        blocks[flat.numel():] = 0  # padding: its sums are never read
    received = torch.empty_like(blocks)
    wait(dist.all_to_all_single(received, blocks, group=group, async_op=True))
    mine = torch.empty(per, dtype=flat.dtype)
    # this rank's elements in the order gloo sums the whole tensor (not the padded one's)
    _reduce(op, received, mine, dist.get_rank(group) * per, flat.numel())
    del received
    wait(all_gather(blocks, mine, group))
    if blocks is not flat:
        flat.copy_(blocks[:flat.numel()])


def all_reduce_over(tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
                    group: dist.ProcessGroup | None = None) -> None:
    """``dist.all_reduce(tensor, op, group)``, by exchange where it can go so (the agreements
    and checks of a checkpoint, whose few dozen integers gloo's ring takes ~20 ms for)."""
    group = group if group is not None else _torch_compat.default_group()
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.is_contiguous() and usable("all_reduce", tensor, group, nbytes, op):
        all_reduce(tensor, op, group, lambda work: work.wait())
    else:
        dist.all_reduce(tensor, op=op, group=group)
