"""Activation checkpointing (``torch.utils.checkpoint``) inside ``fully_shard`` units and
under ``replicate``, as torchtitan-style training does: the recomputation in backward runs
the units' hooks again, and training must still equal single-process training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from devmesh import init_device_mesh
from devmesh.parallel import fully_shard, replicate, state_dict


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.l2(torch.relu(self.l1(x)))


class Net(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


def _batch(step: int):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=gen), torch.randint(0, 3, (16,), generator=gen)


def train(strategy: str, reentrant: bool):
    import torch.distributed as dist

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    model = Net(reentrant)
    if strategy == "fsdp":
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        replicate(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    rank = dist.get_rank()
    for step in range(3):
        x, y = _batch(step)
        F.cross_entropy(model(x[4 * rank: 4 * rank + 4]), y[4 * rank: 4 * rank + 4]).backward()
        opt.step()
        opt.zero_grad()
    return state_dict(model, full=True)


def reference(reentrant: bool):
    model = Net(reentrant)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(3):
        x, y = _batch(step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("strategy", ["fsdp", "replicate"])
def test_activation_checkpointing_matches_single_process(mesh_pool, strategy, reentrant):
    expected = reference(reentrant)
    for params in mesh_pool.run(train, 4, strategy, reentrant):
        for key, value in expected.items():
            torch.testing.assert_close(params[key], value, rtol=1e-5, atol=1e-6, msg=key)
