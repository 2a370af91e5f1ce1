"""``copy.deepcopy`` of a parallelized model (an EMA copy, a teacher, a snapshot before an
experiment) must be a model of its own that trains as the original would: its gradients
averaged or sharded the same way, its parameters separate from the original's. Tensor hooks
do not travel with a copied parameter, so state kept in hooks is where this breaks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from devmesh import init_device_mesh
from devmesh.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    fully_shard,
    parallelize_module,
    replicate,
    state_dict,
)

WORLD = 4


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(step: int, rank: int):
    gen = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(3, 4, generator=gen), torch.randn(3, 2, generator=gen)


def _step(model, opt, step: int, ranks) -> None:
    """One SGD step on the mean loss of ``ranks``' batches (one rank's under a launcher)."""
    loss = sum(F.mse_loss(model(_batch(step, r)[0]), _batch(step, r)[1]) for r in ranks)
    (loss / len(ranks)).backward()
    opt.step()
    opt.zero_grad()


def _schedule(model, copy_of, ranks):
    """Original: step 0; copy it; the copy trains steps 1 and 2; the original step 3."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, 0, ranks)
    twin = copy_of(model)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    _step(twin, twin_opt, 1, ranks)
    _step(twin, twin_opt, 2, ranks)
    _step(model, opt, 3, ranks)
    return twin, model


def train(strategy: str):
    import torch.distributed as dist

    model = _model()
    if strategy == "replicate":
        replicate(model, mesh=init_device_mesh("cpu", (WORLD,)))
    elif strategy == "fsdp":
        mesh = init_device_mesh("cpu", (WORLD,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif strategy == "fsdp-grouped":  # torch's list form: the two Linears one unit
        fully_shard([model[0], model[2]], mesh=init_device_mesh("cpu", (WORLD,)))
    elif strategy == "hsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "shard")))
    else:  # tp over 2 ranks, ddp over the other dim
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        replicate(model, mesh=mesh["dp"])
    rank = dist.get_rank()
    # under tp the two ranks of a tp group see the same data
    data_rank = rank // 2 if strategy == "tp" else rank
    twin, model = _schedule(model, copy.deepcopy, [data_rank])
    return state_dict(twin, full=True), state_dict(model, full=True)


@pytest.mark.parametrize("strategy", ["replicate", "fsdp", "fsdp-grouped", "hsdp", "tp"])
def test_a_deep_copy_trains_as_a_model_of_its_own(mesh_pool, strategy):
    data_ranks = range(2) if strategy == "tp" else range(WORLD)
    twin_expected, model_expected = (m.state_dict() for m in
                                     _schedule(_model(), copy.deepcopy, data_ranks))
    for twin, model in mesh_pool.run(train, WORLD, strategy):
        for key, value in twin_expected.items():
            torch.testing.assert_close(twin[key], value, rtol=1e-5, atol=1e-6, msg=key)
        for key, value in model_expected.items():
            torch.testing.assert_close(model[key], value, rtol=1e-5, atol=1e-6, msg=key)
