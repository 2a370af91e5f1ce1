"""Run by test_multihost on two simulated hosts under ``devmesh run --max-restarts 1``: HSDP x TP
trains 5 steps, saving a checkpoint after each and resuming from the last one on a restart.
With a kill-marker path given, the first attempt writes it after step 2's save and waits
(the test then kills host 1 outright). Each rank writes its final parameters."""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from devmesh import init_device_mesh
from devmesh.parallel import (ColwiseParallel, RowwiseParallel, fully_shard, load_checkpoint,
                              parallelize_module, save_checkpoint)

out_dir, ckpt = sys.argv[1], sys.argv[2]
marker = sys.argv[3] if len(sys.argv) > 3 else None

mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "shard", "tp"))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)).double()
parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
fully_shard(model, mesh=mesh["dp", "shard"])
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
start = 0
if os.path.exists(os.path.join(ckpt, "metadata.json")):
    start = load_checkpoint(ckpt, model, opt)["step"] + 1
data = mesh.get_local_rank("dp") * 2 + mesh.get_local_rank("shard")
for step in range(start, 5):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(8, 16, generator=gen, dtype=torch.float64)
    y = torch.randn(8, 16, generator=gen, dtype=torch.float64)
    opt.zero_grad()
    rows = slice(2 * data, 2 * data + 2)
    nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
    opt.step()
    save_checkpoint(ckpt, model, opt, extra={"step": step})
    if step == 2 and marker and not os.path.exists(marker):
        if dist.get_rank() == 4:  # the first rank of host 1 asks to be killed, with its host
            with open(marker, "w") as f:
                f.write("kill host 1")
        time.sleep(600)
full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
        for k, v in model.state_dict().items()}
torch.save({"start": start, "params": full},
           os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
dist.destroy_process_group()
