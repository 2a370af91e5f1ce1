"""Where a pipeline step's time goes, action by action: each action's measured start on its
rank against its start in the schedule replayed with the step's own measured compute (and
the measured one-way message time), on 2 ranks of ``bench/pipeline.py``'s model.

    .venv/bin/python bench/pipeline_timeline.py 1f1b [--depth 256] [--steps 4]
    .venv/bin/python bench/pipeline_timeline.py interleaved-1f1b

Prints the step on each rank and the replay's length, then per action: when the runner
entered it (ms from the step's start, the receive wait included), when the replay starts it,
the difference ("late"), and its compute. An action whose compute starts later than the
replay says has paid for something the schedule does not model: a steadily growing "late"
along the critical path is a per-action cost of the runner and its message calls. devmesh
only (torch's schedule has no per-action hook to time).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def timed_steps(name: str, depth: int, steps: int) -> list[tuple[float, float, list, dict]]:
    """On each rank: per step, (start, end, [(action, entered, left)], compute per action)."""
    import warnings

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import pipeline as bench
    from devmesh import init_device_mesh
    from devmesh.layout.schedule import build_schedule
    from devmesh.parallel.pipeline import PipelineRunner, split_sequential

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    ranks = 2
    mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=("pp",))
    me = mesh.get_coordinate()[0]
    virtual, mine = bench.my_stages(name, ranks, me)
    parts = split_sequential(bench.build_model(depth), ranks * virtual)
    plan = build_schedule(name, ranks, bench.MICRO, virtual)
    runner = PipelineRunner({s: parts[s] for s in mine}, mesh, plan, F.cross_entropy)
    entered: list = []
    for attr in ("_forward", "_backward", "_weight_grads"):
        inner = getattr(runner, attr)

        def timed(step, action, inner=inner):
            start = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
            inner(step, action)
            entered.append((action, start, time.perf_counter()))
        setattr(runner, attr, timed)
    results = []
    for i in range(steps):
        gen = torch.Generator().manual_seed(i)
        x = torch.randn(bench.BATCH, 512, generator=gen)
        y = torch.randint(0, 10, (bench.BATCH,), generator=gen)
        dist.barrier()
        entered.clear()
        start = time.perf_counter()
        runner.step(x if 0 in mine else None, y if ranks * virtual - 1 in mine else None)
        results.append((start, time.perf_counter(), list(entered), dict(runner.compute_seconds)))
        for p in runner.module.parameters():
            p.grad = None
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("schedule", help="a schedule of bench/pipeline.py, e.g. 1f1b")
    parser.add_argument("--depth", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4, help="the last one is printed")
    parser.add_argument("--latency", type=float, default=0.14,
                        help="one-way message time (ms) for the replay (bench/pipeline.py "
                             "measures it: 0.14 ms here)")
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 << 20))  # as bench/pipeline.py
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(256 << 20))
    import pipeline as bench
    from devmesh.launching.launcher import launch
    from devmesh.layout.schedule import build_schedule

    virtual = 2 if args.schedule in bench.TWO_PER_RANK else 1
    per_rank = launch(timed_steps, 2, args.schedule, args.depth, args.steps, timeout=900)
    last = [steps[-1] for steps in per_rank]
    origin = min(start for start, _, _, _ in last)
    costs = {a: t for _, _, _, compute in last for a, t in compute.items()}
    replay = {t.action: t for t in build_schedule(args.schedule, 2, bench.MICRO, virtual)
              .simulate(costs, args.latency / 1e3)}
    steps_ms = [f"{(end - start) * 1e3:.1f}" for start, end, _, _ in last]
    print(f"{args.schedule}, depth {args.depth}: step {' / '.join(steps_ms)} ms on ranks 0 / 1; "
          f"replayed {max(t.end for t in replay.values()) * 1e3:.1f} ms")
    print(f"{'rank':>4} {'action':<9}{'entered':>9}{'replay':>9}{'late':>8}{'compute':>9}")
    for rank, (_, _, entered, compute) in enumerate(last):
        for action, start, _ in entered:
            at = (start - origin) * 1e3
            planned = replay[action].start * 1e3
            print(f"{rank:>4} {str(action):<9}{at:>9.1f}{planned:>9.1f}{at - planned:>+8.1f}"
                  f"{compute.get(action, 0.0) * 1e3:>9.1f}")


if __name__ == "__main__":
    main()
