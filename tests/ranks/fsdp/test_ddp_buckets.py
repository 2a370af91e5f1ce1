"""``replicate`` packs gradients into flat buckets kept from step to step, as DDP's are
(a bucket made anew each step cost a fresh allocation of every gradient's bytes, and held
the process's peak memory above DDP's): training still equals one process, whether the
optimizer sets gradients to ``None`` or zeroes them, and a gradient the user kept from one
step is not overwritten by the next step's packing; a backward that creates a graph keeps
it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from devmesh import init_device_mesh
from devmesh.parallel import replicate

STEPS = 3
RANKS = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 3)).double()


def _loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x = torch.randn(5, 6, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(10 * step + rank))
    return model(x).pow(2).mean()


def train(set_to_none: bool):
    import torch.distributed as dist

    model = _model()
    # buckets of about one 32 x 32 weight: the model's parameters fill two of them
    replicate(model, mesh=init_device_mesh("cpu", (RANKS,)), bucket_cap_mb=32 * 32 * 8 / 2**20)
    buckets = model._devmesh_ddp.buckets
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    storages, kept = [], []
    for step in range(STEPS):
        _loss(model, step, dist.get_rank()).backward()
        kept.append([(p.grad, p.grad.clone()) for p in model.parameters()])
        storages.append([b.storage.data_ptr() for b in buckets])
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    if not set_to_none:  # zeroed in place: what was kept is the live gradient, now zero
        kept = kept[-1:]
    overwritten = sum(not torch.equal(g, copy) for grads in kept[:-1] for g, copy in grads)
    return len(buckets), storages, overwritten, {n: p.detach() for n, p in
                                                 model.named_parameters()}


def reference():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        (sum(_loss(model, step, r) for r in range(RANKS)) / RANKS).backward()
        opt.step()
        opt.zero_grad()
    return dict(model.named_parameters())


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed"])
def test_buckets_are_kept_between_steps_and_training_equals_one_process(mesh_pool,
                                                                        set_to_none):
    expected = reference()
    for count, storages, overwritten, params in mesh_pool.run(train, RANKS, set_to_none):
        assert count == 2
        assert all(step == storages[0] for step in storages), storages  # the same buffers
        assert overwritten == 0  # a kept gradient is the user's, not a view of a bucket
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value.detach(), rtol=0, atol=1e-15,
                                       msg=name)


def double_backward():
    """A backward with ``create_graph=True`` (a gradient penalty): gradients that require
    grad are packed into a new buffer, so the graph through them stays."""
    import torch.distributed as dist

    model = _model()
    replicate(model, mesh=init_device_mesh("cpu", (RANKS,)))
    _loss(model, 0, dist.get_rank()).backward(create_graph=True)
    return [(p.grad.requires_grad, p.grad.detach().clone()) for p in model.parameters()]


def test_a_backward_that_creates_a_graph_averages_its_gradients(mesh_pool):
    model = _model()
    (sum(_loss(model, 0, r) for r in range(RANKS)) / RANKS).backward()
    for grads in mesh_pool.run(double_backward, RANKS):
        for (requires_grad, grad), p in zip(grads, model.parameters(), strict=True):
            assert requires_grad
            torch.testing.assert_close(grad, p.grad, rtol=0, atol=1e-15)
