"""One stage of a pipelined model on this rank, as torch's ``PipelineStage``: what
torch's schedule classes (:mod:`devmesh.parallel.pipeline.torch_api`) and traced pipelines
(:mod:`devmesh.parallel.pipeline.traced`) hand to devmesh's runner."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from devmesh.parallel.pipeline.split import PipelineError

__all__ = ["PipelineStage", "PipelineStageInfo"]


@dataclass(frozen=True, kw_only=True)
class PipelineStageInfo:
    """One forward of one stage (torch's): what a context registered with
    :meth:`PipelineStage.register_forward_context` is told about the forward it wraps.
    ``is_metadata_inference`` is always ``False`` here: devmesh runs no shape-probing
    forward (each step's first message announces its shapes)."""

    stage_index: int
    microbatch_index: int
    is_metadata_inference: bool = False


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
        self._forward_contexts: OrderedDict[int, Callable[[PipelineStageInfo],
                                                          AbstractContextManager]] = OrderedDict()

    def register_forward_context(
            self, context_factory: Callable[[PipelineStageInfo], AbstractContextManager]
    ) -> RemovableHandle:
        """Run each forward of this stage inside ``context_factory(info)`` (torch's): a fresh
        context per micro-batch, told the stage and micro-batch (:class:`PipelineStageInfo`)
        — to tag profiler ranges, pick per-micro-batch state. One at a time; the handle's
        ``remove()`` unregisters it. The context must not swallow the stage's exceptions."""
        if self._forward_contexts:
            raise PipelineError("A pipeline forward context is already registered; remove its "
                                "handle before registering another")
        handle = RemovableHandle(self._forward_contexts)
        self._forward_contexts[handle.id] = context_factory
        return handle

    def forward_context(self, microbatch: int) -> AbstractContextManager:
        """The registered context for this stage's forward of ``microbatch`` (none: a
        context that does nothing)."""
        if not self._forward_contexts:
            return contextlib.nullcontext()
        factory = next(iter(self._forward_contexts.values()))
        return factory(PipelineStageInfo(stage_index=self.stage_index,
                                          microbatch_index=microbatch))
