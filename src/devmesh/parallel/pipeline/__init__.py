"""Pipeline parallelism: a model split into stages on the ``pp`` dim of a mesh (by hand,
by :func:`split_sequential`, or by torch's tracer through :mod:`.traced`), run by a schedule
(GPipe, 1F1B, interleaved 1F1B, looped BFS, and the zero-bubble ones: one stage per rank,
interleaved, in a V; DualPipeV) given as data (:mod:`devmesh.layout.schedule`)."""

from devmesh.layout.schedule import (
    LOOPED,
    SCHEDULES,
    Action,
    Schedule,
    ScheduleError,
    build_schedule,
    dualpipe_v,
    gpipe,
    interleaved_1f1b,
    interleaved_zero_bubble,
    looped_bfs,
    one_f_one_b,
    parse_schedule,
    zbv_zero_bubble,
    zero_bubble,
)
from devmesh.parallel.pipeline.runner import PipelineRunner
from devmesh.parallel.pipeline.split import PipelineError, balanced_boundaries, split_sequential
from devmesh.parallel.pipeline.stage import PipelineStageInfo
from devmesh.parallel.pipeline.torch_api import (
    PipelineActivationLiveness,
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
    analyze_pipeline_activation_liveness,
    get_schedule_class,
)
from devmesh.parallel.pipeline.traced import Pipe, SplitPoint, build_stage, pipe_split, pipeline

__all__ = ["PipelineRunner", "PipelineError", "split_sequential", "balanced_boundaries",
           "Schedule", "Action", "ScheduleError", "SCHEDULES", "LOOPED", "build_schedule",
           "parse_schedule", "gpipe", "one_f_one_b", "interleaved_1f1b", "looped_bfs",
           "zero_bubble", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipe_v",
           "PipelineStage",
           "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
           "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV",
           "PipelineScheduleSingle",
           "PipelineScheduleMulti", "get_schedule_class",
           "pipeline", "Pipe", "SplitPoint", "pipe_split", "build_stage", "PipelineStageInfo",
           "PipelineActivationLiveness", "analyze_pipeline_activation_liveness"]
