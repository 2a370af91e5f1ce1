"""Mesh creation and slicing: devmesh vs torch's ``init_device_mesh``, measured in the same run.

Three settings:

1. real gloo, 8 local ranks: create a ``(2, 4)`` and a ``(2, 2, 2)`` mesh, then slice every
   dim and pair of dims 100 times, then flatten two dims. Each side runs in its own fresh
   world (same worker processes); every step starts after a barrier, and its time is the
   slowest rank's, median of ``--repeats`` runs.
2. torch's single-process ``fake`` backend at 4,096 and 32,768 ranks (rank 0's view): create a
   3-D mesh and slice / flatten it. No communication: this is the bookkeeping cost.
3. the pure layout: every group of every dim of a 1,048,576-rank 3-D mesh (devmesh only;
   torch has no process-free equivalent).

Prints one line per case with both times and the ratio devmesh / torch (< 1: devmesh faster),
and the spread of that ratio over the repeats (each repeat's devmesh time over the same
repeat's torch time). Each side first runs once untimed in the same processes (imports,
first allocations), and every repeat runs torch a second time: its A/A ratio (torch / torch)
shows how much the machine alone moves a ratio.

    .venv/bin/python bench/mesh_init.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings


def _slice_all(mesh, names, rounds):
    for _ in range(rounds):
        for name in names:
            mesh[name]
        for i in range(len(names)):
            for j in range(i + 1, len(names)):
                mesh[names[i], names[j]]


def gloo_case(which: str, rounds: int) -> dict[str, float]:
    """Runs on every rank of a fresh world; returns this rank's timings in seconds."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    dist.barrier()
    if which == "torch":
        from torch.distributed.device_mesh import init_device_mesh
    else:
        from devmesh import init_device_mesh
    out = {}

    def timed(step: str, work):
        dist.barrier()  # every rank starts the step together: its time is the step's own
        start = time.perf_counter()
        result = work()
        out[step] = time.perf_counter() - start
        return result

    mesh2 = timed("create (2, 4)", lambda: init_device_mesh(
        "cpu", (2, 4), mesh_dim_names=("replicate", "shard")))
    mesh3 = timed("create (2, 2, 2)", lambda: init_device_mesh(
        "cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp")))
    timed(f"slice x{rounds}", lambda: (_slice_all(mesh2, ("replicate", "shard"), rounds),
                                       _slice_all(mesh3, ("replicate", "shard", "tp"), rounds)))
    timed("flatten", lambda: mesh3["replicate", "shard"]._flatten("dp"))
    dist.barrier()
    return out


def fake_case(which: str, shape: tuple[int, ...], rounds: int) -> dict[str, float]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    warnings.filterwarnings("ignore")
    world = 1
    for s in shape:
        world *= s
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    if which == "torch":
        from torch.distributed.device_mesh import init_device_mesh
    else:
        from devmesh import init_device_mesh
    names = ("dp", "fsdp", "tp")
    out = {}
    start = time.perf_counter()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    out["create"] = time.perf_counter() - start
    start = time.perf_counter()
    _slice_all(mesh, names, rounds)
    out[f"slice x{rounds}"] = time.perf_counter() - start
    start = time.perf_counter()
    mesh["dp", "fsdp"]._flatten("dp_fsdp")
    out["flatten"] = time.perf_counter() - start
    dist.destroy_process_group()
    if which == "devmesh":
        from devmesh.distributed import groups

        groups.reset()
    return out


def _report(title: str, ours: list[dict[str, float]], theirs: list[dict[str, float]],
            again: list[dict[str, float]] | None = None) -> None:
    """Medians of the repeats, the median ratio and its spread over the repeats, and the A/A
    ratio (torch's second run over its first) where there is one."""
    print(f"\n{title}")
    aa = "   A/A (torch again)" if again else ""
    print(f"  {'step':<22}{'devmesh':>12}{'torch':>12}{'ratio':>9}{'spread':>14}{aa}")
    for key in list(ours[0]) + ["total"]:
        def value(run, key=key):
            return sum(run.values()) if key == "total" else run[key]
        a = statistics.median(value(r) for r in ours)
        b = statistics.median(value(r) for r in theirs)
        ratios = [value(x) / value(y) for x, y in zip(ours, theirs, strict=True)]
        line = (f"  {key:<22}{a * 1e3:>10.2f}ms{b * 1e3:>10.2f}ms{a / b:>9.2f}"
                f"{min(ratios):>8.2f}-{max(ratios):.2f}")
        if again:
            same = [value(x) / value(y) for x, y in zip(again, theirs, strict=True)]
            line += f"   {statistics.median(same):.2f} ({min(same):.2f}-{max(same):.2f})"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=100, help="slicing rounds")
    args = parser.parse_args()

    from devmesh.launching.launcher import WorkerPool
    from devmesh.layout import MeshLayout

    print("devmesh vs torch init_device_mesh (ratio = devmesh / torch; < 1 means devmesh is faster)")
    with WorkerPool(8) as pool:
        for which in ("torch", "devmesh"):  # untimed: imports and first allocations
            pool.run(gloo_case, 8, which, 1)
        runs: dict[str, list[dict[str, float]]] = {"devmesh": [], "torch": [], "again": []}
        for _ in range(args.repeats):
            for which in ("torch", "devmesh", "again"):
                per_rank = pool.run(gloo_case, 8, "torch" if which == "again" else which,
                                    args.rounds)
                runs[which].append({k: max(r[k] for r in per_rank) for k in per_rank[0]})
        _report("gloo, 8 ranks (slowest rank, median of repeats)", runs["devmesh"],
                runs["torch"], runs["again"])
        for shape in ((16, 16, 16), (32, 32, 32)):
            runs = {"devmesh": [], "torch": []}
            for _ in range(args.repeats):
                for which in ("torch", "devmesh"):
                    runs[which].append(pool.run(fake_case, 1, which, shape, args.rounds)[0])
            size = shape[0] * shape[1] * shape[2]
            _report(f"fake backend, {size} ranks {shape} (rank 0, median of repeats)",
                    runs["devmesh"], runs["torch"])

    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        layout = MeshLayout((128, 128, 64), ("dp", "fsdp", "tp"))
        groups = [layout.groups(name) for name in layout.names]
        times.append(time.perf_counter() - start)
    assert sum(len(g) for g in groups) == 128 * 64 * 2 + 128 * 128
    print(f"\npure layout: every group of every dim of a 1,048,576-rank (128, 128, 64) mesh: "
          f"{statistics.median(times) * 1e3:.0f} ms (median of {args.repeats}; goal < 1000 ms)")


if __name__ == "__main__":
    main()
