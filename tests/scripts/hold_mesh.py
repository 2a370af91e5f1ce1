"""Builds a mesh, then waits until the file named by argv[2] exists (argv[1]: written by rank
0 once the mesh is up), so a test can look at the running processes."""

import os
import sys
import time

import torch

from devmesh import init_device_mesh

ready, done = sys.argv[1], sys.argv[2]
mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("dp",))
torch.distributed.all_reduce(torch.ones(1))
if os.environ["RANK"] == "0":
    with open(ready, "w") as f:
        f.write("up")
deadline = time.monotonic() + 120
while not os.path.exists(done) and time.monotonic() < deadline:
    time.sleep(0.1)
torch.distributed.barrier()
