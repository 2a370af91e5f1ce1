"""Training that survives a killed rank: checkpoint every K steps, and on (re)start resume
from the last complete checkpoint — same losses, bit for bit, as a run never interrupted.

    devmesh run -n 4 --max-restarts 3 examples/elastic_training.py --ckpt /tmp/ckpt
    torchrun --standalone --nproc_per_node=4 --max-restarts=3 examples/elastic_training.py ...

The mesh is HSDP: (replicate, shard) = (2, world // 2), or plain data parallel on 1-2 ranks,
so the same checkpoint also resumes on a smaller world (reshard on load). Every rank sees the
same global batch for step i (a generator seeded by i), so the data order survives a restart;
``--kill-at STEP`` makes rank 1 SIGKILL itself at that step in the first attempt (once every
rank has finished the step before), as a crashed node would. Rank 0 appends ``step loss``
lines to ``--losses``.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.nn.functional as F
from torch import nn

from devmesh import init_device_mesh
from devmesh.parallel import fully_shard, load_checkpoint, replicate, save_checkpoint


def build(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 4))
    if world >= 4:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for i in (0, 2, 4):
            fully_shard(model[i], mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif world > 1:
        replicate(model, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--losses", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=3, help="checkpoint every K steps")
    parser.add_argument("--kill-at", type=int, default=None)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    model, opt = build(world)
    start = 0
    if os.path.exists(os.path.join(args.ckpt, "metadata.json")):
        start = load_checkpoint(args.ckpt, model, opt)["step"]
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for step in range(start, args.steps):
        if step == args.kill_at and first_attempt and world > 1:
            # every rank has finished (and rank 0 logged) the step before: what the log holds
            # does not depend on how fast the launcher stops the other ranks
            torch.distributed.barrier()
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            with open(args.losses, "a") as f:
                f.write(f"{step} {loss.item()!r}\n")
        if (step + 1) % args.every == 0:
            save_checkpoint(args.ckpt, model, opt, extra={"step": step + 1})


if __name__ == "__main__":
    main()
