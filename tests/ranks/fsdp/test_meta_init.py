"""Build on the meta device, parallelize, ``to_empty``, then load or initialize weights —
torchtitan's flow for models too large to build whole — trains as single-process training does,
under FSDP, DDP and TP + FSDP, with tied weights still tied. Before, the FSDP unit kept the
meta parameters (loading failed) and DDP averaged nothing (hooks on the meta objects): replicas
silently trained apart."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from devmesh import init_device_mesh
from devmesh.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    fully_shard,
    load_state_dict,
    parallelize_module,
    replicate,
    state_dict,
)

STEPS = 3


class TiedModel(nn.Module):
    """An embedding tied to the output head, a TP-able MLP, a norm with a buffer-free state."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.down(torch.relu(self.up(self.embed(tokens))))))


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 12, (4, 5), generator=torch.Generator().manual_seed(step))


def _train(model: nn.Module, rows: slice) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for step in range(STEPS):
        tokens = _tokens(step)[rows]
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        opt.step()
        opt.zero_grad()


def _single(seed: int = 0):
    torch.manual_seed(seed)
    model = TiedModel()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, slice(None))
    return start, model.state_dict()


def _parallel(how: str, start: dict[str, torch.Tensor] | None):
    if how == "tp+fsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp = mesh["dp"]
    elif how == "hsdp":  # replicated over dp, sharded over shard
        dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "shard"))
    else:
        dp = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    with torch.device("meta"):
        model = TiedModel()
    if how == "tp+fsdp":
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if how == "ddp":
        replicate(model, mesh=dp)
    elif how == "fsdp-grouped":  # torch's list form, no unit at the root: torch's own
        fully_shard([model.embed, model.head], mesh=dp)  # to_empty converts each module of
        fully_shard(model.up, mesh=dp)  # the tied group on its own
        fully_shard([model.down, model.norm], mesh=dp)
    else:
        fully_shard(model.up, mesh=dp)
        fully_shard(model, mesh=dp)
    model.to_empty(device="cpu")
    tied = model.head.weight is model.embed.weight
    if start is not None:  # pretrained weights, full tensors: each rank keeps its block
        model.load_state_dict(start)
    else:  # initialized in place, differently on each rank: DDP starts from the first rank's
        torch.manual_seed(dp.get_rank())
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    rank, rows = dp.get_rank() if how == "hsdp" else dp.get_local_rank(), 4 // dp.size()
    _train(model, slice(rows * rank, rows * rank + rows))
    return tied, state_dict(model, full=True)


@pytest.mark.parametrize("how", ["fsdp", "fsdp-grouped", "ddp", "tp+fsdp", "hsdp"])
def test_a_model_built_on_meta_trains_as_single_process(mesh_pool, how):
    start, expected = _single()
    world = 4 if how in ("tp+fsdp", "hsdp") else 2
    for tied, full in mesh_pool.run(_parallel, world, how, start):
        assert tied
        assert full.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _children_materialized_one_by_one(how: str, start: dict[str, torch.Tensor]):
    mesh = init_device_mesh("cpu", (2, 2) if how == "hsdp" else (2,))
    with torch.device("meta"):
        model = TiedModel()
    if how == "ddp":
        replicate(model, mesh=mesh)
    else:
        fully_shard(model.up, mesh=mesh)
        fully_shard(model, mesh=mesh)
    for child in model.children():  # plain modules inside the units: torch's classes
        child.to_empty(device="cpu")
    if how == "hsdp":  # devmesh's own loader, before any forward, sees the blocks too
        load_state_dict(model, start)
    else:
        model.load_state_dict(start)
    rows = 4 // mesh.size()
    _train(model, slice(rows * mesh.get_rank(), rows * mesh.get_rank() + rows))
    return model.head.weight is model.embed.weight, state_dict(model, full=True)


@pytest.mark.parametrize("how", ["fsdp", "hsdp", "ddp"])
def test_children_materialized_one_by_one_train_as_single_process(mesh_pool, how):
    # to_empty on each child rather than on the model: the children are torch's own
    # modules, so devmesh's conversion does not run on them. Before, FSDP refused the
    # load ("size mismatch for embed.weight": the new parameters had no layout) and DDP
    # trained the replicas apart silently (the new parameters had no gradient hook); the
    # tied embedding and head came apart in both. Now each unit takes the new parameters
    # (as torch's FSDP2 re-reads its own by name) and ties them again.
    start, expected = _single()
    for tied, full in mesh_pool.run(_children_materialized_one_by_one, 4 if how == "hsdp"
                                    else 2, how, start):
        assert tied
        for name, value in expected.items():
            torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_replicas_built_on_meta_start_from_the_first_ranks_initialization(mesh_pool):
    # rank r initializes with seed r (the usual mistake): replicate makes every replica take
    # the first rank's values before the first forward, as DDP's construction would
    first = _single_from_reset(seed=0)
    for _, full in mesh_pool.run(_parallel, 2, "ddp", None):
        for name, value in first.items():
            torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _single_from_reset(seed: int) -> dict[str, torch.Tensor]:
    """Single-process training from the values ``reset_parameters`` gives on rank 0."""
    torch.manual_seed(seed)
    model = TiedModel()
    torch.manual_seed(seed)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    _train(model, slice(None))
    return model.state_dict()


def _convert_and_pickle():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = TiedModel()
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    before = {k: v.double() for k, v in state_dict(model, full=True).items()}
    model.double()
    after = state_dict(model, full=True)
    tokens = _tokens(0)
    out = model(tokens)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the whole module, as torch.save(model) users do
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    return (before, after, out, loaded(tokens), type(model).__name__, type(loaded).__name__,
            type(model.up).__name__, model.head.weight is model.embed.weight)


def test_conversions_and_pickling_keep_the_layout(mesh_pool):
    for (before, after, out, out_loaded, name, loaded_name, up_name,
         tied) in mesh_pool.run(_convert_and_pickle, 4):
        for key, value in before.items():
            assert after[key].dtype == torch.float64
            torch.testing.assert_close(after[key], value, msg=key)
        assert out.dtype == torch.float64
        torch.testing.assert_close(out_loaded, out)
        assert (name, loaded_name, up_name) == ("FSDPTiedModel", "FSDPTiedModel", "Linear")
        assert tied
