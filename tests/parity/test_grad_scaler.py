"""Loss scaling (float16 training's ``GradScaler``) under devmesh: ``devmesh.parallel.GradScaler``
skips a step on every rank when any rank's gradient block overflowed, as torch's scaler does
under torch's FSDP2 (whose DTensor gradients make the check agree). torch's own scaler on
devmesh's plain gradient blocks decided per rank (one rank skipped, the others stepped, and
the scales parted ways): importing ``devmesh.parallel`` makes it agree as well."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from devmesh import init_device_mesh

from helpers import TorchRuns

STEPS = 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(3, 4, bias=False)
        self.second = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.first(x)
        return self.second(hidden), hidden


def _model() -> nn.Module:
    return Net()


def _loss(model: nn.Module, step: int, rows: slice, overflow: bool) -> torch.Tensor:
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))[rows]
    out, hidden = model(x)
    loss = out.pow(2).mean()
    if overflow and step == 1:  # only the first weight row's gradient overflows
        loss = loss + hidden[:, 0].sum() * 1e35
    return loss


def _train(model: nn.Module, scaler, rows: slice, overflow: bool) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scales = []
    for step in range(STEPS):
        scaler.scale(_loss(model, step, rows, overflow)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales


def _parallel(library: str, overflow: bool):
    import torch.distributed as dist

    mesh = init_device_mesh("cpu", (2,))
    model = _model()
    if library.startswith("devmesh"):  # devmesh's scaler, or torch's ("devmesh+torch's")
        from devmesh.parallel import GradScaler, fully_shard, state_dict

        fully_shard(model.first, mesh=mesh)
        fully_shard(model, mesh=mesh)
        scaler = (GradScaler if library == "devmesh" else torch.amp.GradScaler)(
            "cpu", init_scale=2.0**16)
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.first, mesh=mesh)
        fully_shard(model, mesh=mesh)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    rank = dist.get_rank()
    scales = _train(model, scaler, slice(2 * rank, 2 * rank + 2), overflow)
    if library.startswith("devmesh"):
        full = state_dict(model, full=True)
    else:
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return scales, full


@pytest.fixture(scope="module")
def torch_runs() -> TorchRuns:
    """torch's FSDP2 with its GradScaler, both cases in one fresh launch (see TorchRuns)."""
    return TorchRuns({2: [(_parallel, ("torch", True)), (_parallel, ("torch", False))]})


@pytest.mark.parametrize("scaler", ["devmesh", "devmesh+torch's"])
@pytest.mark.parametrize("overflow", [True, False])
def test_grad_scaler_agrees_on_every_rank_as_under_torchs_fsdp2(mesh_pool, torch_runs, overflow,
                                                                scaler):
    ours = mesh_pool.run(_parallel, 2, scaler, overflow)
    theirs = torch_runs(2, _parallel, "torch", overflow)
    single = _model()
    single_scales = _train(single, torch.amp.GradScaler("cpu", init_scale=2.0**16),
                           slice(None), overflow)
    for (scales, full), (torch_scales, torch_full) in zip(ours, theirs):
        assert scales == torch_scales == single_scales
        for key, value in single.state_dict().items():
            torch.testing.assert_close(full[key], value, rtol=1e-6, atol=1e-7, msg=key)
            torch.testing.assert_close(torch_full[key], value, rtol=1e-6, atol=1e-7, msg=key)
