"""``expert_parallel(moe, mesh["ep"])``: a :class:`~.moe.MoE` layer's experts — or a
transformers experts module's (:mod:`.stacked`) — split over an ``ep`` mesh dim, its tokens
dispatched to them with all-to-all."""

from __future__ import annotations

import torch

from devmesh.errors import ParallelizeError
from devmesh.mesh import DeviceMesh
from devmesh.parallel.expert_parallel.dispatch import ExpertParallelDispatch
from devmesh.parallel.expert_parallel.moe import MoE
from devmesh.parallel.expert_parallel.stacked import (
    is_stacked_experts,
    split_by_expert,
    split_stacked_experts,
)

__all__ = ["expert_parallel"]


def expert_parallel(moe: torch.nn.Module, mesh: DeviceMesh, *,
                    data_mesh: DeviceMesh | None = None) -> torch.nn.Module:
    """Split ``moe``'s experts over the 1-D ``mesh`` (``experts / ep`` per rank, in order)
    and dispatch each rank's tokens to the ranks holding their experts (in place; returns
    ``moe``).

    The ranks of ``mesh`` are data-parallel ranks too (each has its own tokens): as data
    parallelism averages gradients over its ranks, the experts' gradients — summed over
    every rank's tokens by the dispatch — are divided by ``ep``. ``data_mesh``: the ranks
    whose tokens differ, over which the aux loss's assignment counts are summed (default:
    ``mesh``; with more data-parallel dims, e.g. ``mesh["dp", "ep"]``).

    ``moe`` may also be an experts module as transformers or torchtitan writes it, holding
    its experts' weights stacked along dim 0 and called with ``(hidden_states, top_k_index,
    top_k_weights)`` (Mixtral's ``block.mlp.experts``) or with ``(x,
    num_tokens_per_expert)``, the tokens sorted by expert (torchtitan's ``GroupedExperts``):
    its own computation is kept, its weights split
    (:mod:`devmesh.parallel.expert_parallel.stacked`)."""
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ParallelizeError(f"expert_parallel takes the 1-D mesh of the expert-parallel "
                               f"dim, e.g. mesh['ep'], got {mesh!r}")
    if not isinstance(moe, MoE):
        if is_stacked_experts(moe):
            return split_stacked_experts(moe, mesh, data_mesh or mesh)
        raise ParallelizeError(
            f"expert_parallel takes a devmesh MoE layer or an experts module holding its "
            f"experts' weights stacked along dim 0 (an int num_experts, a forward taking "
            f"hidden_states, top_k_index, top_k_weights: transformers' Mixtral, Qwen-MoE; or "
            f"x, num_tokens_per_expert: torchtitan's GroupedExperts), got "
            f"{type(moe).__name__}")
    if isinstance(moe.dispatch, ExpertParallelDispatch):
        raise ParallelizeError(
            f"expert_parallel: this MoE is already split over an ep mesh of "
            f"{moe.dispatch.mesh.size()} ranks; call expert_parallel once per MoE layer")
    ep = mesh.size()
    if moe.num_experts % ep:
        raise ParallelizeError(
            f"expert_parallel: {moe.num_experts} experts do not split evenly over ep = {ep}: "
            f"use a number of experts divisible by {ep}, or an ep size dividing "
            f"{moe.num_experts}")
    split_by_expert(moe.experts, ["w1", "w2"], mesh)
    moe.experts.gradient_scale = 1.0 / ep
    moe.dispatch = ExpertParallelDispatch(mesh, data_mesh or mesh)
    return moe


def expert_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of every MoE's experts in ``module``, and of every stacked experts
    module (those expert parallelism splits; the rest are data-parallel everywhere)."""
    return [p for m in module.modules() if isinstance(m, MoE) for p in m.experts.parameters()
            ] + [p for m in module.modules() if is_stacked_experts(m)
                 for p in m._parameters.values()]
