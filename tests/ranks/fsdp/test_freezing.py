"""Freezing and unfreezing after parallelizing — fine-tuning that trains the head first and
unfreezes the backbone later, or freezes layers as it goes — trains as single-process
training does. (torch's DDP keeps the parameters that required gradients at construction;
one unfrozen later is silently never averaged, so replicas drift apart.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from devmesh import init_device_mesh
from devmesh.parallel import fully_shard, replicate, state_dict
from helpers import caught

STEPS = 4


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    for p in model[0].parameters():  # backbone frozen at first
        p.requires_grad_(False)
    return model


def _batch(step: int, rank: int):
    gen = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)


def _adjust(model: nn.Module, step: int) -> None:
    """Step 1 unfreezes the backbone, step 3 freezes the middle layer."""
    if step == 1:
        for p in model[0].parameters():
            p.requires_grad_(True)
    if step == 3:
        for p in model[2].parameters():
            p.requires_grad_(False)


def _train(model: nn.Module, loss_of) -> None:
    # one optimizer over every parameter from the start: frozen ones have no gradient
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(STEPS):
        _adjust(model, step)
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()


def train(strategy: str):
    import torch.distributed as dist

    model = _model()
    mesh = init_device_mesh("cpu", (4,))
    if strategy == "replicate":
        replicate(model, mesh=mesh)
    else:
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
    rank = dist.get_rank()
    _train(model, lambda m, step: F.cross_entropy(m(_batch(step, rank)[0]), _batch(step, rank)[1]))
    return state_dict(model, full=True)


def reference():
    model = _model()
    _train(model, lambda m, step: sum(F.cross_entropy(m(_batch(step, r)[0]), _batch(step, r)[1])
                                      for r in range(4)) / 4)
    return model.state_dict()


@pytest.mark.parametrize("strategy", ["replicate", "fsdp"])
def test_unfreezing_and_freezing_after_parallelizing(mesh_pool, strategy):
    expected = reference()
    for params in mesh_pool.run(train, 4, strategy):
        for key, value in expected.items():
            torch.testing.assert_close(params[key], value, rtol=1e-5, atol=1e-6, msg=key)


def unfreeze_differently():
    import torch.distributed as dist

    model = _model()
    replicate(model, mesh=init_device_mesh("cpu", (2,)))
    layer = 0 if dist.get_rank() == 0 else 2
    for p in model[layer].parameters():
        p.requires_grad_(layer == 0)
    return caught(lambda: model(torch.randn(2, 6)))


def test_ranks_changing_requires_grad_differently_raise_on_every_rank(mesh_pool):
    for name, message in mesh_pool.run(unfreeze_differently, 2):
        assert name == "MeshMismatchError"
        assert "requires_grad was changed differently" in message and "0.weight" in message


def _adjust_by_name(module: nn.Module, step: int) -> None:
    """:func:`_adjust` for a pipeline stage's part of the model (the model's own names)."""
    for name, p in module.named_parameters():
        if step == 1 and name.startswith("0."):
            p.requires_grad_(True)
        if step == 3 and name.startswith("2."):
            p.requires_grad_(False)


def pipelined(schedule_name: str):
    """The first stage starts with every parameter frozen: its backward has nothing to do
    (it raised "element 0 of tensors does not require grad" before)."""
    from devmesh.parallel.pipeline import PipelineRunner, build_schedule, split_sequential

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    schedule = build_schedule(schedule_name, 2, 4, 1)
    parts = split_sequential(_model(), schedule.stages)
    pp, dp = mesh.get_coordinate()
    stages = {s: parts[s] for s in range(schedule.stages) if schedule.rank_of(s) == pp}
    for stage in stages.values():
        replicate(stage, mesh=mesh["dp"])
    runner = PipelineRunner(stages, mesh, schedule, F.cross_entropy)
    opt = torch.optim.AdamW(runner.module.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(STEPS):
        _adjust_by_name(runner.module, step)
        x, y = _batch(step, dp)
        runner.step(x if 0 in stages else None, y if schedule.stages - 1 in stages else None)
        opt.step()
        opt.zero_grad()
    return runner.state_dict(full=True)


@pytest.mark.parametrize("schedule_name", ["1f1b", "zero-bubble"])
def test_a_frozen_first_stage_and_unfreezing_under_pipelining(mesh_pool, schedule_name):
    model = _model()
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == ["0.weight",
                                                                                "0.bias"]
    _train(model, lambda m, step: F.cross_entropy(
        m(torch.cat([_batch(step, r)[0] for r in range(2)])),
        torch.cat([_batch(step, r)[1] for r in range(2)])))
    expected = model.state_dict()
    for params in mesh_pool.run(pipelined, 4, schedule_name):
        for key, value in expected.items():
            torch.testing.assert_close(params[key], value, rtol=1e-5, atol=1e-6, msg=key)
