"""devmesh: N-dimensional device meshes and the parallelisms composed on them.

A drop-in for ``torch.distributed.device_mesh``::

    from devmesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    tp_group = mesh["tp"].get_group()

Names are imported lazily so that ``import devmesh`` (and the ``devmesh show`` CLI, which
only needs the pure :mod:`devmesh.layout`) does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "MeshLayout": "devmesh.layout",
    "DeviceMesh": "devmesh.mesh",
    "init_device_mesh": "devmesh.mesh",
    "create_hybrid_mesh": "devmesh.hybrid",
    "launch": "devmesh.launching.launcher",
    "WorkerPool": "devmesh.launching.launcher",
    "DevmeshError": "devmesh.errors",
    "Shard": "devmesh.tensor",
    "Replicate": "devmesh.tensor",
    "Partial": "devmesh.tensor",
    "ShardingSpec": "devmesh.tensor",
    "ShardedTensor": "devmesh.tensor",
    "distribute_tensor": "devmesh.tensor",
    "explain_redistribute": "devmesh.tensor",
    "comm_stats": "devmesh.distributed.comm",
    "visualize_sharding": "devmesh.pictures.sharding",
}

__all__ = [
    "DeviceMesh",
    "DevmeshError",
    "MeshLayout",
    "Partial",
    "Replicate",
    "Shard",
    "ShardedTensor",
    "ShardingSpec",
    "WorkerPool",
    "comm_stats",
    "create_hybrid_mesh",
    "distribute_tensor",
    "explain_redistribute",
    "init_device_mesh",
    "launch",
    "visualize_sharding",
]

if TYPE_CHECKING:
    from devmesh.distributed.comm import comm_stats
    from devmesh.errors import DevmeshError
    from devmesh.launching.launcher import WorkerPool, launch
    from devmesh.layout import MeshLayout
    from devmesh.hybrid import create_hybrid_mesh
    from devmesh.mesh import DeviceMesh, init_device_mesh
    from devmesh.tensor import (
        Partial,
        Replicate,
        Shard,
        ShardedTensor,
        ShardingSpec,
        distribute_tensor,
        explain_redistribute,
    )
    from devmesh.pictures.sharding import visualize_sharding


# subpackages reached as attributes (``devmesh.parallel.fully_shard`` after ``import devmesh``),
# imported on first use as the names above are
_SUBPACKAGES = ("parallel", "tensor", "distributed", "launching", "layout", "pictures", "errors")


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None and name in _SUBPACKAGES:
        value = importlib.import_module(f"devmesh.{name}")
        globals()[name] = value
        return value
    if module is None:
        raise AttributeError(f"module 'devmesh' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


def _trace_if_asked() -> None:
    """``DEVMESH_TRACE_COLLECTIVES=1``: record every collective from the start
    (:mod:`devmesh.distributed.trace`); torch is imported only then."""
    import os

    if os.environ.get("DEVMESH_TRACE_COLLECTIVES", "").strip().lower() in ("1", "true", "yes"):
        from devmesh.distributed.trace import install

        install()


_trace_if_asked()
