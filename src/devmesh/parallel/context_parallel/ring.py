"""Exact attention over a sequence split across a ``cp`` mesh dim.

**Ring** (the default): each rank keeps its queries and passes its keys and values around
the ring, one block per step, sending the next block while it computes on the current one.
Each block's partial result is merged into a running one by the log-sum-exp rule (the running
row maximum ``m``, the sum of exponentials ``l``, the unnormalised output): the result equals
softmax attention over the whole sequence, not an approximation. Backward passes the blocks
around again, each with the gradients of its keys and values accumulated by the ranks it
visited, and a last step hands every block's gradients back to its owner.

**All-gather**: every rank gathers all keys and values at once (one collective, cheaper in
latency for short sequences, ``cp`` times the memory) and reduce-scatters their gradients.

Both take the tokens' positions in the whole sequence (see :mod:`.sequence`), so causal
masks and padding masks follow the load-balanced order, and so do the bands of windowed
attention: a sliding window (a query sees the ``sliding_window`` keys up to itself:
Mistral's, Gemma's sliding layers) or aligned chunks (a query sees the keys of its own
``chunk_size`` tokens up to itself: Llama 4's chunked layers). A pair of chunks the band
leaves wholly apart is skipped; one it cuts through is masked. Collectives and messages are
devmesh's own: counted per mesh dim, with the same timeout diagnostics as everything else.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from devmesh import _torch_compat
from devmesh.distributed import comm
from devmesh.errors import ParallelizeError
from devmesh.mesh import DeviceMesh
from devmesh.parallel.activation_checkpointing import recomputed_inside
from devmesh.parallel.context_parallel.sequence import check_cp_mesh, gather_keys, positions_of

__all__ = ["ring_attention", "METHODS"]

METHODS = ("ring", "allgather")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated for grouped-query attention (``enable_gqa``)."""
    groups = heads // kv.shape[-3]
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=-3)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of repeated heads summed back onto the key/value heads."""
    heads = grad.shape[-3]
    if heads == kv_heads:
        return grad
    shape = (*grad.shape[:-3], kv_heads, heads // kv_heads, *grad.shape[-2:])
    return grad.reshape(shape).sum(-3)


@dataclass(frozen=True)
class Band:
    """Windowed causal attention, by the tokens' positions in the whole sequence: a query
    sees the ``sliding_window`` keys up to itself, or the keys of its own aligned
    ``chunk_size`` tokens up to itself (either or both)."""

    sliding_window: int | None = None
    chunk_size: int | None = None

    @classmethod
    def of(cls, sliding_window: int | None, chunk_size: int | None, what: str
           ) -> Band | None:
        """The band the arguments of ``what`` give (``None`` for plain attention), each
        checked to be a number of tokens."""
        if sliding_window is None and chunk_size is None:
            return None
        for name, value in (("sliding_window", sliding_window), ("chunk_size", chunk_size)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ParallelizeError(f"{what} {name}={value!r}: give a number of tokens, "
                                       "1 or more")
        return cls(sliding_window, chunk_size)

    def allows(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """``(Sq, Sk)``: which pairs the band lets attend (causality included)."""
        allowed = q_pos[:, None] >= k_pos[None, :]
        if self.sliding_window is not None:
            allowed &= (q_pos[:, None] - k_pos[None, :]) < self.sliding_window
        if self.chunk_size is not None:
            allowed &= (q_pos[:, None] // self.chunk_size) == (k_pos[None, :] // self.chunk_size)
        return allowed


@functools.lru_cache(maxsize=256)
def _band_block(band: Band, q_start: int, k_start: int, size: int
                ) -> tuple[str, torch.Tensor | None]:
    """How the band cuts the sub-block of ``size`` queries from ``q_start`` and ``size`` keys
    from ``k_start``: ``"none"`` attend (skipped), ``"all"``, ``"causal"`` (the diagonal's
    triangle), or ``"masked"`` with the ``(size, size)`` mask (on the CPU)."""
    rows = torch.arange(size)
    allowed = band.allows(q_start + rows, k_start + rows)
    if not allowed.any():
        return "none", None
    if allowed.all():
        return "all", None
    if q_start == k_start and torch.equal(allowed, torch.ones(size, size, dtype=torch.bool
                                                              ).tril()):
        return "causal", None
    return "masked", allowed


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool,
             key_mask: torch.Tensor | None, band: Band | None = None) -> torch.Tensor | None:
    """Which (query, key) pairs attend: ``(Sq, Sk)`` from causality (or the band), broadcast
    with the key padding mask ``(B, Sk)`` to ``(B, 1, Sq, Sk)``; ``None`` when all do."""
    allowed = q_pos[:, None] >= k_pos[None, :] if causal else None
    if band is not None:
        allowed = band.allows(q_pos, k_pos)
    if key_mask is not None:
        keys = key_mask[:, None, None, :]
        allowed = keys if allowed is None else allowed & keys
    return allowed


def _scores(q, k, scale, allowed):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if allowed is None else s.masked_fill(~allowed, float("-inf"))


class _Ring:
    """One rank's view of the ring: its neighbours, and the message exchange of one step."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh, self.cp, self.rank = mesh, mesh.size(), mesh.get_local_rank()
        self.next, self.prev = (self.rank + 1) % self.cp, (self.rank - 1) % self.cp

    def start(self, tensors: list[torch.Tensor], what: str) -> list[comm.Pending]:
        """Send ``tensors`` to the next rank and receive the previous rank's (same shapes)."""
        watch = comm.exchange_watch(what, self.mesh, 0)
        ops = [("send", t.contiguous(), self.next) for t in tensors]
        ops += [("recv", torch.empty(t.shape, dtype=t.dtype, device=t.device), self.prev)
                for t in tensors]
        pending = comm.batch_p2p(ops, self.mesh, 0, watch)
        return pending

    @staticmethod
    def finish(pending: list[comm.Pending]) -> list[torch.Tensor]:
        results = [p.wait() for p in pending]
        return results[len(results) // 2:]


def _chunk_ids(rank: int, cp: int, load_balance: bool) -> tuple[int, ...]:
    return (rank, 2 * cp - 1 - rank) if load_balance else (rank,)


def _pairs(q_rank: int, k_rank: int, cp: int, load_balance: bool, causal: bool,
           band: Band | None = None, size: int = 0):
    """The (query chunk, key chunk, diagonal, band mask) sub-blocks that attend, as local
    chunk indices: under causality a later chunk sees an earlier one whole, a chunk sees
    itself causally, an earlier one sees nothing of a later one (skipped: no work, no
    message waits on it). With a band (chunks of ``size`` tokens), as the band cuts them:
    whole, causal, skipped, or masked by the ``(size, size)`` mask given."""
    pairs = []
    for i, qc in enumerate(_chunk_ids(q_rank, cp, load_balance)):
        for j, kc in enumerate(_chunk_ids(k_rank, cp, load_balance)):
            if band is not None:
                how, mask = _band_block(band, qc * size, kc * size, size)
                if how != "none":
                    pairs.append((i, j, how == "causal", mask))
            elif not causal or qc > kc:
                pairs.append((i, j, False, None))
            elif qc == kc:
                pairs.append((i, j, True, None))
    return pairs


def _rows(t: torch.Tensor, index: int, chunks: int) -> torch.Tensor:
    size = t.shape[-2] // chunks
    return t[..., index * size:(index + 1) * size, :]


#: where torch's CPU flash attention runs: the CPU, and ``meta`` (shapes only, as the dry run
#: steps), where it is far cheaper than the scores written out op by op
_FUSED_DEVICES = ("cpu", "meta")


def _block_forward(q, k, v, diagonal: bool, key_mask, scale: float, band=None):
    """One sub-block's softmax attention and its log-sum-exp ``(..., Sq, 1)``. On the CPU
    (or ``meta``, the dry run's) without a padding or band mask, torch's fused kernel; else
    the scores written out."""
    if key_mask is None and band is None and q.device.type in _FUSED_DEVICES:
        out, lse = _torch_compat.cpu_flash_attention()(q, k, v, 0.0, diagonal, scale=scale)
        return out, lse.unsqueeze(-1)
    dtype = _compute_dtype(q.dtype)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    s = _scores(q, k, scale, _sub_allowed(q, k, diagonal, key_mask, band))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse))
    return torch.matmul(p, v), lse


def _block_backward(do, q, k, v, out, lse, diagonal: bool, key_mask, scale: float,
                    band=None):
    """The sub-block's share of the gradients of q, k and v, given the whole row's output
    and log-sum-exp (the flash-attention backward's inputs)."""
    if key_mask is None and band is None and q.device.type in _FUSED_DEVICES:
        backward = _torch_compat.cpu_flash_attention_backward()
        return backward(do, q, k, v, out, lse.squeeze(-1), 0.0, diagonal, scale=scale)
    dtype = _compute_dtype(q.dtype)
    do, q, k, v, out = (t.to(dtype) for t in (do, q, k, v, out))
    p = torch.exp(_scores(q, k, scale, _sub_allowed(q, k, diagonal, key_mask, band)) - lse)
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = p * (torch.matmul(do, v.transpose(-1, -2)) - (do * out).sum(-1, keepdim=True))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv


def _sub_allowed(q, k, diagonal: bool, key_mask, band=None):
    allowed = None
    if diagonal:
        allowed = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool,
                             device=q.device).tril()
    if band is not None:  # the band's own mask (causality in it)
        allowed = band.to(q.device)
    if key_mask is not None:
        keys = key_mask[:, None, None, :]
        allowed = keys if allowed is None else allowed & keys
    return allowed


def _merge(out, lse, block_out, block_lse):
    """Two partial softmax results of the same rows as one (log-sum-exp rule), in place."""
    if out.device.type == "meta":  # the dry run: shapes only, which merging keeps (and
        return  # torch's meta element-wise ops cost milliseconds each)
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    out.mul_(torch.exp(lse - safe)).add_(block_out * torch.exp(block_lse - safe))
    lse.copy_(new)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, key_mask, mesh, causal, scale,  # type: ignore[override]
                load_balance, band):
        ring = _Ring(mesh)
        chunks = 2 if load_balance else 1
        size = q.shape[-2] // chunks
        dtype = _compute_dtype(q.dtype)
        heads = q.shape[-3]
        out = torch.zeros(q.shape, dtype=dtype, device=q.device)
        lse = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=dtype, device=q.device)
        block = [k, v] + ([key_mask.to(torch.uint8)] if key_mask is not None else [])
        for step in range(ring.cp):
            pending = ring.start(block, "ring attention") if step < ring.cp - 1 else None
            owner = (ring.rank - step) % ring.cp
            keys, values = _expand(block[0], heads), _expand(block[1], heads)
            for i, j, diagonal, cut in _pairs(ring.rank, owner, ring.cp, load_balance,
                                              causal, band, size):
                mask = _rows(block[2][..., None], j, chunks)[..., 0].bool() if len(
                    block) == 3 else None
                o_b, lse_b = _block_forward(
                    _rows(q, i, chunks), _rows(keys, j, chunks), _rows(values, j, chunks),
                    diagonal, mask, scale, cut)
                _merge(_rows(out, i, chunks), _rows(lse, i, chunks), o_b.to(dtype),
                       lse_b.to(dtype))
            if pending is not None:
                block = ring.finish(pending)
        empty = torch.isinf(lse)  # rows with no key to attend to give zeros
        out = torch.where(empty, torch.zeros_like(out), out).to(q.dtype)
        lse = torch.where(empty, torch.full_like(lse, float("inf")), lse)
        ctx.save_for_backward(q, k, v, key_mask, out, lse)
        ctx.mesh, ctx.causal, ctx.scale, ctx.load_balance = mesh, causal, scale, load_balance
        ctx.band = band
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, key_mask, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.mesh)
        chunks = 2 if ctx.load_balance else 1
        size = q.shape[-2] // chunks
        do = grad_out.to(q.dtype).contiguous()
        heads, kv_heads = q.shape[-3], k.shape[-3]
        dq = torch.zeros(q.shape, dtype=_compute_dtype(q.dtype), device=q.device)
        block = [k, v] + ([key_mask.to(torch.uint8)] if key_mask is not None else [])
        grads = [torch.zeros(k.shape, dtype=dq.dtype, device=k.device),
                 torch.zeros(v.shape, dtype=dq.dtype, device=v.device)]
        for step in range(ring.cp):
            pending = (ring.start(block, "ring attention backward")
                       if step < ring.cp - 1 else None)
            owner = (ring.rank - step) % ring.cp
            keys, values = _expand(block[0], heads), _expand(block[1], heads)
            dk = torch.zeros(keys.shape, dtype=dq.dtype, device=k.device)
            dv = torch.zeros_like(dk)
            for i, j, diagonal, cut in _pairs(ring.rank, owner, ring.cp, ctx.load_balance,
                                              ctx.causal, ctx.band, size):
                mask = _rows(block[2][..., None], j, chunks)[..., 0].bool() if len(
                    block) == 3 else None
                dq_b, dk_b, dv_b = _block_backward(
                    _rows(do, i, chunks), _rows(q, i, chunks), _rows(keys, j, chunks),
                    _rows(values, j, chunks), _rows(out, i, chunks), _rows(lse, i, chunks),
                    diagonal, mask, ctx.scale, cut)
                _rows(dq, i, chunks).add_(dq_b)
                _rows(dk, j, chunks).add_(dk_b)
                _rows(dv, j, chunks).add_(dv_b)
            grads = [grads[0] + _fold(dk, kv_heads), grads[1] + _fold(dv, kv_heads)]
            # the block's gradients travel with it; the last step returns them to the owner
            if ring.cp > 1:
                grads = ring.finish(ring.start(grads, "ring attention backward"))
            if pending is not None:
                block = ring.finish(pending)
        return (dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype),
                None, None, None, None, None, None)


def _allgather_attention(q, k, v, key_mask, mesh, causal, scale, load_balance, band):
    """Every rank gathers every key and value (their gradients are reduce-scattered back),
    then attends locally."""
    cp, rank = mesh.size(), mesh.get_local_rank()
    length = q.shape[-2] * cp
    k_all = gather_keys(k, mesh, -2, load_balance)
    v_all = gather_keys(v, mesh, -2, load_balance)
    q_pos = positions_of(rank, cp, length, load_balance, q.device)
    k_pos = torch.arange(length, device=q.device)
    mask = None
    if key_mask is not None:
        with torch.no_grad():
            mask = gather_keys(key_mask.to(torch.uint8), mesh, -1, load_balance).bool()
    allowed = _allowed(q_pos, k_pos, causal, mask, band)
    dtype = _compute_dtype(q.dtype)
    heads = q.shape[-3]
    s = _scores(q.to(dtype), _expand(k_all, heads).to(dtype), scale, allowed)
    weights = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.matmul(weights, _expand(v_all, heads).to(dtype)).to(q.dtype)


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   mesh: DeviceMesh, *, is_causal: bool = False, scale: float | None = None,
                   key_padding_mask: torch.Tensor | None = None, load_balance: bool = True,
                   method: str = "ring", sliding_window: int | None = None,
                   chunk_size: int | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the keys and values of every rank of ``mesh``
    (the 1-D ``cp`` mesh), equal to ``scaled_dot_product_attention`` on the whole sequence.

    ``query`` ``(B, H, S/cp, D)``, ``key`` and ``value`` ``(B, Hkv, S/cp, D)`` (``Hkv``
    dividing ``H``: grouped-query attention), each rank's tokens as :func:`shard_sequence`
    gives them (with the same ``load_balance``). ``key_padding_mask``: ``(B, S/cp)``, true
    where a key is a real token. ``sliding_window``: each query sees only the keys at
    distances below it (itself included: transformers' sliding layers); ``chunk_size``: only
    the keys of its own aligned chunk of that many tokens (Llama 4's chunked layers); either
    is causal. A query with no key to attend to gets zeros."""
    check_cp_mesh(mesh, "ring_attention")
    band = Band.of(sliding_window, chunk_size, "ring_attention")
    if band is not None and not is_causal:
        raise ParallelizeError(
            "ring_attention attends within a sliding window or a chunk causally only: "
            "pass is_causal=True with sliding_window= or chunk_size=")
    if method not in METHODS:
        raise ParallelizeError(f"context parallelism's method must be one of {METHODS}, "
                               f"got {method!r}")
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ParallelizeError(
            "ring_attention takes (batch, heads, local sequence, head dim) tensors, got "
            f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    if key.shape != value.shape or query.shape[-3] % key.shape[-3] or (
            query.shape[-2] != key.shape[-2]):
        raise ParallelizeError(
            f"ring_attention: key {tuple(key.shape)} and value {tuple(value.shape)} must "
            f"match, with as many tokens as query {tuple(query.shape)} and a head count "
            "dividing its heads")
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (
            key.shape[0], key.shape[-2]):
        raise ParallelizeError(
            f"key_padding_mask must be (batch, local sequence) = "
            f"{(key.shape[0], key.shape[-2])}, got {tuple(key_padding_mask.shape)}")
    positions_of(0, mesh.size(), query.shape[-2] * mesh.size(), load_balance,
                 what="ring_attention")  # a length the chunks divide, refused here if not
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    mask = key_padding_mask.bool() if key_padding_mask is not None else None
    with recomputed_inside():  # selective checkpointing keeps none of the chunks' scores
        if method == "allgather":
            return _allgather_attention(query, key, value, mask, mesh, is_causal, scale,
                                        load_balance, band)
        return _RingAttention.apply(query, key, value, mask, mesh, is_causal, scale,
                                    load_balance, band)
