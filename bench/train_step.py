"""Training step time and peak memory: devmesh vs torch (DDP, FSDP2, TP, FSDP2 + TP).

Same model, same mesh, same data, 8 gloo ranks: an 8.4M-parameter MLP (4 blocks of
Linear(512, 2048) -> ReLU -> Linear(2048, 512)), batch 32 per rank, SGD. Each (library,
strategy) runs in fresh processes so that peak RSS (``ru_maxrss``) belongs to that run alone.
Prints the slowest rank's median step time, the ratio devmesh / torch, and peak RSS.

    .venv/bin/python bench/train_step.py [--steps 5] [--strategies ddp,fsdp,tp,fsdp+tp]
                                         [--repeats 1]

Each repeat runs torch twice: the A/A column (torch's second run over its first) shows how
much the machine alone moves a ratio.

Two more strategies: ``fsdp/4`` (``reshard_after_forward=4``: backward all-gathers within
groups of 4 ranks) and ``ddp+fp16`` (DDP with torch's ``fp16_compress_hook``).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
import warnings


def build_model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    blocks = []
    for _ in range(4):
        blocks += [nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512)]
    return nn.Sequential(*blocks)


TP_PLAN_LAYERS = [(3 * i, 3 * i + 2) for i in range(4)]


def run(library: str, strategy: str, steps: int):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    fp16_hook = strategy == "ddp+fp16"  # DDP with torch's fp16 compression hook
    strategy, _, size = strategy.replace("+fp16", "").partition("/")
    reshard = int(size) if size else None  # fsdp/4: groups of 4 hold the parameters

    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    from devmesh import init_device_mesh

    model = build_model()
    if strategy == "fsdp+tp":
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh["dp"], mesh["tp"]
    elif strategy == "tp":
        mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("tp",))
        dp, tp = None, mesh
    else:
        mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
        dp, tp = mesh, None
    if library == "torch":
        # torch composes FSDP and TP only for slices of one torch mesh: slice torch's view of
        # the root (over the same process groups as devmesh's)
        troot = mesh.to_torch()
        if strategy == "fsdp+tp":
            tdp, ttp = troot["dp"], troot["tp"]
        else:
            tdp, ttp = (troot, None) if dp is not None else (None, troot)
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel, RowwiseParallel, parallelize_module,
        )

        if tp is not None:
            plan = {}
            for up, down in TP_PLAN_LAYERS:
                plan[str(up)], plan[str(down)] = ColwiseParallel(), RowwiseParallel()
            parallelize_module(model, ttp, plan)
        if strategy == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model, process_group=dp.get_group())
            if fp16_hook:
                model.register_comm_hook(dp.get_group(), default_hooks.fp16_compress_hook)
        elif strategy in ("fsdp", "fsdp+tp"):
            for i in range(0, 12, 3):
                fully_shard(model[i], mesh=tdp, reshard_after_forward=reshard)
                fully_shard(model[i + 2], mesh=tdp, reshard_after_forward=reshard)
            fully_shard(model, mesh=tdp)
    elif library == "devmesh":
        from devmesh.parallel import (
            ColwiseParallel, RowwiseParallel, fully_shard, parallelize_module, replicate,
        )

        if tp is not None:
            plan = {}
            for up, down in TP_PLAN_LAYERS:
                plan[str(up)], plan[str(down)] = ColwiseParallel(), RowwiseParallel()
            parallelize_module(model, tp, plan)
        if strategy == "ddp":
            replicate(model, mesh=dp)
            if fp16_hook:
                model.register_comm_hook(dp.get_group(), default_hooks.fp16_compress_hook)
        elif strategy in ("fsdp", "fsdp+tp"):
            for i in range(0, 12, 3):
                fully_shard(model[i], mesh=dp, reshard_after_forward=reshard)
                fully_shard(model[i + 2], mesh=dp, reshard_after_forward=reshard)
            fully_shard(model, mesh=dp)
    # library == "none": the plain model on every rank, no communication
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(32, 512, generator=gen), torch.randn(32, 512, generator=gen)
    times = []
    for step in range(steps + 2):
        dist.barrier()
        start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--strategies", default="ddp,fsdp,tp,fsdp+tp")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    from devmesh._progress import Progress
    from devmesh.launching.launcher import launch

    strategies = args.strategies.split(",")
    progress = Progress("bench train_step", 1 + 3 * len(strategies) * args.repeats, bar=False,
                        unit="runs")

    def measure(library, strategy):
        per_rank = launch(run, 8, library, strategy, args.steps, timeout=1800)
        progress.advance()
        return max(t for t, _ in per_rank), max(m for _, m in per_rank)

    base_time, base_mem = measure("none", "ddp")
    print(f"8.4M-parameter MLP, batch 32 per rank, SGD, 8 gloo ranks on this machine; "
          f"slowest rank's median of {args.steps} steps")
    print(f"no communication (plain model on every rank): {base_time * 1e3:.0f} ms/step, "
          f"peak RSS {base_mem:.0f} MB")
    print(f"{'strategy':<10}{'devmesh':>12}{'torch':>12}{'ratio':>8}{'A/A':>7}"
          f"{'devmesh RSS':>14}{'torch RSS':>12}")
    for strategy in strategies:
        for _ in range(args.repeats):
            ours_t, ours_m = measure("devmesh", strategy)
            theirs_t, theirs_m = measure("torch", strategy)
            again_t, _ = measure("torch", strategy)
            print(f"{strategy:<10}{ours_t * 1e3:>10.0f}ms{theirs_t * 1e3:>10.0f}ms"
                  f"{ours_t / theirs_t:>8.2f}{again_t / theirs_t:>7.2f}"
                  f"{ours_m:>12.0f}MB{theirs_m:>10.0f}MB", flush=True)
    progress.close()


if __name__ == "__main__":
    main()
