"""What a ``fully_shard`` unit gathers for a backward serves that backward only.

A unit whose backward never reduces — its parameters all frozen, a backward of the inputs'
gradients alone, a backward that raised — kept the parameters it re-gathered, and the next
backward used them after the values had changed (a frozen layer loaded or scaled, a step, a
reload after a failure): the layers before it got gradients of the old values, silently
(5e-2 off after three steps here). torch's FSDP2 reshards whatever is still unsharded at the
end of each backward; devmesh drops it at the end of the backward, or at the next forward
after one that raised. ``reset_iter_state()`` (torch's name) forgets the rest after a failed
iteration: gathers kept between micro-batches, gradients held back for a later reduction.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from devmesh import init_device_mesh
from devmesh.parallel import fully_shard, state_dict


class _Boom(torch.autograd.Function):
    """Identity whose backward raises: a failure in the middle of a backward."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        raise RuntimeError("boom in backward")


class _Flaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.fail = nn.Linear(8, 8), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:  # raises after this unit's backward re-gathered its weight
            x = _Boom.apply(x)
        return torch.tanh(self.lin(x))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), _Flaky(), nn.Linear(8, 4))


def _batch():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)


def _scale_middle(model: nn.Module) -> None:
    """A change of values outside the optimizer (a load, an EMA, a schedule)."""
    with torch.no_grad():
        for p in model[2].parameters():
            p.mul_(0.5)


def _failing_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """A forward and a backward that raises in the middle unit, the error caught."""
    model[2].fail = True
    try:
        F.cross_entropy(model(x), y).backward()
    except RuntimeError:
        pass
    model[2].fail = False


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, case: str) -> None:
    """Three steps of ``case``; the middle unit (``model[2]``) is what each case tests."""
    if case == "frozen":
        for p in model[2].parameters():
            p.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for step in range(3):
        if case == "frozen" and step == 1:
            _scale_middle(model)
        if case == "aborted" and step == 1:  # fail, reload (here: scale), go on
            _failing_backward(model, x, y)
            opt.zero_grad()
            _scale_middle(model)
        F.cross_entropy(model(x), y).backward()
        if case == "probe" and step == 1:  # gradients of the input alone, before the step
            probe = x.clone().requires_grad_()
            torch.autograd.grad(model(probe).sum(), probe)
        opt.step()
        opt.zero_grad()


def _sharded_model_and_half_batch():
    """The model with each layer and the whole under ``fully_shard`` on 2 ranks, and this
    rank's half of the batch."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = _model()
    for i in (0, 2, 3):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    x, y = _batch()
    half = mesh.get_local_rank()
    return model, x.chunk(2)[half], y.chunk(2)[half]


def _train_sharded(case: str):
    model, x, y = _sharded_model_and_half_batch()
    _train(model, x, y, case)
    return {k: v.clone() for k, v in state_dict(model, full=True).items()}


@pytest.mark.parametrize("case", ["frozen", "aborted", "probe"])
def test_gathered_parameters_never_serve_a_later_backward(mesh_pool, case):
    model = _model()  # one process: the same steps, failure included, on the whole batch
    _train(model, *_batch(), case)
    expected = model.state_dict()
    for trained in mesh_pool.run(_train_sharded, 2, case):
        assert trained.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(trained[key], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{case} {key}: {m}")


def _train_accumulating(reset: bool):
    """A step of two micro-batches whose second fails in backward after the first kept its
    gathered parameters and unsharded gradients (``set_reshard_after_backward(False)``,
    sync off); the values are reloaded (here: scaled), then two good steps."""
    model, x, y = _sharded_model_and_half_batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    F.cross_entropy(model(x), y).backward()
    _failing_backward(model, x, y)
    if reset:
        model.reset_iter_state()
    model.set_requires_gradient_sync(True)
    model.set_reshard_after_backward(True)
    opt.zero_grad()
    _scale_middle(model)
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in state_dict(model, full=True).items()}


def test_reset_iter_state_forgets_a_failed_accumulation(mesh_pool):
    # torch's recovery call: without it the kept gathers (before the reload) and the first
    # micro-batch's held-back gradients would reach the next steps
    model = _model()
    _scale_middle(model)
    x, y = _batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    expected = model.state_dict()
    for reset, trained in ((True, mesh_pool.run(_train_accumulating, 2, True)),
                           (False, mesh_pool.run(_train_accumulating, 2, False))):
        worst = max((trained[0][k] - v).abs().max().item() for k, v in expected.items())
        if reset:
            assert worst < 1e-6, worst
        else:  # what it guards against: the failed iteration leaks into training
            assert worst > 1e-3, worst


def _pipelined_blocks() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)]
    return nn.Sequential(*blocks, nn.Linear(16, 4))


def _train_pipelined_blocks(name: str):
    from devmesh.layout.schedule import build_schedule
    from devmesh.parallel.pipeline import PipelineRunner, split_sequential

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    me = mesh.get_coordinate()[0]
    model = _pipelined_blocks()
    for p in model[3].parameters():  # a frozen block in the last stage
        p.requires_grad_(False)
    stage = split_sequential(model, 2)[me]
    for block in stage:
        if isinstance(block, nn.Sequential):
            fully_shard(block, mesh=mesh["dp"])
    fully_shard(stage, mesh=mesh["dp"])
    runner = PipelineRunner({me: stage}, mesh, build_schedule(name, 2, 4), F.cross_entropy)
    opt = torch.optim.SGD([p for p in stage.parameters() if p.requires_grad], lr=0.5)
    x, y = _pipeline_batch()
    half = mesh["dp"].get_local_rank()
    x, y = x.chunk(2)[half], y.chunk(2)[half]
    for step in range(3):
        if step == 1 and me == 1:
            with torch.no_grad():
                for p in stage[-2].parameters():  # the frozen block: new values
                    p.mul_(0.5)
        runner.step(x if me == 0 else None, y if me == 1 else None)
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in state_dict(stage, full=True).items()}


def _pipeline_batch():
    gen = torch.Generator().manual_seed(2)
    return torch.randn(16, 16, generator=gen), torch.randint(0, 4, (16,), generator=gen)


@pytest.mark.parametrize("name", ["zero-bubble", "1f1b"])
def test_pipelined_units_with_a_frozen_block_train_as_one_process(mesh_pool, name):
    """zero-bubble's W re-gathers units after I: every data-parallel rank in the same order
    (the order came from a set of autograd nodes, by address: crossed gathers of same-sized
    units, then a hang); the frozen block's gathers end with each step."""
    model = _pipelined_blocks()
    for p in model[3].parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    x, y = _pipeline_batch()
    for step in range(3):
        if step == 1:
            with torch.no_grad():
                for p in model[3].parameters():
                    p.mul_(0.5)
        loss = sum(F.cross_entropy(model(xc), yc) for xc, yc in zip(x.chunk(8), y.chunk(8)))
        (loss / 8).backward()
        opt.step()
        opt.zero_grad()
    expected = model.state_dict()
    trained = {}
    for state in mesh_pool.run(_train_pipelined_blocks, 4, name):
        trained.update(state)
    assert trained.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(trained[key], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name} {key}: {m}")
