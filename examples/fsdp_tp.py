"""Seed 004's FSDP2 + TP experiment, where torch's full_tensor() came back in the wrong order.
A 12x12 weight of arange values is split column-wise by TP (rows 3 per TP rank) and FSDP then
splits each TP piece; devmesh records the nesting (dim 0 split by ("TP", "FSDP")) and
reassembles the original exactly.

    torchrun --nproc_per_node=8 examples/fsdp_tp.py
    devmesh run -n 8 examples/fsdp_tp.py     # (FSDP, TP) = (2, 4)
    devmesh run -n 4 examples/fsdp_tp.py     # (2, 2); 2 ranks: (1, 2)
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn

from devmesh import init_device_mesh, visualize_sharding
from devmesh.parallel import ColwiseParallel, as_sharded, fully_shard, parallelize_module


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(12, 12, bias=False)
        self.relu = nn.ReLU()
        with torch.no_grad():
            self.net1.weight.copy_(torch.arange(101.0, 245.0).reshape(12, 12))

    def forward(self, x):
        return self.relu(self.net1(x))


def fsdp_tp_shape(world: int) -> tuple[int, int]:
    """(FSDP, TP) for ``world`` ranks: TP 4 from 8 ranks on, else 2 (or 1 on an odd world);
    12 columns split evenly by either."""
    tp = 4 if world % 4 == 0 and world >= 8 else 2 if world % 2 == 0 else 1
    return world // tp, tp


def fsdp_over_tp():
    shape = fsdp_tp_shape(int(os.environ["WORLD_SIZE"]))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("FSDP", "TP"))
    model = ToyModel()
    original = model.net1.weight.detach().clone()
    model = parallelize_module(model, mesh["TP"], {"net1": ColwiseParallel()})
    model = fully_shard(model, mesh=mesh["FSDP"], reshard_after_forward=True)
    weight = as_sharded(model.net1.weight)
    full = weight.full_tensor()  # one all-gather over (TP, FSDP)
    table = visualize_sharding(weight, show=False)
    return {
        "rank": dist.get_rank(),
        "fsdp_rank": mesh["FSDP"].get_local_rank(),
        "tp_rank": mesh["TP"].get_local_rank(),
        "local_rows": model.net1.weight.detach()[:, 0].tolist(),
        "full_equal": torch.equal(full, original),
        "layout": str(weight.spec),
        "table": table,
    }


if __name__ == "__main__":
    info = fsdp_over_tp()
    print(f"Global rank: {info['rank']}, fsdp_rank: {info['fsdp_rank']}, tp_rank: "
          f"{info['tp_rank']}, rows starting with {info['local_rows']}")
    if info["rank"] == 0:
        print(info["table"])
        print(f"full_tensor() equals the original weight: {info['full_equal']}")
    dist.destroy_process_group()
