"""Pipeline parallelism: a model split into stages on the ``pp`` dim of a mesh, run by a
schedule (GPipe, 1F1B, interleaved 1F1B, looped BFS, and the zero-bubble ones: one stage per
rank, interleaved, in a V; DualPipeV) given as data (:mod:`devmesh.layout.schedule`)."""

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
from devmesh.parallel.pipeline.torch_api import (
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
    get_schedule_class,
)

__all__ = ["PipelineRunner", "PipelineError", "split_sequential", "balanced_boundaries",
           "Schedule", "Action", "ScheduleError", "SCHEDULES", "LOOPED", "build_schedule",
           "parse_schedule", "gpipe", "one_f_one_b", "interleaved_1f1b", "looped_bfs",
           "zero_bubble", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipe_v",
           "PipelineStage",
           "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
           "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV",
           "PipelineScheduleSingle",
           "PipelineScheduleMulti", "get_schedule_class"]

# torch.distributed.pipelining names devmesh does not provide: code whose imports were
# switched to devmesh learns what to use instead of a bare "cannot import name"
_NOT_PROVIDED = {
    "pipeline": "devmesh does not trace models: split an nn.Sequential with split_sequential",
    "Pipe": "devmesh does not trace models: split an nn.Sequential with split_sequential",
    "pipe_split": "devmesh does not trace models: split an nn.Sequential with split_sequential",
    "SplitPoint": "devmesh does not trace models: split_sequential(model, n, starts=[...]) "
    "takes split_spec's names (a dotted name splits inside a nested nn.Sequential)",
    "build_stage": "build a PipelineStage from the stage's module",
}


def __getattr__(name: str):
    if name in _NOT_PROVIDED:
        raise ImportError(
            f"devmesh.parallel.pipeline has no {name} (torch.distributed.pipelining's): "
            f"{_NOT_PROVIDED[name]}; or keep torch's pipelining on the devmesh mesh's group "
            "(mesh.get_group('pp'))", name=name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
