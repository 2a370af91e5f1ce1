"""Run by test_topology under two torchrun agents (--nnodes=2) on loopback: writes one JSON
file per rank (into $DEVMESH_TEST_OUT) with what devmesh learned about the hosts."""

import json
import os
import warnings

import torch.distributed as dist

from devmesh import create_hybrid_mesh, init_device_mesh
from devmesh.layout.topology import TopologyError, TopologyWarning

out = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    good = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out["good_warnings"] = [str(w.message) for w in caught if w.category is TopologyWarning]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"), heavy_dims="tp")
    out["bad_warnings"] = [str(w.message) for w in caught if w.category is TopologyWarning]
try:
    init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"), heavy_dims="tp", strict=True)
    out["strict"] = None
except TopologyError as exc:
    out["strict"] = str(exc)
out["hosts"] = good.hosts()
out["crossing"] = good.dims_crossing_hosts()
hybrid = create_hybrid_mesh((1, 2), (2, 1), ("dp", "tp"))
out["hybrid"] = hybrid.mesh.tolist()
out["hybrid_crossing"] = hybrid.dims_crossing_hosts()
out["rank"] = dist.get_rank()
path = os.path.join(os.environ["DEVMESH_TEST_OUT"], f"rank{dist.get_rank()}.json")
with open(path + ".tmp", "w") as f:
    json.dump(out, f)
os.replace(path + ".tmp", path)
dist.destroy_process_group()
