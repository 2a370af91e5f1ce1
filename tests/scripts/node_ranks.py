"""Run by test_multihost on simulated hosts (``devmesh run --nnodes 2``, 2 ranks each): each
rank writes the ranks it was given, the address of the host it runs on and the host the mesh
says each rank is on (a JSON file per rank into the folder given), and says where it runs."""

import json
import os
import sys

import torch.distributed as dist

from devmesh import init_device_mesh
from devmesh.launching.hosts import local_address_towards, parse_endpoint

folder, endpoint = sys.argv[1], sys.argv[2]
address = local_address_towards(*parse_endpoint(endpoint))
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
rank = dist.get_rank()
print(f"rank {rank} runs on {address}", flush=True)
with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "env_rank": int(os.environ["RANK"]),
               "group_rank": int(os.environ["GROUP_RANK"]), "address": address,
               "hosts": mesh.hosts(), "tp_crosses": "tp" in mesh.dims_crossing_hosts()}, f)
dist.barrier()
