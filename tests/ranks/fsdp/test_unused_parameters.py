"""Parameters a forward does not use: in single-process training their gradient stays
``None`` and optimizers skip them — with weight decay or momentum a zero gradient would
still move them. ``replicate`` and ``fully_shard`` must leave them alone the same way (as
torch's DDP and FSDP2 do), and must average a parameter that only some ranks used."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from devmesh import init_device_mesh
from devmesh.parallel import fully_shard, replicate, state_dict

STEPS = 4


class Branchy(nn.Module):
    """``rare`` is used on step 1 only (unused on every rank otherwise); ``local`` on rank 0
    only, on steps 2 and 3 (used on one rank, unused on the others)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 8)
        self.rare = nn.Linear(8, 8)
        self.local = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, use_rare: bool, use_local: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_rare:
            h = self.rare(h)
        if use_local:
            h = self.local(h)
        return self.b(h)


def _batch(step: int, rank: int):
    gen = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)


def _uses(step: int, rank: int) -> tuple[bool, bool]:
    return step == 1, step >= 2 and rank == 0


def train(strategy: str):
    import torch.distributed as dist

    shape = (2, 2) if strategy == "hsdp" else (4,)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
    model = Branchy()
    if strategy == "replicate":
        replicate(model, mesh=mesh)
    else:
        fully_shard(model.b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.5)
    rank = dist.get_rank()
    no_grad_after_step0 = []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        F.cross_entropy(model(x, *_uses(step, rank)), y).backward()
        if step == 0:
            no_grad_after_step0 = sorted(n for n, p in model.named_parameters() if p.grad is None)
        opt.step()
        opt.zero_grad()
    return no_grad_after_step0, state_dict(model, full=True)


def reference(world: int = 4):
    """Single process: the loss is the mean of the ranks' losses (what averaging gives)."""
    model = Branchy()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.5)
    for step in range(STEPS):
        loss = sum(F.cross_entropy(model(_batch(step, r)[0], *_uses(step, r)), _batch(step, r)[1])
                   for r in range(world)) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("strategy", ["replicate", "fsdp", "hsdp"])
def test_unused_parameters_are_left_alone_as_in_single_process_training(mesh_pool, strategy):
    expected = reference()
    for no_grad, params in mesh_pool.run(train, 4, strategy):
        assert no_grad == ["local.bias", "local.weight", "rare.bias", "rare.weight"]
        for key, value in expected.items():
            torch.testing.assert_close(params[key], value, rtol=1e-5, atol=1e-6, msg=key)
