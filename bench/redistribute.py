"""Redistribution: devmesh vs torch DTensor on 8 gloo ranks, in the same run.

For the standard transitions and for the nested FSDP-over-TP ``full_tensor`` (torch:
``[_StridedShard(0, sf=4), Shard(0)]``), both libraries redistribute the same 8 MB fp32 tensor
on the same (2, 4) mesh (devmesh's mesh and ``mesh.to_torch()`` share process groups). Prints
the slowest rank's median time, the time ratio devmesh / torch, and collective counts
(devmesh's ``comm_stats``, torch's ``CommDebugMode``).

    .venv/bin/python bench/redistribute.py [--repeats 7] [--rows 1024 --cols 2048]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings


def bench_rank(rows: int, cols: int, repeats: int):
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Partial as TP
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor import Shard as TS
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.placement_types import _StridedShard

    from devmesh import comm_stats, init_device_mesh
    from devmesh.tensor import Partial, Replicate, Shard, ShardedTensor, ShardingSpec

    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    tmesh = mesh.to_torch()
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    nested = ShardingSpec.build((2, 4), (rows, cols), {0: ("tp", "dp")},
                                mesh_dim_names=("dp", "tp"))

    def torch_placements(ps):
        return [TS(p.dim) if isinstance(p, Shard) else TP() if isinstance(p, Partial) else TR()
                for p in ps]

    cases = {
        "Shard(0)->Replicate on tp": ([Replicate(), Shard(0)], [Replicate(), Replicate()]),
        "Partial->Replicate on tp": ([Replicate(), Partial()], [Replicate(), Replicate()]),
        "Partial->Shard(0) on tp": ([Replicate(), Partial()], [Replicate(), Shard(0)]),
        "Shard(0)->Shard(1) on tp": ([Replicate(), Shard(0)], [Replicate(), Shard(1)]),
        "[Shard(0),Shard(1)]->Replicate": ([Shard(0), Shard(1)], [Replicate(), Replicate()]),
        "[Shard(0),Shard(0)]->Replicate": ([Shard(0), Shard(0)], [Replicate(), Replicate()]),
    }
    results = {}

    def timed(ours_fn, theirs_fn):
        """Alternate the two so that machine noise hits both alike; medians."""
        ours_fn(), theirs_fn()  # warm-up: plan caches, lazy buffers
        ours, theirs = [], []
        for _ in range(repeats):
            for fn, times in ((ours_fn, ours), (theirs_fn, theirs)):
                dist.barrier()
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
        return statistics.median(ours), statistics.median(theirs)

    for _ in range(20):  # warm the machine and the connections up
        dist.all_reduce(torch.ones(1 << 16))

    for name, (a, b) in cases.items():
        spec_a = ShardingSpec.from_placements(a, (2, 4), (rows, cols), ("dp", "tp"))
        ours = ShardedTensor(x[tuple(slice(s, s + n) for s, n in spec_a.local_bounds(
            mesh.get_coordinate()))].contiguous(), mesh, spec_a)
        theirs = DTensor.from_local(ours.to_local(), tmesh, torch_placements(a),
                                    shape=x.shape, stride=x.stride())
        target = torch_placements(b)
        t_ours, t_theirs = timed(lambda: ours.redistribute(b),
                                 lambda: theirs.redistribute(tmesh, target))
        with comm_stats() as stats:
            ours.redistribute(b)
        with CommDebugMode() as debug:
            theirs.redistribute(tmesh, target)
        results[name] = (t_ours, t_theirs, stats.calls, debug.get_total_counts())

    local = x[tuple(slice(s, s + n) for s, n in nested.local_bounds(mesh.get_coordinate()))]
    ours = ShardedTensor(local.contiguous(), mesh, nested)
    theirs = DTensor.from_local(ours.to_local(), tmesh, [_StridedShard(0, split_factor=4), TS(0)],
                                shape=x.shape, stride=x.stride())
    assert torch.equal(ours.full_tensor(), x) and torch.equal(theirs.full_tensor(), x)
    t_ours, t_theirs = timed(ours.full_tensor, theirs.full_tensor)
    with comm_stats() as stats:
        ours.full_tensor()
    with CommDebugMode() as debug:
        theirs.full_tensor()
    results["nested (tp, dp) full_tensor"] = (t_ours, t_theirs, stats.calls,
                                              debug.get_total_counts())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=2048)
    args = parser.parse_args()

    from devmesh.launching.launcher import launch

    per_rank = launch(bench_rank, 8, args.rows, args.cols, args.repeats, timeout=1200)
    mb = args.rows * args.cols * 4 / 2**20
    print(f"redistribute a {args.rows}x{args.cols} fp32 tensor ({mb:.0f} MB) on a (2, 4) gloo mesh, "
          f"8 ranks; slowest rank, median of {args.repeats}")
    print(f"{'transition':<34}{'devmesh':>10}{'torch':>10}{'ratio':>8}{'colls':>8}{'torch colls':>13}")
    for name in per_rank[0]:
        ours = max(r[name][0] for r in per_rank)
        theirs = max(r[name][1] for r in per_rank)
        _, _, calls, torch_calls = per_rank[0][name]
        print(f"{name:<34}{ours * 1e3:>8.1f}ms{theirs * 1e3:>8.1f}ms{ours / theirs:>8.2f}"
              f"{calls:>8}{torch_calls:>13}")


if __name__ == "__main__":
    main()
