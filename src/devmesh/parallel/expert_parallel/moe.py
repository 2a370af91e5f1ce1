"""A mixture-of-experts layer: a top-k router and a batch of expert MLPs.

Each token goes to its ``top_k`` experts by router probability; their outputs are summed
weighted by those probabilities renormalised over the chosen experts. The assignments are
sorted by expert, so each expert runs once on a contiguous run of tokens — on this rank
(:class:`LocalDispatch`) or, under expert parallelism, on the rank that holds the expert
(:mod:`.dispatch`). No token is dropped unless ``capacity_factor`` is set; then each expert
takes at most ``ceil(capacity_factor * tokens * top_k / experts)`` of the assignments made on
this rank, in token order, and the rest are dropped (counted in :attr:`MoE.dropped`).

The router's auxiliary load-balancing loss (Switch Transformer's) is left in
:attr:`MoE.aux_loss` by each forward: ``experts * sum_e f_e * P_e``, ``f_e`` the fraction of
assignments to expert ``e`` and ``P_e`` its mean router probability. Under expert parallelism
``f_e`` counts the assignments of every data rank (an all-reduce of ``experts`` integers), so
the loss — and its gradient averaged over the ranks — equals one process's on the whole batch.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from devmesh.errors import ParallelizeError

__all__ = ["MoE", "GroupedExperts", "LocalDispatch"]


class _ScaleGradient(torch.autograd.Function):
    """The identity, whose gradient is scaled."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad * ctx.scale, None


class GroupedExperts(nn.Module):
    """``experts`` two-layer MLPs with their weights batched: ``w1`` ``(experts, dim,
    hidden)``, ``w2`` ``(experts, hidden, dim)`` (expert parallelism splits dim 0).
    ``gradient_scale``: what the weights' gradients are multiplied by (expert parallelism
    averages them over ``ep``, as data parallelism averages the others)."""

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) / math.sqrt(dim))
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) / math.sqrt(hidden))
        self.gradient_scale = 1.0

    def forward(self, tokens: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """``tokens`` sorted by expert, ``per_expert[e]`` of them for this module's expert
        ``e``; each run goes through its expert."""
        w1, w2 = self.w1, self.w2
        if hasattr(w1, "to_local"):  # DTensor views (under FSDP or a state-dict round trip)
            w1, w2 = w1.to_local(), w2.to_local()
        if self.gradient_scale != 1.0:
            w1 = _ScaleGradient.apply(w1, self.gradient_scale)
            w2 = _ScaleGradient.apply(w2, self.gradient_scale)
        outputs = [F.gelu(part @ w1[e]) @ w2[e]
                   for e, part in enumerate(tokens.split(per_expert))]
        return torch.cat(outputs) if outputs else tokens


class Dispatch(Protocol):
    def run(self, tokens: torch.Tensor, per_expert: list[int],
            experts: GroupedExperts) -> torch.Tensor: ...

    def total_counts(self, counts: torch.Tensor) -> torch.Tensor: ...


class LocalDispatch:
    """Every expert on this rank."""

    def run(self, tokens: torch.Tensor, per_expert: list[int],
            experts: GroupedExperts) -> torch.Tensor:
        return experts(tokens, per_expert)

    def total_counts(self, counts: torch.Tensor) -> torch.Tensor:
        return counts


class MoE(nn.Module):
    """A mixture-of-experts MLP: ``(..., dim)`` in, ``(..., dim)`` out."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int = 2, *,
                 capacity_factor: float | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ParallelizeError(f"MoE: top_k = {top_k} must be between 1 and the number "
                                   f"of experts, {experts}")
        self.num_experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = GroupedExperts(experts, dim, hidden)
        self.dispatch: Dispatch = LocalDispatch()
        self.aux_loss: torch.Tensor | None = None
        self.dropped = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(x), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        counts = torch.bincount(chosen.reshape(-1), minlength=self.num_experts)
        total = self.dispatch.total_counts(counts.to(probs.dtype))
        self.aux_loss = self.num_experts * (total / total.sum() * probs.mean(0)).sum()

        expert = chosen.reshape(-1)
        order = torch.argsort(expert, stable=True)  # by expert, then token order
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k)[order]
        weight, expert = weights.reshape(-1)[order], expert[order]
        if self.capacity_factor is not None:
            keep = self._within_capacity(expert, counts, x.shape[0])
            self.dropped = int((~keep).sum())
            token, weight, expert = token[keep], weight[keep], expert[keep]
        else:
            self.dropped = 0
        per_expert = torch.bincount(expert, minlength=self.num_experts).tolist()
        out = self.dispatch.run(x[token], per_expert, self.experts)
        y = torch.zeros_like(x).index_add_(0, token, out * weight[:, None].to(out.dtype))
        return y.reshape(shape)

    def _within_capacity(self, expert: torch.Tensor, counts: torch.Tensor, tokens: int
                         ) -> torch.Tensor:
        """Which of the expert-sorted assignments each expert takes: its first ``capacity``."""
        capacity = math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.arange(expert.numel(), device=expert.device) - starts[expert]
        return rank_in_expert < capacity
