"""Gradient accumulation without synchronization (issue 11, item 1): micro-batches
accumulate locally under ``no_sync()`` / ``set_requires_gradient_sync(False)``, the last one
reduces once, and training equals single-process training on the global batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from devmesh import comm_stats, init_device_mesh
from devmesh.parallel import FSDPModule, ReplicateModule, fully_shard, replicate, state_dict
from strategies import make_model

MICRO = 3


def accumulate(strategy: str, reshard_after_backward: bool = True):
    import torch.distributed as dist

    shape = (2, 2) if strategy == "hsdp" else (4,)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
    model = make_model()
    if strategy == "ddp":
        replicate(model, mesh=mesh)
        assert isinstance(model, ReplicateModule) and isinstance(model, torch.nn.Sequential)
    else:
        for i in (0, 2, 4):
            fully_shard(model[i], mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert isinstance(model, FSDPModule)
        model.set_reshard_after_backward(reshard_after_backward)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, counts = [], []
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(24, 12, generator=gen), torch.randint(0, 5, (24,), generator=gen)
        mine_x, mine_y = x.chunk(world)[rank], y.chunk(world)[rank]  # 6 samples per rank
        step_loss = 0.0
        for i, (xb, yb) in enumerate(zip(mine_x.chunk(MICRO), mine_y.chunk(MICRO))):
            last = i == MICRO - 1
            model.set_requires_gradient_sync(last)
            with comm_stats() as stats:
                loss = F.cross_entropy(model(xb), yb) / MICRO
                loss.backward()
            counts.append({k: v[0] for k, v in stats.by_collective().items()})
            step_loss += loss.item()
        opt.step()
        opt.zero_grad()
        total = torch.tensor([step_loss / world])
        dist.all_reduce(total)
        losses.append(total.item())
    return losses, counts, {k: v for k, v in state_dict(model, full=True).items()}


def reference():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(24, 12, generator=gen), torch.randint(0, 5, (24,), generator=gen)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.parametrize("strategy, reshard", [("ddp", True), ("fsdp", True), ("fsdp", False),
                                               ("hsdp", True)])
def test_accumulating_micro_batches_reduces_once(mesh_pool, strategy, reshard):
    ref_losses, ref_state = reference()
    for losses, counts, state in mesh_pool.run(accumulate, 4, strategy, reshard):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for key, value in ref_state.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)
        for step in range(2):
            micro = counts[step * MICRO:(step + 1) * MICRO]
            for c in micro[:-1]:  # no gradient reduction before the last micro-batch
                assert c.get("reduce_scatter", 0) == 0 and c.get("all_reduce", 0) == 0, c
            reductions = micro[-1].get("reduce_scatter", 0) + micro[-1].get("all_reduce", 0)
            assert reductions > 0
            if strategy == "fsdp" and not reshard:
                # parameters kept from the previous backward: no all-gather either (the first
                # forward of the step gathers: the optimizer changed them)
                assert [c.get("all_gather", 0) for c in micro[1:]] == [0, 0]
            if strategy == "fsdp" and reshard:
                assert all(c.get("all_gather", 0) > 0 for c in micro)
