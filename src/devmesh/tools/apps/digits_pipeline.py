"""The digits demo pipelined: PP x (FSDP | HSDP | DDP) x TP, by default on a
``(pp, shard, tp) = (2, 2, 2)`` mesh of 8 ranks, or PP x HSDP x TP on ``pp=2,dp=2,shard=2,tp=2``
(16 ranks).

Seed 003's network as a sequence ``Flatten, Linear(64, 128), ReLU | Linear(128, 128), ReLU,
Linear(128, 10)`` in two pipeline stages. Inside a stage, the stage's first Linear is tensor
parallel — column-wise in stage 0, whose output crosses the pipeline boundary still split
by ``tp`` (each tp rank sends its half to the same tp rank of stage 1), row-wise in stage 1 —
and each stage is data parallel over the rest: fully sharded over ``shard``, replicated over
``dp`` as well (HSDP) when both are there, DDP over ``dp`` alone; the data-parallel ranks
split the batch. The 1F1B schedule runs 4 micro-batches per step; every rank also trains the
plain network on the whole batch, and the losses and parameters are compared.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from devmesh.tools.apps.digits import MeshPlan, NeuralNetwork, Result, load_data, parse_mesh

__all__ = ["train_pipelined", "parse_pipeline_mesh", "DEFAULT_MESH"]

DEFAULT_MESH = "pp=2,shard=2,tp=2"
_ORDER = ("pp", "dp", "shard", "tp")  # the mesh's dims, outermost first
_STARTS = ["3"]  # stage 1 starts at the second Linear


def parse_pipeline_mesh(text: str = DEFAULT_MESH) -> MeshPlan:
    """``"pp=2,dp=2,shard=2,tp=2"`` -> MeshPlan with the dims in the order pp, dp, shard, tp
    (whatever order the text gives): the network has two stages, so ``pp`` must be 2."""
    plan = parse_mesh(text, allowed=_ORDER)
    if plan.size("pp") != 2 or "pp" not in plan.names:
        raise ValueError(f"mesh {text!r}: the pipelined digits network has two stages; "
                         "give pp=2, e.g. pp=2,shard=2,tp=2")
    names = tuple(n for n in _ORDER if n in plan.names)
    return MeshPlan(names, tuple(plan.size(n) for n in names))


def _data_names(mesh) -> tuple[str, ...]:
    return tuple(n for n in ("dp", "shard") if n in mesh.mesh_dim_names)


def _stages(model: NeuralNetwork, mesh, schedule) -> dict[int, nn.Module]:
    """This rank's stages of the network, tensor parallel and data parallel."""
    from devmesh.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        fully_shard,
        parallelize_module,
        replicate,
    )
    from devmesh.parallel.pipeline import split_sequential

    sequence = nn.Sequential(model.flatten, *model.linear_relu_stack)
    parts = split_sequential(sequence, 2, starts=_STARTS)
    plans = [{"1": ColwiseParallel()}, {"3": RowwiseParallel()}]  # the sequence's own names
    data = _data_names(mesh)
    me = mesh.get_coordinate()[0]
    stages = {}
    for s in (s for s in range(schedule.stages) if schedule.rank_of(s) == me):
        if "tp" in mesh.mesh_dim_names:
            parallelize_module(parts[s], mesh["tp"], plans[s])
        if "shard" in data:  # FSDP, or HSDP with dp: fully_shard on the 2-D (dp, shard) mesh
            fully_shard(parts[s], mesh=mesh[data] if len(data) > 1 else mesh[data[0]])
        elif data:
            replicate(parts[s], mesh=mesh["dp"])
        stages[s] = parts[s]
    return stages


def _data_rank(mesh) -> tuple[int, int]:
    """How many data-parallel ranks split the batch, and which one this rank is."""
    size, index = 1, 0
    for name in _data_names(mesh):
        sub = mesh[name]
        size, index = size * sub.size(), index * sub.size() + sub.get_local_rank()
    return size, index


def train_pipelined(mesh_text: str = DEFAULT_MESH, *, epochs: int = 1, batch_size: int = 64,
                    lr: float = 0.2, microbatches: int = 4,
                    max_steps: int | None = None) -> Result:
    """Runs on every rank of the mesh; returns this rank's Result (losses on every rank).
    ``max_steps`` stops early (tests)."""
    from devmesh import init_device_mesh
    from devmesh.layout.schedule import build_schedule
    from devmesh.parallel import describe
    from devmesh.parallel.pipeline import PipelineRunner

    plan = parse_pipeline_mesh(mesh_text)
    mesh = init_device_mesh("cpu", plan.shape, mesh_dim_names=plan.names)
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
    (x_train, y_train), test = load_data()
    data_size, data_index = _data_rank(mesh)
    if batch_size % (data_size * microbatches):
        raise ValueError(f"batch size {batch_size} must be divisible by the data-parallel "
                         f"degree {data_size} times {microbatches} micro-batches")
    per_rank = batch_size // data_size
    mine = slice(data_index * per_rank, (data_index + 1) * per_rank)
    steps = len(y_train) // batch_size
    for epoch in range(epochs):
        order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(epoch))
        for step in range(steps if max_steps is None else min(steps, max_steps)):
            idx = order[step * batch_size:(step + 1) * batch_size]
            x, y = x_train[idx], y_train[idx]
            loss = runner.step(x[mine] if first else None, y[mine] if last else None)
            opt.step()
            opt.zero_grad()
            # the last stage's ranks hold the loss: average over the replicas, share with all
            total = torch.tensor([loss.item() if loss is not None else 0.0])
            dist.all_reduce(total)
            result.losses.append(total.item() / (dist.get_world_size() // plan.size("pp")))
            ref_loss = F.cross_entropy(reference(x), y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            result.reference_losses.append(ref_loss.item())
        accuracy, expected = _test_accuracy(runner, reference, test, data_size, data_index)
        result.accuracies.append(accuracy)
        result.reference_accuracies.append(expected)
    expected = nn.Sequential(reference.flatten, *reference.linear_relu_stack).state_dict()
    trained = runner.state_dict(full=True)  # the whole model, every stage, on every rank
    assert trained.keys() == expected.keys()
    diff = max((trained[k] - v).abs().max().item() for k, v in expected.items())
    worst = torch.tensor([diff])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    result.max_param_diff = worst.item()
    return result


def _test_accuracy(runner, reference: nn.Module, test, data_size: int, data_index: int
                   ) -> tuple[float, float]:
    """The share of test images the pipelined network classifies right (a forward-only
    pass through the pipeline, :meth:`~devmesh.parallel.pipeline.PipelineRunner.evaluate`,
    each data-parallel rank on its part), and the single-process network's on the same
    images: the first ones that the data-parallel ranks and micro-batches divide evenly."""
    x_test, y_test = test
    unit = data_size * runner.schedule.microbatches
    count = len(y_test) - len(y_test) % unit
    per_rank = count // data_size
    mine = slice(data_index * per_rank, (data_index + 1) * per_rank)
    first, last = 0 in runner.stages, runner.last in runner.stages
    runner.evaluate(x_test[mine] if first else None)
    correct = torch.zeros(1)
    if last:
        correct += (runner.output().argmax(1) == y_test[mine]).sum()
    dist.all_reduce(correct)
    names = runner.mesh.mesh_dim_names
    copies = runner.mesh["tp"].size() if "tp" in names else 1  # tp ranks hold the same output
    with torch.no_grad():
        expected = (reference(x_test[:count]).argmax(1) == y_test[:count]).float().mean()
    return correct.item() / copies / count, expected.item()
