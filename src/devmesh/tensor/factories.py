"""torch's DTensor factories — ``zeros``, ``ones``, ``empty``, ``full``, ``rand``, ``randn`` —
making a :class:`ShardedTensor` directly from its global size, mesh and placements.

The constant ones allocate only this rank's block. The random ones draw the *whole* tensor
from the global RNG on every rank and keep this rank's block, so the global tensor is exactly
``torch.rand(size)`` in one process with the same seed, whatever the mesh (torch's DTensor
draws each block from an offset of a shared seed instead, which depends on the layout); that
costs the full tensor's memory for a moment, and the ranks' RNG states must agree, which is
checked (one small collective) so that ranks seeded differently get an error, not blocks of
different tensors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch

from devmesh.distributed import comm, consensus
from devmesh.layout.placement import Replicate
from devmesh.layout.spec import ShardingSpecError
from devmesh.mesh import DeviceMesh
from devmesh.tensor.sharded import (
    Layout,
    ShardedTensor,
    _as_spec,
    _member_coordinate,
    current_mesh,
)

__all__ = ["zeros", "ones", "empty", "full", "rand", "randn"]


def _size(size: tuple) -> tuple[int, ...]:
    """``zeros(2, 3)`` and ``zeros((2, 3))`` alike, as torch's factories."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in size):
        raise ShardingSpecError(f"a size is non-negative integers, got {size!r}")
    return tuple(size)


def _make(size: tuple, fill: Callable[[tuple[int, ...], torch.dtype], torch.Tensor], *,
          requires_grad: bool, dtype: torch.dtype | None, layout: torch.layout,
          device_mesh: DeviceMesh | None, placements: Layout | None, what: str,
          random: bool = False) -> ShardedTensor:
    if layout != torch.strided:
        raise ShardingSpecError(f"{what} makes strided tensors only, got layout={layout}")
    mesh = current_mesh(device_mesh, what)
    placements = placements if placements is not None else [Replicate()] * mesh.ndim
    global_shape = _size(size)
    spec = _as_spec(placements, mesh, global_shape)
    if any(spec.partial_op(m) is not None for m in range(mesh.ndim)):
        raise ShardingSpecError(f"{what} with a Partial placement is ambiguous (which rank "
                                "holds the values?); make it Replicate and redistribute")
    coordinate = _member_coordinate(mesh, what)
    dtype = dtype or torch.get_default_dtype()
    device = comm.mesh_device(mesh)
    if random:
        _check_rng_agrees(mesh, what)
        whole = fill(global_shape, dtype).to(device)
        index = tuple(slice(start, start + size) for start, size in spec.local_bounds(coordinate))
        local = whole[index].clone()
    else:
        local = fill(spec.local_shape(coordinate), dtype).to(device)
    local.requires_grad_(requires_grad)
    return ShardedTensor(local, mesh, spec)


def _check_rng_agrees(mesh: DeviceMesh, what: str) -> None:
    state = hashlib.blake2b(torch.get_rng_state().numpy().tobytes(), digest_size=8).hexdigest()
    consensus.agree(mesh, tuple(range(mesh.ndim)),
               f"{what}: every rank must have the same random state (call torch.manual_seed "
               "with the same seed on every rank first)", f"torch RNG state {state}")


def _factory(name: str, make: Callable[..., torch.Tensor], doc: str, random: bool = False):
    """One of torch's ``*size`` factories (their signature), over :func:`_make`."""

    def factory(*size, requires_grad: bool = False, dtype: torch.dtype | None = None,
                layout: torch.layout = torch.strided, device_mesh: DeviceMesh | None = None,
                placements: Sequence | None = None) -> ShardedTensor:
        return _make(size, lambda shape, d: make(shape, dtype=d), requires_grad=requires_grad,
                     dtype=dtype, layout=layout, device_mesh=device_mesh,
                     placements=placements, what=name, random=random)

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = doc
    return factory


zeros = _factory("zeros", torch.zeros, "A sharded tensor of zeros of global ``size``.")
ones = _factory("ones", torch.ones, "A sharded tensor of ones of global ``size``.")
empty = _factory("empty", torch.empty,
                 "A sharded tensor of global ``size`` whose values are not initialized.")
rand = _factory("rand", torch.rand, "Uniform [0, 1) values: globally ``torch.rand(size)`` of "
                "one process (see the module's doc).", random=True)
randn = _factory("randn", torch.randn, "Standard normal values: globally "
                 "``torch.randn(size)`` of one process (see the module's doc).", random=True)


def full(size: Sequence[int], fill_value: float, *, requires_grad: bool = False,
         dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
         device_mesh: DeviceMesh | None = None,
         placements: Sequence | None = None) -> ShardedTensor:
    """A sharded tensor of global ``size`` filled with ``fill_value``."""
    return _make((size,), lambda s, d: torch.full(s, fill_value, dtype=d),
                 requires_grad=requires_grad, dtype=dtype, layout=layout,
                 device_mesh=device_mesh, placements=placements, what="full")
