"""``expert_parallel(moe, mesh["ep"])``: a :class:`~.moe.MoE` layer's experts split over an
``ep`` mesh dim, its tokens dispatched to them with all-to-all."""

from __future__ import annotations

import torch

from devmesh.errors import ParallelizeError
from devmesh.mesh import DeviceMesh
from devmesh.parallel.expert_parallel.dispatch import ExpertParallelDispatch
from devmesh.parallel.expert_parallel.moe import MoE
from devmesh.parallel.param import sharded_parameter
from devmesh.parallel.placement import place_parameter
from devmesh.tensor import Shard, distribute_tensor

__all__ = ["expert_parallel"]


def expert_parallel(moe: MoE, mesh: DeviceMesh, *, data_mesh: DeviceMesh | None = None
                    ) -> MoE:
    """Split ``moe``'s experts over the 1-D ``mesh`` (``experts / ep`` per rank, in order)
    and dispatch each rank's tokens to the ranks holding their experts (in place; returns
    ``moe``).

    The ranks of ``mesh`` are data-parallel ranks too (each has its own tokens): as data
    parallelism averages gradients over its ranks, the experts' gradients — summed over
    every rank's tokens by the dispatch — are divided by ``ep``. ``data_mesh``: the ranks
    whose tokens differ, over which the aux loss's assignment counts are summed (default:
    ``mesh``; with more data-parallel dims, e.g. ``mesh["dp", "ep"]``)."""
    if not isinstance(moe, MoE):
        raise ParallelizeError(f"expert_parallel takes a devmesh MoE layer, got "
                               f"{type(moe).__name__}")
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ParallelizeError(f"expert_parallel takes the 1-D mesh of the expert-parallel "
                               f"dim, e.g. mesh['ep'], got {mesh!r}")
    ep = mesh.size()
    if moe.num_experts % ep:
        raise ParallelizeError(
            f"expert_parallel: {moe.num_experts} experts do not split evenly over ep = {ep}: "
            f"use a number of experts divisible by {ep}, or an ep size dividing "
            f"{moe.num_experts}")
    for name in ("w1", "w2"):
        param = moe.experts._parameters[name]
        split = distribute_tensor(param.detach(), mesh, [Shard(0)])
        new = sharded_parameter(split.to_local().contiguous(), param.requires_grad, mesh,
                                split.spec)
        place_parameter(moe.experts, name, new)
    moe.experts.gradient_scale = 1.0 / ep
    moe.dispatch = ExpertParallelDispatch(mesh, data_mesh or mesh)
    return moe


def expert_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of every MoE's experts in ``module`` (those expert parallelism
    splits; the rest are data-parallel everywhere)."""
    return [p for m in module.modules() if isinstance(m, MoE) for p in m.experts.parameters()]
