"""Pipeline parallelism: a model split into stages on the ``pp`` dim of a mesh, run by a
schedule (GPipe, 1F1B, interleaved 1F1B, zero-bubble) given as data
(:mod:`devmesh.layout.schedule`)."""

from devmesh.layout.schedule import (
    SCHEDULES,
    Action,
    Schedule,
    ScheduleError,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zero_bubble,
)
from devmesh.parallel.pipeline.runner import PipelineRunner
from devmesh.parallel.pipeline.split import PipelineError, balanced_boundaries, split_sequential
from devmesh.parallel.pipeline.torch_api import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

__all__ = ["PipelineRunner", "PipelineError", "split_sequential", "balanced_boundaries",
           "Schedule", "Action", "ScheduleError", "SCHEDULES", "build_schedule", "gpipe",
           "one_f_one_b", "interleaved_1f1b", "zero_bubble", "PipelineStage", "ScheduleGPipe",
           "Schedule1F1B", "ScheduleInterleaved1F1B"]
