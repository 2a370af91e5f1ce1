"""A devmesh mesh goes wherever torch takes a DeviceMesh, with no ``to_torch()``: torch's
functional collectives, DTensor, torch's FSDP2 and tensor parallelism (issue 8, item 12).
Each result is compared with the same torch call on a mesh torch built itself."""

from __future__ import annotations

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


def devmesh_data_parallel_over_torch_dtensors():
    """torch's tensor parallelism (its own style, as torchtitan applies its custom ones) on a
    devmesh mesh, then devmesh's fully_shard or replicate: each is refused, on every rank,
    naming the parameter and both ways out; torch's fully_shard on the same mesh trains."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    from devmesh.errors import ParallelizeError
    from devmesh.parallel import fully_shard, replicate

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    messages = []
    for wrap in (fully_shard, replicate):
        model = _model()
        torch_parallelize(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        try:
            wrap(model, mesh=mesh["dp"])
        except ParallelizeError as e:
            messages.append(str(e))
    model = _model()
    torch_parallelize(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    torch_fully_shard(model, mesh=mesh["dp"])
    model(torch.randn(4, 8)).sum().backward()
    return messages, all(p.grad is not None for p in model.parameters())


def test_devmesh_data_parallelism_refuses_torch_dtensor_parameters_with_the_fix(mesh_pool):
    for messages, torch_trained in mesh_pool.run(devmesh_data_parallel_over_torch_dtensors, 4):
        assert len(messages) == 2 and torch_trained
        for message, what in zip(messages, ("fully_shard", "replicate")):
            assert f"{what}: parameter '0.weight' is a torch DTensor" in message
            assert "devmesh.parallel.parallelize_module" in message
            assert f"torch's {what}" in message


def torch_data_parallel_over_devmesh_tp():
    """devmesh's tensor parallelism, then torch's data parallelism over the other dim:
    torch's ``fully_shard`` is refused on every rank (it would take each tensor-parallel
    block for a whole parameter: the training ran, then saving failed with torch's "the
    local_tensor argument only accepts torch.Tensor"); torch's DDP trains as one process."""
    import torch.nn.functional as F
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
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)
            F.cross_entropy(net(x[rows]), y[rows]).backward()
            opt.step()
            opt.zero_grad()
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
