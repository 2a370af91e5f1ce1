"""Optimizers over devmesh's split parameters (this rank's blocks): torch's elementwise ones
train as single-process training does; the ones that read across elements (Adafactor, Muon,
LBFGS) computed on one block and trained differently, silently — they are now refused on
every rank, at every step, with the ways out; a class devmesh does not know gets a warning.
Whole parameters (``replicate``) take any optimizer: LBFGS under ``replicate`` equals
single-process training."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from devmesh import init_device_mesh


def _model() -> nn.Module:
    torch.manual_seed(0)
    # float64: LBFGS's line search amplifies float32's summation-order differences
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def _optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "Muon":
        return torch.optim.Muon([p for p in params if p.ndim == 2], lr=0.02)
    if name == "LBFGS":
        return torch.optim.LBFGS(params, lr=0.1)
    return getattr(torch.optim, name)(params, lr=0.01)


def _train(model: nn.Module, name: str, rank: int = 0, world: int = 1, steps: int = 3):
    optimizer = _optimizer(name, list(model.parameters()))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    y = torch.randn(8, 4, generator=gen, dtype=torch.float64)
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]

    def closure():
        optimizer.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        return loss

    for _ in range(steps):
        if name == "LBFGS":
            optimizer.step(closure)
        else:
            closure()
            optimizer.step()


def _refused_on_every_step(name: str, how: str):
    import torch.distributed as dist

    from devmesh.parallel import ColwiseParallel, RowwiseParallel, fully_shard, parallelize_module

    mesh = init_device_mesh("cpu", (2,))
    model = _model()
    if how == "fully_shard":
        fully_shard(model, mesh=mesh)
    else:
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    messages = []
    for _ in range(2):  # refused again: a caught error must not let the next step through
        try:
            _train(model, name, dist.get_rank(), 2, steps=1)
        except Exception as error:  # noqa: BLE001 - the test inspects it
            messages.append(f"{type(error).__name__}: {error}")
    return messages


@pytest.mark.parametrize("name", ["Adafactor", "Muon", "LBFGS"])
@pytest.mark.parametrize("how", ["fully_shard", "tensor parallel"])
def test_optimizers_reading_across_elements_are_refused_on_every_rank(mesh_pool, name, how):
    for messages in mesh_pool.run(_refused_on_every_step, 2, name, how):
        assert len(messages) == 2
        for message in messages:
            assert message.startswith("ParallelizeError") and name in message
            assert "elementwise optimizer" in message and "replicate" in message


def _whole_parameters(name: str):
    import torch.distributed as dist

    from devmesh.parallel import fully_shard, replicate, state_dict

    mesh = init_device_mesh("cpu", (2,))
    model = _model()
    if name == "AdamW":
        fully_shard(model, mesh=mesh)
    else:
        replicate(model, mesh=mesh)
    _train(model, name, dist.get_rank(), 2)
    return state_dict(model, full=True)


@pytest.mark.parametrize("name", ["LBFGS", "Muon", "AdamW"])
def test_optimizers_train_as_single_process_where_they_may(mesh_pool, name):
    """LBFGS and Muon on whole (replicated) parameters, AdamW on fully sharded ones."""
    reference = _model()
    _train(reference, name)
    for full in mesh_pool.run(_whole_parameters, 2, name):
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(full[key], value, atol=1e-10, rtol=1e-10)


def _warned_about(optimizer_class):
    from devmesh.errors import BlockwiseOptimizerWarning
    from devmesh.parallel import fully_shard

    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = optimizer_class(model.parameters(), lr=0.01)
        for _ in range(2):
            model(torch.ones(2, 8, dtype=torch.float64)).sum().backward()
            optimizer.step()
    return [str(w.message) for w in caught if w.category is BlockwiseOptimizerWarning]


class SignSGD(torch.optim.Optimizer):
    """A user's own optimizer: devmesh cannot know what its step reads."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


class MyAdamW(torch.optim.AdamW):
    """A subclass that keeps torch's step: known elementwise."""


def test_an_unknown_optimizer_class_is_warned_about_once(mesh_pool):
    for warned in mesh_pool.run(_warned_about, 2, SignSGD):
        assert len(warned) == 1 and "SignSGD" in warned[0] and "one block" in warned[0]
    for warned in mesh_pool.run(_warned_about, 2, MyAdamW):
        assert warned == []
