"""A four-stage model whose stages pass tuples (hidden states, a bool mask, a skip
connection, token ids), and its pipeline on 2 or 4 ranks: shared by the rank tests of
tuple-passing stages, training and evaluation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from devmesh import init_device_mesh
from devmesh.layout.schedule import build_schedule
from devmesh.parallel.pipeline import PipelineRunner


class Embed(nn.Module):
    """Takes the features and a per-sample scale (two inputs); gives the hidden states, a
    bool mask and a skip connection that later stages use."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, scale: torch.Tensor):
        h = self.fc(x) * scale
        return h, x[:, :1] > 0, h * 0.5


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor, mask: torch.Tensor, skip: torch.Tensor):
        return torch.tanh(self.fc(h)) * mask + skip, mask, skip


class ToIds(nn.Module):
    """Uses the skip connection for the last time; passes the mask on as integers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor, mask: torch.Tensor, skip: torch.Tensor):
        return torch.tanh(self.fc(h) + skip), mask.to(torch.int64)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, h: torch.Tensor, ids: torch.Tensor):
        return self.fc(h) + ids


def tuple_parts() -> list[nn.Module]:
    torch.manual_seed(0)
    return [Embed(), Masked(), ToIds(), Head()]


def through_parts(parts: list[nn.Module], *inputs: torch.Tensor) -> torch.Tensor:
    out = inputs
    for part in parts:
        out = part(*out) if isinstance(out, tuple) else part(out)
    return out


def tuple_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return (torch.randn(16, 16, generator=gen), torch.rand(16, 1, generator=gen) + 0.5,
            torch.randint(0, 4, (16,), generator=gen))


TWO_PER_RANK = ("interleaved-1f1b", "interleaved-zero-bubble", "zbv-zero-bubble", "dualpipe-v")


def tuple_pipeline(name: str) -> tuple[dict[int, nn.Module], PipelineRunner, torch.optim.SGD]:
    """This rank's stages of the 4-stage model under schedule ``name`` (interleaved and
    zero-bubble V: 2 ranks, 2 stages each; else 4 ranks), its runner and optimizer."""
    virtual = 2 if name in TWO_PER_RANK else 1
    schedule = build_schedule(name, 4 // virtual, 4, virtual)
    mesh = init_device_mesh("cpu", (4 // virtual,), mesh_dim_names=("pp",))
    me = mesh.get_coordinate()[0]
    parts = tuple_parts()
    stages = {s: parts[s] for s in range(4) if schedule.rank_of(s) == me}
    runner = PipelineRunner(stages, mesh, schedule, F.cross_entropy)
    opt = torch.optim.SGD([p for part in stages.values() for p in part.parameters()], lr=0.1)
    return stages, runner, opt


def pipelining_stage(library: str):
    """This rank's stage of the 4-stage model on 4 ranks, built by torch's ``PipelineStage``
    or devmesh's (the same code, imports switched), and the library's pipelining module."""
    if library == "torch":
        import torch.distributed.pipelining.schedules as classes
        from torch.distributed.pipelining import PipelineStage
    else:
        import devmesh.parallel.pipeline as classes
        from devmesh.parallel.pipeline import PipelineStage

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("pp",))
    me = mesh.get_coordinate()[0]
    part = tuple_parts()[me]
    return me, part, PipelineStage(part, me, 4, torch.device("cpu"),
                                   group=mesh.get_group("pp")), classes
