"""Seed 001's HSDP example: on 8 ranks a (2, 4) mesh, FSDP inside each group of 4, DDP across
the 2 (on another even number of ranks, 2 replicas of half the ranks each; on an odd one, a
single replica). With seed 004's trick of arange weights, every rank prints the rows it holds:
ranks with the same shard index hold the same rows.

    torchrun --nproc_per_node=8 examples/hsdp.py
    devmesh run -n 8 examples/hsdp.py
    devmesh run -n 4 examples/hsdp.py     # (2, 2)
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn

from devmesh import init_device_mesh
from devmesh.parallel import fully_shard, state_dict


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10, bias=False)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)
        with torch.no_grad():
            self.net1.weight.copy_(torch.arange(101.0, 201.0).reshape(10, 10))

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def hsdp_shape(world: int) -> tuple[int, int]:
    """(replicas, shard size) for ``world`` ranks: 2 replicas where the world splits evenly."""
    replicas = 2 if world % 2 == 0 and world >= 4 else 1
    return replicas, world // replicas


def hsdp_step():
    """HSDP on (2, world / 2); returns (rank, dp index, shard index, first column of my net1
    rows, full weight equals the original after the step's all-gather)."""
    shape = hsdp_shape(int(os.environ["WORLD_SIZE"]))
    mesh_2d = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = ToyModel()
    original = model.net1.weight.detach().clone()
    fully_shard(model, mesh=mesh_2d)  # a 2-D mesh: shard on "shard", replicate on "replicate"
    rows = model.net1.weight.detach()[:, 0].tolist()
    full_ok = torch.equal(state_dict(model)["net1.weight"], original)
    loss = model(torch.ones(4, 10)).sum()
    loss.backward()
    return (dist.get_rank(), mesh_2d.get_local_rank("replicate"),
            mesh_2d.get_local_rank("shard"), rows, full_ok)


if __name__ == "__main__":
    rank, dp, shard, rows, ok = hsdp_step()
    print(f"Global rank: {rank}, dp_rank: {dp}, shard_rank: {shard}, net1 rows start with {rows}, "
          f"full weight intact: {ok}")
    dist.destroy_process_group()
