"""The by-hand 2-D (HSDP) group setup of the DeviceMesh tutorial (seed 001), made runnable on
CPU as well as GPU. Compare with 2d_setup_with_device_mesh.py, which does the same in one line.

    torchrun --nproc_per_node=8 examples/2d_setup.py
    devmesh run -n 8 examples/2d_setup.py
"""

import os

import torch
import torch.distributed as dist


def setup_groups_by_hand():
    """Returns this rank's (shard group ranks, replicate group ranks), computed by hand."""
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))

    # Create shard groups (e.g. (0, 1, 2, 3), (4, 5, 6, 7))
    # and assign the correct shard group to each rank
    num_devices = world_size
    shard_rank_lists = (
        list(range(0, num_devices // 2)),
        list(range(num_devices // 2, num_devices)),
    )
    shard_groups = (dist.new_group(shard_rank_lists[0]), dist.new_group(shard_rank_lists[1]))
    current_shard_group = shard_groups[0] if rank in shard_rank_lists[0] else shard_groups[1]

    # Create replicate groups (for example, (0, 4), (1, 5), (2, 6), (3, 7))
    # and assign the correct replicate group to each rank
    current_replicate_group = None
    shard_factor = len(shard_rank_lists[0])
    for i in range(num_devices // 2):
        replicate_group_ranks = list(range(i, num_devices, shard_factor))
        replicate_group = dist.new_group(replicate_group_ranks)
        if rank in replicate_group_ranks:
            current_replicate_group = replicate_group
    return (
        dist.get_process_group_ranks(current_shard_group),
        dist.get_process_group_ranks(current_replicate_group),
    )


if __name__ == "__main__":
    shard, replicate = setup_groups_by_hand()
    print(f"rank {dist.get_rank()}: shard group {shard}, replicate group {replicate}")
    dist.destroy_process_group()
