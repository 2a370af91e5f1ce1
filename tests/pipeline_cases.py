"""The pipelines several rank tests train and compare with one process: a stack of blocks on
4 pipeline ranks under any schedule, the same composed with FSDP x TP or DDP on 8 ranks, and
what they are compared with."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from devmesh import comm_stats, init_device_mesh
from devmesh.layout.schedule import Schedule, build_schedule
from devmesh.parallel import state_dict
from devmesh.parallel.pipeline import PipelineRunner, split_sequential


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(8)]
    return nn.Sequential(*blocks, nn.Linear(16, 4))


def train_pipelined(name: str | Schedule, microbatches: int, steps: int = 2,
                    policy: str = "ahead"):
    """Train on 4 pipeline ranks with the schedule ``name`` (or a Schedule); return this
    rank's stage parameters, losses and P2P counts (``policy``: when the receives are posted
    — gloo's default, or NCCL's order)."""
    import torch.distributed as dist

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("pp",))
    schedule = name if isinstance(name, Schedule) else build_schedule(name, 4, microbatches)
    model = make_model()
    parts = split_sequential(model, schedule.stages)  # balanced by parameter count
    me = mesh.get_coordinate()[0]
    stages = {s: parts[s] for s in range(schedule.stages) if schedule.rank_of(s) == me}
    runner = PipelineRunner(stages, mesh, schedule, F.cross_entropy)
    runner._links.backend = {"ahead": "gloo", "fused": "nccl"}[policy]
    params = [p for s in stages.values() for p in s.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    losses, sends = [], []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 16, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        with comm_stats() as stats:
            loss = runner.step(x if 0 in stages else None, y if schedule.stages - 1 in stages
                               else None)
        sends.append(stats.by_collective().get("send", (0, 0))[0])
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else loss.item())
    index = {id(p): n for n, p in model.named_parameters()}
    return {index[id(p)]: p.detach().clone() for p in params}, losses, sends, dist.get_rank()


def reference(make=None, batch: int = 16, steps: int = 2, reduction: str = "mean"):
    """Single-process training of ``make()`` on the same batches: parameters and losses
    (``reduction``: the cross entropy's)."""
    model = (make or make_model)()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(batch, 16, generator=gen)
        y = torch.randint(0, 4, (batch,), generator=gen)
        loss = F.cross_entropy(model(x), y, reduction=reduction)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(model.named_parameters()), losses


def block_model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)) for _ in range(4)]
    return nn.Sequential(*blocks, nn.Linear(16, 4))


class MatmulWork(TorchDispatchMode):
    """Counts the multiply-adds of matrix products run under it (torch's FlopCounterMode
    also tracks modules with hooks that refuse ``autograd.grad`` on a leaf)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            a, b = args[-2:]
            self.flops += a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


def train_composed(name: str | Schedule, composition: str, steps: int = 2):
    """PP x FSDP x TP on (pp, dp, tp) = (2, 2, 2), or PP x DDP on (pp, dp) = (2, 4), under
    the schedule ``name`` (or a Schedule for 2 ranks, 4 micro-batches): each stage
    parallelized on the (dp, tp) slice, each data-parallel replica its own pipeline;
    "fsdp+tp+ac": each block also in torch's ``checkpoint_wrapper`` before ``fully_shard``;
    "fsdp+torch-tp" / "ddp+torch-tp": torch's styles and ``parallelize_module`` split the
    blocks (torch DTensor parameters), devmesh's ``fully_shard`` / ``replicate`` over ``dp``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from devmesh.parallel import fully_shard, replicate

    if "torch-tp" in composition:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
    else:
        from devmesh.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    if composition.startswith(("fsdp+", "ddp+")):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    else:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
    schedule = name if isinstance(name, Schedule) else build_schedule(name, 2, 4)
    model = block_model()
    parts = split_sequential(model, schedule.stages)
    me = mesh.get_coordinate()[0]
    stages = {}
    for s in range(schedule.stages):
        if schedule.rank_of(s) != me:
            continue
        stage = parts[s]
        if composition == "ddp+torch-tp":
            for block in stage:
                if isinstance(block, nn.Sequential):
                    parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(),
                                                           "2": RowwiseParallel()})
            replicate(stage, mesh=mesh["dp"])
        elif composition.startswith("fsdp+"):
            for i, block in enumerate(stage):
                if isinstance(block, nn.Sequential):
                    parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(),
                                                           "2": RowwiseParallel()})
                    if composition == "fsdp+tp+ac":  # torchtitan's order: TP, AC, FSDP
                        block = stage[i] = checkpoint_wrapper(block)
                    fully_shard(block, mesh=mesh["dp"])
            fully_shard(stage, mesh=mesh["dp"])
        else:
            replicate(stage, mesh=mesh["dp"])
        stages[s] = stage
    runner = PipelineRunner(stages, mesh, schedule, F.cross_entropy)
    opt = torch.optim.SGD([p for s in stages.values() for p in s.parameters()], lr=0.1)
    dp_index, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    losses, flops = [], 0
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)
        x, y = x.chunk(dp_size)[dp_index], y.chunk(dp_size)[dp_index]
        with MatmulWork() as counter:
            loss = runner.step(x if 0 in stages else None,
                               y if schedule.stages - 1 in stages else None)
        flops += counter.flops
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else loss.item())
    full = {}
    for stage in stages.values():  # the stages keep the whole model's names
        full.update(state_dict(stage, full=True))
    return full, losses, flops


def check_composed_like_one_process(mesh_pool, schedule: str | Schedule, composition: str
                                    ) -> None:
    """:func:`train_composed` on 8 ranks equals single-process training: every parameter,
    and the replicas' mean loss."""
    ref_state, ref_losses = reference(block_model, batch=32)
    full, replica_losses = {}, []
    for state, losses, _ in mesh_pool.run(train_composed, 8, schedule, composition):
        full.update(state)
        if losses[0] is not None:
            replica_losses.append(losses)
    assert full.keys() == ref_state.keys()
    for key, value in ref_state.items():
        torch.testing.assert_close(full[key], value.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{key} under {schedule}: {m}")
    mean = [sum(step) / len(replica_losses) for step in zip(*replica_losses)]
    assert mean == pytest.approx(ref_losses, rel=1e-5)


class ChunkKeepingTheOtherHalf(nn.Module):
    """A first layer whose output is one half of a chunk, the other half used later."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half, self.other = self.fc(x).chunk(2, dim=1)
        return half
