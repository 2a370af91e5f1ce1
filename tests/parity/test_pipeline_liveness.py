"""Activation liveness of a pipeline rank (devmesh.layout.liveness): when each activation is
held, and the fewest buffers holding them all — checked from first principles on every
schedule, and against torch's ``analyze_pipeline_activation_liveness`` where torch has it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from devmesh.layout.liveness import activation_liveness, assign_slots
from devmesh.layout.schedule import SCHEDULES, build_schedule

GRANULARITIES = ("microbatch", "stage_microbatch")


def _stages_on(schedule, rank):
    return [s for s in range(schedule.stages) if schedule.rank_of(s) == rank]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("ranks,microbatches", [(2, 4), (4, 8), (3, 5)])
def test_slots_are_the_peak_of_activations_held_and_never_shared_while_live(
        name, ranks, microbatches):
    if name == "dualpipe-v":  # needs a micro-batch per stage at least
        microbatches = max(microbatches, 2 * ranks)
    schedule = build_schedule(name, ranks, microbatches)
    for rank in range(ranks):
        for granularity in GRANULARITIES:
            plan = activation_liveness(schedule, pp_rank=rank,
                                       stage_indices=_stages_on(schedule, rank),
                                       granularity=granularity)
            lifetimes = {key: plan.get_activation_lifetime(*key)
                         for key in plan.slot_by_stage_and_microbatch}
            # one slot never holds two activations live at the same position
            by_slot: dict[int, list[tuple[int, int]]] = {}
            for key, span in lifetimes.items():
                by_slot.setdefault(plan.slot_for(*key), []).append(span)
            for spans in by_slot.values():
                distinct = sorted(set(spans))
                assert all(a[1] < b[0] for a, b in zip(distinct, distinct[1:]))
            # and no fewer slots would do: as many as are live at once at the peak
            positions = len(schedule.actions[rank])
            peak = max(len({span for span in lifetimes.values() if span[0] <= p <= span[1]})
                       for p in range(positions))
            assert plan.num_slots == peak == len(by_slot)


def test_one_f_one_b_holds_the_warm_up_count_and_gpipe_every_micro_batch():
    for ranks, microbatches in ((4, 8), (4, 2), (2, 6)):
        one_f_one_b = build_schedule("1f1b", ranks, microbatches)
        gpipe = build_schedule("gpipe", ranks, microbatches)
        for rank in range(ranks):
            slots = activation_liveness(one_f_one_b, pp_rank=rank, stage_indices=[rank],
                                        granularity="stage_microbatch").num_slots
            assert slots == min(ranks - rank, microbatches)
            assert activation_liveness(gpipe, pp_rank=rank, stage_indices=[rank],
                                       granularity="microbatch").num_slots == microbatches


def test_slots_are_assigned_lowest_free_first_and_reused_only_after_the_end():
    assert assign_slots([(0, 2), (1, 3), (3, 4), (5, 6)]) == ([0, 1, 0, 0], 2)
    assert assign_slots([(0, 2), (2, 3)]) == ([0, 1], 2)  # inclusive: position 2 is shared


def test_bad_selections_are_refused_naming_the_fix():
    schedule = build_schedule("interleaved-1f1b", 2, 4)
    with pytest.raises(ValueError, match="Unsupported activation granularity: 'layer'"):
        activation_liveness(schedule, pp_rank=0, stage_indices=[0], granularity="layer")
    with pytest.raises(ValueError, match="stage_indices must not be empty"):
        activation_liveness(schedule, pp_rank=0, stage_indices=[], granularity="microbatch")
    with pytest.raises(ValueError, match="stage_indices must be unique"):
        activation_liveness(schedule, pp_rank=0, stage_indices=[0, 0], granularity="microbatch")
    with pytest.raises(ValueError, match="Rank 2 is not present"):
        activation_liveness(schedule, pp_rank=2, stage_indices=[0], granularity="microbatch")
    with pytest.raises(ValueError, match=r"rank 0 has none for .stage, micro-batch. "
                                         r"\[\(1, 0\).*its stages are \[0, 2\]"):
        activation_liveness(schedule, pp_rank=0, stage_indices=[1], granularity="microbatch")
    plan = activation_liveness(schedule, pp_rank=0, stage_indices=[0, 2],
                               granularity="microbatch")
    with pytest.raises(ValueError, match="No activation slot exists for stage 1, microbatch 0"):
        plan.slot_for(1, 0)


_AGAINST_TORCH = textwrap.dedent("""
    import torch.distributed as dist
    import torch.distributed.pipelining as torchs
    from torch import nn
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import devmesh.parallel.pipeline as ours

    pp, microbatches = 4, 8
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
    for name in ("ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
                 "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        built = {}
        for lib in (torchs, ours):
            data = ours.build_schedule(getattr(ours, name).schedule_name, pp, microbatches)
            mine = [s for s in range(data.stages) if data.rank_of(s) == 0]
            stages = [lib.PipelineStage(nn.Linear(2, 2), s, data.stages, "cpu") for s in mine]
            built[lib] = getattr(lib, name)(stages, microbatches, loss_fn=lambda y, t: y.sum())
        for rank in range(pp):
            held = [s for s in range(data.stages) if data.rank_of(s) == rank]
            for granularity in ("microbatch", "stage_microbatch"):
                theirs, mine = (lib.analyze_pipeline_activation_liveness(
                    built[lib], pp_rank=rank, stage_indices=held, granularity=granularity)
                    for lib in (torchs, ours))
                assert theirs.num_slots == mine.num_slots, (name, rank, granularity)
                assert (dict(theirs.slot_by_stage_and_microbatch)
                        == dict(mine.slot_by_stage_and_microbatch)), (name, rank, granularity)
    print("same")
""")


def test_slots_equal_torchs_analysis_on_every_multi_stage_schedule():
    import torch.distributed.pipelining as torchs

    if not hasattr(torchs, "analyze_pipeline_activation_liveness"):
        pytest.skip("this torch has no analyze_pipeline_activation_liveness (torch 2.15 added "
                    "it): the comparison runs under .ci/compat 2.15.0")
    done = subprocess.run([sys.executable, "-c", _AGAINST_TORCH], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "same", done.stderr[-3000:]
