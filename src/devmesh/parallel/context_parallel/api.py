"""``context_parallel(module, mesh["cp"])``: the module's ``scaled_dot_product_attention``
calls attend over the whole sequence while each rank holds a part of it.

The module runs on this rank's tokens (:func:`~.sequence.shard_sequence`); every
``torch.nn.functional.scaled_dot_product_attention`` call inside its forward is routed to
:func:`~.ring.ring_attention` over the ``cp`` dim. Everything else in a transformer works
token by token (projections, MLPs, norms), so it needs no change — except positions: a
module that builds position ids or rotary tables from ``arange(local length)`` must take
this rank's positions instead (:func:`~.sequence.sequence_positions`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from devmesh.errors import ParallelizeError
from devmesh.mesh import DeviceMesh
from devmesh.parallel.context_parallel.ring import METHODS, Band, ring_attention
from devmesh.parallel.context_parallel.sequence import check_cp_mesh

__all__ = ["context_parallel", "context_parallel_attention"]


def _key_padding(attn_mask: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor | None:
    """The key padding mask an SDPA ``attn_mask`` stands for: a boolean ``(B, 1, 1, S)``
    (true where a key is a real token) — the one mask that splits along keys alone."""
    if attn_mask is None:
        return None
    batch, local = query.shape[0], query.shape[-2]
    if attn_mask.dtype != torch.bool or attn_mask.ndim != 4 or tuple(
            attn_mask.shape[1:3]) != (1, 1) or attn_mask.shape[-1] != local or (
            attn_mask.shape[0] not in (1, batch)):
        raise ParallelizeError(
            "under context parallelism, scaled_dot_product_attention takes a key padding "
            f"mask only: a boolean (batch, 1, 1, local sequence) = ({batch}, 1, 1, {local}) "
            f"tensor of this rank's keys, got {attn_mask.dtype} {tuple(attn_mask.shape)}; "
            "for causal attention pass is_causal=True (positions follow the sharding)")
    return attn_mask[:, 0, 0, :].expand(batch, local)


def _local_band(attn_mask: torch.Tensor, query: torch.Tensor, band: Band) -> bool:
    """Whether ``attn_mask`` is the band over this rank's own tokens alone, as transformers
    builds a sliding or chunked layer's mask from the local length (and no padding): the
    band over the whole sequence replaces it."""
    local = query.shape[-2]
    if attn_mask.dtype != torch.bool or attn_mask.ndim != 4 or tuple(
            attn_mask.shape[-2:]) != (local, local):
        return False
    rows = torch.arange(local, device=attn_mask.device)
    return bool((attn_mask == band.allows(rows, rows)).all())


class _RouteAttention(TorchFunctionMode):
    def __init__(self, mesh: DeviceMesh, load_balance: bool, method: str,
                 band: Band | None = None) -> None:
        super().__init__()
        self.mesh, self.load_balance, self.method = mesh, load_balance, method
        self.band = band

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False):
        if dropout_p:
            raise ParallelizeError(
                f"scaled_dot_product_attention(dropout_p={dropout_p}) under context "
                "parallelism: attention dropout is not supported; use dropout_p=0.0")
        if key.shape[-3] != query.shape[-3] and not enable_gqa:
            raise ParallelizeError(
                f"query has {query.shape[-3]} heads, key {key.shape[-3]}: pass "
                "enable_gqa=True for grouped-query attention")
        band = self.band
        if band is not None:  # a windowed layer: causal, its band over the whole sequence
            if attn_mask is not None and not _local_band(attn_mask, query, band):
                raise ParallelizeError(
                    "under context parallelism a sliding-window or chunked attention layer "
                    "takes no mask but its own band (transformers' mask of this rank's "
                    f"tokens); got {attn_mask.dtype} {tuple(attn_mask.shape)}: a padding "
                    "mask is not supported there (pack sequences, or pad on the right)")
            if attn_mask is None and not is_causal:
                raise ParallelizeError(
                    "a sliding-window or chunked attention layer under context parallelism "
                    "attends causally: its scaled_dot_product_attention call has neither "
                    "is_causal=True nor its band's mask")
            return ring_attention(query, key, value, self.mesh, is_causal=True, scale=scale,
                                  load_balance=self.load_balance, method=self.method,
                                  sliding_window=band.sliding_window,
                                  chunk_size=band.chunk_size)
        return ring_attention(query, key, value, self.mesh, is_causal=is_causal, scale=scale,
                              key_padding_mask=_key_padding(attn_mask, query),
                              load_balance=self.load_balance, method=self.method)


def _check(mesh: DeviceMesh, method: str, what: str) -> None:
    check_cp_mesh(mesh, what)
    if method not in METHODS:
        raise ParallelizeError(f"{what}: method must be one of {METHODS}, got {method!r}")


@contextlib.contextmanager
def context_parallel_attention(mesh: DeviceMesh, *, load_balance: bool = True,
                               method: str = "ring") -> Iterator[None]:
    """Inside the block, ``scaled_dot_product_attention`` attends over the ``cp`` dim's whole
    sequence (for code that is not one module)."""
    _check(mesh, method, "context_parallel_attention")
    with _RouteAttention(mesh, load_balance, method):
        yield


def context_parallel(module: nn.Module, mesh: DeviceMesh, *, load_balance: bool = True,
                     method: str = "ring", sliding_window: int | None = None,
                     chunk_size: int | None = None) -> nn.Module:
    """Route ``module``'s attention over the ``cp`` mesh dim ``mesh`` (in place; returns
    ``module``). ``method``: ``"ring"`` (keys and values passed around, overlapped with
    compute) or ``"allgather"`` (gathered at once: fewer, larger messages for short
    sequences). Feed the module :func:`~.sequence.shard_sequence`'s tokens with the same
    ``load_balance``.

    ``sliding_window`` / ``chunk_size``: the module's attention is windowed (a sliding layer
    of Mistral or Gemma: each query sees the ``sliding_window`` keys up to itself; a chunked
    layer of Llama 4: the keys of its own ``chunk_size`` tokens). The window must be given:
    a model builds its window's mask from the tokens it holds, and skips it where they are
    fewer than the window, which over a split sequence would attend too far."""
    _check(mesh, method, "context_parallel")
    band = Band.of(sliding_window, chunk_size, "context_parallel")
    route = _RouteAttention(mesh, load_balance, method, band)

    def enter(_module: nn.Module, _args: Any) -> None:
        route.__enter__()

    def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
        route.__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
    return module
