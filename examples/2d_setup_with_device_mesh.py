"""The same 2-D setup as 2d_setup.py, with devmesh: one line instead of thirty (seed 001).
Only the import differs from the torch tutorial; "cpu" runs it on any machine.

    torchrun --nproc_per_node=8 examples/2d_setup_with_device_mesh.py
    devmesh run -n 8 examples/2d_setup_with_device_mesh.py
"""

import os

import torch
import torch.distributed as dist

from devmesh import init_device_mesh


def setup_groups_with_mesh():
    """Returns this rank's (shard group ranks, replicate group ranks) from a DeviceMesh."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    world_size = int(os.environ["WORLD_SIZE"])  # 8 in the tutorial: a (2, 4) mesh
    mesh_2d = init_device_mesh(device, (2, world_size // 2), mesh_dim_names=("replicate", "shard"))

    # Users can access the underlying process group thru `get_group` API.
    replicate_group = mesh_2d.get_group(mesh_dim="replicate")
    shard_group = mesh_2d.get_group(mesh_dim="shard")
    return dist.get_process_group_ranks(shard_group), dist.get_process_group_ranks(replicate_group)


if __name__ == "__main__":
    shard, replicate = setup_groups_with_mesh()
    print(f"rank {dist.get_rank()}: shard group {shard}, replicate group {replicate}")
    dist.destroy_process_group()
