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
masks and padding masks follow the load-balanced order. Collectives and messages are
devmesh's own: counted per mesh dim, with the same timeout diagnostics as everything else.
"""

from __future__ import annotations

import math

import torch

from devmesh.distributed import comm
from devmesh.errors import ParallelizeError
from devmesh.mesh import DeviceMesh
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


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool,
             key_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Which (query, key) pairs attend: ``(Sq, Sk)`` from causality, broadcast with the key
    padding mask ``(B, Sk)`` to ``(B, 1, Sq, Sk)``; ``None`` when all do."""
    allowed = q_pos[:, None] >= k_pos[None, :] if causal else None
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


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, key_mask, mesh, causal, scale, load_balance):  # type: ignore[override]
        ring = _Ring(mesh)
        length = q.shape[-2] * ring.cp
        q_pos = positions_of(ring.rank, ring.cp, length, load_balance, q.device)
        dtype = _compute_dtype(q.dtype)
        qc = q.to(dtype)
        heads = q.shape[-3]
        out = torch.zeros(q.shape, dtype=dtype, device=q.device)
        m = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=dtype, device=q.device)
        l = torch.zeros_like(m)
        block = [k, v] + ([key_mask.to(torch.uint8)] if key_mask is not None else [])
        for step in range(ring.cp):
            pending = ring.start(block, "ring attention") if step < ring.cp - 1 else None
            owner = (ring.rank - step) % ring.cp
            k_pos = positions_of(owner, ring.cp, length, load_balance, q.device)
            mask = block[2].bool() if key_mask is not None else None
            allowed = _allowed(q_pos, k_pos, causal, mask)
            if allowed is None or bool(allowed.any()):
                s = _scores(qc, _expand(block[0], heads).to(dtype), scale, allowed)
                m_new = torch.maximum(m, s.amax(-1, keepdim=True))
                shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                p = torch.exp(s - shift)
                alpha = torch.exp(m - shift)
                l = l * alpha + p.sum(-1, keepdim=True)
                out = out * alpha + torch.matmul(p, _expand(block[1], heads).to(dtype))
                m = m_new
            if pending is not None:
                block = ring.finish(pending)
        empty = l == 0  # rows with no key to attend to give zeros
        out = out / torch.where(empty, torch.ones_like(l), l)
        shift = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        lse = torch.where(empty, torch.full_like(l, float("inf")),
                          shift + torch.log(torch.where(empty, torch.ones_like(l), l)))
        ctx.save_for_backward(q, k, v, key_mask, out, lse)
        ctx.mesh, ctx.causal, ctx.scale, ctx.load_balance = mesh, causal, scale, load_balance
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, key_mask, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.mesh)
        length = q.shape[-2] * ring.cp
        q_pos = positions_of(ring.rank, ring.cp, length, ctx.load_balance, q.device)
        dtype = out.dtype
        qc, do = q.to(dtype), grad_out.to(dtype)
        heads, kv_heads = q.shape[-3], k.shape[-3]
        delta = (do * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(qc)
        block = [k, v] + ([key_mask.to(torch.uint8)] if key_mask is not None else [])
        grads = [torch.zeros(k.shape, dtype=dtype, device=k.device),
                 torch.zeros(v.shape, dtype=dtype, device=v.device)]
        for step in range(ring.cp):
            pending = (ring.start(block, "ring attention backward")
                       if step < ring.cp - 1 else None)
            owner = (ring.rank - step) % ring.cp
            k_pos = positions_of(owner, ring.cp, length, ctx.load_balance, q.device)
            mask = block[2].bool() if key_mask is not None else None
            allowed = _allowed(q_pos, k_pos, ctx.causal, mask)
            if allowed is None or bool(allowed.any()):
                kc, vc = _expand(block[0], heads).to(dtype), _expand(block[1], heads).to(dtype)
                p = torch.exp(_scores(qc, kc, ctx.scale, allowed) - lse)
                dv = torch.matmul(p.transpose(-1, -2), do)
                ds = p * (torch.matmul(do, vc.transpose(-1, -2)) - delta)
                dq = dq + torch.matmul(ds, kc) * ctx.scale
                dk = torch.matmul(ds.transpose(-1, -2), qc) * ctx.scale
                grads = [grads[0] + _fold(dk, kv_heads), grads[1] + _fold(dv, kv_heads)]
            # the block's gradients travel with it; the last step returns them to the owner
            grads = ring.finish(ring.start(grads, "ring attention backward"))
            if pending is not None:
                block = ring.finish(pending)
        return (dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype),
                None, None, None, None, None)


def _allgather_attention(q, k, v, key_mask, mesh, causal, scale, load_balance):
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
    allowed = _allowed(q_pos, k_pos, causal, mask)
    dtype = _compute_dtype(q.dtype)
    heads = q.shape[-3]
    s = _scores(q.to(dtype), _expand(k_all, heads).to(dtype), scale, allowed)
    weights = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.matmul(weights, _expand(v_all, heads).to(dtype)).to(q.dtype)


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   mesh: DeviceMesh, *, is_causal: bool = False, scale: float | None = None,
                   key_padding_mask: torch.Tensor | None = None, load_balance: bool = True,
                   method: str = "ring") -> torch.Tensor:
    """Attention of this rank's queries over the keys and values of every rank of ``mesh``
    (the 1-D ``cp`` mesh), equal to ``scaled_dot_product_attention`` on the whole sequence.

    ``query`` ``(B, H, S/cp, D)``, ``key`` and ``value`` ``(B, Hkv, S/cp, D)`` (``Hkv``
    dividing ``H``: grouped-query attention), each rank's tokens as :func:`shard_sequence`
    gives them (with the same ``load_balance``). ``key_padding_mask``: ``(B, S/cp)``, true
    where a key is a real token. A query with no key to attend to gets zeros."""
    check_cp_mesh(mesh, "ring_attention")
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
    if method == "allgather":
        return _allgather_attention(query, key, value, mask, mesh, is_causal, scale,
                                    load_balance)
    return _RingAttention.apply(query, key, value, mask, mesh, is_causal, scale, load_balance)
