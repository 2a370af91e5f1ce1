"""The digits demo pipelined: PP x FSDP x TP on a ``(pp, shard, tp) = (2, 2, 2)`` mesh.

Seed 003's network as a sequence ``Flatten, Linear(64, 128), ReLU | Linear(128, 128), ReLU,
Linear(128, 10)`` in two pipeline stages. Inside a stage, the stage's first Linear is tensor
parallel — column-wise in stage 0, whose output crosses the pipeline boundary still split
by ``tp`` (each tp rank sends its half to the same tp rank of stage 1), row-wise in stage 1 —
and each stage is fully sharded over ``shard``, which also splits the batch. The 1F1B schedule
runs 4 micro-batches per step; every rank also trains the plain network on the whole batch,
and the losses and parameters are compared.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from devmesh.tools.apps.digits import NeuralNetwork, Result, load_data

__all__ = ["train_pipelined", "MESH", "NAMES"]

MESH, NAMES = (2, 2, 2), ("pp", "shard", "tp")
_STARTS = ["3"]  # stage 1 starts at the second Linear


def _stages(model: NeuralNetwork, mesh, schedule) -> dict[int, nn.Module]:
    """This rank's stages of the network, tensor parallel and fully sharded."""
    from devmesh.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        fully_shard,
        parallelize_module,
    )
    from devmesh.parallel.pipeline import split_sequential

    sequence = nn.Sequential(model.flatten, *model.linear_relu_stack)
    parts = split_sequential(sequence, 2, starts=_STARTS)
    plans = [{"1": ColwiseParallel()}, {"3": RowwiseParallel()}]  # the sequence's own names
    me = mesh.get_coordinate()[0]
    stages = {}
    for s in (s for s in range(schedule.stages) if schedule.rank_of(s) == me):
        parallelize_module(parts[s], mesh["tp"], plans[s])
        fully_shard(parts[s], mesh=mesh["shard"])
        stages[s] = parts[s]
    return stages


def train_pipelined(*, epochs: int = 1, batch_size: int = 64, lr: float = 0.2,
                    microbatches: int = 4) -> Result:
    """Runs on every rank of 8; returns this rank's Result (losses on every rank)."""
    from devmesh import init_device_mesh
    from devmesh.layout.schedule import build_schedule
    from devmesh.parallel import describe
    from devmesh.parallel.pipeline import PipelineRunner

    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=NAMES)
    schedule = build_schedule("1f1b", 2, microbatches)
    torch.manual_seed(0)
    model = NeuralNetwork()
    reference = copy.deepcopy(model)
    stages = _stages(model, mesh, schedule)
    runner = PipelineRunner(stages, mesh, schedule, F.cross_entropy)
    opt = torch.optim.SGD(runner.module.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    first, last = 0 in stages, 1 in stages
    result = Result(describe=describe(runner), mesh=repr(mesh))
    (x_train, y_train), _ = load_data()
    shard = mesh["shard"]
    per_rank = batch_size // shard.size()
    mine = slice(shard.get_local_rank() * per_rank, (shard.get_local_rank() + 1) * per_rank)
    for epoch in range(epochs):
        order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(epoch))
        for step in range(len(y_train) // batch_size):
            idx = order[step * batch_size:(step + 1) * batch_size]
            x, y = x_train[idx], y_train[idx]
            loss = runner.step(x[mine] if first else None, y[mine] if last else None)
            opt.step()
            opt.zero_grad()
            # the last stage's ranks hold the loss: average over the replicas, share with all
            total = torch.tensor([loss.item() if loss is not None else 0.0])
            dist.all_reduce(total)
            result.losses.append(total.item() / (dist.get_world_size() // 2))
            ref_loss = F.cross_entropy(reference(x), y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            result.reference_losses.append(ref_loss.item())
    expected = nn.Sequential(reference.flatten, *reference.linear_relu_stack).state_dict()
    trained = runner.state_dict(full=True)  # the whole model, every stage, on every rank
    assert trained.keys() == expected.keys()
    diff = max((trained[k] - v).abs().max().item() for k, v in expected.items())
    worst = torch.tensor([diff])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return Result(result.losses, result.reference_losses, [], worst.item(), result.describe,
                  result.mesh)
