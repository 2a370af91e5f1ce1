"""Seed 004's first experiment: a (2, 3) and a (3, 2) mesh on 6 ranks, each rank printing its
TP sub-mesh. devmesh prints the ranks (torch 2.13 prints only sizes and strides).

    torchrun --nproc_per_node=6 examples/print_submeshes.py
    devmesh run -n 6 examples/print_submeshes.py
"""

import torch
import torch.distributed as dist

from devmesh import init_device_mesh


def tp_submeshes():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lines = []
    for shape in [(2, 3), (3, 2)]:
        device_mesh = init_device_mesh(device, shape, mesh_dim_names=["dp", "tp"])
        tp_mesh = device_mesh["tp"]
        lines.append(f"{shape} Rank: {dist.get_rank()}, {tp_mesh}")
    return lines


if __name__ == "__main__":
    for line in tp_submeshes():
        print(line)
    dist.destroy_process_group()
