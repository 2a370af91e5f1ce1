"""Seed 001's 3-D mesh (replicate, shard, tp) driving HSDP + TP on a small model: the HSDP mesh
and the TP mesh are slices of one mesh, and the parameters' layouts compose.

    torchrun --nproc_per_node=8 examples/custom_3d.py
    devmesh run -n 8 examples/custom_3d.py
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from devmesh import init_device_mesh
from devmesh.parallel import (
    ColwiseParallel, RowwiseParallel, describe, fully_shard, parallelize_module,
)


def hsdp_plus_tp(steps=3):
    mesh_3d = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    hsdp_mesh = mesh_3d["replicate", "shard"]
    tp_mesh = mesh_3d["tp"]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=hsdp_mesh)
    fully_shard(model, mesh=hsdp_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp_index = hsdp_mesh.get_local_rank("replicate") * 2 + hsdp_mesh.get_local_rank("shard")
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 16, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        mine = slice(dp_index * 4, dp_index * 4 + 4)
        loss = F.cross_entropy(model(x[mine]), y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"rank": dist.get_rank(), "losses": losses, "describe": describe(model)}


if __name__ == "__main__":
    info = hsdp_plus_tp()
    print(f"rank {info['rank']}: local losses {[round(v, 4) for v in info['losses']]}")
    if info["rank"] == 0:
        print(info["describe"])
    dist.destroy_process_group()
