"""ShardedTensor: this rank's block of a global tensor, plus the spec that says where it lies.

It mirrors DTensor's API where that makes sense (``distribute_tensor``, ``from_local``,
``to_local``, ``full_tensor``, ``redistribute``, ``placements``, ``device_mesh``) but is a plain
object holding a plain tensor: autograd flows through ``to_local``/``full_tensor``/
``redistribute`` and nothing else pretends to be a torch.Tensor. Converting to and from a torch
``DTensor`` is one call each way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import torch

from devmesh import comm
from devmesh.mesh import DeviceMesh
from devmesh.tensor.placement import Placement, Replicate, Shard
from devmesh.tensor.plan import plan_redistribute
from devmesh.tensor.redistribute import execute, redistribute_local
from devmesh.tensor.spec import NestedShardingError, ShardingSpec, ShardingSpecError

__all__ = ["ShardedTensor", "distribute_tensor", "Layout"]

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
            layout = layout.replace(mesh_dim_names=mesh.mesh_dim_names)
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
        self._local = local
        self._mesh = mesh
        self._spec = spec

    # -- construction ----------------------------------------------------------------------
    @staticmethod
    def from_local(
        local: torch.Tensor,
        device_mesh: DeviceMesh,
        placements: Layout,
        *,
        shape: Sequence[int] | None = None,
    ) -> ShardedTensor:
        """Wrap this rank's block. Without ``shape`` the global shape assumes even splits
        (``local size x number of pieces`` per dim), as DTensor does; pass ``shape`` when the
        sizes are uneven."""
        if shape is None:
            if isinstance(placements, ShardingSpec):
                shape = placements.global_shape
            else:
                global_shape = list(local.shape)
                for m, p in enumerate(placements):
                    if isinstance(p, Shard):
                        global_shape[p.dim] *= device_mesh.shape[m]
                shape = global_shape
        spec = _as_spec(placements, device_mesh, shape)
        return ShardedTensor(local, device_mesh, spec)

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

    def to_local(self) -> torch.Tensor:
        """This rank's block (the tensor itself: autograd flows through it)."""
        return self._local

    def redistribute(self, layout: Layout) -> ShardedTensor:
        """The same global tensor in another layout, with the fewest collectives;
        differentiable."""
        dst = _as_spec(layout, self._mesh, self._spec.global_shape)
        local = redistribute_local(self._local, self._mesh, self._spec, dst)
        return ShardedTensor(local, self._mesh, dst)

    def full_tensor(self) -> torch.Tensor:
        """The whole global tensor on every rank (one collective for any nesting);
        differentiable."""
        return redistribute_local(self._local, self._mesh, self._spec, self._spec.replicated())

    def explain_redistribute(self, layout: Layout) -> str:
        """The plan ``redistribute(layout)`` would run, with the bytes each step moves."""
        dst = _as_spec(layout, self._mesh, self._spec.global_shape)
        return str(plan_redistribute(self._spec, dst, self._local.element_size()))

    # -- torch DTensor interop ---------------------------------------------------------------
    def to_dtensor(self):
        """A torch ``DTensor`` over ``device_mesh.to_torch()``. A nested split of two mesh
        dims becomes torch's ``_StridedShard`` (as FSDP2 over TP produces)."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor import Partial as TorchPartial
        from torch.distributed.tensor import Replicate as TorchReplicate
        from torch.distributed.tensor import Shard as TorchShard
        from torch.distributed.tensor.placement_types import _StridedShard

        spec = self._spec
        placements: list = [TorchReplicate()] * len(spec.mesh_shape)
        for d, dims in enumerate(spec.dim_map):
            if list(dims) == sorted(dims):
                for m in dims:
                    placements[m] = TorchShard(d)
            elif len(dims) == 2:  # (later mesh dim, earlier mesh dim): FSDP over TP
                inner_first, outer = dims
                placements[inner_first] = TorchShard(d)
                placements[outer] = _StridedShard(d, split_factor=spec.mesh_shape[inner_first])
            else:
                raise NestedShardingError(
                    f"torch's DTensor cannot express dim {d} split by "
                    f"{tuple(spec.name(m) for m in dims)}"
                )
        for m, op in spec.partial:
            placements[m] = TorchPartial(op)
        return DTensor.from_local(self._local, self._mesh.to_torch(), placements,
                                  shape=self.shape, stride=_contiguous_strides(self.shape),
                                  run_check=False)

    @staticmethod
    def from_dtensor(dtensor, device_mesh: DeviceMesh | None = None) -> ShardedTensor:
        """The devmesh view of a torch ``DTensor`` (its local tensor is shared, not copied)."""
        from torch.distributed.tensor import Partial as TorchPartial
        from torch.distributed.tensor import Shard as TorchShard
        from torch.distributed.tensor.placement_types import _StridedShard

        mesh = device_mesh or DeviceMesh.from_torch(dtensor.device_mesh)
        shape = tuple(dtensor.shape)
        dim_map: list[list[int]] = [[] for _ in shape]
        strided: dict[int, int] = {}
        partial = []
        for m, p in enumerate(dtensor.placements):
            if isinstance(p, _StridedShard):
                strided[p.dim] = m
            elif isinstance(p, TorchShard):
                dim_map[p.dim].append(m)
            elif isinstance(p, TorchPartial):
                partial.append((m, p.reduce_op))
        for d, m in strided.items():  # strided mesh dim m splits within the later ones
            dim_map[d] = dim_map[d] + [m]
        spec = ShardingSpec(mesh.shape, shape, tuple(map(tuple, dim_map)), tuple(partial),
                            mesh.mesh_dim_names)
        return ShardedTensor(dtensor.to_local(), mesh, spec)

    def __repr__(self) -> str:
        return (
            f"ShardedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, layout=[{self._spec}], "
            f"mesh={self._mesh!r}, local_shape={tuple(self._local.shape)})"
        )


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Layout | None = None,
    *,
    src_rank: int | None = 0,
) -> ShardedTensor:
    """Split a full tensor over the mesh.

    Every rank passes a tensor of the global shape. With ``src_rank`` (an index into the mesh's
    ranks in row-major order; default 0) the values of that rank are broadcast first, as
    DTensor does; with ``src_rank=None`` each rank keeps its own values (no communication).
    The result is a leaf: it requires grad if ``tensor`` did.
    """
    placements = placements if placements is not None else [Replicate()] * device_mesh.ndim
    spec = _as_spec(placements, device_mesh, tuple(tensor.shape))
    _member_coordinate(device_mesh, "distribute_tensor")
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
