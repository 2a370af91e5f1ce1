"""Random redistributions compared with torch's DTensor on the same mesh: the test's author
did not choose the cases. Each case draws a tensor shape (uneven and empty dims included), a
source and a target placement per mesh dim (``Shard(d)``, ``Replicate()``, ``Partial`` sum
or avg on the source; a target keeps a source's ``Partial`` or resolves it, as torch allows),
and checks that devmesh's ``redistribute`` gives torch's local block on every rank, the same
full tensor, and the same gradient for a random upstream gradient."""

from __future__ import annotations

import logging
import math
import random
import warnings

import pytest
import torch

from devmesh import init_device_mesh


def _placements(rng: random.Random, ndim: int, mesh_ndim: int, source=None) -> list:
    from torch.distributed.tensor import Partial, Replicate, Shard

    out = []
    for i in range(mesh_ndim):
        draw = rng.random()
        if draw < 0.45:
            out.append(Shard(rng.randrange(ndim)))
        elif source is None and draw > 0.8:
            out.append(Partial(rng.choice(["sum", "avg"])))
        elif source is not None and draw > 0.85 and source[i].is_partial():
            out.append(source[i])  # torch refuses to make a partial: keep the source's
        else:
            out.append(Replicate())
    return out


def _shape(rng: random.Random) -> list[int]:
    """1 to 3 dims, small ones (uneven and empty blocks) and large ones (where the planner
    gathers rather than sending each peer its part: latency no longer dominates), at most
    2**17 elements."""
    while True:
        shape = [rng.choice([0, 1, 2, 3, 5, 8, 63, 256, 1031])
                 for _ in range(rng.choice([1, 2, 3]))]
        if math.prod(shape) <= 1 << 17:
            return shape


def compare(seed: int, cases: int, mesh_shape: tuple[int, ...]) -> list:
    """The cases (of ``cases`` drawn with ``seed``) where devmesh and torch differ on this
    rank."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    from devmesh.tensor import ShardedTensor

    logging.disable(logging.WARNING)  # torch's advice to flatten sequential all-gathers
    warnings.filterwarnings("ignore")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("a", "b", "c")[:len(mesh_shape)])
    coord = mesh.get_coordinate()
    rng = random.Random(seed)
    differ = []
    for case in range(cases):
        shape = _shape(rng)
        src = _placements(rng, len(shape), len(mesh_shape))
        dst = _placements(rng, len(shape), len(mesh_shape), source=src)
        gen = torch.Generator().manual_seed(seed * 1000 + case)
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        # this rank's block of x in src: a sum-partial holds the value on coordinate 0 only
        local = distribute_tensor(x, mesh, [Replicate() if p.is_partial() else p
                                            for p in src]).to_local().clone()
        if any(p.is_partial() and p.reduce_op == "sum" and coord[i] for i, p in enumerate(src)):
            local.zero_()
        theirs = DTensor.from_local(local, mesh, src, shape=x.shape, stride=x.stride(),
                                    run_check=False).detach().requires_grad_(True)
        ours_leaf = local.clone().requires_grad_(True)
        ours = ShardedTensor.from_local(ours_leaf, mesh, src, shape=tuple(shape),
                                        run_check=False)
        their_out, our_out = theirs.redistribute(mesh, dst), ours.redistribute(mesh, dst)
        upstream = torch.randn(their_out.to_local().shape, generator=gen, dtype=torch.float64)
        their_out.to_local().backward(upstream)
        our_out.to_local().backward(upstream)
        their_grad = theirs.grad.to_local() if isinstance(theirs.grad, DTensor) else theirs.grad
        same = (our_out.to_local().shape == their_out.to_local().shape
                and torch.allclose(our_out.to_local(), their_out.to_local(), atol=1e-12)
                and torch.allclose(our_out.full_tensor(), their_out.full_tensor(), atol=1e-12)
                and (their_grad is None) == (ours_leaf.grad is None)
                and (their_grad is None or torch.allclose(ours_leaf.grad, their_grad,
                                                          atol=1e-12)))
        if not same:
            differ.append((shape, [str(p) for p in src], [str(p) for p in dst]))
    return differ


@pytest.mark.parametrize("mesh_shape, world", [((2, 2), 4), ((2, 4), 8), ((2, 2, 2), 8)])
def test_random_redistributions_equal_torchs_dtensor(mesh_pool, mesh_shape, world):
    for differ in mesh_pool.run(compare, world, 13, 40, mesh_shape):
        assert differ == []
