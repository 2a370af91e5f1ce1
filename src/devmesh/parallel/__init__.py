"""Parallelisms on a mesh: replicate (DDP), fully_shard (FSDP, HSDP), tensor parallelism,
context parallelism, expert parallelism (mixture of experts), pipeline stages, gradient clipping, state dicts and sharded checkpoints."""

from devmesh.parallel.checkpoint import load_checkpoint, save_checkpoint
from devmesh.parallel.context_parallel import (
    context_parallel,
    gather_sequence,
    ring_attention,
    sequence_positions,
    shard_sequence,
)
from devmesh.parallel.expert_parallel import MoE, expert_parallel
from devmesh.parallel.fsdp import (
    FSDPModule,
    FSDPUnit,
    GradientReductionHandle,
    MixedPrecisionPolicy,
    UnshardHandle,
    batched_checks,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from devmesh.parallel.param import ParallelizeError, as_sharded, get_layout
from devmesh.parallel.replicate import ReplicateModule, replicate
from devmesh.parallel.tensor_parallel import (
    ColwiseParallel,
    ExpertsTensorParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from devmesh.parallel.grads import clip_grad_norm_, route_torchs_clip_grad_norm
from devmesh.parallel.grad_scaler import GradScaler, route_torchs_grad_scaler
from devmesh.parallel.state_dict import load_state_dict, state_dict
from devmesh.parallel.torch_ddp import route_torchs_ddp

__all__ = [
    "fully_shard", "batched_checks", "MixedPrecisionPolicy", "FSDPUnit", "FSDPModule", "UnshardHandle",
    "GradientReductionHandle", "register_fsdp_forward_method", "share_comm_ctx", "replicate",
    "ReplicateModule", "parallelize_module", "context_parallel", "ring_attention",
    "shard_sequence", "gather_sequence", "sequence_positions", "MoE", "expert_parallel",
    "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
    "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput",
    "ExpertsTensorParallel", "loss_parallel", "clip_grad_norm_", "GradScaler", "state_dict",
    "load_state_dict", "describe",
    "get_layout", "as_sharded", "ParallelizeError", "save_checkpoint", "load_checkpoint",
    "parallelize",
]


def __getattr__(name: str):
    """``describe`` lives with the other pictures (:mod:`devmesh.pictures`),
    ``parallelize`` with the integrations of other libraries' models
    (:mod:`devmesh.integrations`), and ``loss_parallel`` is torch's (see
    :mod:`.tensor_parallel`); all stay reachable here, imported on first use."""
    if name == "parallelize":
        from devmesh.integrations import parallelize

        return parallelize
    if name == "describe":
        from devmesh.pictures.describe import describe

        return describe
    if name == "loss_parallel":
        from devmesh.parallel import tensor_parallel

        return tensor_parallel.loss_parallel
    raise AttributeError(f"module 'devmesh.parallel' has no attribute {name!r}")

# torch's clip_grad_norm_ and GradScaler, as code written for torch's FSDP2 calls them, clip
# a devmesh-sharded model by its global norm and skip an overflowing step on every rank (see
# route_torchs_clip_grad_norm, route_torchs_grad_scaler), and torch's DistributedDataParallel
# refuses a devmesh-split model instead of overwriting its blocks (route_torchs_ddp); other
# calls stay torch's own
route_torchs_clip_grad_norm()
route_torchs_grad_scaler()
route_torchs_ddp()
