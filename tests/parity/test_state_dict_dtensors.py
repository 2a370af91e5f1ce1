"""``model.state_dict()`` of a model devmesh split gives each split parameter as a torch
``DTensor`` (this rank's block on its mesh), as torch's FSDP2 and TP do, so torch's own
checkpointing — ``dcp.save(model.state_dict())`` / ``dcp.load`` — saves and restores the whole
model. Before, the state dict held plain local blocks: DCP took them for replicated tensors
and saved rank 0's block only, and loading back into the same model silently gave every
rank rank 0's block."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from devmesh import init_device_mesh
from devmesh.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    state_dict,
)

from helpers import TorchRuns


@pytest.fixture(scope="module")
def torch_runs() -> TorchRuns:
    """The runs with torch's FSDP2 / TP, in one fresh launch (see ``TorchRuns``)."""
    return TorchRuns({4: [*((_placements_of, (layout, "torch")) for layout in _LAYOUTS),
                          (_between_libraries, ())]})


class MLP(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.up = nn.Linear(6, 10)  # 10 rows over 4 ranks: uneven blocks
        self.down = nn.Linear(10, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(torch.relu(self.up(x))))


def _parallelize(model: nn.Module, layout: str, library: str = "devmesh") -> nn.Module:
    if library == "devmesh":
        from devmesh.parallel import fully_shard as shard, parallelize_module as tp
        colwise, rowwise = ColwiseParallel, RowwiseParallel
    else:
        from torch.distributed.fsdp import fully_shard as shard
        from torch.distributed.tensor.parallel import (ColwiseParallel as colwise,
                                                       RowwiseParallel as rowwise,
                                                       parallelize_module as tp)
    if layout == "fsdp":
        shard(model, mesh=init_device_mesh("cpu", (4,)))
    elif layout == "hsdp":
        shard(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    else:  # tp + fsdp
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp(model, mesh["tp"], {"up": colwise(), "down": rowwise()})
        shard(model, mesh=mesh["dp"])
    return model


def _save_then_load(path: str, saved_as: str, loaded_as: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    model = _parallelize(MLP(seed=0), saved_as)
    saved = state_dict(model, full=True)
    sd = model.state_dict()
    kinds = {k: type(v).__name__ for k, v in sd.items()}
    dcp.save(sd, checkpoint_id=path)
    other = _parallelize(MLP(seed=1), loaded_as)  # other values, maybe another layout
    target = other.state_dict()
    dcp.load(target, checkpoint_id=path)
    other.load_state_dict(target)
    plain = MLP(seed=2)  # and a plain, single-process model
    plain_target = plain.state_dict()
    dcp.load(plain_target, checkpoint_id=path)
    plain.load_state_dict(plain_target)
    placements = {k: [str(p) for p in v.placements] for k, v in sd.items()
                  if isinstance(v, DTensor)}
    return saved, state_dict(other, full=True), plain.state_dict(), kinds, placements


@pytest.mark.parametrize("saved_as, loaded_as", [("fsdp", "fsdp"), ("fsdp", "tp+fsdp"),
                                                 ("tp+fsdp", "hsdp"), ("hsdp", "fsdp")])
def test_torch_dcp_saves_and_loads_the_whole_model(mesh_pool, tmp_path, saved_as, loaded_as):
    path = str(tmp_path / "ckpt")
    for saved, loaded, plain, kinds, _ in mesh_pool.run(_save_then_load, 4, path, saved_as,
                                                        loaded_as):
        assert set(kinds.values()) == {"DTensor"}
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key
            assert torch.equal(plain[key], value), key


def _placements_of(layout: str, library: str):
    from torch.distributed.tensor import DTensor

    sd = _parallelize(MLP(), layout, library).state_dict()
    return {k: ([str(p) for p in v.placements], tuple(v.shape), tuple(v.to_local().shape))
            for k, v in sd.items() if isinstance(v, DTensor)}


_LAYOUTS = ["fsdp", "hsdp", "tp+fsdp"]


@pytest.mark.parametrize("layout", _LAYOUTS)
def test_state_dict_placements_are_torchs(mesh_pool, torch_runs, layout):
    ours = mesh_pool.run(_placements_of, 4, layout, "devmesh")
    assert ours == torch_runs(4, _placements_of, layout, "torch")


def _optimizer_save_then_load(path: str, saved_as: str, loaded_as: str):
    """Adam's state through torch's own optimizer checkpointing (torchtitan's calls): the
    loaded model and optimizer then train on exactly as the saved ones do."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    def step(model, opt, seed):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(seed))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    model = _parallelize(MLP(seed=0), saved_as)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    step(model, opt, 0)
    kinds = {type(v).__name__ for s in opt.state_dict()["state"].values() for v in s.values()}
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=path)
    other = _parallelize(MLP(seed=1), loaded_as)
    other_opt = torch.optim.Adam(other.parameters(), lr=0.05)
    target = {"model": other.state_dict(), "optim": get_optimizer_state_dict(other, other_opt)}
    dcp.load(target, checkpoint_id=path)
    other.load_state_dict(target["model"])
    set_optimizer_state_dict(other, other_opt, target["optim"])
    for seed in (1, 2):  # the moments decide these steps: wrong ones would show
        step(model, opt, seed)
        step(other, other_opt, seed)
    return state_dict(model, full=True), state_dict(other, full=True), kinds


@pytest.mark.parametrize("saved_as, loaded_as", [("fsdp", "fsdp"), ("tp+fsdp", "tp+fsdp"),
                                                 ("tp+fsdp", "fsdp")])
def test_torch_dcp_saves_and_loads_the_optimizer(mesh_pool, tmp_path, saved_as, loaded_as):
    path = str(tmp_path / "ckpt")
    for trained, resumed, kinds in mesh_pool.run(_optimizer_save_then_load, 4, path, saved_as,
                                                 loaded_as):
        assert "DTensor" in kinds
        for key, value in trained.items():
            # another layout sums in another order (~5e-7 here); a moment from another
            # rank's block would move a weight by about the learning rate (0.05)
            torch.testing.assert_close(resumed[key], value, rtol=0, atol=1e-5, msg=key)


def _between_libraries():
    from devmesh.parallel import load_state_dict

    ours = _parallelize(MLP(seed=0), "fsdp")
    theirs = _parallelize(MLP(seed=1), "fsdp", "torch")
    other_layout = _parallelize(MLP(seed=2), "tp+fsdp")
    load_state_dict(other_layout, ours.state_dict())  # devmesh's own loader, another layout
    after_devmesh = state_dict(other_layout, full=True)
    theirs_full = {k: v.full_tensor() for k, v in theirs.state_dict().items()}
    ours.load_state_dict(theirs.state_dict())  # torch FSDP2's DTensors into devmesh
    after_from_torch = state_dict(ours, full=True)
    mine = _parallelize(MLP(seed=3), "fsdp")
    theirs.load_state_dict(mine.state_dict())  # and devmesh's into torch FSDP2
    return (state_dict(_parallelize(MLP(seed=0), "fsdp"), full=True), after_devmesh,
            theirs_full, after_from_torch, state_dict(mine, full=True),
            {k: v.full_tensor() for k, v in theirs.state_dict().items()})


def test_state_dicts_load_between_devmesh_and_torch(torch_runs):
    for (first, after_devmesh, torchs, after_from_torch, mine,
         torch_after) in torch_runs(4, _between_libraries):
        for key in first:
            assert torch.equal(after_devmesh[key], first[key]), key
            assert torch.equal(after_from_torch[key], torchs[key]), key
            assert torch.equal(torch_after[key], mine[key]), key


def _optimizer_through_torch_save(path: str):
    """Each rank ``torch.save``s its optimizer's ``state_dict()`` (DTensor moments) and a
    fresh optimizer ``load_state_dict``s it before its first step: training goes on as the
    uninterrupted run."""
    import torch.distributed as dist

    def step(model, opt, seed):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(seed))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    model = _parallelize(MLP(seed=0), "tp+fsdp")
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    step(model, opt, 0)
    own = f"{path}-rank{dist.get_rank()}.pt"
    torch.save(opt.state_dict(), own)
    fresh = torch.optim.Adam(model.parameters(), lr=0.05)
    fresh.load_state_dict(torch.load(own, weights_only=False))
    twin = _parallelize(MLP(seed=0), "tp+fsdp")  # the uninterrupted run
    twin_opt = torch.optim.Adam(twin.parameters(), lr=0.05)
    step(twin, twin_opt, 0)
    for seed in (1, 2):
        step(model, fresh, seed)
        step(twin, twin_opt, seed)
    return state_dict(model, full=True), state_dict(twin, full=True)


def test_an_optimizer_state_saved_per_rank_loads_before_the_first_step(mesh_pool, tmp_path):
    for resumed, uninterrupted in mesh_pool.run(_optimizer_through_torch_save, 4,
                                                str(tmp_path / "optim")):
        for key, value in uninterrupted.items():
            assert torch.equal(resumed[key], value), key
