"""What setting a model up costs in communication: ``fully_shard`` checks one rank's own
arguments and agrees on what its unit holds, a model's calls together in a single
collective at the root's call (inside ``batched_checks()``, two collectives for all the
calls), and
``parallelize_module`` agrees on its whole plan (styles, and the shapes and dtypes of the
parameters they split) once, then sends each rank its blocks of the split parameters from
the source in buckets (torch's scatters each parameter on its own).
Counted on real gloo ranks (every collective entered on a process group); the refusals and
disagreements these single agreements still catch on every rank are in
the errors tests."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from devmesh import init_device_mesh
from devmesh.distributed.entered import entered_collectives

BLOCKS = 6


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
                           for _ in range(BLOCKS)])


def _plan() -> dict:
    """Each block's first layer split column-wise, its last row-wise."""
    from devmesh.parallel import ColwiseParallel, RowwiseParallel

    return {f"{i}.{j}": style() for i in range(BLOCKS)
            for j, style in ((0, ColwiseParallel), (2, RowwiseParallel))}


def setup_collectives() -> dict[str, int]:
    from devmesh.parallel import batched_checks, fully_shard, parallelize_module

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = _model()
    with entered_collectives() as sharding:
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model = _model()
    with entered_collectives() as batched, batched_checks():
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model = _model()
    plan = _plan()
    from devmesh.distributed import comm

    sends = []
    scatter = comm.scatter_bytes
    comm.scatter_bytes = lambda *args, **kwargs: sends.append(1) or scatter(*args, **kwargs)
    try:
        with entered_collectives() as splitting:
            parallelize_module(model, mesh, plan)
    finally:
        comm.scatter_bytes = scatter
    return {"fully_shard": sum(sharding.values()), "parallelize_module": sum(splitting.values()),
            "sends": len(sends), "batched": sum(batched.values())}


def test_a_models_setup_costs_one_agreement_and_its_split_parameters_one_bucket(mesh_pool):
    for counts in mesh_pool.run(setup_collectives, 2):
        assert counts["fully_shard"] == 1, counts  # one for the calls, at the root's call
        assert counts["batched"] == 2, counts  # a failure flag, then one digest of them all
        # two Linear layers per block, a weight and a bias each: 24 parameters, 10 KB in all,
        # one bucket
        assert counts["sends"] == 1, counts
        assert counts["parallelize_module"] == 1 + 2, counts     # + refusal + plan


def split_from_differently_initialised_ranks(bucket_bytes: int) -> bool:
    """Each rank builds the model from its own seed; ``parallelize_module`` (buckets of
    ``bucket_bytes``: several per model, and parameters larger than one) must leave every
    rank holding its block of rank 0's values — a float64 layer beside float32 ones, and a
    layer split by a style of one's own."""
    from devmesh.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from devmesh.parallel.tensor_parallel import source_values

    def build(seed: int) -> nn.Sequential:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8).double(),
                             nn.Linear(8, 6), nn.Linear(6, 8))

    from devmesh.parallel.tensor_parallel.styles import ParallelStyle
    from devmesh.tensor import Shard

    class RowsOfOwn(ParallelStyle):
        """A style of one's own, which does not say how it splits (no ``splits``): its
        parameters come whole from the source and each rank splits its copy."""

        distributes_parameters = True

        def apply(self, module, mesh, distribute):
            distribute(module, "weight", Shard(0))
            distribute(module, "bias", Shard(0))
            return module

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    rank = mesh.get_local_rank(0)
    default, source_values.BUCKET_BYTES = source_values.BUCKET_BYTES, bucket_bytes
    try:
        model = parallelize_module(build(rank), mesh, {"0": ColwiseParallel(),
                                                       "2": RowwiseParallel(),
                                                       "3": RowsOfOwn(),
                                                       "4": RowwiseParallel()})
    finally:
        source_values.BUCKET_BYTES = default
    want = build(0)
    for (name, got), (_, whole) in zip(model.named_parameters(), want.named_parameters(),
                                       strict=True):
        block = got.to_local() if hasattr(got, "to_local") else got
        dim = 0 if name.startswith(("0.", "3.")) else (1 if name.endswith("weight") else None)
        expected = whole if dim is None else whole.chunk(2, dim)[rank]
        if block.dtype != whole.dtype or not torch.equal(block.detach(), expected):
            return False
    return True


def test_split_parameters_take_the_source_ranks_values_bucket_by_bucket(mesh_pool):
    for bucket_bytes in (200, 1 << 25):  # many buckets (one weight larger than any); one
        assert mesh_pool.run(split_from_differently_initialised_ranks, 2, bucket_bytes) == \
            [True, True]


def whole_parameters_alive_while_splitting() -> list[int]:
    """How many of the model's whole (unsplit) parameters are still alive as each one is
    split, small buckets (one parameter each)."""
    import weakref

    from devmesh.parallel import parallelize_module
    from devmesh.parallel.tensor_parallel import api, source_values

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = _model()
    plan = _plan()
    wholes = [weakref.ref(p) for p in model.parameters()]
    alive: list[int] = []
    split = api._distribute

    def counting(*args, **kwargs):
        split(*args, **kwargs)
        alive.append(sum(w() is not None for w in wholes))

    default, source_values.BUCKET_BYTES = source_values.BUCKET_BYTES, 1
    api._distribute = counting
    try:
        parallelize_module(model, mesh, plan)
    finally:
        api._distribute, source_values.BUCKET_BYTES = split, default
    return alive


def test_each_whole_parameter_is_freed_once_split(mesh_pool):
    """A whole parameter goes once its block replaces it: holding them all until the whole
    plan was split kept the entire model beside its blocks (a large model's peak memory)."""
    for alive in mesh_pool.run(whole_parameters_alive_while_splitting, 2):
        assert len(alive) == 4 * BLOCKS  # a weight and a bias of two layers per block
        assert alive == list(range(4 * BLOCKS - 1, -1, -1)), alive


def bytes_received_while_splitting() -> tuple[int, int]:
    """The bytes this rank received of the source's values, and the model's bytes."""
    from devmesh.distributed import comm
    from devmesh.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    model = _model()
    plan = _plan()
    received = []
    scatter = comm.scatter_bytes

    def counting(*args, **kwargs):
        mine = scatter(*args, **kwargs)
        received.append(mine.numel())
        return mine

    comm.scatter_bytes = counting
    try:
        whole = sum(p.numel() * p.element_size() for p in model.parameters())
        parallelize_module(model, mesh, plan)
    finally:
        comm.scatter_bytes = scatter
    return sum(received), whole


def test_each_rank_receives_only_its_blocks_of_the_source_values(mesh_pool):
    """Over 4 ranks a rank receives its quarter of each split weight and of the column-wise
    biases, and the row-wise biases whole (added after the reduction), as torch's scatter
    sends them: not the whole model (a broadcast of every parameter sent each rank 4x that)."""
    per_block = (8 * 16 + 16 + 16 * 8) * 4 // 4 + 8 * 4  # float32; (padding: 16-byte steps)
    for received, whole in mesh_pool.run(bytes_received_while_splitting, 4):
        assert whole == BLOCKS * (8 * 16 + 16 + 16 * 8 + 8) * 4
        assert BLOCKS * per_block <= received <= BLOCKS * per_block + 4 * BLOCKS * 16, received


def split_from_another_source(src: int) -> bool:
    """Rank ``src`` of a mesh whose order is not the ranks' (``[2, 0, 1]``) sends each rank
    its block, 10 rows over 3 ranks (4, 4, 2)."""
    import torch.distributed as dist

    from devmesh import DeviceMesh
    from devmesh.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def build(seed: int) -> nn.Sequential:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, 10), nn.Linear(10, 8))

    mesh = DeviceMesh("cpu", [2, 0, 1], mesh_dim_names=("tp",))
    index = mesh.get_local_rank(0)
    model = parallelize_module(build(dist.get_rank()), mesh,
                               {"0": ColwiseParallel(), "1": RowwiseParallel()},
                               src_data_rank=src)
    want = build([2, 0, 1][src])  # the source's own model
    for (name, got), (_, whole) in zip(model.named_parameters(), want.named_parameters(),
                                       strict=True):
        block = got.to_local() if hasattr(got, "to_local") else got
        dim = 0 if name.startswith("0.") else (1 if name.endswith("weight") else None)
        expected = whole if dim is None else whole.chunk(3, dim)[index]
        if not torch.equal(block.detach(), expected.detach()):
            return False
    return True


@pytest.mark.parametrize("src", [1, 2])
def test_any_source_rank_of_a_reordered_mesh_sends_each_rank_its_block(mesh_pool, src):
    assert mesh_pool.run(split_from_another_source, 3, src) == [True] * 3
