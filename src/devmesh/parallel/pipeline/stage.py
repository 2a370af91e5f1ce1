"""One stage of a pipelined model on this rank, as torch's ``PipelineStage``: what
torch's schedule classes (:mod:`devmesh.parallel.pipeline.torch_api`) and traced pipelines
(:mod:`devmesh.parallel.pipeline.traced`) hand to devmesh's runner."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from devmesh.parallel.pipeline.split import PipelineError

__all__ = ["PipelineStage"]


class PipelineStage:
    """One stage of a pipelined model on this rank, as torch's ``PipelineStage``: the module
    (``submod``), its index among ``num_stages``, and the pipeline's process group."""

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int,
                 device: torch.device | str, input_args: Any = None, output_args: Any = None,
                 output_grads: Any = None, input_grads: Any = None,
                 group: dist.ProcessGroup | None = None, dw_builder: Any = None,
                 get_mesh: Any = None) -> None:
        # input_args / output_args / output_grads / input_grads: torch's shape hints, not
        # needed (each step's first message announces its shapes)
        if not 0 <= stage_index < num_stages:
            raise PipelineError(f"stage_index {stage_index} is not one of the {num_stages} "
                                "stages (0..num_stages-1)")
        if dw_builder is not None:
            raise PipelineError("dw_builder is not supported: devmesh's zero-bubble schedule "
                                "splits the backward itself")
        if get_mesh is not None:
            raise PipelineError("get_mesh is not supported: devmesh passes plain tensors "
                                "between stages; return local tensors from the stage "
                                "(DTensor.to_local(), or use_local_output=True in its TP plan)")
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.group = group
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
