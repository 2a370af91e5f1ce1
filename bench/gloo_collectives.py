"""devmesh's collectives over gloo against torch's, on the same ranks and tensors.

devmesh sends a reduce-scatter (up to 16 MiB), an all-gather or an all-reduce (up to 4 MiB)
of a CPU tensor as one ``all_to_all_single`` exchange (two for an all-reduce whose copies
exceed 1 MiB) and combines the pieces in gloo's own order (:mod:`devmesh.distributed.exchange`); torch's collectives run gloo's
ring. For each collective and size (the whole tensor's bytes: an all-gather's output, a
reduce-scatter's input), 8 gloo ranks time devmesh's ``comm`` call and torch's
``torch.distributed`` call alternately, each after a barrier, and print the slowest rank's
median of each and the ratio devmesh / torch (< 1: devmesh faster), with torch / torch (A/A)
for the machine's noise, and each library's CPU time per call (all of a rank's threads).

    .venv/bin/python bench/gloo_collectives.py [--sizes 512,64K,1M,4M,16M] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def run(sizes: list[int], repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from devmesh import init_device_mesh
    from devmesh.distributed import comm

    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    n = mesh.size()
    out = {}
    for nbytes in sizes:
        numel = max(n, nbytes // 4 // n * n)
        whole = torch.randn(numel)
        block = torch.randn(numel // n)
        gathered = torch.empty(numel)
        mine = torch.empty(numel // n)
        cases = {
            "all_reduce": (lambda: comm.all_reduce(whole, mesh, (0,)),
                           lambda: dist.all_reduce(whole)),
            "reduce_scatter": (lambda: comm.reduce_scatter(whole.view(n, -1), mesh, (0,)),
                               lambda: dist.reduce_scatter_single(mine, whole)),
            "all_gather": (lambda: comm.all_gather(block, mesh, (0,)),
                           lambda: dist.all_gather_into_tensor(gathered, block)),
        }
        for name, (ours, theirs) in cases.items():
            times = {"devmesh": [], "torch": [], "torch again": []}
            cpu = {"devmesh": 0.0, "torch": 0.0}
            for _ in range(repeats):
                for who, call in (("devmesh", ours), ("torch", theirs), ("torch again", theirs)):
                    dist.barrier()
                    start, start_cpu = time.perf_counter(), time.process_time()
                    call()
                    times[who].append(time.perf_counter() - start)
                    if who in cpu:
                        cpu[who] += time.process_time() - start_cpu
            out[(name, nbytes)] = ({k: statistics.median(v) for k, v in times.items()},
                                   {k: v / repeats for k, v in cpu.items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="512,64K,1M,4M,16M")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    from devmesh.launching.launcher import launch

    sizes = [_bytes(s) for s in args.sizes.split(",")]
    per_rank = launch(run, 8, sizes, args.repeats, timeout=1800)
    print(f"8 gloo ranks; slowest rank's median of {args.repeats}, alternating; CPU: a rank's "
          "mean per call, all its threads")
    print(f"{'collective':<16}{'bytes':>10}{'devmesh':>10}{'torch':>10}{'ratio':>8}{'A/A':>7}"
          f"{'CPU devmesh':>13}{'CPU torch':>11}")
    for key in per_rank[0]:
        slowest = {who: max(r[key][0][who] for r in per_rank) for who in per_rank[0][key][0]}
        cpu = {who: statistics.mean(r[key][1][who] for r in per_rank) for who in ("devmesh",
                                                                                  "torch")}
        name, nbytes = key
        print(f"{name:<16}{nbytes:>10}{slowest['devmesh'] * 1e3:>8.1f}ms"
              f"{slowest['torch'] * 1e3:>8.1f}ms{slowest['devmesh'] / slowest['torch']:>8.2f}"
              f"{slowest['torch again'] / slowest['torch']:>7.2f}"
              f"{cpu['devmesh'] * 1e3:>11.1f}ms{cpu['torch'] * 1e3:>9.1f}ms")


if __name__ == "__main__":
    main()
