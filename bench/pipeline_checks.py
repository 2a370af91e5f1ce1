"""What the pipeline runner's agreement among a stage's copies costs a training step.

On a mesh with dims beside ``pp`` a stage runs on several ranks (its data-parallel copies)
that share its collectives, so the runner makes them agree at the start of each step (one
tiny all-reduce among the copies) and all-reduces the end-of-step failure flag over the whole
mesh rather than the pipeline alone (see ``parallel/pipeline/runner.py``). This runs 1F1B on
``(pp, dp) = (2, 2)`` over gloo — ``replicate`` stages of Linear(256, 256) -> ReLU blocks, 8
micro-batches of 32 — with the checks and without them (the runner told it has no copies:
the flag over the pipeline alone, as before they existed), alternating in rounds, and prints
rank 0's median step time of each and their ratio. On a 2-core machine the 4 ranks
time-share the cores, so every collective is a point where ranks wait for one another to be
scheduled; on a GPU each check is a tiny all-reduce.

A third mode keeps the checks but runs the step outside a stops scope, so the waits in the
stages' collectives are plain ``work.wait()`` rather than waits that look for a copy that
stopped every 0.5 s (``distributed/stops.py``): "polled / unpolled" is what watching for a
stopped copy costs a step.

    .venv/bin/python bench/pipeline_checks.py [--rounds 6] [--steps 5] [--depth 8]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time


def run(rounds: int, steps: int, depth: int) -> dict[str, float]:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from devmesh import init_device_mesh
    from devmesh.layout.schedule import build_schedule
    from devmesh.parallel import replicate
    from devmesh.parallel.pipeline import PipelineRunner, split_sequential

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    me = mesh.get_coordinate()[0]
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(depth)]
    stage = split_sequential(nn.Sequential(*blocks, nn.Linear(256, 10)), 2)[me]
    replicate(stage, mesh=mesh["dp"])
    runner = PipelineRunner({me: stage}, mesh, build_schedule("1f1b", 2, 8), F.cross_entropy)
    copies = runner._copies  # the group the checks run over; None turns them off
    x, y = torch.randn(256, 256), torch.randint(0, 10, (256,))
    times: dict[str, list[float]] = {"with checks": [], "without": [], "unpolled": []}
    scope = runner._scope
    for _ in range(rounds):
        for mode in times:
            runner._copies = None if mode == "without" else copies
            runner._scope = contextlib.nullcontext if mode == "unpolled" else scope
            for _ in range(steps):
                start = time.perf_counter()
                runner.step(x if me == 0 else None, y if me == 1 else None)
                times[mode].append(time.perf_counter() - start)
                stage.zero_grad()
    return {mode: statistics.median(spent) for mode, spent in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--depth", type=int, default=8)
    args = parser.parse_args()
    from devmesh.launching.launcher import launch

    medians = launch(run, 4, args.rounds, args.steps, args.depth, timeout=900)[0]
    with_checks, without = medians["with checks"], medians["without"]
    unpolled = medians["unpolled"]
    print(f"1F1B, (pp, dp) = (2, 2), rank 0's median step: with the copies' checks "
          f"{with_checks * 1e3:.2f} ms, without {without * 1e3:.2f} ms, "
          f"ratio {with_checks / without:.3f}; waits polled for a stopped copy / unpolled "
          f"{with_checks / unpolled:.3f} ({unpolled * 1e3:.2f} ms unpolled)")


if __name__ == "__main__":
    main()
