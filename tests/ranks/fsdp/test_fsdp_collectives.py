"""The byte layout of a ``fully_shard`` unit's two collectives, checked without processes: the
ranks' rows are packed here as each rank would, stacked as the all-gather (or summed as the
reduce-scatter) would, and unpacked — for uneven, empty and 0-d blocks, blocks cut along any
dim (``shard_placement_fn``) and mixed dtypes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from devmesh.layout.spec import chunk_bounds
from devmesh.parallel.fsdp.collectives import (
    ShardedParam,
    gather_dtypes,
    pack_gradients,
    pack_shards,
    unpack_gathered,
    unpack_reduced,
)

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _params(shapes, dtypes, k, dims=None):
    """Each full tensor, and per rank the ShardedParam list that rank would hold, each split
    along its ``dims`` entry (default 0)."""
    dims = dims or [0] * len(shapes)
    fulls = []
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        gen = torch.Generator().manual_seed(i)
        fulls.append(torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype))
    per_rank = []
    for rank in range(k):
        params = []
        for full, dim in zip(fulls, dims):
            flat = full.reshape(-1) if full.ndim == 0 else full
            start, size = chunk_bounds(flat.shape[dim], k, rank)
            shard = nn.Parameter(flat.narrow(dim, start, size).clone(),
                                 requires_grad=full.dtype.is_floating_point)
            padded = -(-flat.shape[dim] // k) if flat.shape[dim] else 0
            params.append(ShardedParam([], shard, tuple(flat.shape), padded, tuple(full.shape),
                                       dim))
        per_rank.append(params)
    return fulls, per_rank


def _dims(shapes, data) -> list[int]:
    """A dim to split each parameter along (``shard_placement_fn``'s ``Shard(d)``)."""
    return [data.draw(st.integers(0, max(len(shape), 1) - 1)) for shape in shapes]


shapes_strategy = st.lists(
    st.one_of(st.just(()), st.tuples(st.integers(0, 7)),
              st.tuples(st.integers(0, 7), st.integers(1, 3))),
    min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(shapes=shapes_strategy, k=st.integers(1, 5), data=st.data())
def test_gathered_rows_unpack_to_the_full_parameters(shapes, k, data):
    dtypes = [data.draw(st.sampled_from(DTYPES)) for _ in shapes]
    fulls, per_rank = _params(shapes, dtypes, k, _dims(shapes, data))
    wanted = gather_dtypes(per_rank[0], None)
    rows = [pack_shards(params, [p.sharded for p in params], wanted) for params in per_rank]
    assert len({row.numel() for row in rows}) == 1  # c10d needs equal pieces
    stacked = torch.stack(rows)
    for rank in range(k):  # every rank unpacks the same stack to the same tensors
        out = unpack_gathered(per_rank[rank], stacked, wanted, k)
        for full, got in zip(fulls, out):
            assert got.dtype == full.dtype
            assert torch.equal(got.reshape(full.shape), full)


@settings(max_examples=30, deadline=None)
@given(shapes=shapes_strategy, k=st.integers(1, 4))
def test_gathered_in_the_compute_dtype(shapes, k):
    fulls, per_rank = _params(shapes, [torch.float32] * len(shapes), k)
    wanted = gather_dtypes(per_rank[0], torch.bfloat16)
    stacked = torch.stack([pack_shards(ps, [p.sharded for p in ps], wanted) for ps in per_rank])
    for full, got in zip(fulls, unpack_gathered(per_rank[0], stacked, wanted, k)):
        assert got.dtype == torch.bfloat16
        assert torch.equal(got.reshape(full.shape), full.to(torch.bfloat16))


@settings(max_examples=60, deadline=None)
@given(shapes=shapes_strategy, k=st.integers(1, 5), data=st.data())
def test_reduced_gradients_are_each_ranks_chunk_of_the_sum(shapes, k, data):
    """Rank r's gradients after the reduce-scatter (a sum here) are its chunk of the sum of
    every rank's full gradient; a parameter no rank has a gradient for gets ``None``, one
    that some rank has counts the others' as zeros."""
    dims = _dims(shapes, data)
    fulls, per_rank = _params(shapes, [torch.float64] * len(shapes), k, dims)
    present = [[data.draw(st.booleans()) for _ in shapes] for _ in range(k)]
    grads = [[torch.randn(full.shape, dtype=torch.float64).reshape(
                  per_rank[0][i].full_shape) if present[r][i] else None
              for i, full in enumerate(fulls)] for r in range(k)]
    packed = [pack_gradients(per_rank[r], grads[r], k, torch.float64) for r in range(k)]
    summed = sum(packed)  # what a sum reduce-scatter adds, row j going to rank j
    for rank in range(k):
        out = unpack_reduced(per_rank[rank], summed[rank], k, rank)
        for i, got in enumerate(out):
            if not any(present[r][i] for r in range(k)):
                assert got is None
                continue
            total = sum(g[i] for g in grads if g[i] is not None)
            start, size = chunk_bounds(per_rank[rank][i].full_shape[dims[i]], k, rank)
            expected = total.narrow(dims[i], start, size).reshape(
                per_rank[rank][i].sharded.shape)
            torch.testing.assert_close(got, expected)


def test_mixed_dtype_segments_start_aligned_so_each_views_as_its_own_dtype():
    # a 3-element bfloat16 shard (6 bytes) before a float64 one: the second must start on
    # an 8-byte boundary, else viewing it as float64 fails
    fulls, per_rank = _params([(3,), (2,)], [torch.bfloat16, torch.float64], 1)
    wanted = gather_dtypes(per_rank[0], None)
    row = pack_shards(per_rank[0], [p.sharded for p in per_rank[0]], wanted)
    assert row.numel() == 8 + 16
    out = unpack_gathered(per_rank[0], row.unsqueeze(0), wanted, 1)
    assert [t.dtype for t in out] == [torch.bfloat16, torch.float64]
    assert math.isclose(out[1].sum().item(), fulls[1].sum().item())


class _ZeroRankAdapter(nn.Module):
    """A low-rank adapter whose rank is 0 (a LoRA switched off by its config): its ``down``
    unit holds a (0, 6) weight, no elements at all, and ``up`` a (6, 0) weight beside a
    bias; the adapter adds only ``up``'s bias to the base layer's output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(6, 6)
        self.down = nn.Linear(6, 0, bias=False)
        self.up = nn.Linear(0, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + self.up(self.down(x)))


def _train_adapter(ranks: int) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    from devmesh import init_device_mesh
    from devmesh.parallel import fully_shard, state_dict

    model = _ZeroRankAdapter()
    if ranks > 1:
        mesh = init_device_mesh("cpu", (ranks,))
        for part in (model.down, model.up, model):
            fully_shard(part, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        for rank in ([dist.get_rank()] if ranks > 1 else range(2)):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
            (model(x).pow(2).mean() / (1 if ranks > 1 else 2)).backward()
        opt.step()
        opt.zero_grad()
    return state_dict(model, full=True) if ranks > 1 else model.state_dict()


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_a_unit_whose_parameters_hold_no_elements_trains_as_one_process(mesh_pool):
    """Before: the gather's empty rows could not be viewed as float32 ("storage_offset()
    must be divisible by 4"), so such a unit failed its first forward."""
    expected = _train_adapter(1)
    for params in mesh_pool.run(_train_adapter, 2, 2):
        assert params["down.weight"].shape == (0, 6)
        for key, value in expected.items():
            torch.testing.assert_close(params[key], value, rtol=1e-6, atol=1e-7, msg=key)


def test_mixed_precision_casts_floating_point_parameters_only():
    _, per_rank = _params([(4,), (3,), (2,)], [torch.float32, torch.int64, torch.complex64], 1)
    assert gather_dtypes(per_rank[0], torch.bfloat16) == [torch.bfloat16, torch.int64,
                                                          torch.complex64]


class _Quantized(nn.Module):
    """A frozen int64 table with values bfloat16 cannot hold, beside a trainable float."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.arange(6, dtype=torch.int64) + 2 ** 40 + 1,
                                  requires_grad=False)
        self.weight = nn.Parameter(torch.ones(6))
        self.seen: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((self.table.dtype, self.table.clone(), self.weight.dtype))
        return x * self.weight + (self.table % 7).to(x.dtype)


def _int_parameter_under_bf16() -> list:
    from devmesh import init_device_mesh
    from devmesh.parallel import MixedPrecisionPolicy, fully_shard

    model = _Quantized()
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)),
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    model(torch.ones(6)).float().sum().backward()
    return model.seen


def test_an_integer_parameter_keeps_its_dtype_under_mixed_precision(mesh_pool):
    """torch's FSDP2 casts only floating-point parameters to ``param_dtype``; devmesh cast
    every one, so an int64 table arrived as bfloat16, its values rounded (checked against
    torch's FSDP2 by hand: int8 weights arrive as int8 there)."""
    expected = _Quantized().table
    for seen in mesh_pool.run(_int_parameter_under_bf16, 2):
        (table_dtype, table, weight_dtype), = seen
        assert (table_dtype, weight_dtype) == (torch.int64, torch.bfloat16)
        assert torch.equal(table, expected)
