"""Seed 001's custom-parallel example: slice a 3-D mesh into an HSDP mesh and a TP mesh.
The slices reuse the communicators created with the 3-D mesh (no new process group).

    torchrun --nproc_per_node=8 examples/3d_custom_slicing.py
    devmesh run -n 8 examples/3d_custom_slicing.py
"""

import torch
import torch.distributed as dist

from devmesh import init_device_mesh


def slice_3d():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh_3d = init_device_mesh(device, (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))

    # Users can slice child meshes from the parent mesh.
    hsdp_mesh = mesh_3d["replicate", "shard"]
    tp_mesh = mesh_3d["tp"]

    # Users can access the underlying process group thru get_group API.
    replicate_group = hsdp_mesh["replicate"].get_group()
    shard_group = hsdp_mesh["shard"].get_group()
    tp_group = tp_mesh.get_group()
    return {
        "hsdp_mesh": repr(hsdp_mesh),
        "tp_mesh": repr(tp_mesh),
        "replicate": dist.get_process_group_ranks(replicate_group),
        "shard": dist.get_process_group_ranks(shard_group),
        "tp": dist.get_process_group_ranks(tp_group),
    }


if __name__ == "__main__":
    info = slice_3d()
    print(f"rank {dist.get_rank()}: hsdp {info['hsdp_mesh']}, tp {info['tp_mesh']}, "
          f"groups replicate={info['replicate']} shard={info['shard']} tp={info['tp']}")
    dist.destroy_process_group()
