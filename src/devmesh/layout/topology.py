"""Hosts and links: which mesh dims stay inside a host and which cross the network.

Pure (no torch): the hosts of the ranks are an array (``host_of[rank]``), taken from torchrun's
``GROUP_RANK`` of every rank, or assumed as contiguous blocks of ``ranks_per_host``. A mesh dim
*crosses hosts* when some group along it has ranks on two hosts; a bandwidth-heavy dim (tensor
parallelism, by default the innermost dim) should not.

``hybrid_layout`` builds a mesh whose dims are products of within-host and across-host factors,
as JAX's ``create_hybrid_device_mesh`` does for TPU slices: dim ``i`` has size
``inter[i] * intra[i]``, with the across-host factor major.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from devmesh.errors import MeshShapeError, TopologyError, TopologyWarning  # noqa: F401 - re-exported
from devmesh.layout import Dims, MeshLayout

__all__ = [
    "TopologyError", "TopologyWarning", "contiguous_hosts", "crossing_dims", "hosts_of",
    "hybrid_layout", "check_heavy_dims",
]


def contiguous_hosts(world_size: int, ranks_per_host: int) -> np.ndarray:
    """``host_of[rank]`` when every host runs ``ranks_per_host`` consecutive ranks (torchrun)."""
    if ranks_per_host < 1 or world_size % ranks_per_host:
        raise MeshShapeError(
            f"{world_size} ranks do not fill hosts of {ranks_per_host} ranks each evenly"
        )
    return np.arange(world_size) // ranks_per_host


def hosts_of(layout: MeshLayout, host_of: Sequence[int] | np.ndarray) -> np.ndarray:
    """The host of every rank of the mesh, with the mesh's shape."""
    return np.asarray(host_of)[layout.ranks]


def crossing_dims(layout: MeshLayout, host_of: Sequence[int] | np.ndarray) -> list[int]:
    """Mesh dims along which some group spans more than one host."""
    hosts = hosts_of(layout, host_of)
    out = []
    for d in range(layout.ndim):
        moved = np.moveaxis(hosts, d, -1)
        if np.any(moved != moved[..., :1]):
            out.append(d)
    return out


def check_heavy_dims(
    layout: MeshLayout, host_of: Sequence[int] | np.ndarray, heavy: Dims | None = None
) -> list[str]:
    """Messages for every heavy dim (default: the innermost) that crosses hosts."""
    heavy_dims = layout.dims(heavy) if heavy is not None else (layout.ndim - 1,)
    crossing = set(crossing_dims(layout, host_of))
    hosts = int(np.max(np.asarray(host_of))) + 1
    messages = []
    for d in heavy_dims:
        if d in crossing and layout.shape[d] > 1:
            messages.append(
                f"mesh dim {layout.dim_name(d)!r} (size {layout.shape[d]}) crosses hosts: its "
                f"groups span several of the {hosts} hosts, so its traffic goes over the network. "
                "Put it innermost (last in the shape) with a size that divides the ranks per "
                "host, or use create_hybrid_mesh"
            )
    return messages


def hybrid_layout(
    intra_shape: Sequence[int], inter_shape: Sequence[int], names: Sequence[str] | None = None,
    ranks_per_host: int | None = None,
) -> MeshLayout:
    """A layout with dim ``i`` of size ``inter_shape[i] * intra_shape[i]``: the across-host
    factor major, the within-host factor minor. Hosts hold consecutive ranks."""
    intra, inter = tuple(intra_shape), tuple(inter_shape)
    if len(intra) != len(inter):
        raise MeshShapeError(
            f"intra_shape {intra} and inter_shape {inter} need the same number of dims"
        )
    per_host = math.prod(intra)
    if ranks_per_host is not None and ranks_per_host != per_host:
        raise MeshShapeError(
            f"intra_shape {intra} covers {per_host} ranks but each host runs {ranks_per_host}"
        )
    host_grid = np.arange(math.prod(inter)).reshape(inter) if inter else np.zeros(())
    device_grid = np.arange(per_host).reshape(intra)
    # ranks[a_0*intra_0 + b_0, ...] = host(a) * per_host + device(b)
    ranks = host_grid.reshape(sum(([s, 1] for s in inter), []))[...] * per_host
    ranks = ranks + device_grid.reshape(sum(([1, s] for s in intra), []))
    shape = tuple(a * b for a, b in zip(inter, intra, strict=True))
    return MeshLayout(shape, names, ranks.reshape(shape))
