"""Tensor and sequence parallelism with torch's API: styles, ``parallelize_module``, and the
autograd-aware collectives that move activations between layouts."""

from devmesh.parallel.tensor_parallel.api import parallelize_module
from devmesh.parallel.tensor_parallel.experts import ExpertsTensorParallel
from devmesh.parallel.tensor_parallel.styles import (
    ColwiseParallel,
    HeadwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    ReplicatedWithGradSum,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
    "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "ReplicatedWithGradSum",
    "HeadwiseParallel", "ExpertsTensorParallel", "parallelize_module", "loss_parallel",
]


def __getattr__(name: str):
    """``loss_parallel`` is torch's own (it works on the DTensor a style with
    ``use_local_output=False`` hands on), imported when first asked for: importing torch's
    tensor parallelism costs a process ~0.6 s that a script without it should not pay."""
    if name == "loss_parallel":
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
