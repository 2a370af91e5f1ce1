"""``create_hybrid_mesh``: dims that are products of within-host and across-host factors, as
JAX's ``create_hybrid_device_mesh``, so bandwidth-heavy dims stay inside a host."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch.distributed as dist

from devmesh.distributed import env, groups
from devmesh.errors import WorldSizeMismatchError
from devmesh.layout import _check_shape
from devmesh.layout.topology import hybrid_layout
from devmesh.mesh import DeviceMesh, _check_device_type

if TYPE_CHECKING:
    import datetime

__all__ = ["create_hybrid_mesh"]


def create_hybrid_mesh(
    intra_shape: Sequence[int],
    inter_shape: Sequence[int],
    mesh_dim_names: Sequence[str] | None = None,
    *,
    device_type: str = "cpu",
    timeout: float | datetime.timedelta | None = None,
) -> DeviceMesh:
    """A mesh whose dim ``i`` has size ``inter_shape[i] * intra_shape[i]``: ``intra_shape``
    over the ranks of one host, ``inter_shape`` over the hosts (as JAX's
    ``create_hybrid_device_mesh``). E.g. 2 hosts x 4 GPUs: ``create_hybrid_mesh((1, 4), (2, 1),
    ("dp", "tp"))`` puts tp inside each host and dp across hosts."""
    _check_device_type(device_type)
    intra, inter = _check_shape(intra_shape), _check_shape(inter_shape)
    size = math.prod(intra) * math.prod(inter)
    env.ensure_default_group(device_type, expected_world_size=size,
                             timeout=groups.as_timedelta(timeout))
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    if size != dist.get_world_size():
        raise WorldSizeMismatchError(
            f"create_hybrid_mesh({intra}, {inter}) covers {size} ranks but the world has "
            f"{dist.get_world_size()}"
        )
    layout = hybrid_layout(intra, inter, mesh_dim_names, ranks_per_host=per_host)
    return DeviceMesh(device_type, layout.ranks, mesh_dim_names=mesh_dim_names, timeout=timeout)
