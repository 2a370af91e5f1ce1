"""Pipeline parallelism (issue 11, items 2-3): schedules as data checked without processes,
and every schedule trained on 4 real pipeline ranks equal to single-process training."""

from __future__ import annotations

import copy
import functools
import itertools
import json
import math
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from devmesh import comm_stats, init_device_mesh
from devmesh.parallel import state_dict
from devmesh.layout.pipeline_messages import fifo_problem, nccl_problem
from devmesh.layout.schedule import (
    IN_A_V,
    LOOPED,
    SCHEDULES,
    Action,
    Schedule,
    ScheduleError,
    build_schedule,
)
from devmesh.parallel.pipeline import (
    PipelineError,
    PipelineRunner,
    balanced_boundaries,
    split_sequential,
)
from helpers import hand_written_schedule
from pipeline_cases import (
    ChunkKeepingTheOtherHalf,
    MatmulWork,
    block_model,
    check_composed_like_one_process,
    make_model,
    reference,
    train_composed,
    train_pipelined,
)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_runs_every_piece_once_and_never_waits_on_itself(name):
    for ranks, microbatches in itertools.product((1, 2, 3, 4), (1, 2, 3, 4, 6, 8)):
        if name == "dualpipe-v" and microbatches < 2 * ranks:  # as torch's, refused
            with pytest.raises(ScheduleError, match="at least as many micro-batches as st"):
                build_schedule(name, ranks, microbatches)
            continue
        schedule = build_schedule(name, ranks, microbatches)
        timeline = schedule.simulate()  # raises if some rank would wait forever
        seen = sorted((t.action.kind, t.action.stage, t.action.microbatch) for t in timeline)
        split = {(t.action.stage, t.action.microbatch) for t in timeline if t.action.kind == "I"}
        if "zero-bubble" in name:
            assert len(split) == schedule.stages * microbatches  # every backward split
        elif name == "dualpipe-v":  # some split (warm-up, cool-down), the others whole
            assert 0 < len(split) < schedule.stages * microbatches
        else:
            assert not split
        assert seen == sorted([("F", s, m) for s in range(schedule.stages)
                               for m in range(microbatches)]
                              + [(kind, s, m) for s in range(schedule.stages)
                                 for m in range(microbatches)
                                 for kind in (("I", "W") if (s, m) in split else ("B",))])
        for t in timeline:  # each action runs on the rank holding its stage
            assert t.rank == schedule.rank_of(t.action.stage)


_TORCH_LOOPED_ORDER = """
import json, sys
import torch, torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed import pipelining
orders = {}
for name, cases in json.loads(sys.argv[1]).items():
    kind, orders[name] = getattr(pipelining, name), {}
    for pp, n, v in cases:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
        in_a_v = name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
        mine = (0, 2 * pp - 1) if in_a_v else range(0, pp * v, pp)
        stages = [pipelining.PipelineStage(nn.Linear(2, 2), s, pp * v, torch.device("cpu"))
                  for s in mine]
        try:
            order = kind(stages, n, loss_fn=torch.nn.functional.mse_loss).pipeline_order
            # DualPipeV pairs a forward and a backward in one action: its parts, in order
            orders[name][f"{pp},{n},{v}"] = [[str(part) for a in order[r] if a is not None
                                              for part in (a.sub_actions or (a,))]
                                             for r in range(pp)]
        except ValueError:
            orders[name][f"{pp},{n},{v}"] = None
        dist.destroy_process_group()
print(json.dumps(orders))
"""
LOOPED_TORCH_CLASSES = {"interleaved-1f1b": "ScheduleInterleaved1F1B",
                        "looped-bfs": "ScheduleLoopedBFS",
                        "interleaved-zero-bubble": "ScheduleInterleavedZeroBubble",
                        "zbv-zero-bubble": "ScheduleZBVZeroBubble",
                        "dualpipe-v": "ScheduleDualPipeV"}


def _looped_cases(name: str) -> list[tuple[int, int, int]]:
    """(ranks, micro-batches, stages per rank) compared with torch for schedule ``name``."""
    per_rank = (2,) if name in IN_A_V else (2, 3)
    return list(itertools.product(range(1, 7), range(1, 17), per_rank))


@functools.lru_cache(maxsize=1)
def _torch_looped_orders() -> dict[str, dict[str, list | None]]:
    """torch's action orders for every looped schedule's cases, from one subprocess (one
    import of torch's pipelining over its fake process group for all five classes)."""
    cases = {torch_class: _looped_cases(name) for name, torch_class in LOOPED_TORCH_CLASSES.items()}
    done = subprocess.run([sys.executable, "-c", _TORCH_LOOPED_ORDER, json.dumps(cases)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("name, torch_class", list(LOOPED_TORCH_CLASSES.items()))
def test_looped_schedules_take_every_micro_batch_count_torch_takes_in_torchs_order(
        name, torch_class):
    """torch's ``ScheduleInterleaved1F1B`` runs micro-batch counts that are not a multiple
    of the ranks (equal rounds of ``n // max(1, n // ranks)``: 6 on 4 ranks, 2 on 4); code
    moved from torch to devmesh must not be refused them. For every (ranks, micro-batches,
    stages per rank) here, devmesh accepts exactly what torch accepts (torch's schedules
    built over its fake process group, in a subprocess), with torch's action order on every
    rank (zero-bubble V and DualPipeV: two stages per rank in a V; DualPipeV's paired forward
    and backward as two actions), and each order runs (simulated) with each stream of
    messages used in the order sent, and without deadlock on NCCL."""
    cases = _looped_cases(name)
    theirs = _torch_looped_orders()[torch_class]
    refused = 0
    for ranks, microbatches, virtual in cases:
        torch_order = theirs[f"{ranks},{microbatches},{virtual}"]
        if torch_order is None:
            refused += 1
            if name == "dualpipe-v":  # fewer micro-batches than stages, as torch
                assert microbatches < 2 * ranks
                with pytest.raises(ScheduleError, match=f"use {2 * ranks} micro-batches or "
                                                        "more, or zbv-zero-bubble"):
                    build_schedule(name, ranks, microbatches, virtual)
                continue
            with pytest.raises(ScheduleError, match=f"{name} runs .* equal rounds") as info:
                build_schedule(name, ranks, microbatches, virtual)
            # the counts it names instead are ones both accept
            for fit in re.findall(r"use (\d+)(?: or (\d+))? micro-batches", str(info.value))[0]:
                if fit:
                    assert theirs.get(f"{ranks},{fit},{virtual}", []) is not None
                    build_schedule(name, ranks, int(fit), virtual)
            continue
        schedule = build_schedule(name, ranks, microbatches, virtual)
        assert schedule.stages == ranks * virtual
        ours = [[f"{a.stage}{a.kind}{a.microbatch}" for a in seq] for seq in schedule.actions]
        assert ours == torch_order, (ranks, microbatches, virtual)
        schedule.simulate()
        assert fifo_problem(schedule) is None
        # NCCL: one rank sending to itself is refused; past 2 rounds of warm-up, steady
        # state and cool-down an order only repeats its steady state: the longest stands
        # for the rest
        if ranks > 1 and (microbatches <= 2 * ranks + 1 or microbatches == 16):
            assert nccl_problem(schedule) is None
    # interleaved: e.g. 9 on 4 ranks (2 rounds cannot be equal); DualPipeV: fewer than the
    # stages; the others take any count
    if name == "dualpipe-v":
        assert refused == sum(m < 2 * r for r, m, _ in cases)
    else:
        assert (0 < refused < len(cases) // 4) if name.startswith("interleaved") else not refused


def test_bubbles_match_the_known_formulas():
    for s, m in ((4, 8), (2, 6), (8, 8)):
        expected = (s - 1) / (m + s - 1)  # GPipe and 1F1B, backward = 2 x forward
        assert build_schedule("gpipe", s, m).bubble() == pytest.approx(expected)
        assert build_schedule("1f1b", s, m).bubble() == pytest.approx(expected)
        assert build_schedule("interleaved-1f1b", s, m).bubble() < expected
        assert build_schedule("zero-bubble", s, m).bubble() < expected / 2


def test_message_latency_delays_only_inputs_from_another_rank():
    # 2 ranks, 1 micro-batch: F0@0, message, F0@1, B0@1, message, B0@0 — 6 units of work
    # on a makespan of 6 + 2 latencies
    two = build_schedule("1f1b", 2, 1)
    assert two.bubble() == pytest.approx(1 - 6 / 12)
    assert two.bubble(latency=1.0) == pytest.approx(1 - 6 / 16)
    one = build_schedule("gpipe", 1, 4)  # every stage on one rank: nothing crosses
    assert one.bubble(latency=5.0) == one.bubble() == 0.0


def test_measured_costs_per_action_replace_the_costs_per_kind():
    from devmesh.layout.schedule import Action

    # the last stage's forward (head and loss) costs 3 instead of 1: rank 0 waits 2 more
    two = build_schedule("1f1b", 2, 1)
    slow_head = {Action("F", 1, 0): 3.0}
    assert two.bubble(slow_head) == pytest.approx(1 - 8 / 16)
    timeline = {t.action: (t.start, t.end) for t in two.simulate(slow_head)}
    assert timeline[Action("B", 1, 0)] == (4.0, 6.0)


@pytest.mark.parametrize("ranks, microbatches, problem", [
    (["F0@0 F1@0 B0@0", "F0@1 B0@1 F1@1 B1@1"], 2,
     "micro-batch 1 of stage 0 has no backward (B1@0, or I1@0 and W1@0): its gradients would "
     "be left out of the step"),
    (["F0@0 F1@0", "F0@1 F1@1"], 2, None),  # forward only: what an evaluation plays
    (["F0@0 F0@1 B0@1 B0@0", ""], 1, "F0@1 is in rank 0's list, but stage 1 lives on rank 1"),
    (["F0@0 F0@0 B0@0", "F0@1 B0@1"], 1, "F0@0 appears twice in rank 0's list"),
    (["F0@0 B0@0 W0@0", "F0@1 B0@1"], 1, "has a whole backward (B) and a split one (I, W)"),
    (["F0@0 I0@0", "F0@1 B0@1"], 1, "micro-batch 0 of stage 0 has no W0@0"),
    (["F0@0 B0@0", "B0@1"], 1, "micro-batch 0 of stage 1 has no forward (F0@1)"),
    (["F0@0 B0@0", "F0@1 B0@1 F1@1 B1@1"], 1, "F1@1 names micro-batch 1, outside 0..0"),
    (["F0@0 B0@0", "F0@1 X0@1 B0@1"], 1, "X0@1 has kind 'X'"),
    (["B0@0 F0@0", "F0@1 B0@1"], 1, "cannot proceed: each rank waits for an input that comes "
     "later ({0: 'B0@0', 1: 'F0@1'})"),
    (["F0@0 W0@0 I0@0", "F0@1 B0@1"], 1, "cannot proceed"),
])
def test_a_hand_written_schedule_is_checked_when_built(ranks, microbatches, problem):
    # a micro-batch left without a backward would train on part of the batch, silently; one
    # that waits on itself would hang every rank: both are refused before anything runs
    if problem is None:
        assert hand_written_schedule(*ranks, microbatches=microbatches).microbatches == microbatches
        return
    with pytest.raises(ScheduleError, match="schedule 'hand-written'") as refused:
        hand_written_schedule(*ranks, microbatches=microbatches, pp=2)
    assert problem in str(refused.value)


def test_a_printed_schedule_reads_back_and_a_bad_line_is_named():
    from devmesh.layout.schedule import parse_schedule

    for name in SCHEDULES:
        schedule = build_schedule(name, 3, 6)
        assert parse_schedule(str(schedule)) == schedule
    # a V placement reads back from its first line ("in a V"), or without one from the
    # stages each rank lists; an action on the wrong rank of a V is named as such
    v = build_schedule("zbv-zero-bubble", 2, 2)
    assert "4 stages on 2 ranks in a V" in str(v)
    assert parse_schedule(str(v).split("\n", 1)[1]).placement == "v"
    with pytest.raises(ScheduleError, match="lives on rank 1 .placed in a V"):
        Schedule("v", 2, 4, 1, ((Action("F", 0, 0), Action("F", 2, 0), Action("F", 3, 0)),
                                (Action("F", 1, 0),)), "v")
    with pytest.raises(ScheduleError, match="multiple of twice the ranks"):
        Schedule("v", 2, 2, 1, ((Action("F", 0, 0),), (Action("F", 1, 0),)), "v")
    # without a first line: one rank per line, stages and micro-batches as named
    plain = parse_schedule("rank 0: F0@0 F1@0 B0@0 B1@0\n\nrank 1: F0@1 B0@1 F1@1 B1@1 # ok")
    assert (plain.ranks, plain.stages, plain.microbatches) == (2, 2, 2)
    assert plain.bubble() == pytest.approx(build_schedule("1f1b", 2, 2).bubble())
    for text, problem in [
            ("rank 0: F0@0 B0@0\nrank 1: F0@1 Bx", "line 2: 'Bx' is not an action"),
            ("rank 0: F0@0 B0@0\nrank 0: F0@1 B0@1", "line 2: rank 0 is listed twice"),
            ("rank 0: F0@0 B0@0\nstage 1: F0@1", "line 2 ('stage 1: F0@1') is neither"),
            ("x: 2 stages on 2 ranks, 1 micro-batches\nrank 0: F0@0 B0@0",
             "needs lines for ranks 0..1; missing: [1]"),
            ("# nothing", "no 'rank R: ...' line")]:
        with pytest.raises(ScheduleError) as refused:
            parse_schedule(text)
        assert problem in str(refused.value)
    with pytest.raises(ScheduleError, match="actions holds 1 lists for 2 ranks"):
        Schedule("built", 2, 2, 1, (plain.actions[0],))
    # lists, as a user writes them, are kept as tuples: the schedule stays hashable
    from devmesh.layout.pipeline_messages import fifo_problem

    listed = Schedule(plain.name, 2, 2, 2, [list(actions) for actions in plain.actions])
    assert listed == plain and hash(listed) == hash(plain) and fifo_problem(listed) is None


def test_a_hand_written_schedule_trains_like_one_process(mesh_pool):
    # GPipe with each rank's backwards in the reverse order of its forwards (last in, first
    # out, as activation memory would suggest): any schedule the checks accept runs exactly
    mine = hand_written_schedule(*[" ".join([f"F{m}@{r}" for m in range(4)]
                                    + [f"B{m}@{r}" for m in reversed(range(4))])
                           for r in range(4)], stages=4, microbatches=4)
    ref_params, ref_losses = reference()
    owned = {}
    for params, losses, sends, _ in mesh_pool.run(train_pipelined, 4, mine, 4):
        owned.update(params)
        if losses[0] is not None:
            assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert owned.keys() == ref_params.keys()
    for key, value in owned.items():
        torch.testing.assert_close(value, ref_params[key].detach(), rtol=1e-5, atol=1e-6)


def test_a_gpu_mesh_refuses_only_a_schedule_that_would_deadlock_on_nccl(monkeypatch):
    from types import SimpleNamespace

    from devmesh.layout.pipeline_messages import nccl_problem
    from devmesh.parallel.pipeline import runner as runner_module

    # a schedule with no deadlock-free placement of its receives under NCCL's rules is
    # refused on a GPU mesh on every rank, before any message (every built-in schedule has
    # one; the verdict is stubbed here to reach the refusal)
    gpu_mesh = SimpleNamespace(device_type="cuda", mesh_dim_names=("pp",), shape=(2,), ndim=1,
                               size=lambda: 2, get_coordinate=lambda: [0],
                               get_group=lambda dim: None)
    monkeypatch.setattr(runner_module.comm, "process_group", lambda mesh, dims: None)
    monkeypatch.setattr(runner_module, "nccl_problem", lambda schedule: "would deadlock on "
                        "NCCL in a training step: use a CPU mesh")
    monkeypatch.setattr(runner_module.consensus, "differing", lambda text, group: {})
    with pytest.raises(PipelineError, match="would deadlock on NCCL in a training step.*CPU "
                                            "mesh"):
        PipelineRunner({}, gpu_mesh, build_schedule("1f1b", 2, 2), F.cross_entropy)
    for name in SCHEDULES:  # every built-in schedule on 2+ ranks has a placement
        for ranks, microbatches in ((2, 4), (2, 8), (4, 8), (4, 16)):
            assert nccl_problem(build_schedule(name, ranks, microbatches)) is None
    # stages on one rank hand their tensors over in memory: nothing to deadlock on (two
    # stages on one rank sent messages to itself before, which NCCL deadlocked on)
    for name in ("interleaved-1f1b", "looped-bfs", *IN_A_V):
        assert nccl_problem(build_schedule(name, 1, 4)) is None


def test_splits_by_name_and_by_parameter_count():
    model = make_model()
    stages = split_sequential(model, 3, starts=["4", "6"])
    assert [len(s) for s in stages] == [4, 2, 3]
    assert stages[1][0] is model[4]  # the model's own modules
    assert balanced_boundaries([5, 1, 1, 1, 5, 1], 3) == [0, 1, 4]
    assert [len(s) for s in split_sequential(model, 4)] == [2, 2, 2, 3]
    with pytest.raises(PipelineError, match="9 layers .children. for 10 pipeline stages"):
        split_sequential(model, 10)
    with pytest.raises(PipelineError, match="increasing order"):
        split_sequential(model, 3, starts=["6", "4"])
    with pytest.raises(PipelineError, match="nn.Sequential"):
        split_sequential(nn.Linear(2, 2), 2)
    with pytest.raises(PipelineError, match=re.escape(  # the names where the count goes
            "split_sequential(model, 3, starts=['4', '6'])")):
        split_sequential(model, ["4", "6"])


def nested_model() -> nn.Sequential:
    """``Sequential(embed, blocks, head)``, the blocks in a nested ``nn.Sequential``."""
    from collections import OrderedDict

    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)])
    return nn.Sequential(OrderedDict(embed=nn.Linear(16, 16), blocks=blocks,
                                     head=nn.Linear(16, 4)))


def test_splits_inside_a_nested_sequential_by_dotted_names():
    """``starts=["blocks.2"]`` (torch's ``split_spec`` names split points this way): each
    stage holds its part of ``blocks`` under the model's names; a container held whole stays
    the model's own module."""
    model = nested_model()
    parts = split_sequential(model, 3, starts=["blocks.2", "blocks.5"])
    assert [[n for n, _ in part.named_children()] for part in parts] == \
        [["embed", "blocks"], ["blocks"], ["blocks", "head"]]
    assert [list(part.blocks._modules) for part in parts] == [["0", "1"], ["2", "3", "4"], ["5"]]
    assert parts[1].blocks[0] is model.blocks[2] and parts[2].head is model.head
    keys = [k for part in parts for k in part.state_dict()]
    assert sorted(keys) == sorted(model.state_dict()) and len(keys) == len(set(keys))
    x = torch.randn(4, 16)
    out = x
    for part in parts:
        out = part(out)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    whole = split_sequential(model, 2, starts=["blocks"])
    assert whole[1].blocks is model.blocks  # no split inside: the model's own container
    with pytest.raises(PipelineError, match="'blocks.9' is not a child of the model"):
        split_sequential(model, 2, starts=["blocks.9"])
    with pytest.raises(PipelineError, match="inside 'embed', a Linear: a split point may lie "
                                            "inside an nn.Sequential only"):
        split_sequential(model, 2, starts=["embed.weight"])
    with pytest.raises(PipelineError, match="increasing order"):
        split_sequential(model, 3, starts=["blocks.4", "blocks.2"])


def _train_nested(path: str, steps: int = 2):
    """Interleaved 1F1B on 2 ranks, 4 stages split inside ``blocks``: rank 0 holds blocks
    0-1 and 4, rank 1 blocks 2-3 and 5 with the head; saved to ``path`` after training."""
    from devmesh.parallel import save_checkpoint

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    schedule = build_schedule("interleaved-1f1b", 2, 4, 2)
    parts = split_sequential(nested_model(), 4, starts=["blocks.2", "blocks.4", "blocks.5"])
    me = mesh.get_coordinate()[0]
    stages = {s: parts[s] for s in range(4) if schedule.rank_of(s) == me}
    runner = PipelineRunner(stages, mesh, schedule, F.cross_entropy)
    opt = torch.optim.SGD(runner.module.parameters(), lr=0.1)
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 16, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        runner.step(x if me == 0 else None, y if me == 1 else None)
        opt.step()
        opt.zero_grad()
    save_checkpoint(path, runner.module)
    return sorted(runner.module.state_dict()), runner.state_dict(full=True)


def test_a_model_split_inside_a_nested_sequential_trains_as_one_process(mesh_pool, tmp_path):
    from devmesh.parallel import load_checkpoint

    model = nested_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 16, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    results = mesh_pool.run(_train_nested, 2, str(tmp_path / "ckpt"))
    # each rank's two parts of blocks joined under one "blocks" (its optimizer, checkpoints)
    assert results[0][0] == sorted(f"{k}.{w}" for k in ("blocks.0.0", "blocks.1.0",
                                   "blocks.4.0", "embed") for w in ("bias", "weight"))
    plain = nested_model()  # the checkpoint of the pipelined run, loaded in one process
    load_checkpoint(str(tmp_path / "ckpt"), plain)
    for full in [full for _, full in results] + [plain.state_dict()]:
        assert sorted(full) == sorted(model.state_dict())
        for key, value in model.state_dict().items():
            torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6, msg=key)


# NCCL's order ("fused") on the schedules whose receives it places differently: 1F1B, the
# interleaved one whose receives some must go early, and a V with stages handing over in
# memory. Every schedule's NCCL programs are checked free of deadlock without processes
# (tests/unit), and the computes, which decide the result, are the same under both orders
NCCL_ORDER = ("1f1b", "interleaved-1f1b", "dualpipe-v")


@pytest.mark.parametrize("name, policy", [(name, "ahead") for name in SCHEDULES]
                         + [(name, "fused") for name in NCCL_ORDER])
def test_every_schedule_trains_like_one_process(mesh_pool, name, policy):
    # "fused": the receives posted as on NCCL (with the last send before them), all messages
    # matched by order alone (one tag) — gloo runs the order NCCL depends on
    ref_params, ref_losses = reference()
    microbatches = 8
    results = mesh_pool.run(train_pipelined, 4, name, microbatches, 2, policy)
    owned = {}
    schedule = build_schedule(name, 4, microbatches)
    boundaries = sum(1 for s in range(schedule.stages - 1)
                     if schedule.rank_of(s) != schedule.rank_of(s + 1))
    total_sends = [0, 0]
    for params, losses, sends, rank in results:
        owned.update(params)
        if losses[0] is not None:
            assert losses == pytest.approx(ref_losses, rel=1e-5)
        total_sends = [a + b for a, b in zip(total_sends, sends)]
    assert owned.keys() == ref_params.keys()
    for key, value in owned.items():
        torch.testing.assert_close(value, ref_params[key].detach(), rtol=1e-5, atol=1e-6)
    # per boundary and micro-batch: one activation forward, one gradient back; each step also
    # sends each boundary's shape once, with its first activation
    assert total_sends == [2 * boundaries * microbatches + boundaries] * 2


def test_pipeline_errors_name_the_fix(mesh_pool):
    for error in mesh_pool.run(pipeline_errors, 4):
        assert "has no 'pp' dim" in error[0], error[0]
        # the mesh suggested has as many ranks as the world (not a 4-rank mesh on 2 ranks)
        assert "init_device_mesh('cpu', (2, 2), mesh_dim_names=('pp', 'dp')) on these 4 " \
               "ranks" in error[0], error[0]
        # every rank refuses it alike, without a collective: the schedule is the same on all
        assert "cannot run schedule 'swapped': rank 2 uses rank 1's activations for stage 2 " \
               "in another order than rank 1 sends them (activation 0: sent a0@2, used " \
               "a1@2); messages " \
               "between two ranks are matched in order (NCCL ignores tags), so reorder the " \
               "schedule's actions" in error[1], error[1]
        error = error[:1] + error[2:]
        # only rank 0 sees the data; every rank says why it was refused, none waits forever
        assert "pipeline step failed — rank 0: 4 micro-batches do not divide the batch of 10 " \
               "inputs" in error[1], error[1]
        assert "rank 0: the inputs must be tensors with a batch dim, got a dict: the first " \
               "stage takes a tensor or a tuple of tensors" in error[2], error[2]
        assert "rank 0: 4 micro-batches do not divide the keyword input 'mask' of shape " \
               "(10, 1) along dim 0" in error[3], error[3]
        # micro-batches counted from each rank's own data: every rank refuses, none hangs
        assert "the ranks hold different schedules (ranks [0, 1]: gpipe: 4 stages " \
               "on 4 ranks, 2 micro-batches; ranks [2, 3]: gpipe: 4 stages on 4 ranks, 4 " \
               "micro-batches" in error[4], error[4]
        assert "build the same schedule on every rank" in error[4]
        assert "rank 3: the last stage's rank needs the targets: schedule.step(target=y) " \
               "(runner.step(inputs, targets))" in error[5], error[5]
        assert "split_sequential takes the number of stages, got a DeviceMesh: pass the " \
               "schedule's stage count, split_sequential(model, schedule.stages)" in error[6]


def pipeline_errors():
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    out = []
    try:
        PipelineRunner({}, mesh, build_schedule("1f1b", 4, 4), F.cross_entropy)
    except PipelineError as exc:
        out.append(str(exc))
    pp = init_device_mesh("cpu", (4,), mesh_dim_names=("pp",))
    parts = split_sequential(make_model(), 4)
    me = pp.get_coordinate()[0]
    gpipe = build_schedule("gpipe", 4, 2)
    swapped = list(gpipe.actions)  # rank 2 takes rank 1's activations in the other order
    swapped[2] = (swapped[2][1], swapped[2][0]) + swapped[2][2:]
    try:
        PipelineRunner({me: parts[me]}, pp, Schedule("swapped", 4, 4, 2, tuple(swapped)),
                       F.cross_entropy)
    except PipelineError as exc:
        out.append(str(exc))
    runner = PipelineRunner({me: parts[me]}, pp, build_schedule("1f1b", 4, 4), F.cross_entropy)
    try:  # only the first stage has inputs (of a bad size), only the last has targets: the
        # middle stages must not wait for a message that never comes
        runner.step(torch.randn(10, 16) if me == 0 else None,
                    torch.zeros(12, dtype=torch.long) if me == 3 else None)
    except PipelineError as exc:
        out.append(str(exc))
    try:  # inputs in a dict, on the first stage only (a tensor or a tuple of them is taken)
        runner.step({"x": torch.randn(8, 16)} if me == 0 else None,
                    torch.zeros(8, dtype=torch.long) if me == 3 else None)
    except PipelineError as exc:
        out.append(str(exc))
    try:  # a keyword input whose batch the micro-batches do not divide
        runner.step(torch.randn(8, 16) if me == 0 else None,
                    torch.zeros(8, dtype=torch.long) if me == 3 else None,
                    input_kwargs={"mask": torch.ones(10, 1)} if me == 0 else None)
    except PipelineError as exc:
        out.append(str(exc))
    try:
        PipelineRunner({me: parts[me]}, pp, build_schedule("gpipe", 4, 2 if me < 2 else 4),
                       F.cross_entropy)
    except PipelineError as exc:
        out.append(str(exc))
    try:  # the last stage's rank forgot its targets: every rank hears how to pass them
        runner.step(torch.randn(8, 16) if me == 0 else None, None)
    except PipelineError as exc:
        out.append(str(exc))
    try:  # the mesh where the number of stages goes
        split_sequential(make_model(), pp)
    except PipelineError as exc:
        out.append(str(exc))
    return out


def test_a_model_split_into_more_stages_than_the_schedule_runs_is_refused(mesh_pool):
    # a 7-layer model split into 4 parts under a 2-stage schedule on (pp, dp) = (2, 2) trained
    # layers 0-2 only, without a word: now every rank refuses, naming both counts and the fix
    for errors in mesh_pool.run(truncated_pipelines, 4):
        assert len(errors) == 3, errors
        too_many, swapped, too_few = errors
        assert "split_sequential split the model into 4 stages, the schedule runs 2" in too_many
        assert "would never run" in too_many and "split_sequential(model, 2)" in too_many
        assert "was given split_sequential's part" in swapped, swapped
        assert "split_sequential split the model into 2 stages, the schedule runs 4" in too_few


def truncated_pipelines():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    me = mesh.get_coordinate()[0]
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(6)), nn.Linear(8, 4))
    out = []
    for parts, schedule, pick in [
        (split_sequential(model, 4), build_schedule("1f1b", 2, 2), lambda s: s),
        (split_sequential(model, 2), build_schedule("1f1b", 2, 2), lambda s: 1 - s),
        (split_sequential(model, 2), build_schedule("interleaved-1f1b", 2, 2, virtual=2),
         lambda s: s % 2)]:
        stages = {s: parts[pick(s)] for s in range(schedule.stages) if schedule.rank_of(s) == me}
        try:
            PipelineRunner(stages, mesh, schedule, F.cross_entropy)
            out.append("built")
        except PipelineError as exc:
            out.append(str(exc))
    return out


def test_devmesh_plan_prints_and_draws_a_schedule_without_launching(tmp_path):
    png = tmp_path / "1f1b.png"
    proc = subprocess.run([sys.executable, "-m", "devmesh", "plan", "--pp", "4",
                           "--microbatches", "8", "--schedule", "1f1b", "--png", str(png)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "rank 3: F0@3 B0@3 F1@3" in proc.stdout and "bubble: 27.3%" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, "-m", "devmesh", "plan", "--pp", "4",
                          "--microbatches", "9", "--schedule", "interleaved-1f1b"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "use 8 or 10 micro-batches" in bad.stderr
    # the messages each rank starts, batch by batch, and NCCL's verdict, without a process
    messages = subprocess.run([sys.executable, "-m", "devmesh", "plan", "--pp", "2",
                               "--microbatches", "4", "--schedule", "interleaved-1f1b",
                               "--messages", "nccl"], capture_output=True, text=True,
                              timeout=120)
    assert messages.returncode == 0, messages.stderr
    # rank 0 sends an activation and posts, in the same batch, the receive of a gradient
    # its peer sends next ("fused" alone would post it only with rank 0's next send: early)
    assert "F3@0 {>a3@1 <g1@2 <a2@2} B1@2" in messages.stdout, messages.stdout
    assert "no deadlock under NCCL's rules" in messages.stdout
    assert "10 receives posted early" in messages.stdout
    # a schedule written in a file (one line per rank, as printed): checked, timed, drawn
    mine = tmp_path / "mine.txt"
    mine.write_text("# 1F1B, with rank 0's backwards split\n"
                    "rank 0: F0@0 F1@0 I0@0 W0@0 I1@0 W1@0\n"
                    "rank 1: F0@1 B0@1 F1@1 B1@1\n")
    png = tmp_path / "mine.png"
    written = subprocess.run([sys.executable, "-m", "devmesh", "plan", "--schedule", str(mine),
                              "--messages", "nccl", "--png", str(png)], capture_output=True,
                             text=True, timeout=120)
    assert written.returncode == 0, written.stderr
    assert "hand-written: 2 stages on 2 ranks, 2 micro-batches" in written.stdout
    assert "bubble: 33.3%" in written.stdout and "no deadlock" in written.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    mine.write_text("rank 0: F0@0 F1@0 I0@0 I1@0\nrank 1: F0@1 B0@1 F1@1 B1@1\n")
    refused = subprocess.run([sys.executable, "-m", "devmesh", "plan", "--schedule", str(mine)],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert "micro-batch 0 of stage 0 has no W0@0" in refused.stderr, refused.stderr
    mine.write_bytes(b"\x80\x04\x95 not a schedule")  # a pickle's first bytes: never loaded
    binary = subprocess.run([sys.executable, "-m", "devmesh", "plan", "--schedule", str(mine)],
                            capture_output=True, text=True, timeout=120)
    assert binary.returncode == 2 and "cannot read" in binary.stderr and "as text" in \
        binary.stderr, binary.stderr


def train_with_torch_pipelining(name: str, microbatches: int, steps: int = 2,
                                library: str = "torch", scale_grads: bool = True):
    """The same model, split and schedule run by torch.distributed.pipelining (the anchor),
    or — ``library="devmesh"`` — the same code with only its imports switched to devmesh's
    classes of the same names; ``"torch-stages"``: torch's ``PipelineStage`` objects given to
    devmesh's schedules. ``scale_grads=False``: torch's argument, with a loss that sums."""
    if library == "torch":
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import (
            PipelineScheduleMulti,
            get_schedule_class,
        )
    elif library == "torch-stages":
        from torch.distributed.pipelining import PipelineStage

        from devmesh.parallel.pipeline import PipelineScheduleMulti, get_schedule_class
    else:
        from devmesh.parallel.pipeline import (
            PipelineScheduleMulti,
            PipelineStage,
            get_schedule_class,
        )

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("pp",))
    group = mesh.get_group("pp")
    virtual = 2 if name in LOOPED or name in IN_A_V else 1
    model = make_model()
    parts = split_sequential(model, 4 * virtual)
    me = mesh.get_coordinate()[0]
    # stage s on rank s % 4, or in a V (zero-bubble V, DualPipeV): rank r holds r and 7 - r
    mine = [me, 7 - me] if name in IN_A_V else list(range(me, 4 * virtual, 4))
    stages = [PipelineStage(parts[s], s, 4 * virtual, torch.device("cpu"), group=group)
              for s in mine]
    loss_fn = F.cross_entropy if scale_grads else functools.partial(F.cross_entropy,
                                                                    reduction="sum")
    # torchtitan's way: the class by name, looped schedules told apart by their base class
    kind = get_schedule_class({"gpipe": "GPipe", "1f1b": "1F1B", "looped-bfs": "LoopedBFS",
                               "interleaved-1f1b": "Interleaved1F1B",
                               "interleaved-zero-bubble": "InterleavedZeroBubble",
                               "zbv-zero-bubble": "ZBVZeroBubble",
                               "dualpipe-v": "DualPipeV"}[name])
    looped = issubclass(kind, PipelineScheduleMulti)
    schedule = kind(stages if looped else stages[0], n_microbatches=microbatches,
                    loss_fn=loss_fn, scale_grads=scale_grads)
    params = [p for s in mine for p in parts[s].parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    losses, outputs = [], []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 16, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        if 0 in mine and 4 * virtual - 1 in mine:  # a V: the first and last stage here
            outputs.append(schedule.step(x, target=y, losses=losses))
        elif 0 in mine:
            schedule.step(x)
        elif 4 * virtual - 1 in mine:
            outputs.append(schedule.step(target=y, losses=losses))
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
    index = {id(p): n for n, p in model.named_parameters()}
    return ({index[id(p)]: p.detach().clone() for p in params},
            [float(loss) for loss in losses], [tuple(out.shape) for out in outputs])


def _merged_params(results):
    merged = {}
    for params, *_ in results:
        merged.update(params)
    return merged


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs",
                                  "interleaved-zero-bubble", "zbv-zero-bubble", "dualpipe-v"])
def test_same_result_as_torch_pipelining(mesh_pool, name):
    theirs = _merged_params(mesh_pool.run(train_with_torch_pipelining, 4, name, 8))
    ours = _merged_params(mesh_pool.run(train_pipelined, 4, name, 8))
    assert theirs.keys() == ours.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs",
                                  "interleaved-zero-bubble", "zbv-zero-bubble", "dualpipe-v"])
def test_torch_pipelining_code_runs_on_devmesh_with_its_imports_switched(mesh_pool, name):
    """torch's PipelineStage / Schedule code, unchanged but for its imports: the same
    parameters, per-micro-batch losses and step outputs as torch's own run."""
    theirs = mesh_pool.run(train_with_torch_pipelining, 4, name, 8)
    ours = mesh_pool.run(train_with_torch_pipelining, 4, name, 8, 2, "devmesh")
    for (params, losses, shapes), (t_params, t_losses, t_shapes) in zip(ours, theirs):
        assert params.keys() == t_params.keys()
        for key in params:
            torch.testing.assert_close(params[key], t_params[key], rtol=1e-5, atol=1e-6)
        assert losses == pytest.approx(t_losses, rel=1e-5) and shapes == t_shapes
    last = 0 if name in IN_A_V else 3  # the rank holding the last stage
    assert len(ours[last][1]) == 8 and ours[last][2] == [(16, 4), (16, 4)]


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zbv-zero-bubble"])
def test_devmesh_schedules_take_torchs_own_stage_objects(mesh_pool, name):
    """torch's ``PipelineStage`` objects (code that builds its stages with torch and takes
    only the schedule from devmesh): the same parameters and losses as torch's own run."""
    theirs = mesh_pool.run(train_with_torch_pipelining, 4, name, 8)
    ours = mesh_pool.run(train_with_torch_pipelining, 4, name, 8, 2, "torch-stages")
    for (params, losses, _), (t_params, t_losses, _) in zip(ours, theirs):
        for key in params:
            torch.testing.assert_close(params[key], t_params[key], rtol=1e-5, atol=1e-6)
        assert losses == pytest.approx(t_losses, rel=1e-5)


def test_interleaved_1f1b_with_fewer_micro_batches_than_ranks_as_torch(mesh_pool):
    """2 micro-batches on 4 ranks, 2 stages each: torch's flexible interleaving runs them in
    one round shorter than the pipeline, and so does devmesh — torch's code with its imports
    switched gives torch's parameters and losses, and single-process training's."""
    theirs = mesh_pool.run(train_with_torch_pipelining, 4, "interleaved-1f1b", 2)
    ours = mesh_pool.run(train_with_torch_pipelining, 4, "interleaved-1f1b", 2, 2, "devmesh")
    single, _ = reference()
    for (params, losses, _), (t_params, t_losses, _) in zip(ours, theirs):
        for key in params:
            torch.testing.assert_close(params[key], t_params[key], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(params[key], single[key].detach(), rtol=1e-5, atol=1e-6)
        assert losses == pytest.approx(t_losses, rel=1e-5)
    assert len(ours[3][1]) == 2  # the last rank's per-micro-batch losses


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b"])
def test_unscaled_gradients_with_a_summing_loss_as_torch(mesh_pool, name):
    """torch's ``scale_grads=False`` (a loss that sums, or torchtitan's own scaling): each
    micro-batch's loss is not divided, so the gradients are the micro-batches' sum — the
    same parameters and losses as torch's run, and as one process summing over the batch."""
    theirs = mesh_pool.run(train_with_torch_pipelining, 4, name, 8, 2, "torch", False)
    ours = mesh_pool.run(train_with_torch_pipelining, 4, name, 8, 2, "devmesh", False)
    single, sums = reference(reduction="sum")
    for (params, losses, _), (t_params, t_losses, _) in zip(ours, theirs):
        for key in params:
            torch.testing.assert_close(params[key], t_params[key], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(params[key], single[key].detach(), rtol=1e-5, atol=1e-5)
        assert losses == pytest.approx(t_losses, rel=1e-5)
    last = ours[3][1]  # the last stage's rank: the last step's 8 micro-batch losses
    assert len(last) == 8 and sum(last) == pytest.approx(sums[1], rel=1e-5)


@pytest.mark.parametrize("name, composition", [(n, "fsdp+tp") for n in SCHEDULES]
                         + [("1f1b", "ddp"), ("dualpipe-v", "ddp"), ("1f1b", "fsdp+tp+ac"),
                            ("zero-bubble", "fsdp+tp+ac"), ("1f1b", "fsdp+torch-tp"),
                            ("zero-bubble", "fsdp+torch-tp"), ("interleaved-1f1b",
                                                               "ddp+torch-tp")])
def test_pipeline_composes_with_fsdp_tp_and_ddp(mesh_pool, name, composition):
    """"fsdp+tp+ac": each block also in torch's checkpoint_wrapper (non-reentrant) between TP
    and FSDP, torchtitan's stack: zero-bubble's W recomputes the blocks again. "+torch-tp":
    torch's own styles split the blocks (DTensor parameters) under devmesh's data
    parallelism, in the pipeline as outside it."""
    check_composed_like_one_process(mesh_pool, name, composition)


def _accumulate_over_steps(name: str, composition: str):
    """Two pipeline steps per optimizer step, gradient sync off for the first (torch's
    ``set_requires_gradient_sync``); (pp, dp) = (2, 2); the reduce-scatters of each step."""
    from devmesh import comm_stats
    from devmesh.parallel import fully_shard, replicate

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    me = mesh.get_coordinate()[0]
    stage = split_sequential(block_model(), 2)[me]
    if composition == "fsdp":
        for block in stage:
            if isinstance(block, nn.Sequential):
                fully_shard(block, mesh=mesh["dp"])
        fully_shard(stage, mesh=mesh["dp"])
    else:
        replicate(stage, mesh=mesh["dp"])
    runner = PipelineRunner({me: stage}, mesh, build_schedule(name, 2, 4), F.cross_entropy)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    half = mesh["dp"].get_local_rank()
    reduce_scatters = []
    for step in range(2):
        for part in range(2):
            stage.set_requires_gradient_sync(part == 1)
            gen = torch.Generator().manual_seed(10 * step + part)
            x, y = torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)
            with comm_stats() as stats:
                runner.step(x.chunk(2)[half] if me == 0 else None,
                            y.chunk(2)[half] if me == 1 else None)
            reduce_scatters.append(stats.by_collective().get("reduce_scatter", (0,))[0])
        opt.step()
        opt.zero_grad()
    return state_dict(stage, full=True), reduce_scatters


@pytest.mark.parametrize("name", ["1f1b", "zero-bubble"])
@pytest.mark.parametrize("composition", ["fsdp", "ddp"])
def test_gradients_accumulate_over_pipeline_steps_without_sync(mesh_pool, name, composition):
    """Each optimizer step on two runner steps, the first without gradient sync: equal to
    one process accumulating the same micro-batches, and under FSDP no reduce-scatter
    before the last runner step (the units keep unsharded gradients meanwhile)."""
    model = block_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        for part in range(2):
            gen = torch.Generator().manual_seed(10 * step + part)
            x, y = torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)
            # each replica: 16 rows in 4 micro-batches; the mean over micro-batches and replicas
            losses = [F.cross_entropy(model(a), b) for a, b in zip(x.chunk(8), y.chunk(8))]
            (sum(losses) / 8).backward()
        opt.step()
        opt.zero_grad()
    full = {}
    for state, reduce_scatters in mesh_pool.run(_accumulate_over_steps, 4, name, composition):
        full.update(state)
        if composition == "fsdp":
            assert reduce_scatters[0] == reduce_scatters[2] == 0, reduce_scatters
            assert reduce_scatters[1] > 0 and reduce_scatters[3] > 0, reduce_scatters
    for key, value in model.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name} {composition} {key}: {m}")


def test_zero_bubble_split_backward_computes_no_more_than_one_backward(mesh_pool):
    """Zero-bubble splits each backward into the input gradient (I) and the weight gradients
    (W); W must start from the gradients I kept, not recompute the input-gradient chain (it
    did: 1.25x the matmul work of 1F1B on this model). Counted under FSDP x TP, where W also
    runs FSDP's reduce-scatter node and TP's split layers."""
    per_rank = {name: [flops for _, _, flops in mesh_pool.run(train_composed, 8, name,
                                                               "fsdp+tp")]
                for name in ("1f1b", "zero-bubble")}
    assert min(per_rank["1f1b"]) > 0
    assert per_rank["zero-bubble"] == per_rank["1f1b"]


def _collectives_of_a_step(name: str, composition: str):
    """One training step of a (pp, dp) = (2, 2) pipeline, each stage under devmesh's
    ``replicate`` or ``fully_shard`` (a unit per block, and the stage): the collectives of
    the second step by kind, and the gradients it left."""
    from devmesh.parallel import fully_shard, replicate

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    me = mesh.get_coordinate()[0]
    stage = split_sequential(block_model(), 2)[me]
    if composition == "ddp":
        replicate(stage, mesh=mesh["dp"])
    else:
        for block in stage:
            if isinstance(block, nn.Sequential):
                fully_shard(block, mesh=mesh["dp"])
        fully_shard(stage, mesh=mesh["dp"])
    runner = PipelineRunner({me: stage}, mesh, build_schedule(name, 2, 4), F.cross_entropy)
    gen = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
    x, y = torch.randn(16, 16, generator=gen), torch.randint(0, 4, (16,), generator=gen)
    runner.step(x if me == 0 else None, y if me == 1 else None)
    stage.zero_grad()
    with comm_stats() as stats:
        runner.step(x if me == 0 else None, y if me == 1 else None)
    counts = {kind: n for kind, (n, *_) in stats.by_collective().items()}
    grads = {name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
             for name, p in stage.named_parameters()}
    return counts, grads


@pytest.mark.parametrize("composition", ["ddp", "fsdp"])
def test_zero_bubble_communicates_as_much_as_1f1b(mesh_pool, composition):
    """Zero-bubble's W computes a micro-batch's weight gradients in several autograd calls.
    ``replicate`` all-reduced every bucket at the end of each (3 and 5 all-reduces a step
    instead of 1), and ``fully_shard`` units dropped their gathered parameters at the end of
    each and gathered them again for the next (20 and 28 all-gathers instead of 16 and 20).
    Now both communicate exactly as under 1F1B, with the same gradients."""
    ours = {name: mesh_pool.run(_collectives_of_a_step, 4, name, composition)
            for name in ("1f1b", "zero-bubble")}
    for (counts_1f1b, grads_1f1b), (counts_zb, grads_zb) in zip(ours["1f1b"],
                                                                ours["zero-bubble"]):
        assert counts_zb == counts_1f1b
        assert counts_1f1b.get("all_reduce" if composition == "ddp" else "reduce_scatter")
        assert grads_zb.keys() == grads_1f1b.keys()
        for key, grad in grads_1f1b.items():
            torch.testing.assert_close(grads_zb[key], grad, rtol=1e-5, atol=1e-7, msg=key)


class _CountingRunner(PipelineRunner):
    """Counts the matrix-product work of each action kind on each stage."""

    def _counted(self, step, action, inner) -> None:
        with MatmulWork() as counter:
            inner(step, action)
        key = (action.stage, action.kind)
        self.work[key] = self.work.get(key, 0) + counter.flops

    def _backward(self, step, action) -> None:
        self._counted(step, action, super()._backward)

    def _weight_grads(self, step, action) -> None:
        self._counted(step, action, super()._weight_grads)


class _BlocksThenEmbed(nn.Module):
    """A first stage that registers its blocks before the embedding its forward calls first
    (a custom module, not an ``nn.Sequential``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh())
                                    for _ in range(3))
        self.embed = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return h


def zero_bubble_work(custom_first_stage: bool):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    parts = split_sequential(make_model(), 2)
    if custom_first_stage:
        parts[0] = _BlocksThenEmbed()
    me = mesh.get_coordinate()[0]
    runner = _CountingRunner({me: parts[me]}, mesh, build_schedule("zero-bubble", 2, 4),
                             F.cross_entropy)
    runner.work = {}
    x, y = torch.randn(16, 16), torch.randint(0, 4, (16,))
    runner.step(x if me == 0 else None, y if me == 1 else None)
    if me == 0:  # the gradients of one plain backward through the same stage and head
        stage, rest = copy.deepcopy(parts[0]), copy.deepcopy(split_sequential(make_model(), 2)[1])
        for p in stage.parameters():
            p.grad = None
        F.cross_entropy(rest(stage(x)), y).backward()
        for ours, theirs in zip(parts[0].parameters(), stage.parameters()):
            torch.testing.assert_close(ours.grad, theirs.grad)
    return runner.work


@pytest.mark.parametrize("custom_first_stage", [False, True], ids=["sequential", "custom"])
def test_zero_bubbles_first_stage_splits_at_its_first_layer(mesh_pool, custom_first_stage):
    """The first stage's input needs no gradient; its I computes the gradients down to the
    output of the first child it calls, so I and W share its backward as on the other
    stages (before, I did nothing and W was the whole backward; then only an nn.Sequential
    stage was split)."""
    first, last = mesh_pool.run(zero_bubble_work, 2, custom_first_stage)
    assert first[(0, "I")] > 0 and first[(0, "W")] > 0
    # stage 0 (4 layers of 16 x 16): I has 3 layers' input gradients, W 4 layers' weights'
    assert first[(0, "I")] * 4 == first[(0, "W")] * 3
    assert last[(1, "I")] > 0 and last[(1, "W")] > 0


def batches_of_two_sizes():
    """A full batch, then a smaller last one: the stages exchange shapes again."""
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("pp",))
    schedule = build_schedule("1f1b", 4, 4)
    model = make_model()
    parts = split_sequential(model, 4)
    me = mesh.get_coordinate()[0]
    runner = PipelineRunner({me: parts[me]}, mesh, schedule, F.cross_entropy)
    opt = torch.optim.SGD(parts[me].parameters(), lr=0.1)
    losses = []
    for step, batch in enumerate((16, 8, 8)):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(batch, 16, generator=gen), torch.randint(0, 4, (batch,), generator=gen)
        loss = runner.step(x if me == 0 else None, y if me == 3 else None)
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else loss.item())
    return losses


def test_a_smaller_last_batch_needs_no_restart(mesh_pool):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = []
    for step, batch in enumerate((16, 8, 8)):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(batch, 16, generator=gen), torch.randint(0, 4, (batch,), generator=gen)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    losses = mesh_pool.run(batches_of_two_sizes, 4)[3]
    assert losses == pytest.approx(expected, rel=1e-5)


class _ShrinksOnThirdCall(nn.Module):
    """Drops the last feature on its third call: a data-dependent shape within a step."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x[:, :-1] if self.calls == 3 else x


class _DictOnce(nn.Module):
    """Returns ``{"x": x}`` until ``wrapped`` is switched off: a stage whose output cannot
    cross a boundary (a tensor or a tuple of tensors can)."""

    def __init__(self) -> None:
        super().__init__()
        self.wrapped = True

    def forward(self, x: torch.Tensor):
        return {"x": x} if self.wrapped else x


def shapes_across_steps(name: str, policy: str = "ahead"):
    """Steps of 16, a failing step (stage 1 fails before it can announce a shape), then 8,
    8 and 16 samples: each step's first message on a link either lands in the receive
    posted in advance in the previous step's shape, or zeros fill that receive and the data
    follows (``policy``: when receives are posted, see ``train_pipelined``)."""
    model = make_model()
    model.insert(4, _DictOnce())
    model[4].wrapped = False
    virtual = 2 if name == "interleaved-1f1b" else 1
    schedule = build_schedule(name, 4 // virtual, 4, virtual)
    mesh = init_device_mesh("cpu", (4 // virtual,), mesh_dim_names=("pp",))
    parts = split_sequential(model, 4, starts=["2", "5", "7"])
    me = mesh.get_coordinate()[0]
    stages = {s: parts[s] for s in range(4) if schedule.rank_of(s) == me}
    runner = PipelineRunner(stages, mesh, schedule, F.cross_entropy)
    runner._links.backend = {"ahead": "gloo", "fused": "nccl"}[policy]
    opt = torch.optim.SGD([p for part in stages.values() for p in part.parameters()], lr=0.1)
    losses = []
    for step, batch in enumerate((16, 16, 8, 8, 16)):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(batch, 16, generator=gen), torch.randint(0, 4, (batch,), generator=gen)
        model[4].wrapped = step == 1
        try:
            loss = runner.step(x if 0 in stages else None, y if 3 in stages else None)
        except PipelineError:
            loss = "failed"
        else:
            opt.step()
        opt.zero_grad()
        losses.append(loss if loss in (None, "failed") else loss.item())
    return losses


@pytest.mark.parametrize("name, policy", [("1f1b", "ahead"), ("interleaved-1f1b", "ahead"),
                                          ("1f1b", "fused"), ("interleaved-1f1b", "fused"),
                                          ("zero-bubble", "fused")])
def test_shapes_that_change_or_fail_between_steps(mesh_pool, name, policy):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = []
    for step, batch in enumerate((16, 16, 8, 8, 16)):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(batch, 16, generator=gen), torch.randint(0, 4, (batch,), generator=gen)
        if step == 1:
            expected.append("failed")
            continue
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    results = mesh_pool.run(shapes_across_steps, 4 // (2 if name == "interleaved-1f1b" else 1),
                            name, policy)
    assert all(r[1] == "failed" for r in results)
    last = results[-1]
    assert last[:1] + last[2:] == pytest.approx(expected[:1] + expected[2:], rel=1e-5)


def failing_stages(case: str):
    """4 pipeline ranks where one stage fails mid-step; every rank's error, then whether the
    next step (the failure gone) trains as usual."""
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("pp",))
    model = make_model()
    reduction = ["mean"]
    if case == "shape changes within a step":
        model.insert(4, _ShrinksOnThirdCall())  # the last layer of stage 1 (children 2-4)
        starts = ["2", "5", "7"]
        model_fix = lambda: setattr(model[4], "calls", 10)  # noqa: E731
    elif case == "a stage returns a dict":
        model.insert(4, _DictOnce())
        starts = ["2", "5", "7"]
        model_fix = lambda: setattr(model[4], "wrapped", False)  # noqa: E731
    elif case == "a loss per sample":
        reduction[0], starts = "none", ["2", "4", "6"]
        model_fix = lambda: reduction.__setitem__(0, "mean")  # noqa: E731
    else:  # stage 2 expects 32 features where stage 1 gives 16
        model[4] = nn.Sequential(nn.Linear(32, 16), nn.Tanh())
        starts = ["2", "4", "6"]
        model_fix = lambda: model.__setitem__(4, nn.Sequential(nn.Linear(16, 16)))  # noqa: E731
    parts = split_sequential(model, 4, starts=starts)
    me = mesh.get_coordinate()[0]
    runner = PipelineRunner({me: parts[me]}, mesh, build_schedule("1f1b", 4, 4),
                            lambda out, y: F.cross_entropy(out, y, reduction=reduction[0]))
    x, y = torch.randn(16, 16), torch.randint(0, 4, (16,))
    error = None
    try:
        runner.step(x if me == 0 else None, y if me == 3 else None)
    except PipelineError as exc:
        error = str(exc)
    model_fix()
    if me == 2 and case == "wrong input shape":  # the fixed layer is stage 2's
        parts = split_sequential(model, 4, starts=starts)
        runner.stages[2] = parts[2]
    loss = runner.step(x if me == 0 else None, y if me == 3 else None)
    return error, None if loss is None else loss.item()


@pytest.mark.parametrize("case, culprit, says", [
    ("shape changes within a step", 1, "stage 1's output for micro-batch 2 is (4, 15)"),
    ("wrong input shape", 2, "stage 2, forward of micro-batch 0 on an input of (4, 16)"),
    ("a stage returns a dict", 1, "stage 1, forward of micro-batch 0 on an input of (4, 16) "
                                  "torch.float32: PipelineError: stage 1 returned a dict: a "
                                  "pipeline stage passes a tensor, or a tuple of 1 to 8 tensors"),
    ("a loss per sample", 3, "stage 3, forward of micro-batch 0 on an input of (4, 16) "
                             "torch.float32: PipelineError: the loss function returned a "
                             "tensor of shape (4,)"),
])
def test_a_failing_stage_raises_on_every_rank_and_the_next_step_runs(mesh_pool, case, culprit,
                                                                      says):
    results = mesh_pool.run(failing_stages, 4, case)
    for error, _ in results:  # no hang: every rank raises, naming the rank and what failed
        assert error is not None and f"rank {culprit}: {says}" in error, error
        assert "pipeline step failed" in error and "zero them" in error
        assert error.count("[rank") == 1, error  # the rank prefix once
    assert results[3][1] is not None and results[3][1] == results[3][1]  # a finite loss


def v_turn_fails(culprit: int, name: str):
    """Zero-bubble V or DualPipeV on 2 ranks (stages 0, 3 on rank 0; 1, 2 on rank 1, handing
    over in memory): stage ``culprit``'s forward of micro-batch 1 raises; then a clean
    step."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    schedule = build_schedule(name, 2, 4)
    parts = split_sequential(make_model(), 4)
    calls = []

    def fail_on_the_second_call(module, args):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("bad batch")

    parts[culprit].register_forward_pre_hook(fail_on_the_second_call)
    me = mesh.get_coordinate()[0]
    stages = {s: parts[s] for s in range(4) if schedule.rank_of(s) == me}
    runner = PipelineRunner(stages, mesh, schedule, F.cross_entropy)
    x, y = torch.randn(16, 16), torch.randint(0, 4, (16,))
    error = None
    try:
        runner.step(x if 0 in stages else None, y if 3 in stages else None)
    except PipelineError as exc:
        error = str(exc)
    for stage in stages.values():
        stage.zero_grad()
    loss = runner.step(x if 0 in stages else None, y if 3 in stages else None)
    return error, None if loss is None else loss.item()


@pytest.mark.parametrize("name", sorted(IN_A_V))
@pytest.mark.parametrize("culprit", [1, 2])
def test_a_failure_at_the_turn_of_a_v_raises_on_every_rank(mesh_pool, culprit, name):
    """Where two stages on one rank hand their tensors over in memory, a failure on either
    side still reaches every rank at the end of the step (no rank waits), and the next step
    runs."""
    results = mesh_pool.run(v_turn_fails, 2, culprit, name)
    for error, _ in results:
        assert error is not None and f"rank 1: stage {culprit}, forward of micro-batch 1" \
            in error and "ValueError: bad batch" in error, error
    assert results[0][1] is not None and math.isfinite(results[0][1])


def test_torch_schedule_arguments_devmesh_does_not_support_are_refused():
    from devmesh.parallel.pipeline import PipelineStage, Schedule1F1B

    stage = PipelineStage(nn.Linear(2, 2), 0, 2, "cpu")
    for kwargs, words in (({"loss_fn": F.mse_loss, "args_chunk_spec": (0,)}, "chunk"),):
        with pytest.raises(PipelineError, match=words):
            Schedule1F1B(stage, 4, **kwargs)
    assert PipelineStage(nn.Linear(2, 2), 0, 2, torch.device("cuda", 0)).device.type == "cuda"
    with pytest.raises(PipelineError, match="stage_index 2"):
        PipelineStage(nn.Linear(2, 2), 2, 2, "cpu")
    with pytest.raises(PipelineError, match="backward_requires_autograd=False"):
        Schedule1F1B(stage, 4, F.mse_loss, backward_requires_autograd=False)
    with pytest.raises(PipelineError, match="get_mesh.*local tensors"):
        PipelineStage(nn.Linear(2, 2), 0, 2, "cpu", get_mesh=lambda *args: None)
    with pytest.raises(PipelineError, match="register_custom_function is not supported: "
                                            "devmesh's runner runs every action itself"):
        Schedule1F1B(stage, 4, F.mse_loss).register_custom_function("OVERLAP_F_B", print)


def test_torch_pipelining_signatures_and_defaults_are_accepted_as_torchs():
    """Code moved from torch passes its arguments by torch's names and positions (``stage``
    for one stage per rank, ``stages`` for several), torch's defaults spelled out included:
    each devmesh class takes torch's parameters in torch's order."""
    import inspect

    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torchs

    import devmesh.parallel.pipeline as ours

    for name in ("PipelineStage", "PipelineScheduleSingle", "ScheduleGPipe", "Schedule1F1B",
                 "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble",
                 "ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        torch_class = PipelineStage if name == "PipelineStage" else getattr(torchs, name)
        theirs = list(inspect.signature(torch_class.__init__).parameters)
        mine = list(inspect.signature(getattr(ours, name).__init__).parameters)
        assert mine[:len(theirs)] == theirs, name
    stages = [ours.PipelineStage(nn.Linear(2, 2), s, 4, "cpu", input_args=None, output_args=None,
                                 output_grads=None, input_grads=None, group=None,
                                 dw_builder=None, get_mesh=None) for s in (0, 2)]
    ours.Schedule1F1B(stage=stages[0], n_microbatches=4, loss_fn=F.mse_loss,
                      args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None,
                      scale_grads=True)
    for kind in (ours.ScheduleInterleaved1F1B, ours.ScheduleLoopedBFS):
        for defer in (False, True):  # when torch posts receives: devmesh has its own rule
            kind(stages=stages, n_microbatches=4, loss_fn=F.mse_loss, output_merge_spec=None,
                 scale_grads=False, backward_requires_autograd=True, defer_pp_recv=defer)
    with pytest.raises(TypeError):  # torch's LoopedBFS takes no chunk specs either
        ours.ScheduleLoopedBFS(stages, 4, F.mse_loss, args_chunk_spec=None)
    # DualPipeV refuses fewer micro-batches than stages when built, as torch's constructor
    with pytest.raises(ValueError, match="ScheduleDualPipeV needs at least as many micro-"
                                         "batches as stages: got 3 micro-batches for 4 "
                                         "stages .use 4 or more, or ScheduleZBVZeroBubble"):
        ours.ScheduleDualPipeV(stages, 3, F.mse_loss)
    ours.ScheduleDualPipeV(stages, 4, F.mse_loss, None, None, None, True, True, False)


def test_schedule_classes_by_name_as_torch():
    from torch.distributed.pipelining import schedules as torchs

    from devmesh.parallel.pipeline import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleDualPipeV,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleLoopedBFS,
        ScheduleZBVZeroBubble,
        get_schedule_class,
    )

    for name, ours in (("1f1b", Schedule1F1B), ("GPipe", ScheduleGPipe),
                       ("INTERLEAVED1F1B", ScheduleInterleaved1F1B),
                       ("LoopedBFS", ScheduleLoopedBFS), ("ZBVZeroBubble", ScheduleZBVZeroBubble),
                       ("InterleavedZeroBubble", ScheduleInterleavedZeroBubble),
                       ("dualpipev", ScheduleDualPipeV)):
        assert get_schedule_class(name) is ours
        looped = issubclass(torchs.get_schedule_class(name), torchs.PipelineScheduleMulti)
        assert issubclass(ours, PipelineScheduleMulti) == looped
        assert issubclass(ours, PipelineScheduleSingle) != looped
    with pytest.raises(ValueError, match="Unknown schedule name 'bogus'"):
        get_schedule_class("bogus")
    assert get_schedule_class("zbvzerobubble") is ScheduleZBVZeroBubble
    with pytest.raises(PipelineError, match="no PipelineScheduleMulti schedule: use a "
                                            "schedule's name: Interleaved1F1B"):
        get_schedule_class("PipelineScheduleMulti")


def test_every_torch_pipelining_name_is_devmesh_too():
    """Code whose imports were switched from torch's pipelining finds every name torch
    exports; the tracer's are torch's own objects (devmesh's ``pipeline`` wraps torch's)."""
    import torch.distributed.pipelining as torchs

    import devmesh.parallel.pipeline as ours

    assert set(torchs.__all__) <= set(ours.__all__)
    for name in ("Pipe", "SplitPoint", "pipe_split"):
        assert getattr(ours, name) is getattr(torchs, name)
    with pytest.raises(AttributeError):
        ours.no_such_name  # noqa: B018


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x)).relu()


class _ScaleUsedTwice(nn.Module):
    """A parameter used directly by two operations: the split's exact fast path does not
    apply, and W falls back to a whole backward over the parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.scale = nn.Linear(16, 16), nn.Parameter(torch.randn(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * self.scale).tanh() * self.scale


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


class _OneFlatParameter(nn.Module):
    """Two layers whose weights are views of one flat parameter, as ``fully_shard``'s gather
    gives them: the layers' weight sides meet in one node, which must run once."""

    def __init__(self) -> None:
        super().__init__()
        self.flat = nn.Parameter(torch.randn(2 * 16 * 16) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = self.flat.view(2, 16, 16).unbind(0)
        return F.linear(F.linear(x, first).relu(), second)


def _mlp_stage() -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(4)])


@pytest.mark.parametrize("build, extra_work", [
    (_mlp_stage, 0),
    (lambda: nn.Sequential(_Residual(), _Residual()), 0),
    (_ScaleUsedTwice, 0),
    (_OneFlatParameter, 0),
    # W re-runs each checkpointed block's forward once (I dropped its recomputed tensors)
    (lambda: nn.Sequential(_Checkpointed(), _Checkpointed()), 4 * 8 * 16 * 16),
])
def test_split_backward_gives_one_backwards_gradients_for_one_backwards_work(build, extra_work):
    from devmesh.parallel.pipeline.split_backward import SplitBackward

    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    x, grad = torch.randn(8, 16), torch.randn(8, 16)
    x_ref = x.clone().requires_grad_()
    out = reference(x_ref)
    with MatmulWork() as whole:
        out.backward(grad)
    x_split = x.clone().requires_grad_()
    split = SplitBackward(model(x_split), grad, x_split, list(model.parameters()))
    with MatmulWork() as input_part:
        input_grad = split.input_grad()
    assert all(p.grad is None for p in model.parameters())  # I touches no parameter
    with MatmulWork() as weight_part:
        split.weight_grads()
    torch.testing.assert_close(input_grad, x_ref.grad)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad)
    assert input_part.flops + weight_part.flops == whole.flops + extra_work


def test_weight_gradients_go_straight_into_grad_where_layers_weights_are_apart():
    """W runs each layer's weight side on its own, straight into its parameters' ``.grad``
    (keeping each weight gradient in between made W 1.4x the weight half of a backward);
    where the layers' weight sides meet (one flat parameter), they run together, once."""
    from devmesh.parallel.pipeline.split_backward import SplitBackward, _own_parameters

    def own_parameters(model: nn.Module):
        x = torch.randn(8, 16, requires_grad=True)
        split = SplitBackward(model(x), torch.randn(8, 16), x, list(model.parameters()))
        split.input_grad()
        return _own_parameters([e for piece in split._pieces for e in piece.entries()],
                               split.params)

    mlp = _mlp_stage()
    own = own_parameters(mlp)
    layers = [{id(p) for p in block.parameters()} for block in mlp]
    assert sorted(({id(p) for p in params} for params in own), key=min) == \
        sorted(layers, key=min)
    assert own_parameters(_OneFlatParameter()) is None


def test_split_at_one_output_of_a_chunk_stays_exact():
    """Splitting at a tensor made inside the stage (the first stage's first child output)
    by an operation with several outputs would keep one output's gradient only; the split
    then leaves W the whole backward (before this guard: wrong weight gradients)."""
    from devmesh.parallel.pipeline.split_backward import SplitBackward

    torch.manual_seed(0)
    first, rest = ChunkKeepingTheOtherHalf(), nn.Linear(16, 16)
    ref_first, ref_rest = copy.deepcopy(first), copy.deepcopy(rest)
    x, grad = torch.randn(8, 16), torch.randn(8, 16)
    (ref_rest(ref_first(x)) + ref_first.other).backward(grad)
    half = first(x)
    split = SplitBackward(rest(half) + first.other, grad, half,
                          [*first.parameters(), *rest.parameters()])
    split.input_grad()
    split.weight_grads()
    for ours, theirs in zip([*first.parameters(), *rest.parameters()],
                            [*ref_first.parameters(), *ref_rest.parameters()]):
        torch.testing.assert_close(ours.grad, theirs.grad)


def _two_steps_per_update(style: str, name: str):
    """Gradient accumulation across pipeline steps: two ``runner.step`` calls, then one
    optimizer step, on ``(pp, dp) = (2, 2)`` with each stage under ``replicate`` or
    ``fully_shard`` (each step reduces its gradients once; the second adds to the first)."""
    from devmesh.parallel import fully_shard, replicate

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh.get_coordinate()
    stage = split_sequential(block_model(), 2)[pp]
    (fully_shard if style == "fsdp" else replicate)(stage, mesh=mesh["dp"])
    runner = PipelineRunner({pp: stage}, mesh, build_schedule(name, 2, 4), F.cross_entropy)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    for update in range(2):
        for half in range(2):
            x, y = _accumulation_batch(update, half)
            mine = slice(8 * dp, 8 * dp + 8)
            runner.step(x[mine] if pp == 0 else None, y[mine] if pp == 1 else None)
        opt.step()
        opt.zero_grad()
    return pp, state_dict(stage, full=True)


def _accumulation_batch(update: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 * update + half)
    return torch.randn(16, 16, generator=gen), torch.randint(0, 4, (16,), generator=gen)


@pytest.mark.parametrize("style, name", [("ddp", "1f1b"), ("fsdp", "zero-bubble")])
def test_gradients_accumulate_across_pipeline_steps(mesh_pool, style, name):
    model = block_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for update in range(2):
        for half in range(2):
            x, y = _accumulation_batch(update, half)
            F.cross_entropy(model(x), y).backward()  # the sum of the two batches' means
        opt.step()
        opt.zero_grad()
    expected = model.state_dict()
    for pp, state in mesh_pool.run(_two_steps_per_update, 4, style, name):
        assert state and all(key in expected for key in state)
        for key, value in state.items():
            torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6, msg=key)


def stages_without_parameters() -> list[tuple[str, str, list[str]]]:
    """Stages holding only a ``Tanh`` or a ``Dropout`` (a split by names can make them),
    under 1F1B, zero-bubble and interleaved 1F1B, plain and under FSDP and DDP on
    ``(pp, dp) = (2, 2)``: the keys whose trained values differ from one process."""
    from devmesh.parallel import fully_shard, replicate

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.0), nn.Linear(8, 2))

    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen)
    alone = model()
    opt = torch.optim.SGD(alone.parameters(), lr=0.1)
    for _ in range(2):
        F.mse_loss(alone(x), y).backward()
        opt.step()
        opt.zero_grad()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    dp = mesh["dp"].get_local_rank()
    differing = []
    for composition in ("plain", "fsdp", "ddp"):
        for name in ("1f1b", "zero-bubble", "interleaved-1f1b"):
            schedule = build_schedule(name, 2, 4)
            starts = ["2"] if schedule.stages == 2 else ["1", "2", "3"]
            parts = split_sequential(model(), schedule.stages, starts=starts)
            me = mesh.get_coordinate()[0]
            stages = {s: parts[s] for s in range(schedule.stages) if schedule.rank_of(s) == me}
            for stage in stages.values():
                if composition == "fsdp":
                    fully_shard(stage, mesh=mesh["dp"])
                elif composition == "ddp":
                    replicate(stage, mesh=mesh["dp"])
            runner = PipelineRunner(stages, mesh, schedule, F.mse_loss)
            opt = torch.optim.SGD(runner.module.parameters(), lr=0.1)
            rows = slice(None) if composition == "plain" else slice(4 * dp, 4 * dp + 4)
            for _ in range(2):
                runner.step(x[rows], y[rows])
                opt.step()
                opt.zero_grad()
            full = runner.state_dict(full=True)
            differing.append((composition, name, [
                k for k, v in alone.state_dict().items()
                if not torch.allclose(full[k], v, rtol=1e-5, atol=1e-6)]))
    return differing


def test_stages_without_parameters_train_as_one_process(mesh_pool):
    for differing in mesh_pool.run(stages_without_parameters, 4):
        assert len(differing) == 9
        assert all(keys == [] for _, _, keys in differing), differing


class _Raises(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.fail = inner, False

    def forward(self, x):
        if self.fail:
            raise ValueError("stage failed")
        return self.inner(x)


def forward_contexts(name: str):
    """torch 2.15's ``PipelineStage.register_forward_context`` on devmesh's stages: each
    forward of a micro-batch runs inside a fresh context told its stage and micro-batch."""
    import contextlib

    from devmesh.parallel.pipeline import PipelineStage, PipelineStageInfo, get_schedule_class

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    virtual = 2 if name == "Interleaved1F1B" else 1
    parts = split_sequential(make_model(), 2 * virtual)
    me = mesh.get_coordinate()[0]
    mine = list(range(me, 2 * virtual, 2))
    stages = [PipelineStage(_Raises(parts[s]), s, 2 * virtual, "cpu") for s in mine]
    seen, inside = [], []

    @contextlib.contextmanager
    def recording(info):
        assert isinstance(info, PipelineStageInfo) and not info.is_metadata_inference
        seen.append((info.stage_index, info.microbatch_index))
        inside.append(True)
        try:
            yield
        finally:
            inside.pop()

    handles = [stage.register_forward_context(recording) for stage in stages]
    for stage in stages:  # the context must be entered around the module's forward
        stage.submod.register_forward_pre_hook(lambda *a: seen.append("ran inside")
                                               if inside else seen.append("ran outside"))
    twice = None
    try:
        stages[0].register_forward_context(recording)
    except PipelineError as exc:
        twice = str(exc)
    schedule = get_schedule_class(name)(stages if virtual > 1 else stages[0], 4,
                                        loss_fn=F.cross_entropy)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
    args = (x,) if me == 0 else ()
    kwargs = {"target": y} if me == 1 else {}
    schedule.step(*args, **kwargs)
    first = list(seen)
    for handle in handles:
        handle.remove()
    seen.clear()
    schedule.step(*args, **kwargs)
    unrecorded = [s for s in seen if s != "ran outside"]

    def swallowing(info):
        return contextlib.suppress(ValueError)

    stages[0].register_forward_context(swallowing)
    stages[0].submod.fail = True
    try:
        schedule.step(*args, **kwargs)
        swallowed = None
    except PipelineError as exc:
        swallowed = str(exc)
    return first, unrecorded, twice, swallowed, schedule.schedule_data()


@pytest.mark.parametrize("name", ["1F1B", "Interleaved1F1B"])
def test_a_registered_forward_context_wraps_each_forward_as_torchs(mesh_pool, name):
    for rank, (first, unrecorded, twice, swallowed, data) in enumerate(
            mesh_pool.run(forward_contexts, 2, name)):
        forwards = [(a.stage, a.microbatch) for a in data.actions[rank] if a.kind == "F"]
        assert [s for s in first if s != "ran inside"] == forwards  # each forward, in order
        assert first.count("ran inside") == len(forwards) and "ran outside" not in first
        assert unrecorded == []  # removed: no context any more
        assert "A pipeline forward context is already registered; remove its handle" in twice
        assert "suppressed an exception from the stage module" in swallowed, swallowed


def test_torch_2_15s_fsdp_residency_options_are_taken_and_checked():
    from devmesh.parallel.pipeline import PipelineStage, ScheduleInterleaved1F1B

    stages = [PipelineStage(nn.Linear(2, 2), s, 4, "cpu") for s in (0, 2)]
    ScheduleInterleaved1F1B(stages, 4, F.mse_loss, max_active_stages=2,
                            unshard_lookahead="auto", defer_reduce_grad_wait=True,
                            max_outstanding_sends=0)
    ScheduleInterleaved1F1B(stages, 4, F.mse_loss, unshard_lookahead=(1, 3))
    for kwargs, words in (({"max_active_stages": 0}, "max_active_stages must be a positive "
                                                      "integer, got 0"),
                          ({"unshard_lookahead": "some"}, "unshard_lookahead must be 'full', "
                                                          "'auto', or a tuple"),
                          ({"unshard_lookahead": (1, 4)}, r"unshard_lookahead\[1\] must be "
                                                          "an integer within .1, "
                                                          "max_active_stages=3., got 4"),
                          ({"max_outstanding_sends": -1}, "max_outstanding_sends must be a "
                                                          "non-negative integer")):
        with pytest.raises(PipelineError, match=words):
            ScheduleInterleaved1F1B(stages, 4, F.mse_loss, **kwargs)


_TORCH_STAGE_CONTEXT = """
import contextlib
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.testing._internal.distributed.fake_pg import FakeStore

from devmesh.parallel.pipeline.traced import as_devmesh_stage

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
seen = []
stage = PipelineStage(nn.Linear(2, 2), 0, 2, "cpu")
stage.register_forward_context(lambda info: seen.append(info) or contextlib.nullcontext())
ours = as_devmesh_stage(stage)
with ours.forward_context(3):
    pass
assert [(i.stage_index, i.microbatch_index) for i in seen] == [(0, 3)], seen
print("kept")
"""


def test_a_torch_stage_keeps_its_forward_context_on_devmesh_schedules():
    from torch.distributed.pipelining import PipelineStage as TorchStage

    if not hasattr(TorchStage, "register_forward_context"):
        pytest.skip("this torch's PipelineStage has no register_forward_context (torch 2.15 "
                    "added it): checked under .ci/compat 2.15.0")
    done = subprocess.run([sys.executable, "-c", _TORCH_STAGE_CONTEXT], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "kept", done.stderr[-3000:]
