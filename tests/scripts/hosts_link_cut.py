"""Run by test_multihost on two simulated hosts: the ranks build a (dp, tp) mesh with a short
timeout, all-reduce once, say they are ready, and wait for the test to cut host 1's link;
then an all-reduce over dp (across the hosts). Each rank writes the error it got (or none)."""

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from devmesh import init_device_mesh
from devmesh.distributed import comm

folder = sys.argv[1]
mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"),
                        timeout=datetime.timedelta(seconds=15))
comm.all_reduce(torch.ones(4), mesh, (0, 1))
rank = dist.get_rank()
open(os.path.join(folder, f"ready{rank}"), "w").close()
while not os.path.exists(os.path.join(folder, "cut")):
    time.sleep(0.1)
started = time.monotonic()


try:
    comm.all_reduce(torch.ones(4), mesh, (0,))
    error = None
except Exception as exc:  # noqa: BLE001 - written for the test to read
    error = f"{type(exc).__name__}: {exc}"
with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "error": error, "seconds": time.monotonic() - started}, f)
if error:  # a rank's failure stops its host's other ranks: stay until they wrote theirs
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sum(
            name.startswith("rank") and name.endswith(".json")
            for name in os.listdir(folder)) < 8:
        time.sleep(0.1)
sys.exit(1 if error else 0)
