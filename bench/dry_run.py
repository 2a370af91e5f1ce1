"""The dry run at scale: ``devmesh plan --model llama3-8b`` for 1,024 and 16,384 ranks, with
the wall time and peak memory the dry run itself took (each in a fresh process, so the peak
resident memory is the dry run's own).

torch has no planner to compare with: its fake process group is what the dry run runs on,
and torchtitan's memory estimator was removed. What is printed is devmesh's output and its
cost on this machine.

    .venv/bin/python bench/dry_run.py [--tflops 400 --bandwidth tp=300,dp=25,pp=25]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time

JOBS = [  # (ranks, mesh, model): Llama-3-8B's shape, the batch grown with the data ranks
    (1024, "pp=4,dp=32,tp=8", "llama3-8b"),
    (16384, "pp=4,dp=512,tp=8", "llama3-8b:batch=4096"),
    (1024, "pp=4,dp=4,shard=8,tp=8", "llama3-8b"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tflops", default="400")
    parser.add_argument("--bandwidth", default="tp=300,25")
    parser.add_argument("--device-memory", default="80GB")
    args = parser.parse_args()
    for ranks, mesh, model in JOBS:
        start = time.perf_counter()
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        done = subprocess.run(
            [sys.executable, "-m", "devmesh", "plan", "--model", model, "--mesh", mesh,
             "--device-memory", args.device_memory, "--tflops", args.tflops,
             "--bandwidth", args.bandwidth], capture_output=True, text=True)
        seconds = time.perf_counter() - start
        peak = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 2**20
        print(done.stdout)
        if done.returncode not in (0, 1):
            print(done.stderr)
        print(f"== {ranks:,} ranks ({mesh}): the dry run took {seconds:.1f} s and at most "
              f"{peak:.2f} GiB of memory ==\n")


if __name__ == "__main__":
    main()
