"""FSDP2-style ``fully_shard``: per-parameter sharding on dim 0, HSDP on a 2-D mesh.

Each ``fully_shard`` call makes one *unit* of the parameters of a module (or of a list of
modules) not already in a child unit; every parameter is replaced by this rank's rows, and
the unit gathers them in one all-gather around its forward and reduce-scatters their
gradients in one collective in backward (then all-reduces them over the replicate dim on a
2-D mesh: hybrid sharding). torch's names and arguments, so FSDP2 code runs unchanged with
``torch.distributed.fsdp`` replaced by ``devmesh.parallel.fsdp`` (or ``devmesh.parallel``).

The modules, each with one job:

* :mod:`~devmesh.parallel.fsdp.api`: ``fully_shard`` and torch's other FSDP2 functions;
* :mod:`~devmesh.parallel.fsdp.module`: ``FSDPModule``, the methods a sharded module gains;
* :mod:`~devmesh.parallel.fsdp.unit`: one unit's lifecycle — shard, gather, save for
  backward, reduce, accumulate;
* :mod:`~devmesh.parallel.fsdp.state`: what a unit's modules hold in their parameter slots,
  and the legal moves between those states;
* :mod:`~devmesh.parallel.fsdp.collectives`: the byte layout of a unit's two collectives;
* :mod:`~devmesh.parallel.fsdp.order`: the recorded forward order that drives prefetching;
* :mod:`~devmesh.parallel.fsdp.weight_grads`: gathers kept for a pipeline's weight-gradient
  backward;
* :mod:`~devmesh.parallel.fsdp.mixed_precision`: ``MixedPrecisionPolicy``.
"""

from devmesh.parallel.fsdp.api import (
    batched_checks,
    fully_shard,
    parameters_grouped_with,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from devmesh.parallel.fsdp.mixed_precision import MixedPrecisionPolicy
from devmesh.parallel.fsdp.module import FSDPModule, GradientReductionHandle, UnshardHandle
from devmesh.parallel.fsdp.unit import FSDPUnit, users_saved_tensor_hooks
from devmesh.parallel.fsdp.weight_grads import (
    release_weight_gradient_gathers,
    weight_gradients_follow,
)

__all__ = ["fully_shard", "batched_checks", "MixedPrecisionPolicy", "FSDPUnit", "FSDPModule", "UnshardHandle",
           "GradientReductionHandle",
           "register_fsdp_forward_method", "share_comm_ctx", "parameters_grouped_with",
           "users_saved_tensor_hooks", "weight_gradients_follow",
           "release_weight_gradient_gathers"]
