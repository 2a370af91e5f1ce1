"""A pipeline step lowered into per-rank programs (docs/design/pipelines.md): every built-in
schedule lowers into programs that pass every check, and each check refuses a program
broken in the way it names."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from devmesh.layout.pipeline_messages import nccl_placement, upcoming
from devmesh.layout.pipeline_program import (
    Instruction,
    Op,
    format_programs,
    lower,
    program_problem,
)
from devmesh.layout.schedule import SCHEDULES, build_schedule, stage_bounds

# every schedule takes these (dualpipe-v: 2 x ranks micro-batches; interleaved: equal rounds)
SIZES = [(2, 4), (2, 6), (4, 8), (3, 6)]


def _programs(schedule, backend="gloo", **kwargs):
    return [lower(schedule, r, backend, **kwargs) for r in range(schedule.ranks)]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_every_built_in_schedule_lowers_into_programs_that_pass_every_check(name, backend):
    for ranks, microbatches in SIZES:
        schedule = build_schedule(name, ranks, microbatches)
        for training in (True, False):
            programs = _programs(schedule, backend, training=training)
            assert program_problem(programs) is None, (name, ranks, microbatches, training)
            for program in programs:
                computes = tuple(i.action for i in program.computes)
                expected = schedule.actions[program.rank]
                if not training:
                    expected = tuple(a for a in expected if a.kind == "F")
                assert computes == expected
                # a post between every two computes, and one before the first
                ops = [i.op is Op.POST for i in program.instructions]
                assert ops[::2] == [True] * (len(computes) + 1) and not any(ops[1::2])


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_each_stage_is_reduced_once_at_its_last_backward_that_adds_weight_gradients(name):
    schedule = build_schedule(name, 2, 4)
    for rank in range(2):
        actions = schedule.actions[rank]
        stages = {a.stage for a in actions}
        for whole in (frozenset(), frozenset(stages)):
            program = lower(schedule, rank, whole=whole)
            kinds = ("B", "I") if whole else ("B", "W")
            last = {a.stage: a for a in actions if a.kind in kinds}
            assert program.reducing == frozenset(last.values())
        assert lower(schedule, rank, training=False).reducing == frozenset()


def _replace(program, index, **changes):
    instructions = list(program.instructions)
    instructions[index] = dataclasses.replace(instructions[index], **changes)
    return dataclasses.replace(program, instructions=tuple(instructions))


def test_a_reduction_before_a_backward_that_adds_to_it_is_refused():
    schedule = build_schedule("1f1b", 2, 4)
    programs = _programs(schedule)
    program = programs[1]
    last = max(i for i, ins in enumerate(program.instructions) if ins.reduce)
    first_b = next(i for i, ins in enumerate(program.instructions)
                   if ins.op is Op.BACKWARD)
    broken = _replace(_replace(program, last, reduce=False), first_b, reduce=True)
    problem = program_problem([programs[0], broken])
    assert problem.startswith("rank 1: stage 1's gradients are reduced in B0@1, before B3@1")
    twice = _replace(program, first_b, reduce=True)
    assert "reduced 2 times" in program_problem([programs[0], twice])
    never = _replace(program, last, reduce=False)
    assert "reduced 0 times" in program_problem([programs[0], never])


def test_a_compute_whose_receive_no_post_makes_is_refused():
    schedule = build_schedule("gpipe", 2, 2)
    programs = _programs(schedule)
    # rank 1's first post asks for the first activation: without it F0@1 waits forever
    broken = _replace(programs[1], 0, receives=())
    assert program_problem([programs[0], broken]) == (
        "rank 1: F0@1 waits for a0@1, whose receive no post before it makes")


def test_a_message_nobody_receives_and_a_missing_compute_are_refused():
    schedule = build_schedule("gpipe", 2, 2)
    programs = _programs(schedule)
    # rank 0 no longer sends a1@1 (its post after F1@0 sends nothing)
    post = next(i for i, ins in enumerate(programs[0].instructions)
                if ins.op is Op.POST and any(m.microbatch == 1 for m in ins.sends))
    silent = _replace(programs[0], post, sends=())
    assert program_problem([silent, programs[1]]) == (
        "a rank receives a1@1, which no rank sends")
    instructions = tuple(i for i in programs[1].instructions if str(i) != "B1@1+reduce")
    dropped = dataclasses.replace(programs[1], instructions=instructions)
    assert program_problem([programs[0], dropped]) == (
        "rank 1: its computes are not the schedule's actions in order (missing B1@1)")
    assert "one program per rank" in program_problem(programs[:1])
    forward = dataclasses.replace(programs[1], training=False)
    assert "one program per rank" in program_problem([programs[0], forward])


def test_a_forward_only_program_reduces_nothing():
    schedule = build_schedule("1f1b", 2, 2)
    programs = _programs(schedule, training=False)
    f = next(i for i, ins in enumerate(programs[0].instructions) if ins.op is Op.FORWARD)
    broken = _replace(programs[0], f, reduce=True)
    assert program_problem([broken, programs[1]]) == (
        "rank 0: a forward-only pass reduces no gradient")


def test_nccl_programs_move_the_receives_nccl_placement_moves():
    """Interleaved 1F1B with more micro-batches than ranks deadlocks under NCCL's fused
    order alone: its NCCL program posts some receives earlier than gloo's would not, and
    the check plays it free of deadlock."""
    schedule = build_schedule("interleaved-1f1b", 2, 6)
    nccl = _programs(schedule, "nccl")
    assert program_problem(nccl) is None
    placement = nccl_placement(schedule)
    assert placement  # this schedule needs early receives on NCCL
    for rank, placed in placement.items():
        for boundary, messages in placed.items():
            post = nccl[rank].instructions[2 * boundary]  # the post before actions[boundary]
            assert post.op is Op.POST and set(messages) <= set(post.receives)
            # NCCL's own order ("fused", nothing moved) would not post them there
            fused = upcoming(schedule, schedule.actions[rank], boundary, "fused")
            assert not set(messages) & set(fused)


def test_lowering_refuses_a_backend_or_rank_it_does_not_know():
    schedule = build_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="backend must be one of"):
        lower(schedule, 0, "mpi")
    with pytest.raises(ValueError, match="rank 2 is not one of"):
        lower(schedule, 2)


def test_an_instruction_prints_as_the_plan_shows_it():
    schedule = build_schedule("1f1b", 2, 2)
    program = lower(schedule, 0)
    assert str(program) == "F0@0 {>header@1 >a0@1 <g0@0} F1@0 {>a1@1 <g1@0} B0@0 B1@0+reduce"
    assert str(program).endswith("B1@0+reduce")
    assert str(Instruction(Op.POST)) == "{}"


def test_devmesh_plan_prints_the_checked_programs():
    out = subprocess.run([sys.executable, "-m", "devmesh", "plan", "--schedule", "1f1b",
                          "--pp", "2", "--microbatches", "2", "--program", "nccl",
                          "--rank", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "rank 1: {<a0@1} F0@1 B0@1 {>g0@0 <a1@1} F1@1 B1@1+reduce {>g1@0}" in text
    assert "rank 0:" not in text.split("one training step")[1]
    assert "no deadlock under NCCL's rules" in text
    assert format_programs(build_schedule("1f1b", 2, 2), "nccl", 1) in text
    bad = subprocess.run([sys.executable, "-m", "devmesh", "plan", "--schedule", "1f1b",
                          "--pp", "2", "--program", "gloo", "--rank", "7"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--rank 7, but the schedule has 2 ranks" in bad.stderr


@pytest.mark.parametrize("layers,stages", [(32, 4), (7, 3), (5, 5), (2, 1), (10, 4)])
def test_stages_split_the_layers_evenly_the_earlier_ones_taking_the_extra(layers, stages):
    bounds = stage_bounds(layers, stages)
    assert bounds[0][0] == 0 and bounds[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [end - start for start, end in bounds]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("stages", [0, 6])
def test_more_stages_than_layers_are_refused_naming_the_sizes_that_work(stages):
    with pytest.raises(ValueError, match="use 1 to 5 stages"):
        stage_bounds(5, stages)
