"""Pipeline x FSDP with mixed precision (bfloat16 compute, float32 reductions): torchtitan's
everyday configuration, compared with torch's own pipelining and FSDP2 running the same code
on the same (pp, dp) = (2, 2) mesh — bfloat16 rounding makes one process a loose reference,
torch's run an exact one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import TorchRuns


def block_model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)) for _ in range(4)]
    return nn.Sequential(*blocks, nn.Linear(16, 4))


def train(library: str, schedule_name: str, steps: int = 2) -> dict[str, torch.Tensor]:
    """Each pipeline rank's half of ``block_model`` under ``fully_shard`` with bfloat16
    compute on the ``dp`` dim, trained by ``schedule_name``; this rank's full parameters.
    The code is torch's, with ``library``'s imports."""
    if library == "devmesh":
        from devmesh import init_device_mesh
        from devmesh.parallel import MixedPrecisionPolicy, fully_shard, state_dict
        from devmesh.parallel.pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    blocks = list(block_model())
    stage_module = nn.Sequential(*(blocks[:2] if pp == 0 else blocks[2:]))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in stage_module:
        if isinstance(block, nn.Sequential):
            fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(stage_module, mesh=mesh["dp"], mp_policy=policy)
    stage = PipelineStage(stage_module, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule_name]
    schedule = kind(stage, 4, loss_fn=lambda out, y: F.cross_entropy(out.float(), y))
    opt = torch.optim.SGD(stage_module.parameters(), lr=0.1)
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)
        x, y = x.chunk(2)[dp], y.chunk(2)[dp]
        schedule.step(x) if pp == 0 else schedule.step(target=y)
        opt.step()
        opt.zero_grad()
    if library == "devmesh":
        return state_dict(stage_module, full=True)
    return {n: p.full_tensor() for n, p in stage_module.named_parameters()}


SCHEDULES = ("1f1b", "gpipe")


@pytest.fixture(scope="module")
def torch_runs() -> TorchRuns:
    return TorchRuns({4: [(train, ("torch", name)) for name in SCHEDULES]})


@pytest.mark.parametrize("schedule_name", SCHEDULES)
def test_bfloat16_fsdp_stages_train_as_torchs_pipelining_and_fsdp2(mesh_pool, torch_runs,
                                                                  schedule_name):
    theirs = torch_runs(4, train, "torch", schedule_name)
    ours = mesh_pool.run(train, 4, "devmesh", schedule_name)
    blocks = list(block_model())
    for rank, (mine, torchs) in enumerate(zip(ours, theirs)):
        initial = nn.Sequential(*(blocks[:2] if rank < 2 else blocks[2:])).state_dict()
        assert mine.keys() == torchs.keys() and mine, rank
        for key, value in torchs.items():
            assert mine[key].dtype == torch.float32  # the sharded master copy stays float32
            torch.testing.assert_close(mine[key], value, rtol=0, atol=0, msg=key)
            assert not torch.equal(value, initial[key]), key  # it trained
