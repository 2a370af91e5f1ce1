"""Parameters of different dtypes in one ``fully_shard`` unit — a float64 scale beside
float32 weights, wider norms in a bfloat16 model — keep their own dtypes through the unit's
one all-gather and reduce-scatter, and train as single-process training. (torch's FSDP2
refuses them: "FSDP expects uniform original parameter dtype"; before this, devmesh
gathered every parameter in the first one's dtype.) ``replicate`` gets the same model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from devmesh import init_device_mesh
from devmesh.parallel import MixedPrecisionPolicy, fully_shard, replicate, state_dict

STEPS = 3


class Mixed(nn.Module):
    """Checks, in forward, that each parameter arrives in ``dtypes[name]``."""

    def __init__(self, low: torch.dtype = torch.float32, high: torch.dtype = torch.float64):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(5, 6).to(low)
        self.scale = nn.Parameter(torch.randn(6, 6, dtype=high))
        self.norm = nn.LayerNorm(6).to(high)
        self.head = nn.Linear(6, 3, bias=False).to(low)
        self.expected: dict[str, torch.dtype] = {}
        # a hook, not forward: with norm its own unit, its parameters are gathered just
        # before its forward (devmesh's hooks come first)
        self.norm.register_forward_pre_hook(lambda norm, args: self._check(norm, "norm."))

    def _check(self, module: nn.Module, prefix: str = "") -> None:
        for name, param in module.named_parameters():
            want = self.expected.get(prefix + name)
            if want is not None and param.dtype != want:
                raise AssertionError(f"{prefix}{name} arrived as {param.dtype}, not {want}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for child in (self.proj, self.head):
            self._check(child, "proj." if child is self.proj else "head.")
        if self.scale.dtype != self.expected.get("scale", self.scale.dtype):
            raise AssertionError(f"scale arrived as {self.scale.dtype}")
        h = self.proj(x.to(self.proj.weight.dtype))
        h = self.norm(h.to(self.scale.dtype) @ self.scale)
        return self.head(torch.tanh(h).to(self.head.weight.dtype))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + rank))


def _loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    return model(_batch(step, rank)).float().pow(2).mean()


def train(strategy: str, low: torch.dtype, param_dtype: torch.dtype | None = None):
    import torch.distributed as dist

    model = Mixed(low)
    model.expected = {n: param_dtype or p.dtype for n, p in model.named_parameters()}
    if strategy == "replicate":
        replicate(model, mesh=init_device_mesh("cpu", (4,)))
    else:
        mesh = (init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "shard"))
                if strategy == "hsdp" else init_device_mesh("cpu", (4,)))
        policy = MixedPrecisionPolicy(param_dtype=param_dtype)
        fully_shard(model.norm, mesh=mesh, mp_policy=policy)  # a unit of float64 only
        fully_shard(model, mesh=mesh, mp_policy=policy)  # float32 (or bf16) and float64
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        loss = _loss(model, step, dist.get_rank())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    return dtypes, state_dict(model, full=True)


def reference(low: torch.dtype):
    model = Mixed(low)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        (sum(_loss(model, step, r) for r in range(4)) / 4).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("strategy", ["fsdp", "hsdp", "replicate"])
def test_float32_and_float64_parameters_in_one_unit(mesh_pool, strategy):
    expected = reference(torch.float32)
    for dtypes, params in mesh_pool.run(train, 4, strategy, torch.float32):
        assert dtypes == {"proj.weight": torch.float32, "proj.bias": torch.float32,
                          "scale": torch.float64, "norm.weight": torch.float64,
                          "norm.bias": torch.float64, "head.weight": torch.float32}
        for key, value in expected.items():
            assert params[key].dtype == value.dtype, key
            torch.testing.assert_close(params[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_bfloat16_weights_with_float64_norms(mesh_pool):
    """The mixed-precision layout users keep (low-precision weights, wide norms): each
    arrives in its dtype and training follows single-process training to bf16's precision."""
    expected = reference(torch.bfloat16)
    for dtypes, params in mesh_pool.run(train, 4, "fsdp", torch.bfloat16):
        assert dtypes["proj.weight"] == torch.bfloat16 and dtypes["scale"] == torch.float64
        for key, value in expected.items():
            assert params[key].dtype == value.dtype, key
            torch.testing.assert_close(params[key].float(), value.float(), rtol=2e-2,
                                       atol=1e-2, msg=key)


def test_param_dtype_casts_every_parameter_as_torch(mesh_pool):
    """``MixedPrecisionPolicy(param_dtype=...)`` gathers every parameter in that dtype (the
    forward checks it); the sharded parameters keep their own dtypes."""
    for dtypes, _ in mesh_pool.run(train, 4, "fsdp", torch.float32, torch.float32):
        assert dtypes["scale"] == torch.float64 and dtypes["proj.weight"] == torch.float32



def unused_here():
    """``wide`` (float64) is used on every rank, ``narrow`` (float32, in the same bucket) on
    rank 0 only: the other ranks must get its averaged gradient in its own dtype (the bucket
    is float64)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = nn.Module()
    model.wide = nn.Parameter(torch.randn(4, dtype=torch.float64))
    model.narrow = nn.Parameter(torch.randn(4))
    replicate(model, mesh=init_device_mesh("cpu", (4,)))
    loss = model.wide.sum() * (dist.get_rank() + 1)
    if dist.get_rank() == 0:
        loss = loss + (model.narrow * 4).sum()
    loss.backward()
    return {n: (p.grad.dtype, p.grad.tolist()) for n, p in model.named_parameters()}


def test_a_parameter_unused_on_some_ranks_gets_a_gradient_of_its_own_dtype(mesh_pool):
    """Before: ranks 1-3 assigned a float64 gradient to a float32 parameter and raised —
    while rank 0 went on (a hang under a launcher)."""
    for rank, grads in enumerate(mesh_pool.run(unused_here, 4)):
        assert grads["wide"] == (torch.float64, [2.5] * 4)  # mean of 1, 2, 3, 4
        assert grads["narrow"] == (torch.float32, [1.0] * 4), rank  # 4 on rank 0, averaged


def replicas_of_every_dtype():
    """Each rank builds its model from its own seed: ``replicate`` must make every replica
    rank 0's, bit for bit, for every dtype a model holds."""
    import torch.distributed as dist

    mesh = init_device_mesh("cpu", (2,))
    gen = torch.Generator().manual_seed(dist.get_rank())
    model = nn.Module()
    model.half_weight = nn.Parameter(torch.randn(3, 5, generator=gen).half())  # 30 bytes
    model.scale = nn.Parameter(torch.randn((), generator=gen, dtype=torch.float64))
    model.rotation = nn.Parameter(torch.randn(3, generator=gen, dtype=torch.complex64))
    model.register_buffer("mask", torch.rand(5, generator=gen) > 0.5)
    model.register_buffer("cached", torch.randn(4, generator=gen).to(torch.float8_e4m3fn))
    model.register_buffer("count", torch.tensor(dist.get_rank() + 7))
    replicate(model, mesh=mesh)
    return {k: v.view(torch.uint8) if v.dtype.itemsize == 1 else v.clone()
            for k, v in model.state_dict().items()}


def test_replicate_gives_every_replica_rank_0s_values_in_every_dtype(mesh_pool):
    """One broadcast of bytes: float8 and bool buffers arrive too (gloo cannot broadcast
    float8 as such; devmesh raised "Invalid scalar type" there, as torch's DDP does), an
    odd-sized float16 weight before a float64 one included."""
    first, second = mesh_pool.run(replicas_of_every_dtype, 2)
    assert first.keys() == second.keys() and int(first["count"]) == 7
    for key in first:
        assert torch.equal(first[key], second[key]), key


def float8_moved_every_way():
    from devmesh.distributed import comm
    from devmesh.layout.placement import Replicate, Shard
    from devmesh.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    full = torch.randn(5, 3, generator=torch.Generator().manual_seed(0)).to(torch.float8_e4m3fn)
    seen = []
    for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
        sharded = distribute_tensor(full, mesh, placements)  # scatter or broadcast
        seen.append(sharded.full_tensor())  # all-gather
        seen.append(sharded.redistribute(mesh, [Shard(1 - getattr(placements[0], "dim", 1))])
                    .full_tensor())  # all-to-all between the two shardings
    me = mesh.get_coordinate()[0]
    message = full if me == 0 else torch.empty_like(full)
    for pending in comm.batch_p2p([("send" if me == 0 else "recv", message, 1 - me)], mesh, 0):
        pending.wait()
    seen.append(message)
    return [t.view(torch.uint8) for t in seen], full.view(torch.uint8)


def test_float8_tensors_move_through_every_data_collective(mesh_pool):
    """Collectives that only move data carry float8 as bytes (gloo has no float8 type:
    "Invalid scalar type" before, from ``distribute_tensor`` on)."""
    for seen, full in mesh_pool.run(float8_moved_every_way, 2):
        assert len(seen) == 7
        for tensor in seen:
            assert torch.equal(tensor, full)


class _Rotation(nn.Module):
    """A real weight beside a complex one (a rotary or spectral layer's parameters)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.weight = nn.Parameter(torch.randn(4, 3, generator=gen))
        self.rotation = nn.Parameter(torch.randn(3, generator=gen, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x @ self.weight).to(torch.complex64) * self.rotation).abs()


def _rotation_batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * step + rank))


def train_rotation(strategy: str):
    import warnings

    import torch.distributed as dist

    mesh = init_device_mesh("cpu", (2,))
    model = _Rotation()
    if strategy == "replicate":
        replicate(model, mesh=mesh)
    else:  # "fsdp-bf16": bfloat16 compute for the real weight, which torch's rule gives
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if "bf16" in strategy else None
        fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught_warnings:
        warnings.simplefilter("always")
        for step in range(2):
            model(_rotation_batch(step, dist.get_rank())).sum().backward()
            opt.step()
            opt.zero_grad()
    return state_dict(model, full=True), [str(w.message) for w in caught_warnings]


@pytest.mark.parametrize("strategy", ["fsdp", "replicate", "fsdp-bf16"])
def test_a_complex_parameter_beside_real_ones_trains_as_one_process(mesh_pool, strategy):
    """The unit (or bucket) reduces in complex64; each real gradient takes the real part.
    Before: ``fully_shard`` raised "'>' not supported between 'complex' and 'int'" on its
    used-flags, ``replicate`` warned "Casting complex values to real discards the imaginary
    part" every step; under ``param_dtype=bfloat16`` (which torch's rule leaves off
    complex parameters) the unit reduced in bfloat16 and dropped the imaginary part."""
    model = _Rotation()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        for rank in range(2):
            (model(_rotation_batch(step, rank)).sum() / 2).backward()
        opt.step()
        opt.zero_grad()
    tolerance = dict(rtol=2e-2, atol=2e-2) if "bf16" in strategy else dict(rtol=1e-5, atol=1e-6)
    for params, warned in mesh_pool.run(train_rotation, 2, strategy):
        assert warned == []
        for key, value in model.state_dict().items():
            assert params[key].dtype == value.dtype, key
            torch.testing.assert_close(params[key], value, **tolerance, msg=key)
