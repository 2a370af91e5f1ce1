"""Where a parameter's shard lies: a ShardingSpec attached to a plain ``nn.Parameter``.

Parallelized modules keep ordinary ``nn.Parameter``s holding this rank's block, so
``torch.optim`` works on them unchanged. The mesh and spec ride along as an attribute; helpers
that need the global picture (state dicts, gradient clipping, ``describe``) read it. When TP and
FSDP compose, the spec lives on one mesh that spans both (a slice of their common root), and
the weight's dim 0 is split by ``("tp", "dp")`` — TP's pieces, each split by FSDP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from devmesh.errors import ParallelizeError  # noqa: F401 - re-exported
from devmesh.mesh import DeviceMesh
from devmesh.tensor import ShardedTensor, ShardingSpec

__all__ = ["ParamLayout", "get_layout", "set_layout", "as_sharded", "combined_mesh",
           "mark_partial_grad", "partial_grad_mesh"]

_ATTR = "_devmesh_layout"


@dataclass(frozen=True)
class ParamLayout:
    mesh: DeviceMesh
    spec: ShardingSpec


def get_layout(param: torch.Tensor) -> ParamLayout | None:
    return getattr(param, _ATTR, None)


def set_layout(param: torch.Tensor, mesh: DeviceMesh, spec: ShardingSpec) -> None:
    setattr(param, _ATTR, ParamLayout(mesh, spec))


_PARTIAL_GRAD = "_devmesh_partial_grad_mesh"


def mark_partial_grad(param: torch.Tensor, mesh: DeviceMesh) -> None:
    """Record that ``param``'s gradient is a partial sum over (1-D) ``mesh``."""
    setattr(param, _PARTIAL_GRAD, mesh)


def partial_grad_mesh(param: torch.Tensor) -> DeviceMesh | None:
    return getattr(param, _PARTIAL_GRAD, None)


def as_sharded(param: torch.Tensor) -> ShardedTensor | None:
    """The parameter (or its gradient's owner) as a ShardedTensor, if it is laid out on a mesh."""
    layout = get_layout(param)
    if layout is None:
        return None
    return ShardedTensor(param.detach(), layout.mesh, layout.spec)


def combined_mesh(a: DeviceMesh, b: DeviceMesh) -> DeviceMesh:
    """The slice of the common root spanning the dims of ``a`` and of ``b`` (in root order)."""
    if a._root is not b._root:
        raise ParallelizeError(
            f"cannot compose parallelisms on {a!r} and {b!r}: they must be slices of the same "
            "mesh, e.g. mesh['tp'] and mesh['dp'] of init_device_mesh(..., ('dp', 'tp'))"
        )
    root = a._root
    names = root.mesh_dim_names
    if names is None:
        raise ParallelizeError("composing parallelisms needs a mesh with mesh_dim_names")
    used = {d for m in (a, b) for roots in m._dim_roots for d in roots}
    wanted = tuple(names[d] for d in sorted(used))
    return root if wanted == names else root[wanted]
