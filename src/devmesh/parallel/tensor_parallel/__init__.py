"""Tensor and sequence parallelism with torch's API: styles, ``parallelize_module``, and the
autograd-aware collectives that move activations between layouts."""

from devmesh.parallel.tensor_parallel.api import parallelize_module
from devmesh.parallel.tensor_parallel.styles import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

# torch's own: it works on the DTensor a style with use_local_output=False hands on
from torch.distributed.tensor.parallel import loss_parallel  # noqa: E402

__all__ = [
    "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
    "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "parallelize_module", "loss_parallel",
]
