"""The dry run at scale: ``devmesh plan --model llama3-8b`` for 1,024 and 16,384 ranks, and
the mesh search (``--world N --search``) for as many, with the wall time and peak memory each
took (each in a fresh process, so the peak resident memory is its own).

torch has no planner to compare with: its fake process group is what the dry run runs on,
and torchtitan's memory estimator was removed. What is printed is devmesh's output and its
cost on this machine.

    .venv/bin/python bench/dry_run.py [--tflops 400 --bandwidth tp=300,25] [--only search]
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
SEARCHES = [(1024, "llama3-8b"), (16384, "llama3-8b:batch=4096")]


def run(args: list[str], label: str) -> None:
    start = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    done = subprocess.run([sys.executable, "-m", "devmesh", "plan", *args],
                          capture_output=True, text=True)
    seconds = time.perf_counter() - start
    peak = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 2**20
    print(done.stdout)
    if done.returncode not in (0, 1):
        print(done.stderr)
    print(f"== {label}: took {seconds:.1f} s and at most {peak:.2f} GiB of memory ==\n",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tflops", default="400")
    parser.add_argument("--bandwidth", default="tp=300,25")
    parser.add_argument("--device-memory", default="80GB")
    parser.add_argument("--latency", default="20us")
    parser.add_argument("--only", choices=("mesh", "search"), default=None)
    args = parser.parse_args()
    costs = ["--device-memory", args.device_memory, "--tflops", args.tflops,
             "--bandwidth", args.bandwidth]
    if args.only != "search":
        for ranks, mesh, model in JOBS:
            run(["--model", model, "--mesh", mesh, *costs], f"{ranks:,} ranks ({mesh})")
    if args.only != "mesh":
        for ranks, model in SEARCHES:
            run(["--model", model, "--world", str(ranks), "--search", "--latency", args.latency,
                 *costs], f"the search over {ranks:,} ranks")

if __name__ == "__main__":
    main()
