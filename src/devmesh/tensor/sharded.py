"""ShardedTensor: this rank's block of a global tensor, plus the spec that says where it lies.

It mirrors DTensor's API where that makes sense (``distribute_tensor``, ``from_local``,
``to_local``, ``full_tensor``, ``redistribute``, ``placements``, ``device_mesh``) but is a plain
object holding a plain tensor: autograd flows through ``to_local``/``full_tensor``/
``redistribute`` and nothing else pretends to be a torch.Tensor. Converting to and from a torch
``DTensor`` is one call each way.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Union

import torch
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

from devmesh import _torch_compat
from devmesh.distributed import comm, consensus
from devmesh.mesh import DeviceMesh
from devmesh.layout.placement import Placement, Replicate, Shard, as_placement
from devmesh.layout.plan import plan_redistribute
from devmesh.tensor.redistribute import execute, redistribute_local
from devmesh.layout.spec import NestedShardingError, ShardingSpec, ShardingSpecError

__all__ = ["ShardedTensor", "distribute_tensor", "Layout"]

_UNSET: object = object()

Layout = Union[ShardingSpec, Sequence[Placement]]
"""A destination layout: a :class:`ShardingSpec`, or one placement per mesh dim."""


def _as_spec(layout: Layout, mesh: DeviceMesh, global_shape: Sequence[int]) -> ShardingSpec:
    if isinstance(layout, ShardingSpec):
        if layout.mesh_shape != mesh.shape:
            raise ShardingSpecError(
                f"the spec is for a mesh of shape {layout.mesh_shape}, not {mesh.shape}"
            )
        if layout.global_shape != tuple(global_shape):
            raise ShardingSpecError(
                f"the spec is for a tensor of shape {layout.global_shape}, not "
                f"{tuple(global_shape)}"
            )
        if layout.mesh_dim_names is None and mesh.mesh_dim_names:
            layout = dataclasses.replace(layout, mesh_dim_names=mesh.mesh_dim_names)
        return layout
    return ShardingSpec.from_placements(layout, mesh.shape, tuple(global_shape),
                                        mesh.mesh_dim_names)


def _member_coordinate(mesh: DeviceMesh, what: str) -> tuple[int, ...]:
    coord = mesh.get_coordinate()
    if coord is None:
        raise ShardingSpecError(
            f"{what}: rank {mesh.get_rank()} is not part of {mesh!r}, so it holds no block"
        )
    return coord


class ShardedTensor:
    """A global tensor of shape ``spec.global_shape`` of which this rank holds one block."""

    __slots__ = ("_local", "_mesh", "_spec")

    def __init__(self, local: torch.Tensor, mesh: DeviceMesh, spec: ShardingSpec) -> None:
        coord = _member_coordinate(mesh, "ShardedTensor")
        expected = spec.local_shape(coord)
        if tuple(local.shape) != expected:
            raise ShardingSpecError(
                f"local block has shape {tuple(local.shape)} but {spec} puts a block of shape "
                f"{expected} at mesh coordinate {coord}"
            )
        if any(op == "avg" for _, op in spec.partial) and not (
                local.is_floating_point() or local.is_complex()):
            raise ShardingSpecError(
                f"Partial('avg') needs a floating-point tensor, got {local.dtype}: an average "
                "of integers is not an integer. Use Partial('sum') and divide, or convert the "
                "tensor to a floating dtype"
            )
        self._local = local
        self._mesh = mesh
        self._spec = spec

    # -- construction ----------------------------------------------------------------------
    @staticmethod
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh | None = None,
        placements: Layout | None = None,
        *,
        run_check: bool = True,
        shape: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
        grad_placements: Layout | None = None,
    ) -> ShardedTensor:
        """Wrap this rank's block; torch's signature. Without ``device_mesh`` the mesh of the
        innermost ``with mesh:`` block is used; without ``placements`` the block is
        replicated. Without ``shape`` the global shape assumes even splits (``local size x
        number of pieces`` per dim), as DTensor does; pass ``shape`` when the sizes are
        uneven. ``stride`` is accepted for torch's signature: devmesh's global tensors are
        contiguous, so it must be the contiguous stride of ``shape``.

        ``grad_placements`` (as torch's): the layout the gradient leaves in on its way back
        to ``local_tensor`` (default: these placements with ``Partial`` made ``Replicate``).

        ``run_check`` (default on; torch's is off) checks, with one small collective, that
        every rank of the mesh states the same global shape, dtype and layout, and raises the
        same clear error on every rank if not (else ranks would silently disagree, or die in
        a later collective). Unlike torch's it does not broadcast replicated blocks. Turn it
        off on hot paths whose inputs are known to agree."""
        device_mesh = current_mesh(device_mesh, "ShardedTensor.from_local")
        if isinstance(local_tensor, ShardedTensor):
            raise ShardingSpecError("from_local takes this rank's block (a torch.Tensor), got "
                                    "a ShardedTensor; it is already distributed")
        if placements is None:
            placements = [Replicate()] * device_mesh.ndim
        if shape is None:
            if isinstance(placements, ShardingSpec):
                shape = placements.global_shape
            else:
                global_shape = list(local_tensor.shape)
                for m, p in enumerate(placements):
                    p = as_placement(p)
                    if isinstance(p, Shard):
                        global_shape[p.dim] *= device_mesh.shape[m]
                shape = global_shape
        if stride is not None and tuple(stride) != _contiguous_strides(shape):
            raise ShardingSpecError(
                f"stride={tuple(stride)} is not the contiguous stride "
                f"{_contiguous_strides(shape)} of shape {tuple(shape)}: devmesh's global "
                "tensors are contiguous; make the tensor contiguous before wrapping it")
        spec = _as_spec(placements, device_mesh, shape)
        if run_check:
            _check_agreement(device_mesh, spec, local_tensor.dtype, "ShardedTensor.from_local")
        if grad_placements is not None:
            grad_out = _as_spec(grad_placements, device_mesh, spec.global_shape)
            local_tensor = redistribute_local(local_tensor, device_mesh, spec, spec,
                                              grad_out_spec=grad_out)
        return ShardedTensor(local_tensor, device_mesh, spec)

    # -- the DTensor-like API --------------------------------------------------------------
    @property
    def spec(self) -> ShardingSpec:
        return self._spec

    @property
    def placements(self) -> tuple[Placement, ...]:
        """Per-mesh-dim placements (raises :class:`NestedShardingError` for nested splits)."""
        return self._spec.placements()

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._mesh

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._spec.global_shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    @property
    def ndim(self) -> int:
        return self._spec.ndim

    @property
    def dtype(self) -> torch.dtype:
        return self._local.dtype

    @property
    def device(self) -> torch.device:
        return self._local.device

    @property
    def requires_grad(self) -> bool:
        return self._local.requires_grad

    def to_local(self, *, grad_placements: Layout | None = None) -> torch.Tensor:
        """This rank's block (the tensor itself: autograd flows through it).

        ``grad_placements`` (as torch's): the layout the gradient of the block will have —
        e.g. ``[Partial()]`` when the consumer of a replicated block produces partial sums;
        it is turned into this tensor's own layout on the way back."""
        if grad_placements is None:
            return self._local
        grad = _as_spec(grad_placements, self._mesh, self._spec.global_shape)
        return redistribute_local(self._local, self._mesh, self._spec, self._spec,
                                  grad_spec=grad)

    def redistribute(self, device_mesh: DeviceMesh | Layout | None = None,
                     placements: Layout | None = None, *, async_op: bool = False,
                     forward_dtype: torch.dtype | None = None,
                     backward_dtype: torch.dtype | None = None) -> ShardedTensor:
        """The same global tensor in another layout, with the fewest collectives;
        differentiable. Torch's call shape (``redistribute(mesh, placements)``, either
        optional) and devmesh's (``redistribute(layout)``, a spec or placements) both work.
        ``async_op`` is accepted for torch's signature; the result is computed at once.

        As torch's: ``forward_dtype`` casts the block before the collectives (the result is
        in it); ``backward_dtype`` is the dtype the gradient's collectives run in (default:
        this tensor's dtype, not ``forward_dtype``), the gradient arriving back in this
        tensor's dtype."""
        if device_mesh is not None and not isinstance(device_mesh, TorchDeviceMesh):
            device_mesh, placements = None, device_mesh  # redistribute(layout)
        if device_mesh is not None and _as_devmesh(device_mesh) != self._mesh:
            raise ShardingSpecError(
                f"redistribute stays on the tensor's mesh {self._mesh!r}, got {device_mesh!r}"
            )
        if placements is None and forward_dtype is None:
            return self
        dst = (self._spec if placements is None
               else _as_spec(placements, self._mesh, self._spec.global_shape))
        local = redistribute_local(self._local, self._mesh, self._spec, dst,
                                   forward_dtype=forward_dtype, backward_dtype=backward_dtype)
        return ShardedTensor(local, self._mesh, dst)

    def full_tensor(self, *, grad_placements: Layout | None = None) -> torch.Tensor:
        """The whole global tensor on every rank (one collective for any nesting);
        differentiable. ``grad_placements`` is the layout of the gradient that will arrive
        (default replicated), as in torch."""
        full = self._spec.replicated()
        grad = (None if grad_placements is None
                else _as_spec(grad_placements, self._mesh, self._spec.global_shape))
        return redistribute_local(self._local, self._mesh, self._spec, full, grad_spec=grad)

    def explain_redistribute(self, layout: Layout) -> str:
        """The plan ``redistribute(layout)`` would run, with the bytes each step moves."""
        dst = _as_spec(layout, self._mesh, self._spec.global_shape)
        return str(plan_redistribute(self._spec, dst, self._local.element_size()))

    # -- torch DTensor interop ---------------------------------------------------------------
    def to_dtensor(self):
        """A torch ``DTensor`` on the same mesh (a devmesh mesh is a torch mesh). A nested
        split becomes torch's ``_StridedShard``, as FSDP2 over TP produces: a mesh dim that
        splits inside pieces made by later mesh dims carries the product of their sizes as
        its split factor."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor import Partial as TorchPartial
        from torch.distributed.tensor import Replicate as TorchReplicate
        from torch.distributed.tensor import Shard as TorchShard
        strided_shard = _torch_compat.strided_shard_type()

        spec = self._spec
        placements: list = [TorchReplicate()] * len(spec.mesh_shape)
        for d, dims in enumerate(spec.dim_map):
            for m, factor in _split_factors(spec.mesh_shape, dims).items():
                placements[m] = (TorchShard(d) if factor == 1
                                 else strided_shard(d, split_factor=factor))
        for m, op in spec.partial:
            placements[m] = TorchPartial(op)
        return DTensor.from_local(self._local, self._mesh, placements,
                                  shape=self.shape, stride=_contiguous_strides(self.shape),
                                  run_check=False)

    @staticmethod
    def from_dtensor(dtensor, device_mesh: DeviceMesh | None = None) -> ShardedTensor:
        """The devmesh view of a torch ``DTensor`` (its local tensor is shared, not copied).
        ``_StridedShard`` placements become the nesting they stand for; split factors that
        no nesting explains raise :class:`NestedShardingError`."""
        from torch.distributed.tensor import Partial as TorchPartial
        from torch.distributed.tensor import Shard as TorchShard
        strided_shard = _torch_compat.strided_shard_type()

        mesh = _as_devmesh(device_mesh or dtensor.device_mesh)
        shape = tuple(dtensor.shape)
        splits: dict[int, dict[int, int]] = {}
        partial = []
        for m, p in enumerate(dtensor.placements):
            if isinstance(p, strided_shard):
                splits.setdefault(p.dim % len(shape), {})[m] = p.split_factor
            elif isinstance(p, TorchShard):
                splits.setdefault(p.dim % len(shape), {})[m] = 1
            elif isinstance(p, TorchPartial):
                partial.append((m, p.reduce_op))
        dim_map: list[tuple[int, ...]] = [() for _ in shape]
        for d, factors in splits.items():
            order = next((o for o in itertools.permutations(sorted(factors))
                          if _split_factors(mesh.shape, o) == factors), None)
            if order is None:
                raise NestedShardingError(
                    f"DTensor placements {tuple(dtensor.placements)} split dim {d} with "
                    "split factors no nesting of those mesh dims produces"
                )
            dim_map[d] = order
        spec = ShardingSpec(mesh.shape, shape, tuple(dim_map), tuple(partial),
                            mesh.mesh_dim_names)
        return ShardedTensor(dtensor.to_local(), mesh, spec)

    def __repr__(self) -> str:
        return (
            f"ShardedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, layout=[{self._spec}], "
            f"mesh={self._mesh!r}, local_shape={tuple(self._local.shape)})"
        )


def _split_factors(mesh_shape: Sequence[int], order: Sequence[int]) -> dict[int, int]:
    """For mesh dims splitting one tensor dim in ``order`` (major to minor): each one's torch
    split factor, the product of the sizes of the mesh dims before it in the order that come
    after it in mesh order (1: a plain ``Shard``)."""
    return {m: math.prod(mesh_shape[o] for o in order[:i] if o > m)
            for i, m in enumerate(order)}


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Layout | None = None,
    *,
    src_rank: int | None = 0,
    src_data_rank: int | None = _UNSET,  # type: ignore[assignment]
    check: bool = True,
) -> ShardedTensor:
    """Split a full tensor over the mesh.

    Every rank passes a tensor of the global shape. With ``src_rank`` (torch's name,
    ``src_data_rank``, works too: an index into the mesh's ranks in row-major order; default
    0) the values of that rank are broadcast first, as DTensor does; with ``None`` each rank
    keeps its own values (no communication). The result is a leaf: it requires grad if
    ``tensor`` did. ``check`` first confirms, with one small collective, that every rank
    passed the same shape and dtype (a clear error on every rank instead of a crash in
    the broadcast).
    """
    if src_data_rank is not _UNSET:
        src_rank = src_data_rank
    device_mesh = current_mesh(device_mesh, "distribute_tensor")
    placements = placements if placements is not None else [Replicate()] * device_mesh.ndim
    spec = _as_spec(placements, device_mesh, tuple(tensor.shape))
    _member_coordinate(device_mesh, "distribute_tensor")
    if check and src_rank is not None:
        _check_agreement(device_mesh, spec, tensor.dtype, "distribute_tensor")
    full = tensor.detach()
    if src_rank is not None:
        if not 0 <= src_rank < device_mesh.size():
            raise ShardingSpecError(
                f"src_rank={src_rank} is not an index into the mesh's {device_mesh.size()} ranks"
            )
        full = full.clone().contiguous()
        comm.broadcast(full, device_mesh, tuple(range(device_mesh.ndim)), src_rank)
    local = execute(full, device_mesh, plan_redistribute(spec.replicated(), spec,
                                                         full.element_size()))
    if local is full or local.data_ptr() == tensor.data_ptr():
        local = local.clone()
    local.requires_grad_(tensor.requires_grad)
    return ShardedTensor(local, device_mesh, spec)


def _check_agreement(mesh: DeviceMesh, spec: ShardingSpec, dtype: torch.dtype,
                     what: str) -> None:
    consensus.agree(mesh, tuple(range(mesh.ndim)), what,
               f"global shape {spec.global_shape}, {dtype}, layout [{spec}]")


def current_mesh(device_mesh: object | None, what: str) -> DeviceMesh:
    """``device_mesh``, or — when it is ``None`` — the mesh of the innermost ``with mesh:``
    block, as torch's DTensor APIs take it (a devmesh mesh is a torch mesh, so torch's mesh
    context is the one used, and torch's and devmesh's calls see the same mesh)."""
    if device_mesh is not None:
        return _as_devmesh(device_mesh)
    mesh = _torch_compat.innermost_torch_mesh()
    if mesh is None:
        raise ShardingSpecError(
            f"{what} needs a mesh: pass device_mesh=..., or call it inside `with mesh:`")
    return _as_devmesh(mesh)


def _as_devmesh(mesh: object) -> DeviceMesh:
    """devmesh's view of ``mesh`` (a torch-built DeviceMesh is adopted, same groups)."""
    if isinstance(mesh, DeviceMesh):
        return mesh
    if isinstance(mesh, TorchDeviceMesh):
        return DeviceMesh.from_torch(mesh)
    raise ShardingSpecError(f"expected a DeviceMesh, got {type(mesh).__name__}")
