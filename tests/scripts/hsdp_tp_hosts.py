"""Run by test_multihost on simulated hosts (``devmesh run --nnodes 2``, 4 ranks each): HSDP x TP
on (dp 2, shard 2, tp 2), the replicas on different hosts, trains 3 steps; each rank writes
what it saw of the hosts and how far its parameters are from one process's (a JSON file per
rank into the folder given)."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from devmesh import init_device_mesh
from devmesh.parallel import ColwiseParallel, RowwiseParallel, fully_shard, parallelize_module


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)).double()


def batches():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=gen, dtype=torch.float64),
             torch.randn(8, 16, generator=gen, dtype=torch.float64)) for _ in range(3)]


reference = model()
opt = torch.optim.SGD(reference.parameters(), lr=0.1)
for x, y in batches():
    opt.zero_grad()
    nn.functional.mse_loss(reference(x), y).backward()
    opt.step()

mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "shard", "tp"))
ours = parallelize_module(model(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
fully_shard(ours, mesh=mesh["dp", "shard"])
opt = torch.optim.SGD(ours.parameters(), lr=0.1)
data = mesh.get_local_rank("dp") * 2 + mesh.get_local_rank("shard")
for x, y in batches():
    opt.zero_grad()
    rows = slice(2 * data, 2 * data + 2)
    nn.functional.mse_loss(ours(x[rows]), y[rows]).backward()
    opt.step()

full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
        for k, v in ours.state_dict().items()}
hosts = mesh.hosts()
tp_group = mesh["tp"].mesh.tolist()
host_of = {r: h for plane, hplane in zip(mesh.mesh.tolist(), hosts)
           for row, hrow in zip(plane, hplane) for r, h in zip(row, hrow)}
out = {
    "rank": dist.get_rank(),
    "crossing": mesh.dims_crossing_hosts(),
    "tp_group_hosts": sorted({host_of[r] for r in tp_group}),
    "my_host": host_of[dist.get_rank()],
    "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME"),
    "max_difference": max(float((full[k] - v).abs().max())
                          for k, v in reference.state_dict().items()),
}
path = os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json")
with open(path + ".tmp", "w") as f:
    json.dump(out, f)
os.replace(path + ".tmp", path)
dist.destroy_process_group()
