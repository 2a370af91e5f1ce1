"""``model.load_state_dict(...)`` — nn.Module's own method, the one every training script
calls to load pretrained weights — on a model devmesh sharded: it takes the full tensors (a
single-process ``state_dict()``) and keeps this rank's block, takes this rank's blocks as
plain tensors as they are, takes ``model.state_dict()``'s DTensors, and names both shapes
when a tensor is neither. A 0-d parameter keeps its shape through ``fully_shard`` in every
state dict."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from devmesh import init_device_mesh
from devmesh.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    fully_shard,
    parallelize_module,
    describe,
    state_dict,
)


class ScaledMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)
        self.temperature = nn.Parameter(torch.tensor(3.0))  # 0-d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))) / self.temperature


def pretrained() -> dict[str, torch.Tensor]:
    """Other weights for the same model, as a single-process ``state_dict()``."""
    model = ScaledMLP()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model.state_dict()


def load_both_ways(strategy: str):
    model = ScaledMLP()
    if strategy == "fsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    elif strategy == "tp":
        parallelize_module(model, init_device_mesh("cpu", (2,)),
                           {"up": ColwiseParallel(), "down": RowwiseParallel()})
    else:  # tp + hsdp-free fsdp on a (dp, tp) mesh
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    own = model.state_dict()  # DTensors for the split parameters
    own_blocks = {k: _local(v).clone() for k, v in own.items()}
    own_dtensors = {k: v.clone() for k, v in own.items()}
    full = pretrained()
    model.load_state_dict(full)
    after_full = state_dict(model, full=True)
    copied = copy.deepcopy(model)  # the hook travels with a copy
    copied.load_state_dict(own_blocks)
    after_blocks = state_dict(copied, full=True)
    copied = copy.deepcopy(model)
    copied.load_state_dict(own_dtensors)
    after_dtensors = state_dict(copied, full=True)
    model.load_state_dict(own_blocks)
    round_trip = {k: _local(v).clone() for k, v in model.state_dict().items()}
    wrong = dict(full, **{"up.weight": torch.zeros(3, 3)})
    try:
        model.load_state_dict(wrong)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    model.load_state_dict(full)
    shown = describe(model)
    return (after_full, after_blocks, after_dtensors, round_trip, own_blocks, error,
            model(x).detach(), shown)


def _local(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


@pytest.mark.parametrize("strategy, world", [("fsdp", 2), ("tp", 2), ("tp+fsdp", 4)])
def test_load_state_dict_takes_full_tensors_and_own_blocks(mesh_pool, strategy, world):
    full = pretrained()
    reference = ScaledMLP()
    untrained = {k: v.clone() for k, v in reference.state_dict().items()}
    reference.load_state_dict(full)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    for after_full, after_blocks, after_dtensors, round_trip, own, error, out, shown in (
            mesh_pool.run(load_both_ways, world, strategy)):
        for key, value in full.items():
            assert after_full[key].shape == value.shape, key  # () for temperature
            assert torch.equal(after_full[key], value), key
            assert torch.equal(after_blocks[key], untrained[key]), key
            assert torch.equal(after_dtensors[key], untrained[key]), key
        assert all(torch.equal(round_trip[k], v) for k, v in own.items())
        assert "up.weight is sharded by devmesh" in error and "(8, 4)" in error
        torch.testing.assert_close(out, reference(x).detach())
        row = next(line for line in shown.splitlines() if line.startswith("temperature "))
        assert row.split()[1] == "()", row  # its own shape, not FSDP's one element


def meta_built_then_loaded(strategy: str):
    """A model built on the meta device and parallelized there, then loaded with
    ``assign=True`` (devmesh's ``load_state_dict`` and the module's own, as torch's FSDP2
    recipe does), against the same weights loaded into a model built with storage; and
    devmesh's copying load into meta parameters refused."""
    from devmesh.errors import StateDictError
    from devmesh.parallel import load_state_dict

    def built(device: str):
        with torch.device(device):
            model = ScaledMLP()
        if strategy == "fsdp":
            fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        else:
            parallelize_module(model, init_device_mesh("cpu", (2,)),
                               {"up": ColwiseParallel(), "down": RowwiseParallel()})
        return model

    weights = pretrained()
    expected = built("cpu")
    load_state_dict(expected, weights)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    results = {}
    for how in ("devmesh", "module"):
        model = built("meta")
        if how == "devmesh":
            load_state_dict(model, weights, assign=True)
        else:
            model.load_state_dict(weights, assign=True)
        results[how] = (all(not p.is_meta for p in model.parameters()),
                        torch.equal(model(x), expected(x)),
                        {k: torch.equal(v, weights[k]) for k, v in state_dict(model).items()})
    try:
        load_state_dict(built("meta"), weights)
        refused = None
    except StateDictError as exc:
        refused = str(exc)
    return results, refused


@pytest.mark.parametrize("strategy", ["fsdp", "tp"])
def test_a_model_built_on_meta_loads_with_assign_and_a_copy_into_it_is_refused(mesh_pool,
                                                                             strategy):
    for results, refused in mesh_pool.run(meta_built_then_loaded, 2, strategy):
        for how, (materialized, same_output, same_weights) in results.items():
            assert materialized and same_output and all(same_weights.values()), (how, results)
        assert refused is not None and "on the meta device" in refused, refused
        assert "Pass assign=True" in refused
