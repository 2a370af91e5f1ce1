"""ShardedTensor as torch users call it, and the mistakes that used to crash or hang some
ranks (issue 8, items 5, 7, 9, 15): nested DTensor layouts both ways, shape/dtype
disagreement between ranks, Partial('avg') on integers, torch's call shapes."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial as TorchPartial
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard

from devmesh import init_device_mesh
from helpers import caught
from devmesh.tensor import Partial, Replicate, Shard, ShardedTensor, ShardingSpec, distribute_tensor



def nested_layouts_round_trip_through_dtensor():
    """Every nesting order of 3 mesh dims over one tensor dim: to_dtensor() gives torch the
    same blocks (its full_tensor is right), and from_dtensor() gives the nesting back."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
    out = []
    for rows, r in itertools.product((16, 13, 5), (1, 2, 3)):  # even, uneven, empty blocks
        x = torch.arange(rows * 3.0).reshape(rows, 3)
        for order in itertools.permutations(range(3), r):
            spec = ShardingSpec(mesh.shape, x.shape, (order, ()), (), mesh.mesh_dim_names)
            st = distribute_tensor(x, mesh, spec)
            dt = st.to_dtensor()
            back = ShardedTensor.from_dtensor(dt)
            out.append(((rows, order), torch.equal(dt.full_tensor(), x), back.spec.dim_map[0] == order,
                        torch.equal(back.to_local(), st.to_local())))
    return out


def test_nested_layouts_round_trip_through_dtensor(mesh_pool):
    for rank_result in mesh_pool.run(nested_layouts_round_trip_through_dtensor, 8):
        for order, torch_full_ok, same_order, same_block in rank_result:
            assert torch_full_ok and same_order and same_block, order


def torch_fsdp_over_tp_param_reads_back():
    """A weight torch's FSDP2 sharded over torch's TP (placements _StridedShard + Shard):
    from_dtensor reads the nesting, and devmesh's full_tensor equals torch's."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    weight = model[0].weight
    ours = ShardedTensor.from_dtensor(weight)
    bogus = DTensor.from_local(torch.zeros(2, 4), mesh,
                               [torch.distributed.tensor.placement_types._StridedShard(
                                   0, split_factor=3), TorchShard(0)], run_check=False)
    return (str(weight.placements), ours.spec.dim_map, torch.equal(ours.full_tensor(),
                                                                   weight.full_tensor()),
            caught(lambda: ShardedTensor.from_dtensor(bogus)))


def test_torch_fsdp_over_tp_parameter_reads_back(mesh_pool):
    for placements, dim_map, equal, bogus in mesh_pool.run(torch_fsdp_over_tp_param_reads_back, 4):
        assert "_StridedShard" in placements
        assert dim_map[0] == (1, 0)  # tp major, dp minor
        assert equal
        assert bogus is not None and bogus[0] == "NestedShardingError"


def disagreeing_ranks(case: str):
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("x",))
    rank = dist.get_rank()
    if case == "from_local_shape":
        shape = (8, 4) if rank != 2 else (9, 4)
        return caught(lambda: ShardedTensor.from_local(torch.zeros(2, 4), mesh, [Shard(0)],
                                                       shape=shape))
    if case == "distribute_dtype":
        dtype = torch.float32 if rank != 1 else torch.float64
        return caught(lambda: distribute_tensor(torch.zeros(4, 4, dtype=dtype), mesh,
                                                [Shard(0)]))
    if case == "distribute_shape":
        return caught(lambda: distribute_tensor(torch.zeros(4 + (rank == 3), 4), mesh,
                                                [Shard(0)]))
    raise AssertionError(case)


@pytest.mark.parametrize("case, words", [
    ("from_local_shape", "global shape (9, 4)"),
    ("distribute_dtype", "torch.float64"),
    ("distribute_shape", "global shape (5, 4)"),
])
def test_ranks_that_disagree_all_get_the_same_error(mesh_pool, case, words):
    results = mesh_pool.run(disagreeing_ranks, 4, case, timeout=60)
    for result in results:
        assert result is not None
        name, message = result
        assert name == "MeshMismatchError" and words in message
        assert "ranks" in message
    assert len({message.split("] ", 1)[1] for _, message in results}) == 1


def torch_call_shapes():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.arange(16.0).reshape(4, 4)
    # torch's placement classes, torch's keyword names, torch's redistribute signature
    t = distribute_tensor(x, mesh, [TorchShard(0), TorchReplicate()], src_data_rank=0)
    u = t.redistribute(mesh, [TorchReplicate(), TorchShard(1)], async_op=True)
    same = t.redistribute(placements=None)
    # full_tensor(grad_placements=...): a partial gradient is reduce-scattered back
    leaf = t.to_local().detach().clone().requires_grad_()
    full = ShardedTensor.from_local(leaf, mesh, [Shard(0), Replicate()]).full_tensor(
        grad_placements=[TorchPartial(), TorchPartial()])
    full.sum().backward()
    # to_local(grad_placements=...): the consumer's gradient is partial over tp
    leaf2 = torch.ones(4, 4, requires_grad=True)
    rep = ShardedTensor.from_local(leaf2, mesh, [Replicate(), Replicate()])
    rep.to_local(grad_placements=[Replicate(), Partial()]).sum().backward()
    int_avg = caught(lambda: ShardedTensor.from_local(torch.ones(2, dtype=torch.int64), mesh,
                                                      [Partial("avg"), Replicate()]))
    return {
        "u_local": u.to_local().tolist(), "same": same is t,
        "full_grad": leaf.grad.tolist(), "partial_grad": leaf2.grad.tolist(),
        "int_avg": int_avg,
    }


def test_torch_call_shapes(mesh_pool):
    results = mesh_pool.run(torch_call_shapes, 4)
    x = torch.arange(16.0).reshape(4, 4)
    for rank, r in enumerate(results):
        tp = rank % 2
        assert r["u_local"] == x[:, 2 * tp: 2 * tp + 2].tolist()
        assert r["same"]
        # each of the 4 ranks contributes ones; summed over the 4 partial ranks: 4 per element
        assert r["full_grad"] == [[4.0] * 4] * 2
        assert r["partial_grad"] == [[2.0] * 4] * 4  # summed over the 2 tp ranks
        assert r["int_avg"][0] == "ShardingSpecError" and "floating-point" in r["int_avg"][1]


def partial_reductions():
    """Partial(max/min/avg/sum) resolved on real processes, to Replicate and to Shard."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rank = dist.get_rank()
    local = torch.arange(8.0).reshape(2, 4) * (rank + 1) - 3 * rank
    out = {}
    for op in ("sum", "avg", "max", "min"):
        t = ShardedTensor.from_local(local.clone(), mesh, [Partial(op), Partial(op)])
        out[op] = (t.full_tensor().tolist(),
                   t.redistribute([Shard(0), Replicate()]).to_local().tolist())
    return out


def test_partial_reductions_on_real_processes(mesh_pool):
    results = mesh_pool.run(partial_reductions, 4)
    values = torch.stack([torch.arange(8.0).reshape(2, 4) * (r + 1) - 3 * r for r in range(4)])
    expected = {"sum": values.sum(0), "avg": values.mean(0), "max": values.amax(0),
                "min": values.amin(0)}
    for rank, r in enumerate(results):
        for op, full in expected.items():
            assert torch.allclose(torch.tensor(r[op][0]), full), op
            row = rank // 2
            assert torch.allclose(torch.tensor(r[op][1]), full[row: row + 1]), op


def factories_next_to_torch():
    """devmesh's DTensor factories on a (2, 2) mesh with torch's placements, an uneven size
    and an empty block, next to torch's own factories on the same mesh."""
    import torch.distributed.tensor as tdt

    import devmesh.tensor as dmt

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    placements = [TorchShard(0), TorchShard(1)]
    out = {"shapes": [], "values": []}
    for name, args in (("zeros", (5, 1)), ("ones", ((5, 3),)), ("empty", (2, 3))):
        ours = getattr(dmt, name)(*args, device_mesh=mesh, placements=placements,
                                  dtype=torch.float64, requires_grad=True)
        theirs = getattr(tdt, name)(*args, device_mesh=mesh, placements=placements,
                                    dtype=torch.float64, requires_grad=True)
        out["shapes"].append((tuple(ours.to_local().shape), tuple(theirs.to_local().shape),
                              ours.requires_grad))
        if name != "empty":
            out["values"].append(torch.equal(ours.full_tensor(), theirs.full_tensor()))
    filled = dmt.full((5, 3), 7.5, device_mesh=mesh, placements=placements)
    out["full"] = torch.equal(filled.full_tensor(), torch.full((5, 3), 7.5))
    torch.manual_seed(3)
    out["rand"] = dmt.rand(6, 4, device_mesh=mesh, placements=placements).full_tensor()
    out["randn"] = dmt.randn(6, 4, device_mesh=mesh, placements=[Replicate(), Shard(1)]
                             ).full_tensor()
    torch.manual_seed(dist.get_rank())  # ranks seeded differently: refused on every rank
    out["seeds"] = caught(lambda: dmt.randn(4, device_mesh=mesh))
    out["partial"] = caught(lambda: dmt.ones(4, device_mesh=mesh,
                                             placements=[TorchPartial(), TorchReplicate()]))
    return out


def test_tensor_factories_as_torch(mesh_pool):
    torch.manual_seed(3)
    rand, randn = torch.rand(6, 4), torch.randn(6, 4)  # one process, the same seed
    for r in mesh_pool.run(factories_next_to_torch, 4):
        for ours, theirs, requires_grad in r["shapes"]:
            assert ours == theirs and requires_grad
        assert all(r["values"]) and r["full"]
        assert torch.equal(r["rand"], rand) and torch.equal(r["randn"], randn)
        assert r["seeds"][0] == "MeshMismatchError" and "same random state" in r["seeds"][1]
        assert "Partial placement is ambiguous" in r["partial"][1]


def redistribute_dtypes(library: str):
    """redistribute with forward_dtype / backward_dtype, devmesh's or torch's, on a (2, 2)
    mesh: [R, R] -> [S(0), S(1)] (forward: a local chunk; backward: an all-gather of the
    gradient). The result's dtype and values, the gradient's dtype and values, and (devmesh)
    the bytes the backward moved."""
    import torch.distributed.tensor as tdt

    from devmesh import comm_stats

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    make = distribute_tensor if library == "devmesh" else tdt.distribute_tensor
    full = torch.linspace(-3, 3, 48).reshape(8, 6) * 1.001
    weight = torch.linspace(0.1, 7, 12).reshape(4, 3).to(torch.bfloat16) * 1.003
    out = []
    for backward_dtype in (None, torch.bfloat16):
        x = make(full.clone().requires_grad_(), mesh, [TorchReplicate(), TorchReplicate()])
        y = x.redistribute(mesh, [TorchShard(0), TorchShard(1)],
                           forward_dtype=torch.bfloat16, backward_dtype=backward_dtype)
        local = y.to_local()
        with comm_stats() as stats:
            (local * weight).sum().backward()
        grad = x._local.grad if library == "devmesh" else x.grad.to_local()
        moved = sum(b for _, b in stats.by_collective().values())
        out.append((local.dtype, local.float(), grad.dtype, grad.clone(), moved))
    return out


def test_redistribute_forward_and_backward_dtypes_as_torch(mesh_pool):
    ours = mesh_pool.run(redistribute_dtypes, 4, "devmesh")
    theirs = mesh_pool.run(redistribute_dtypes, 4, "torch")
    for rank_ours, rank_theirs in zip(ours, theirs):
        for (dtype, values, grad_dtype, grad, _), (t_dtype, t_values, t_grad_dtype, t_grad, _) \
                in zip(rank_ours, rank_theirs):
            assert dtype == t_dtype == torch.bfloat16 and torch.equal(values, t_values)
            assert grad_dtype == t_grad_dtype == torch.float32
            assert torch.equal(grad, t_grad)
        # the gradient's all-gather ran in fp32 (the tensor's dtype), then in bf16
        assert rank_ours[0][4] > 0 and rank_ours[1][4] * 2 == rank_ours[0][4]


def from_local_and_mesh_context(library: str):
    """torch's ``from_local`` arguments and ``with mesh:`` default, devmesh's or torch's, on a
    (2, 2) mesh: what each rank's leaf gradient is, what the factories and from_local make
    without a mesh argument, and (devmesh) the errors."""
    import torch.distributed.tensor as tdt

    import devmesh.tensor as dmt

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    ours = library == "devmesh"
    from_local = ShardedTensor.from_local if ours else DTensor.from_local
    lib = dmt if ours else tdt
    coord = mesh.get_coordinate()
    weight = torch.arange(12.0).reshape(4, 3) + 1
    out = {}
    # grad_placements: a replicated block whose gradient leaves as a partial sum over "a"
    # (torch: the gradient / 2 on each rank; devmesh: the gradient on a=0, zeros on a=1)
    for name, placements, grad_placements in (
            ("replicate->partial", [TorchReplicate(), TorchReplicate()],
             [TorchPartial(), TorchReplicate()]),
            ("shard->partial", [TorchShard(0), TorchReplicate()],
             [TorchShard(0), TorchPartial()]),
            ("partial->default", [TorchPartial(), TorchReplicate()], None)):
        leaf = torch.ones(4, 3, requires_grad=True)
        t = from_local(leaf, mesh, placements, grad_placements=grad_placements)
        full = t.full_tensor()
        (full * torch.arange(float(full.numel())).reshape(full.shape)).sum().backward()
        out[name] = leaf.grad.clone()
    with mesh:
        out["context"] = (
            [type(p).__name__ for p in from_local(weight).placements] == ["Replicate"] * 2,
            tuple(lib.zeros(5, 2, placements=[TorchShard(0), TorchShard(1)]).to_local().shape),
            torch.equal(lib.distribute_tensor(weight, placements=[TorchShard(0), TorchShard(1)])
                        .full_tensor(), weight))
    if ours:
        out["no mesh"] = caught(lambda: dmt.ones(4))
        out["stride"] = caught(lambda: from_local(weight, mesh, stride=(1, 4)))
        out["nested"] = caught(lambda: from_local(from_local(weight, mesh), mesh))
    out["coord"] = tuple(coord)
    return out


def test_from_local_grad_placements_and_mesh_context_as_torch(mesh_pool):
    ours = mesh_pool.run(from_local_and_mesh_context, 4, "devmesh")
    theirs = mesh_pool.run(from_local_and_mesh_context, 4, "torch")
    for name in ("replicate->partial", "shard->partial", "partial->default"):
        # the partial sums differ per rank (docs/guide/sharded-tensors.md), their sums are torch's
        for group in ([0, 2], [1, 3]) if name == "replicate->partial" else ([0, 1], [2, 3]):
            if name == "partial->default":
                for rank in range(4):
                    assert torch.equal(ours[rank][name], theirs[rank][name]), name
                continue
            assert torch.allclose(sum(ours[r][name] for r in group),
                                  sum(theirs[r][name] for r in group)), name
            # devmesh: the whole gradient on the group's first rank, zeros on the other
            assert torch.count_nonzero(ours[group[1]][name]) == 0
            assert torch.equal(ours[group[0]][name], 2 * theirs[group[0]][name])
    for o, t in zip(ours, theirs):
        assert o["context"] == t["context"] and o["context"][0] and o["context"][2]
        assert "with mesh:" in o["no mesh"][1]
        assert "contiguous stride" in o["stride"][1]
        assert "already distributed" in o["nested"][1]
