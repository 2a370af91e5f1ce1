"""The pure core: rank algebra and sharding algebra, no torch, no processes.

* :mod:`.mesh_layout`: ``MeshLayout`` — shape, names and the global rank array; coordinate ↔
  rank, the groups along any dims, slicing, flattening, unflattening;
* :mod:`.topology`: which host each rank is on, dims crossing hosts, hybrid layouts;
* :mod:`.placement`, :mod:`.spec`: per-mesh-dim placements and the ``ShardingSpec`` that
  states nesting explicitly;
* :mod:`.plan`: planning a redistribution between two specs.

Importing this package imports neither torch nor any process machinery (a test asserts it),
so ``devmesh show`` and ``explain_redistribute`` answer instantly for any size.
"""

from devmesh.layout.mesh_layout import (
    Dim,
    Dims,
    MeshLayout,
    _check_names,
    _check_shape,
    format_ranks,
    ranks_phrase,
)

__all__ = ["MeshLayout", "Dim", "Dims", "format_ranks", "ranks_phrase", "_check_names", "_check_shape"]
