"""Mesh creation and slicing: devmesh vs torch's ``init_device_mesh``, measured in the same run.

Three settings:

1. real gloo, 8 local ranks: create a ``(2, 4)`` and a ``(2, 2, 2)`` mesh, then slice every
   dim and pair of dims 100 times. Each side runs in its own fresh world (same worker
   processes); the time is the slowest rank's, median of ``--repeats`` runs.
2. torch's single-process ``fake`` backend at 4,096 and 32,768 ranks (rank 0's view): create a
   3-D mesh and slice / flatten it. No communication: this is the bookkeeping cost.
3. the pure layout: every group of every dim of a 1,048,576-rank 3-D mesh (devmesh only;
   torch has no process-free equivalent).

Prints one line per case with both times and the ratio devmesh / torch (< 1: devmesh faster).

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
    start = time.perf_counter()
    mesh2 = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    out["create (2, 4)"] = time.perf_counter() - start
    start = time.perf_counter()
    mesh3 = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    out["create (2, 2, 2)"] = time.perf_counter() - start
    start = time.perf_counter()
    _slice_all(mesh2, ("replicate", "shard"), rounds)
    _slice_all(mesh3, ("replicate", "shard", "tp"), rounds)
    out[f"slice x{rounds}"] = time.perf_counter() - start
    start = time.perf_counter()
    mesh3["replicate", "shard"]._flatten("dp")
    out["flatten"] = time.perf_counter() - start
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


def _report(title: str, ours: dict[str, float], theirs: dict[str, float]) -> None:
    print(f"\n{title}")
    print(f"  {'step':<22}{'devmesh':>12}{'torch':>12}{'ratio':>9}")
    for key in ours:
        a, b = ours[key], theirs[key]
        print(f"  {key:<22}{a * 1e3:>10.2f}ms{b * 1e3:>10.2f}ms{a / b:>9.2f}")
    total_a, total_b = sum(ours.values()), sum(theirs.values())
    print(f"  {'total':<22}{total_a * 1e3:>10.2f}ms{total_b * 1e3:>10.2f}ms{total_a / total_b:>9.2f}")


def _median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=100, help="slicing rounds")
    args = parser.parse_args()

    from devmesh.launching.launcher import WorkerPool
    from devmesh.layout import MeshLayout

    print("devmesh vs torch init_device_mesh (ratio = devmesh / torch; < 1 means devmesh is faster)")
    with WorkerPool(8) as pool:
        runs: dict[str, list[dict[str, float]]] = {"devmesh": [], "torch": []}
        for _ in range(args.repeats):
            for which in ("torch", "devmesh"):
                per_rank = pool.run(gloo_case, 8, which, args.rounds)
                runs[which].append({k: max(r[k] for r in per_rank) for k in per_rank[0]})
        _report("gloo, 8 ranks (slowest rank, median of repeats)",
                _median_of(runs["devmesh"]), _median_of(runs["torch"]))
        for shape in ((16, 16, 16), (32, 32, 32)):
            runs = {"devmesh": [], "torch": []}
            for _ in range(args.repeats):
                for which in ("torch", "devmesh"):
                    runs[which].append(pool.run(fake_case, 1, which, shape, args.rounds)[0])
            size = shape[0] * shape[1] * shape[2]
            _report(f"fake backend, {size} ranks {shape} (rank 0, median of repeats)",
                    _median_of(runs["devmesh"]), _median_of(runs["torch"]))

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
