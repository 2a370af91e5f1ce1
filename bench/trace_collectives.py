"""What recording collectives costs (``devmesh run --trace-collectives``,
``DEVMESH_TRACE_COLLECTIVES=1``): torch's own ``dist.all_reduce`` timed as it is and under
devmesh's recorder (``devmesh.distributed.trace``), interleaved in rounds in the same
processes, on 2 gloo ranks. Prints rank 0's median time per collective of each, the ratio
(recorded / torch), and the recorder's own cost per call in microseconds. Message sizes: a
4-byte flag (where the fixed cost shows most) and 1 MiB.

    .venv/bin/python bench/trace_collectives.py [--calls 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time


def run(calls: int, rounds: int) -> dict[str, dict[str, float]]:
    import torch
    import torch.distributed as dist

    from devmesh import init_device_mesh
    from devmesh.distributed import trace

    init_device_mesh("cpu", (dist.get_world_size() if dist.is_initialized() else 2,))
    out: dict[str, dict[str, list[float]]] = {}
    for label, numel in (("4 B", 1), ("1 MiB", 1 << 18)):
        x = torch.ones(numel)
        times: dict[str, list[float]] = {"torch": [], "recorded": []}
        for _ in range(rounds):
            for mode in ("torch", "recorded"):
                trace.install() if mode == "recorded" else trace.uninstall()
                dist.barrier()
                n = calls if numel == 1 else max(1, calls // 20)
                start = time.perf_counter()
                for _ in range(n):
                    dist.all_reduce(x)
                times[mode].append((time.perf_counter() - start) / n)
        trace.uninstall()
        out[label] = {mode: statistics.median(t) for mode, t in times.items()}
    return out


def recorder_alone(calls: int) -> tuple[float, float]:
    """The recorder's own time per call, without a collective to hide it: a wrapped no-op
    against the bare no-op, in this process (seconds per call)."""
    import torch

    from devmesh.distributed import trace

    def collective(tensor, op=None, group=None, async_op=False):
        return None

    wrapped = trace._wrap("all_reduce", collective, trace._group_finder(collective))
    x = torch.ones(1)
    best = []
    for fn in (collective, wrapped):
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                fn(x, group=[0, 1])  # a rank list: resolved without a process group
            runs.append((time.perf_counter() - start) / calls)
        best.append(min(runs))
    return best[0], best[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from devmesh.launching.launcher import launch

    result = launch(run, 2, args.calls, args.rounds, timeout=1800)[0]
    print(f"dist.all_reduce on 2 gloo ranks, median of {args.rounds} interleaved rounds")
    print(f"{'size':<8}{'torch':>12}{'recorded':>12}{'ratio':>8}{'recorder':>12}")
    for label, t in result.items():
        print(f"{label:<8}{t['torch'] * 1e6:>10.1f}us{t['recorded'] * 1e6:>10.1f}us"
              f"{t['recorded'] / t['torch']:>8.3f}{(t['recorded'] - t['torch']) * 1e6:>10.1f}us")
    bare, wrapped = recorder_alone(20000)
    print(f"the recorder alone, around a no-op: {(wrapped - bare) * 1e6:.1f} us a call "
          f"(the ranks' difference above is inside this machine's noise when it is smaller)")


if __name__ == "__main__":
    main()
