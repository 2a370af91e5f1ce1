"""Zero-bubble over stages whose backward cannot be split into I and W: a ``torch.compile``d
stage or block (one autograd node; inductor donates its saved buffers to the backward, so
the graph cannot be kept for W — torch's own zero-bubble schedules fail there, pytorch#161904)
and reentrant activation checkpointing (its backward refuses ``autograd.grad``). Such a
stage's I does the whole backward and its W nothing; training equals one process's, also
when the stage is data parallel (its gradients then reduce at its last I)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from devmesh import init_device_mesh
from devmesh.parallel import state_dict
from devmesh.layout.schedule import build_schedule
from devmesh.parallel.pipeline import PipelineRunner, split_sequential
from devmesh.parallel.pipeline.split_backward import SplitBackward


class Block(nn.Module):
    """``tanh(Linear(x))``, under reentrant activation checkpointing if asked. (A custom
    module, not an ``nn.Sequential``: ``nn.Sequential.compile()`` compiles nothing in torch
    2.13 — its output keeps eager autograd nodes — while a custom module's does.)"""

    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant:
            return checkpoint(self._run, x, use_reentrant=True)
        return self._run(x)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def make_model(case: str = "plain") -> nn.Sequential:
    torch.manual_seed(0)
    # the first block plain: reentrant checkpointing of a block whose input needs no
    # gradient gives its parameters none (torch warns), and none after it either
    blocks = [Block(reentrant=case == "reentrant" and i > 0) for i in range(6)]
    return nn.Sequential(*blocks, nn.Linear(16, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(16, 16, generator=gen), torch.randint(0, 4, (16,), generator=gen)


def reference(steps: int = 2) -> dict[str, torch.Tensor]:
    """Single-process training of the plain model (compiling and checkpointing change no
    value)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batch(step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(case: str, steps: int = 2):
    """Zero-bubble on 2 pipeline ranks (on (pp, dp) = (2, 2) with replicated or sharded
    stages for ``compiled-replicate`` / ``compiled-fsdp``); this rank's stage parameters
    under the plain model's names (whole), and whether each split this rank made was
    whole."""
    from devmesh.parallel import fully_shard, replicate

    data_parallel = case in ("compiled-replicate", "compiled-fsdp")
    mesh = init_device_mesh("cpu", (2, 2) if data_parallel else (2,),
                            mesh_dim_names=("pp", "dp") if data_parallel else ("pp",))
    schedule = build_schedule("zero-bubble", 2, 4)
    model = make_model(case)
    parts = split_sequential(model, 2)
    me = mesh.get_coordinate()[0]
    stage = parts[me]
    run = stage
    if case == "compiled":  # inductor, the default: the whole stage one compiled region
        run = torch.compile(stage)
    elif data_parallel:
        for block in stage:  # torchtitan's way: each block compiled, then the stage wrapped
            if isinstance(block, Block):
                block.compile()
                if case == "compiled-fsdp":
                    fully_shard(block, mesh=mesh["dp"])
        (fully_shard if case == "compiled-fsdp" else replicate)(stage, mesh=mesh["dp"])
    runner = PipelineRunner({me: run}, mesh, schedule, F.cross_entropy)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    whole = []
    original = SplitBackward.input_grad

    def input_grad(self):
        whole.append(getattr(self, "whole", False))
        return original(self)

    SplitBackward.input_grad = input_grad
    try:
        for step in range(steps):
            x, y = batch(step)
            if data_parallel:  # each replica its half of the batch
                half = mesh["dp"].get_local_rank()
                x, y = x.chunk(2)[half], y.chunk(2)[half]
            runner.step(x if me == 0 else None, y if me == 1 else None)
            opt.step()
            opt.zero_grad()
    finally:
        SplitBackward.input_grad = original
    owned = {n for n, _ in stage.named_children()}
    full = state_dict(stage, full=True) if case == "compiled-fsdp" else stage.state_dict()
    return {k: v.detach().clone() for k, v in full.items() if k.split(".")[0] in owned}, whole


@pytest.mark.parametrize("case", ["compiled", "compiled-replicate", "compiled-fsdp",
                                  "reentrant"])
def test_zero_bubble_trains_stages_whose_backward_cannot_be_split(mesh_pool, case):
    expected = reference()
    ranks = 4 if case in ("compiled-replicate", "compiled-fsdp") else 2
    trained, splits = {}, []
    for params, whole in mesh_pool.run(train, ranks, case):
        trained.update(params)
        splits += whole
    assert trained.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(trained[key], value, rtol=1e-5, atol=1e-6)
    # the last stage's I actions saw the indivisible node and did the whole backward
    assert splits and any(splits)
