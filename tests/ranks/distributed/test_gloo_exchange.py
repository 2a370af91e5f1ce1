"""devmesh's reductions and gathers over gloo go as one all-to-all exchange
(:mod:`devmesh.distributed.exchange`), and give torch's gloo collectives' results bit for bit:
every size on both sides of the one-exchange and two-exchange all-reduce, uneven pieces, each
reduced dtype and op, group sizes that are odd and even, and a group whose mesh order is not
c10d's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from devmesh import init_device_mesh

SIZES = (1, 3, 7, 10, 17, 100, 1001, 65_537, 300_000, 300_001)
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64)


def _values(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, (numel,), generator=g)
    # magnitudes from 1e-3 to 1e3: the order of the additions shows in the last bits
    return (torch.randn(numel, generator=g) * torch.logspace(-3, 3, numel)).to(dtype)


def against_torch(shape: tuple[int, ...]) -> list[str]:
    """Each of devmesh's collectives on every size, dtype and op, against torch's on the same
    values; the mismatches, named."""
    from devmesh.distributed import comm

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=tuple("abc"[:len(shape)]))
    rank = dist.get_rank()
    bad = []
    dim_sets = [(d,) for d in range(len(shape))] + ([(1, 0)] if len(shape) > 1 else [])
    for dims in dim_sets:
        group = comm.process_group(mesh, dims)
        order = list(mesh.layout.group_of(rank, dims))  # mesh order
        c10d = sorted(order)
        for numel in SIZES:
            for dtype in DTYPES:
                x = _values(numel, dtype, 7 * rank + numel)
                for op in ("sum", "max", "min"):
                    theirs = x.clone()
                    dist.all_reduce(theirs, op=getattr(dist.ReduceOp, op.upper()), group=group)
                    ours = comm.all_reduce(x.clone(), mesh, dims, op)
                    ours_async = comm.all_reduce_async(x.clone(), mesh, dims, op).wait()
                    if not (torch.equal(ours, theirs) and torch.equal(ours_async, theirs)):
                        bad.append(f"all_reduce {op} {dims} {numel} {dtype}")
                stacked = torch.stack([_values(numel, dtype, 100 * rank + i)
                                       for i in range(len(order))])
                theirs = torch.empty(numel, dtype=dtype)
                in_c10d = stacked[[order.index(r) for r in c10d]].contiguous()
                dist.reduce_scatter_single(theirs, in_c10d.view(-1), group=group)
                if not torch.equal(comm.reduce_scatter(stacked, mesh, dims, "sum"), theirs):
                    bad.append(f"reduce_scatter {dims} {numel} {dtype}")
                gathered = torch.empty(len(order) * numel, dtype=dtype)
                dist.all_gather_into_tensor(gathered, x, group=group)
                theirs = gathered.view(len(order), numel)[[c10d.index(r) for r in order]]
                if not torch.equal(comm.all_gather(x, mesh, dims), theirs):
                    bad.append(f"all_gather {dims} {numel} {dtype}")
    return bad


@pytest.mark.parametrize("world,shape", [(8, (2, 4)), (5, (5,))])
def test_reductions_and_gathers_by_exchange_equal_torchs_gloo_bit_for_bit(mesh_pool, world,
                                                                          shape):
    for bad in mesh_pool.run(against_torch, world, shape):
        assert bad == []


def collectives_called() -> dict[str, int]:
    """Which torch collectives devmesh's all-reduce (small and mid-sized), reduce-scatter and
    all-gather call on gloo."""
    from devmesh.distributed import comm

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    called: dict[str, int] = {}
    originals = {name: getattr(dist, name) for name in (
        "all_reduce", "reduce_scatter_single", "all_gather_single", "all_to_all_single")}

    def counting(name):
        def call(*args, **kwargs):
            called[name] = called.get(name, 0) + 1
            return originals[name](*args, **kwargs)
        return call

    for name in originals:
        setattr(dist, name, counting(name))
    try:
        comm.all_reduce(torch.ones(10), mesh, (0,))  # one exchange
        comm.all_reduce(torch.ones(1 << 20), mesh, (0,))  # 4 MiB: two
        comm.reduce_scatter(torch.ones(4, 1000), mesh, (0,))
        comm.all_gather(torch.ones(1000), mesh, (0,))
        comm.all_reduce(torch.ones(8 << 20), mesh, (0,))  # 32 MiB: gloo's ring
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return called


def test_gloo_reductions_and_gathers_go_as_all_to_all_exchanges(mesh_pool):
    for called in mesh_pool.run(collectives_called, 4):
        assert called == {"all_to_all_single": 5, "all_reduce": 1}


def traced_ops() -> list[str]:
    """What ``--trace-collectives`` records for devmesh's collectives by exchange."""
    from devmesh.distributed import comm, trace

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    trace.install()
    try:
        comm.all_reduce(torch.ones(10), mesh, (0,))  # one exchange
        comm.all_reduce(torch.ones(1 << 20), mesh, (0,))  # two
        comm.all_reduce_async(torch.ones(10), mesh, (0,)).wait()
        comm.reduce_scatter(torch.ones(4, 1000), mesh, (0,))
        comm.all_gather(torch.ones(1000), mesh, (0,))
        dist.all_to_all_single(torch.empty(4), torch.ones(4))  # the user's own: as it is
        ops = [r.op for r in trace.records()]
    finally:
        trace.uninstall()
    return ops


def test_the_collective_recorder_names_the_collective_an_exchange_makes(mesh_pool):
    """A hang report names what the code asked for: devmesh's all-reduce, not the
    all-to-all it is made of."""
    for ops in mesh_pool.run(traced_ops, 4):
        assert ops == ["all_reduce (as all_to_all_single)"] * 4 + [
            "reduce_scatter (as all_to_all_single)", "all_gather (as all_to_all_single)",
            "all_to_all_single"], ops
