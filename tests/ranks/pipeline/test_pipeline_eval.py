"""Forward-only passes through a pipeline (validation between training steps), as torch's
``schedule.eval``: the same outputs and losses as one process, no gradients touched, no
gradient messages, and the batch may differ from the training batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from devmesh import comm_stats, init_device_mesh
from devmesh.layout.schedule import IN_A_V, build_schedule
from devmesh.parallel.pipeline import PipelineRunner

from tuple_stages import (
    TWO_PER_RANK,
    tuple_batch,
    tuple_parts,
    tuple_pipeline,
    pipelining_stage,
    through_parts,
)

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "interleaved-zero-bubble",
             "zbv-zero-bubble", "dualpipe-v"]


def _ranks(name: str) -> int:
    return 2 if name in TWO_PER_RANK else 4


def _train_then_evaluate(name: str):
    """One training step on a batch of 16, then validation on a batch of 8 (with and
    without targets, twice), then a second training step on 16."""
    stages, runner, opt = tuple_pipeline(name)
    first, last = 0 in stages, 3 in stages
    x, scale, y = tuple_batch(0)
    runner.step((x, scale) if first else None, y if last else None)
    opt.step()
    opt.zero_grad()
    vx, vscale, vy = (t[:8] for t in tuple_batch(7))
    results = {"loss": runner.evaluate((vx, vscale) if first else None, vy if last else None)}
    results["output"] = runner.output()
    with comm_stats() as stats:
        results["no_targets"] = runner.evaluate((vx, vscale) if first else None)
    results["stats"] = stats.by_collective()
    results["output_no_targets"] = runner.output()
    results["grads"] = [p.grad for part in stages.values() for p in part.parameters()]
    x, scale, y = tuple_batch(1)
    results["train_loss"] = runner.step((x, scale) if first else None, y if last else None)
    opt.step()
    opt.zero_grad()
    return results, {s: part.state_dict() for s, part in stages.items()}


@pytest.mark.parametrize("name", SCHEDULES)
def test_evaluate_between_training_steps_is_one_process_forward(mesh_pool, name):
    parts = tuple_parts()
    opt = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=0.1)
    x, scale, y = tuple_batch(0)
    F.cross_entropy(through_parts(parts, x, scale), y).backward()
    opt.step()
    opt.zero_grad()
    vx, vscale, vy = (t[:8] for t in tuple_batch(7))
    with torch.no_grad():
        expected_output = through_parts(parts, vx, vscale)
    # the pipeline's loss: the mean of the 4 micro-batches' mean losses (equal sizes)
    expected_loss = torch.stack([F.cross_entropy(o, t) for o, t in
                                 zip(expected_output.chunk(4), vy.chunk(4))]).mean()
    x, scale, y = tuple_batch(1)
    expected_train = F.cross_entropy(through_parts(parts, x, scale), y)
    expected_train.backward()
    opt.step()

    results = mesh_pool.run(_train_then_evaluate, _ranks(name), name)
    virtual = 2 if name in TWO_PER_RANK else 1
    last = build_schedule(name, 4 // virtual, 4, virtual).rank_of(3)  # the last stage's rank
    for rank, (got, states) in enumerate(results):
        assert all(grad is None for grad in got["grads"]), "evaluate wrote gradients"
        assert got["no_targets"] is None
        if rank == last:
            torch.testing.assert_close(got["loss"], expected_loss, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got["output"], expected_output, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got["output_no_targets"], expected_output, rtol=1e-5,
                                       atol=1e-6)
            assert not got["output"].requires_grad
            torch.testing.assert_close(got["train_loss"], expected_train.detach(), rtol=1e-5,
                                       atol=1e-6)
        else:
            assert got["loss"] is None and got["output"] is None
        for s, state in states.items():  # training after evaluate is unchanged
            for key, value in state.items():
                torch.testing.assert_close(value, parts[s].state_dict()[key], rtol=1e-5,
                                           atol=1e-6, msg=f"stage {s} {key}")
    # forward messages only: 4 micro-batches and a header per boundary between two ranks
    # (a V's turn, stages 1 and 2 on one rank, hands over in memory)
    crossing = 2 if name in IN_A_V else 3
    sends = sum(got["stats"].get("send", (0,))[0] for got, _ in results)
    receives = sum(got["stats"].get("recv", (0,))[0] for got, _ in results)
    assert sends == receives == crossing * 4 + crossing
    assert all(set(got["stats"]) <= {"send", "recv"} for got, _ in results)


def _evaluate_sharded(style: str):
    """1F1B on (pp, dp) = (4, 2), each stage under ``fully_shard`` or ``replicate`` over
    ``dp``: validation on each dp rank's half of the batch."""
    from devmesh.parallel import fully_shard, replicate

    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("pp", "dp"))
    me, dp = mesh.get_coordinate()
    stage = tuple_parts()[me]
    (fully_shard if style == "fsdp" else replicate)(stage, mesh=mesh["dp"])
    runner = PipelineRunner({me: stage}, mesh, build_schedule("1f1b", 4, 4), F.cross_entropy)
    x, scale, y = tuple_batch(3)
    half = slice(8 * dp, 8 * dp + 8)
    loss = runner.evaluate((x[half], scale[half]) if me == 0 else None,
                           y[half] if me == 3 else None)
    return loss, runner.output(), [p.grad for p in stage.parameters()]


@pytest.mark.parametrize("style", ["fsdp", "ddp"])
def test_evaluate_with_sharded_stages(mesh_pool, style):
    parts = tuple_parts()
    x, scale, y = tuple_batch(3)
    with torch.no_grad():
        expected = through_parts(parts, x, scale)
    results = mesh_pool.run(_evaluate_sharded, 8, style)
    for rank, (loss, output, grads) in enumerate(results):
        assert all(g is None for g in grads)
        if rank // 2 == 3:  # the last stage's two dp ranks, each its half of the batch
            half = slice(8 * (rank % 2), 8 * (rank % 2) + 8)
            torch.testing.assert_close(output, expected[half], rtol=1e-5, atol=1e-6)
            mean = torch.stack([F.cross_entropy(o, t) for o, t in
                                zip(expected[half].chunk(4), y[half].chunk(4))]).mean()
            torch.testing.assert_close(loss, mean, rtol=1e-5, atol=1e-6)
        else:
            assert loss is None and output is None


def _torch_eval_code(library: str):
    """torch's pipelining code with a validation pass: ``eval`` with and without targets,
    ``step`` with ``loss_kwargs`` and ``return_outputs=False``, and a schedule built
    without a loss (forward only); run by torch's classes or, imports switched, devmesh's."""
    me, part, stage, classes = pipelining_stage(library)

    def loss_fn(output, target, weight=1.0):
        return F.cross_entropy(output, target) * weight

    schedule = classes.Schedule1F1B(stage, 4, loss_fn=loss_fn)
    opt = torch.optim.SGD(part.parameters(), lr=0.1)
    x, scale, y = tuple_batch(0)
    vx, vscale, vy = (t[:8] for t in tuple_batch(5))
    out = {}
    if me == 0:
        schedule.step(x, scale, loss_kwargs={"weight": 0.5})
        opt.step()
        with torch.no_grad():
            schedule.eval(vx, vscale)
            schedule.eval(vx, scale=vscale)
    elif me == 3:
        out["train"] = schedule.step(target=y, return_outputs=False,
                                     loss_kwargs={"weight": 0.5})
        opt.step()
        out["losses"] = []
        with torch.no_grad():
            out["eval"] = schedule.eval(target=vy, losses=out["losses"])
            out["eval_keyword"] = schedule.eval(target=vy)
    else:
        schedule.step(loss_kwargs={"weight": 0.5})
        opt.step()
        with torch.no_grad():
            schedule.eval()
            schedule.eval()
    opt.zero_grad()
    forward_only = classes.ScheduleGPipe(stage, 2)  # no loss: step runs forward only, as eval
    if me == 0:
        forward_only.step(vx, vscale)
    else:
        out["forward_only"] = forward_only.step()
    out["losses"] = [float(v) for v in out.get("losses", [])]
    out["grads"] = [p.grad for p in part.parameters()]
    return part.state_dict(), out


def test_eval_and_step_arguments_as_torchs_pipelining(mesh_pool):
    theirs = mesh_pool.run(_torch_eval_code, 4, "torch")
    ours = mesh_pool.run(_torch_eval_code, 4, "devmesh")
    for (state, out), (t_state, t_out) in zip(ours, theirs):
        for key, value in t_state.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)
        assert out.keys() == t_out.keys()
        assert all(g is None for g in out["grads"])
        for key in out.keys() - {"losses", "grads"}:
            if t_out[key] is None:
                assert out[key] is None, key
            else:
                torch.testing.assert_close(out[key], t_out[key], rtol=1e-5, atol=1e-6,
                                           msg=key)
        assert out["losses"] == pytest.approx(t_out["losses"], rel=1e-5)
    assert ours[3][1]["train"] is None and len(ours[3][1]["losses"]) == 4
    assert ours[3][1]["eval"].shape == (8, 4)


def _step_without_gradients():
    from devmesh.parallel.pipeline import PipelineError

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    me = mesh.get_coordinate()[0]
    stages = {me: nn.Linear(16, 16) if me == 0 else nn.Linear(16, 4)}
    runner = PipelineRunner(stages, mesh, build_schedule("1f1b", 2, 2), F.cross_entropy)
    x, _, y = tuple_batch(0)
    errors = []
    try:  # only the first stage's rank has gradients off: every rank must still hear of it
        with torch.set_grad_enabled(me != 0):
            runner.step(x if me == 0 else None, y if me == 1 else None)
    except PipelineError as exc:
        errors.append(str(exc))
    def accuracy(logits, target):  # a metric: no gradient reaches the model through it
        return (logits.argmax(-1) == target).double().mean()

    metric = PipelineRunner(stages, mesh, build_schedule("1f1b", 2, 2), accuracy)
    try:
        metric.step(x if me == 0 else None, y if me == 1 else None)
    except PipelineError as exc:
        errors.append(str(exc))
    bare = PipelineRunner(stages, mesh, build_schedule("1f1b", 2, 2), None)
    try:
        bare.step(x if me == 0 else None, y if me == 1 else None)
    except PipelineError as exc:
        errors.append(str(exc))
    try:  # a batch the micro-batches do not divide, on the first stage's rank only
        bare.evaluate(x[:3] if me == 0 else None)
    except PipelineError as exc:
        errors.append(str(exc))
    bare.evaluate(x if me == 0 else None)  # forward only needs no loss function
    return errors, bare.output()


def test_step_without_gradients_or_loss_is_named_on_every_rank(mesh_pool):
    """Gradients off on one rank, a loss no gradient flows through (a metric), no loss
    function, a batch the micro-batches do not divide: each named on every rank."""
    results = mesh_pool.run(_step_without_gradients, 2)
    for rank, (errors, output) in enumerate(results):
        assert len(errors) == 4, errors
        assert "gradients are off here" in errors[0] and "call evaluate()" in errors[0]
        # before, the step returned the metric and left every gradient at None, silently
        assert "rank 1: stage 1, forward of micro-batch 0" in errors[1]
        assert "the loss function returned a tensor that does not require grad" in errors[1]
        assert "no loss function" in errors[2]
        assert "rank 0: 2 micro-batches do not divide the batch of 3" in errors[3]
        assert "zero them" not in errors[3] and errors[3].count("[rank") == 1  # no gradients
        assert (output is None) == (rank == 0)
    assert results[1][1].shape == (16, 4)
