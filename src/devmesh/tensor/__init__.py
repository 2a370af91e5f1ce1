"""Sharded tensors: explicit nested specs, planned redistribution, autograd."""

from devmesh.layout.placement import Partial, Placement, Replicate, Shard, as_placement
from devmesh.layout.plan import Plan, explain_redistribute, plan_redistribute
from devmesh.tensor.sharded import ShardedTensor, distribute_tensor
from devmesh.tensor.factories import empty, full, ones, rand, randn, zeros
from devmesh.layout.spec import NestedShardingError, ShardingSpec, ShardingSpecError

__all__ = [
    "Partial", "Placement", "Replicate", "Shard", "as_placement", "ShardingSpec", "ShardingSpecError",
    "NestedShardingError", "ShardedTensor", "distribute_tensor", "Plan", "plan_redistribute",
    "explain_redistribute", "zeros", "ones", "empty", "full", "rand", "randn",
]
