"""A pipeline whose last stage hands class-sharded logits (a torch DTensor) to a vocabulary-
parallel cross-entropy, torch's ``loss_parallel``: torchtitan's PP × TP with its loss. The
backward of such a loss needs the context too, so it goes around the step."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from devmesh import init_device_mesh
from helpers import train_alone

STEPS, BATCH, CLASSES = 2, 8, 7  # 7 classes: split 4 and 3 by the 2 tensor-parallel ranks


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6), nn.Linear(6, CLASSES)).double()


def _batch(step: int):
    gen = torch.Generator().manual_seed(step)
    return (torch.randn(BATCH, 6, dtype=torch.float64, generator=gen),
            torch.randint(0, CLASSES, (BATCH,), generator=gen))


def vocabulary_parallel_pipeline(schedule_name: str, context_around: str):
    """Two stages on ``pp``, each split over ``tp``; the head's logits stay class-sharded.
    ``context_around``: "step" (``with loss_parallel(): runner.step(...)``) or "loss" (the
    loss function enters it). Returns the losses and the whole model, or the error."""
    from devmesh.layout.schedule import build_schedule
    from devmesh.parallel import ColwiseParallel, RowwiseParallel, loss_parallel
    from devmesh.parallel import parallelize_module
    from devmesh.parallel.pipeline import PipelineError, PipelineRunner, split_sequential

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    schedule = build_schedule(schedule_name, 2, 4)
    parts = split_sequential(_model(), 2, starts=["3"])
    me = mesh.get_coordinate()[0]
    plan = ({"0": ColwiseParallel(), "2": RowwiseParallel()} if me == 0 else
            {"3": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    parallelize_module(parts[me], mesh["tp"], plan)

    def loss_fn(logits, target):
        with loss_parallel() if context_around == "loss" else contextlib.nullcontext():
            return F.cross_entropy(logits, target)

    runner = PipelineRunner({me: parts[me]}, mesh, schedule, loss_fn)
    opt = torch.optim.SGD(runner.module.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        try:
            with loss_parallel() if context_around == "step" else contextlib.nullcontext():
                loss = runner.step(x if me == 0 else None, y if me == 1 else None)
        except PipelineError as exc:
            return str(exc)
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else float(loss.full_tensor()))
    return losses, runner.state_dict(full=True)


@pytest.mark.parametrize("schedule_name", ["1f1b", "zero-bubble"])
def test_loss_parallel_around_the_step_trains_as_one_process(mesh_pool, schedule_name):
    """The logits never gathered (7 classes split 4 + 3), under 1F1B and under zero-bubble's
    split backward: the losses and the whole model equal one process's."""
    ref_losses = []
    ref_state = train_alone(_model(), STEPS, _batch, ref_losses)
    for rank, (losses, state) in enumerate(
            mesh_pool.run(vocabulary_parallel_pipeline, 4, schedule_name, "step")):
        if rank >= 2:  # the last stage's ranks
            assert losses == pytest.approx(ref_losses, rel=1e-13)
        for key, value in ref_state.items():
            torch.testing.assert_close(state[key], value, atol=1e-13, rtol=1e-13)


def test_loss_parallel_inside_the_loss_function_is_named_on_every_rank(mesh_pool):
    """Entered in the loss function only, the backward runs outside it and torch fails
    ("got mixed torch.Tensor and DTensor"): every rank says to enter it around the step."""
    for message in mesh_pool.run(vocabulary_parallel_pipeline, 4, "1f1b", "loss"):
        assert "stage 1, backward of micro-batch 0" in message
        assert "with loss_parallel(): runner.step(...)" in message
