"""A devmesh mesh goes wherever torch takes a DeviceMesh, with no ``to_torch()``: torch's
functional collectives, DTensor, torch's FSDP2 and tensor parallelism (issue 8, item 12).
Each result is compared with the same torch call on a mesh torch built itself."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

from devmesh import init_device_mesh


def functional_collectives_and_dtensor():
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    rank = dist.get_rank()
    out = {"is_torch_mesh": isinstance(mesh, TorchDeviceMesh)
           and isinstance(mesh["tp"], TorchDeviceMesh)}
    t = torch.tensor([float(rank)])
    out["funcol_tp"] = funcol.all_reduce(t, "sum", group=(mesh, 1)).item()
    out["funcol_dp"] = funcol.all_reduce(t, "sum", group=(mesh, 0)).item()
    out["funcol_submesh"] = funcol.all_reduce(t, "sum", group=mesh["tp"]).item()
    flat = mesh["dp", "tp"]._flatten("dp_tp")
    out["funcol_flat"] = funcol.all_reduce(t, "sum", group=flat).item()

    full = torch.arange(48.0).reshape(6, 8)
    d = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    out["local"] = d.to_local().tolist()
    out["full_ok"] = torch.equal(d.full_tensor(), full)
    d2 = DTensor.from_local(torch.ones(2, 2) * rank, mesh["tp"], [Shard(0)])
    out["from_local_shape"] = tuple(d2.shape)
    out["redistributed"] = d2.redistribute(mesh["tp"], [Replicate()]).to_local()[:, 0].tolist()

    reference = torch_init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    r = distribute_tensor(full, reference, [Shard(0), Shard(1)])
    out["same_local_as_torch"] = torch.equal(r.to_local(), d.to_local())
    out["coordinate_as_torch"] = (reference.get_coordinate() == mesh.get_coordinate()
                                  and reference["tp"].get_coordinate()
                                  == mesh["tp"].get_coordinate())
    return out


def test_functional_collectives_and_dtensor_take_a_devmesh_mesh(mesh_pool):
    results = mesh_pool.run(functional_collectives_and_dtensor, 8)
    for rank, r in enumerate(results):
        row, col = divmod(rank, 4)
        assert r["is_torch_mesh"]
        assert r["funcol_tp"] == sum(range(4 * row, 4 * row + 4))
        assert r["funcol_dp"] == col + col + 4
        assert r["funcol_submesh"] == r["funcol_tp"]
        assert r["funcol_flat"] == sum(range(8))
        assert r["full_ok"] and r["same_local_as_torch"] and r["coordinate_as_torch"]
        assert r["from_local_shape"] == (8, 2)
        assert r["redistributed"] == [float(4 * row + i) for i in range(4) for _ in range(2)]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def torch_fsdp_tp_on_devmesh(use_devmesh: bool):
    """torch's parallelize_module + fully_shard (FSDP over TP, a (2, 2) mesh): the same losses
    and full weights on a devmesh mesh as on torch's own."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    make = init_device_mesh if use_devmesh else torch_init_device_mesh
    mesh = make("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _model()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + mesh.get_local_rank("dp"))
    losses = []
    for _ in range(3):
        loss = model(torch.randn(4, 8)).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = [p.full_tensor() for p in model.parameters()]
    return losses, weights


def test_torch_fsdp_and_tp_take_a_devmesh_mesh(mesh_pool):
    ours = mesh_pool.run(torch_fsdp_tp_on_devmesh, 4, True)
    theirs = mesh_pool.run(torch_fsdp_tp_on_devmesh, 4, False)
    for (losses, weights), (ref_losses, ref_weights) in zip(ours, theirs):
        assert losses == ref_losses
        for w, ref in zip(weights, ref_weights):
            assert torch.equal(w, ref)


def torch_hsdp_on_devmesh():
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _model()
    fully_shard(model, mesh=mesh)
    torch.manual_seed(dist.get_rank())
    model(torch.randn(4, 8)).sum().backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    return [g.sum().item() for g in grads]


def test_torch_hsdp_takes_a_2d_devmesh_mesh(mesh_pool):
    results = mesh_pool.run(torch_hsdp_on_devmesh, 4)
    assert all(r == results[0] for r in results)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _net_batch(step: int):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(4, 6, 8, generator=gen), torch.randint(0, 5, (4, 6), generator=gen)


def fully_shard_over_torch_tp(library: str, case: str, path: str | None = None):
    """torch's ``parallelize_module`` and styles (as torchtitan applies its own), then
    ``fully_shard`` over ``dp`` — devmesh's or torch's — on a (dp, tp) = (2, 2) devmesh
    mesh: Adam steps on each dp rank's half of the batch. ``case``: "tp"; "sp" (sequence
    parallelism: the norms' replicated weights get partial gradients); "sp+checkpoint"
    (torch's ``checkpoint_wrapper`` on each block first, as torchtitan orders them);
    "sp+compile" (each block compiled: torch's DTensors inside the graph carry the devmesh
    mesh, which torch hands over as a stand-in; before, comparing it with a real mesh failed
    inside torch's sharding propagation, under torch's ``fully_shard`` too)."""
    import torch.nn.functional as F
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if library == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from devmesh.parallel import fully_shard, replicate, save_checkpoint
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_coordinate()
    sp = case.startswith("sp")
    model = _Net()
    for block in model.blocks:
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        if sp:
            plan = {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                    "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}
        parallelize_module(block, mesh["tp"], plan)
    if sp:
        parallelize_module(model, mesh["tp"], {"head": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Replicate())})
    if case == "sp+checkpoint":
        model.blocks = torch.nn.ModuleList(checkpoint_wrapper(b) for b in model.blocks)
    if case == "sp+compile":  # torchtitan's order: TP, compile each block, FSDP
        for block in model.blocks:
            block.compile(backend="aot_eager")
    if library == "devmesh replicate":  # torchtitan's DDP + TP
        replicate(model, mesh=mesh["dp"])
    else:
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for step in range(3):
        x, y = _net_batch(step)
        x, y = x[2 * dp:2 * dp + 2], y[2 * dp:2 * dp + 2]
        if sp:  # this rank's positions of the sequence
            x = DTensor.from_local(x[:, 3 * tp:3 * tp + 3].contiguous(), mesh["tp"],
                                   [Shard(1)])
        loss = F.cross_entropy(model(x).reshape(-1, 5), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if path is not None:
        save_checkpoint(path, model)
    state = {k.replace("_checkpoint_wrapped_module.", ""):
             v.full_tensor() if hasattr(v, "full_tensor") else v  # replicate: whole ones plain
             for k, v in model.state_dict().items()}
    return losses, state


def _net_trained_alone() -> tuple[list[list[float]], dict]:
    import torch.nn.functional as F

    model = _Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for step in range(3):
        x, y = _net_batch(step)
        halves = [F.cross_entropy(model(x[h:h + 2]).reshape(-1, 5), y[h:h + 2].reshape(-1))
                  for h in (0, 2)]
        (sum(halves) / 2).backward()
        opt.step()
        opt.zero_grad()
        losses.append([h.item() for h in halves])
    return losses, model.state_dict()


@pytest.mark.parametrize("case", ["tp", "sp", "sp+checkpoint", "sp+compile"])
def test_devmesh_fully_shard_over_torch_tensor_parallelism(mesh_pool, tmp_path, case):
    """devmesh's ``fully_shard`` shards the blocks of torch's DTensor parameters, as torch's
    FSDP2 does, handing the modules torch's DTensors in forward (before, it refused such
    parameters): the same losses and parameters as torch's ``fully_shard`` and as one
    process, and a checkpoint a plain model loads."""
    from devmesh.parallel import load_checkpoint

    path = str(tmp_path / "ckpt")
    ours = mesh_pool.run(fully_shard_over_torch_tp, 4, "devmesh", case, path)
    theirs = mesh_pool.run(fully_shard_over_torch_tp, 4, "torch", case)
    alone_losses, alone = _net_trained_alone()
    for rank, ((losses, state), (t_losses, t_state)) in enumerate(zip(ours, theirs)):
        assert losses == pytest.approx(t_losses, rel=1e-6)
        assert losses == pytest.approx([step[rank // 2] for step in alone_losses], rel=1e-5)
        assert state.keys() == alone.keys()
        for key, value in alone.items():
            torch.testing.assert_close(state[key], t_state[key], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)
    plain = _Net()
    load_checkpoint(path, plain)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, ours[0][1][key]), key


@pytest.mark.parametrize("case", ["tp", "sp", "sp+checkpoint", "sp+compile"])
def test_devmesh_replicate_over_torch_tensor_parallelism(mesh_pool, tmp_path, case):
    """torchtitan's DDP + TP: torch's tensor parallelism, then devmesh's ``replicate`` over
    ``dp`` (before, refused). The DTensor parameters are held as devmesh blocks and shown to
    their modules as DTensors while the model runs (and while a checkpointed block
    recomputes in backward): the same losses and parameters as one process, and a checkpoint
    a plain model loads. (torch's own DDP-based ``replicate`` over torch's TP, run the same
    way by hand, left the norms and the head 1.6e-2 away from one process.)"""
    from devmesh.parallel import load_checkpoint

    path = str(tmp_path / "ckpt")
    ours = mesh_pool.run(fully_shard_over_torch_tp, 4, "devmesh replicate", case, path)
    alone_losses, alone = _net_trained_alone()
    for rank, (losses, state) in enumerate(ours):
        assert losses == pytest.approx([step[rank // 2] for step in alone_losses], rel=1e-5)
        assert state.keys() == alone.keys()
        for key, value in alone.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)
    plain = _Net()
    load_checkpoint(path, plain)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, ours[0][1][key]), key


def torch_data_parallel_over_devmesh_tp():
    """devmesh's tensor parallelism, then torch's data parallelism over the other dim:
    torch's ``fully_shard`` is refused on every rank (it would take each tensor-parallel
    block for a whole parameter: the training ran, then saving failed with torch's "the
    local_tensor argument only accepts torch.Tensor"); torch's DDP trains as one process."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from devmesh.parallel import ColwiseParallel, RowwiseParallel, parallelize_module, state_dict
    from helpers import caught

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    model = parallelize_module(_model(), mesh["tp"], plan)
    torch_fully_shard(model, mesh=mesh["dp"])
    refusals = [caught(model.state_dict), caught(lambda: model(torch.randn(4, 8)))]

    reference, model = _model(), parallelize_module(_model(), mesh["tp"], plan)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=mesh["dp"].get_group())
    dp = mesh["dp"].get_local_rank()
    for net, rows in ((ddp, slice(4 * dp, 4 * dp + 4)), (reference, slice(None))):
        _train_steps(net, rows, torch.optim.SGD(net.parameters(), lr=0.1))
    trained, expected = state_dict(model, full=True), reference.state_dict()
    return refusals, {k: (trained[k] - v).abs().max().item() for k, v in expected.items()}


def test_torch_data_parallelism_over_devmesh_tensor_parallelism(mesh_pool):
    for refusals, errors in mesh_pool.run(torch_data_parallel_over_devmesh_tp, 4):
        for refusal in refusals:
            assert refusal is not None and refusal[0] == "ParallelizeError"
            assert "split by devmesh's parallelize_module" in refusal[1]
            assert "managed by torch's fully_shard" in refusal[1]
            assert "devmesh.parallel.fully_shard" in refusal[1]
        assert "module '0' (Linear)" in refusals[0][1]  # the state dict knows the name
        assert set(errors) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        assert max(errors.values()) < 1e-6, errors


def torch_fsdp_over_devmesh_fsdp():
    """torch's ``fully_shard`` over a model devmesh's ``fully_shard`` sharded: the forward
    is refused on every rank (it ran, taking each rank's shard for a whole parameter; only
    saving refused it)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from devmesh.parallel import fully_shard
    from helpers import caught

    mesh = init_device_mesh("cpu", (2,))
    model = fully_shard(_model(), mesh=mesh)
    torch_fully_shard(model, mesh=mesh)
    return caught(lambda: model(torch.randn(4, 8)))


def test_torch_fully_shard_over_devmesh_fully_shard_is_refused_at_the_forward(mesh_pool):
    for refusal in mesh_pool.run(torch_fsdp_over_devmesh_fsdp, 2):
        assert refusal is not None and refusal[0] == "ParallelizeError", refusal
        assert "split by devmesh's parallelize_module or fully_shard and is managed by " \
            "torch's fully_shard" in refusal[1]
        assert "Apply devmesh.parallel.fully_shard instead, once" in refusal[1]


def torch_ddp_over_devmesh_blocks():
    """torch's DistributedDataParallel over models devmesh split, where DDP's group holds
    ranks with other blocks (it would broadcast rank 0's blocks over theirs and average
    different blocks): each refused on every rank before DDP's first collective, the
    blocks left as they were. Over the ranks holding the same blocks (``device_mesh=`` the
    dp dim) and over devmesh's whole-parameter DDP it is accepted."""
    from devmesh.parallel import (ColwiseParallel, RowwiseParallel, fully_shard,
                                  parallelize_module, replicate)
    from helpers import caught

    DDP = torch.nn.parallel.DistributedDataParallel
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    sharded = fully_shard(_model(), mesh=init_device_mesh("cpu", (4,)))
    before = [p.detach().clone() for p in sharded.parameters()]
    split = parallelize_module(_model(), mesh["tp"], plan)
    refusals = [caught(lambda: DDP(sharded)), caught(lambda: DDP(split)),
                caught(lambda: DDP(split, process_group=mesh["tp"].get_group()))]
    kept = all(torch.equal(a, b) for a, b in zip(before, sharded.parameters(), strict=True))
    accepted = [type(DDP(parallelize_module(_model(), mesh["tp"], plan),
                         device_mesh=mesh["dp"])).__name__,
                type(DDP(replicate(_model(), mesh=init_device_mesh("cpu", (4,))))).__name__]
    return refusals, kept, accepted


def test_torch_ddp_over_a_model_devmesh_split_is_refused_where_it_would_mix_blocks(mesh_pool):
    """Code that wraps whatever model it is handed in DDP (transformers' Trainer, through
    accelerate) trained a devmesh-split model silently unlike one process."""
    for refusals, kept, accepted in mesh_pool.run(torch_ddp_over_devmesh_blocks, 4):
        for refusal in refusals:
            assert refusal is not None and refusal[0] == "ParallelizeError", refusal
            assert "torch's DistributedDataParallel over " in refusal[1]
            assert "without the DDP wrapper" in refusal[1]
        assert "0.weight, 0.bias, 2.weight" in refusals[0][1]  # every block of FSDP's
        assert "0.weight, 0.bias, 2.weight" in refusals[1][1]  # 2.bias stays whole
        assert kept
        assert accepted == ["DistributedDataParallel", "DistributedDataParallel"]


def devmesh_and_torch_styles_under_one_fully_shard():
    """devmesh's ColwiseParallel on the first layer, torch's RowwiseParallel (a torch-API
    style, as one's own would be) on the second, one devmesh ``fully_shard`` over ``dp``."""
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    from devmesh.parallel import ColwiseParallel, fully_shard, parallelize_module, state_dict

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _model()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
    torch_parallelize(model, mesh["tp"], {"2": TorchRowwise()})
    fully_shard(model, mesh=mesh["dp"])
    dp = mesh["dp"].get_local_rank()
    _train_steps(model, slice(4 * dp, 4 * dp + 4), torch.optim.Adam(model.parameters(), lr=0.01))
    return state_dict(model, full=True)


def _train_steps(model: torch.nn.Module, rows: slice, opt: torch.optim.Optimizer,
                 steps: range = range(3)) -> None:
    """``steps`` of ``opt`` on ``rows`` of each step's batch of 8."""
    import torch.nn.functional as F

    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        F.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()


def test_devmesh_and_torch_styles_mix_under_devmesh_fully_shard(mesh_pool):
    alone = _model()
    _train_steps(alone, slice(None), torch.optim.Adam(alone.parameters(), lr=0.01))
    for state in mesh_pool.run(devmesh_and_torch_styles_under_one_fully_shard, 4):
        for key, value in alone.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)


def _gathers_per_step(styles: str) -> int:
    """All-gathers in one forward and backward of two blocks under ``fully_shard``, split by
    devmesh's styles or torch's."""
    from devmesh import comm_stats
    from devmesh.parallel import fully_shard

    if styles == "torch":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
    else:
        from devmesh.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8)) for _ in range(2)])
    for block in model:
        parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    with comm_stats() as stats:
        model(torch.randn(4, 8)).sum().backward()
    return stats.by_collective()["all_gather"][0]


def test_torch_tp_blocks_are_released_after_forward_as_devmesh_ones(mesh_pool):
    """A unit resharded after forward keeps no gathered block until backward: the DTensor
    views torch's styles save are kept as handles and re-gathered in backward, as devmesh's
    own blocks are (before, autograd kept each gathered block alive from forward to
    backward: 2 all-gathers a step instead of 4, and the memory of reshard_after_forward=False)."""
    for styles in ("devmesh", "torch"):
        assert mesh_pool.run(_gathers_per_step, 4, styles) == [4] * 4, styles


def _torch_tp_alone(path: str, tp: int, phase: str):
    """torch's tensor parallelism alone (no devmesh data parallelism) on ``tp`` ranks:
    devmesh's ``state_dict`` gathers its DTensors; its checkpoints hold each DTensor
    parameter (and its Adam state, DTensors too) as blocks of its layout. ``phase``: "save"
    trains 2 steps and saves; "resume" loads and trains the third step."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    from devmesh.parallel import load_checkpoint, save_checkpoint, state_dict

    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    model = torch_parallelize(_model(), mesh["tp"], {"0": ColwiseParallel(),
                                                     "2": RowwiseParallel()})
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if phase == "save":
        _train_steps(model, slice(None), opt, steps=range(2))
        save_checkpoint(path, model, opt, extra={"step": 2})
        return (state_dict(model, full=True),
                {k: tuple(v.to_local().shape) for k, v in state_dict(model, full=False).items()})
    extra = load_checkpoint(path, model, opt)
    kinds = {type(v).__name__ for state in opt.state.values() for v in state.values()}
    assert all(isinstance(p, DTensor) for p in model.parameters())
    _train_steps(model, slice(None), opt, steps=range(2, 3))
    return extra, kinds, state_dict(model, full=True)


def test_torch_tensor_parallelism_alone_in_state_dicts_and_checkpoints(mesh_pool, tmp_path):
    """Saved on 2 tensor-parallel ranks; resumed on 4 (each block half as wide), on 2, and
    in one process with a plain model: the third step equals three steps of one process. Before, ``save_checkpoint`` refused DTensor
    parameters (and earlier still failed on their bytes: "numpy() is not supported for
    tensor subclasses")."""
    from devmesh.parallel import load_checkpoint

    path = str(tmp_path / "ckpt")
    alone = _model()
    opt = torch.optim.Adam(alone.parameters(), lr=0.01)
    _train_steps(alone, slice(None), opt, steps=range(2))
    after_two = {k: v.clone() for k, v in alone.state_dict().items()}
    _train_steps(alone, slice(None), opt, steps=range(2, 3))
    for full, blocks in mesh_pool.run(_torch_tp_alone, 2, path, 2, "save"):
        for key, value in after_two.items():
            assert type(full[key]) is torch.Tensor, key
            torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6, msg=key)
        assert blocks == {"0.weight": (8, 8), "0.bias": (8,), "2.weight": (4, 8),
                          "2.bias": (4,)}
    for tp in (4, 2):
        for extra, kinds, full in mesh_pool.run(_torch_tp_alone, tp, path, tp, "resume"):
            assert extra == {"step": 2} and kinds == {"Tensor", "DTensor"}, kinds
            for key, value in alone.state_dict().items():
                torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6, msg=key)
    plain = _model()
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.01)
    load_checkpoint(path, plain, plain_opt)
    _train_steps(plain, slice(None), plain_opt, steps=range(2, 3))
    for key, value in alone.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[key], value, rtol=1e-5, atol=1e-6,
                                   msg=key)


WRAPS_AND_CHECKPOINTS = ("fully_shard", "replicate", "save_checkpoint", "load_checkpoint")
ERRORS = ("ParallelizeError",) * 2 + ("CheckpointError",) * 2


def _partial_sums_refused(path: str):
    """A DTensor parameter that is a partial sum (a ``Partial`` placement) has no block to
    hold or shard: devmesh's ``fully_shard`` and ``replicate`` refuse it on every rank, and
    its checkpoints (with their own kind of error: a ``except CheckpointError`` around a
    save sees it)."""
    from torch.distributed.tensor import DTensor, Partial

    from devmesh.parallel import fully_shard, load_checkpoint, replicate, save_checkpoint
    from helpers import caught

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    refusals = []
    for wrap in (fully_shard, replicate, lambda model, mesh: save_checkpoint(path, model),
                 lambda model, mesh: load_checkpoint(path, model)):
        model = _model()
        model[2].weight = torch.nn.Parameter(
            DTensor.from_local(model[2].weight.detach(), mesh["tp"], [Partial()]))
        refusals.append(caught(lambda: wrap(model, mesh=mesh["dp"])))
    return refusals


def test_a_partial_sum_parameter_is_refused_by_name(mesh_pool, tmp_path):
    from devmesh.parallel import save_checkpoint

    save_checkpoint(tmp_path / "ckpt", _model())  # a checkpoint to load from
    for refusals in mesh_pool.run(_partial_sums_refused, 4, str(tmp_path / "ckpt")):
        assert len(refusals) == len(ERRORS)
        for refusal, what, kind in zip(refusals, WRAPS_AND_CHECKPOINTS, ERRORS):
            assert refusal[0] == kind, refusal
            assert f"{what}: parameter '2.weight' is a DTensor with placements" in refusal[1]
            assert "redistribute it to Replicate() or Shard(d) first" in refusal[1]


def _torch_fsdp_tp_checkpoint(path: str, resume_with: str):
    """torch's own FSDP2 over torch's TP (DTensor parameters laid out ``(_StridedShard(0,
    sf=2), Shard(0))`` on ``(dp, tp)``) saved by devmesh's ``save_checkpoint`` after 2 Adam
    steps; resumed for the third step by ``resume_with`` ("torch": the same torch model,
    "devmesh": devmesh's styles and fully_shard). Returns the whole model after it."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    from devmesh.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        fully_shard,
        load_checkpoint,
        parallelize_module,
        save_checkpoint,
        state_dict,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rows = slice(4 * mesh["dp"].get_local_rank(), 4 * mesh["dp"].get_local_rank() + 4)

    def torch_model():
        model = torch_parallelize(_model(), mesh["tp"], {"0": TorchColwise(),
                                                         "2": TorchRowwise()})
        return torch_fully_shard(model, mesh=mesh["dp"])

    model = torch_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _train_steps(model, rows, opt, steps=range(2))
    save_checkpoint(path, model, opt)
    if resume_with == "torch":
        model = torch_model()
    else:
        model = parallelize_module(_model(), mesh["tp"], {"0": ColwiseParallel(),
                                                          "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    load_checkpoint(path, model, opt)
    _train_steps(model, rows, opt, steps=range(2, 3))
    return state_dict(model, full=True)


@pytest.mark.parametrize("resume_with", ["torch", "devmesh"])
def test_torch_fsdp_over_torch_tp_checkpointed_by_devmesh(mesh_pool, tmp_path, resume_with):
    """Before, refused (a DTensor parameter)."""
    alone = _model()
    _train_steps(alone, slice(None), torch.optim.Adam(alone.parameters(), lr=0.01))
    for full in mesh_pool.run(_torch_fsdp_tp_checkpoint, 4, str(tmp_path / "ckpt"),
                              resume_with):
        for key, value in alone.state_dict().items():
            torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6, msg=key)


def _load_into_torch_tp_alone():
    """devmesh's ``load_state_dict`` into a model torch's TP split (DTensor parameters): from
    a plain model's full state dict, and from another such model's ``state_dict()`` (its
    DTensors). torch's ``nn.Module.load_state_dict`` of the full one raises. Then
    ``describe`` of it."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    from devmesh.parallel import load_state_dict, state_dict

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}

    def split(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch_parallelize(torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)), mesh["tp"], plan)

    source = _model()
    model = split(1)
    try:
        model.load_state_dict(source.state_dict())
        torch_refused = False
    except RuntimeError:
        torch_refused = True
    loaded_full = load_state_dict(model, source.state_dict())
    from_full = state_dict(model, full=True)
    load_state_dict(model, split(2).state_dict())
    from devmesh.parallel import describe

    return torch_refused, str(loaded_full), from_full, state_dict(model, full=True), \
        describe(model)


def test_devmesh_load_state_dict_into_torch_tensor_parallelism(mesh_pool):
    """Before, "aten.copy_.default got mixed torch.Tensor and DTensor" on every rank; and
    ``state_dict(full=True)`` of a replicated DTensor was the live parameter itself (with
    ``requires_grad``), so the next load changed the state dict taken before it."""
    source = _model().state_dict()
    torch.manual_seed(2)
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4)).state_dict()
    for torch_refused, keys, from_full, from_dtensors, table in mesh_pool.run(
            _load_into_torch_tp_alone, 2):
        # describe reads torch's layouts too (before: "not distributed", the global shape
        # and bytes as this rank's)
        rows = [line.split() for line in table.splitlines()]
        assert ["0.weight", "(16,", "8)", "dim", "0", "split", "by", "(tp)", "(8,", "8)", "on",
                "every", "rank", "256"] in rows, table
        assert ["2.bias", "(4,)", "replicated", "(4,)", "on", "every", "rank", "16"] in rows
        assert "bytes per rank: 432 on ranks 0-1 (the full model: 848)" in table
        assert torch_refused and keys == "<All keys matched successfully>"
        for key in source:
            assert not from_full[key].requires_grad, key
            assert torch.equal(from_full[key], source[key]), key
            assert torch.equal(from_dtensors[key], other[key]), key
