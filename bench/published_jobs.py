"""The dry run against the jobs torchtitan published (its
``benchmarks/llama3_h100_202412_torchtitan.md``: Llama 3.1 8B, 70B and 405B on H100s): for
each row the dry run can express, the memory it predicts for the largest rank (its ``device``
figure: the step's measured peak plus the default allowance) against the published peak,
and the tokens per second per GPU its predicted step gives at one stated efficiency against
the published throughput.

torch has no planner to compare with; what is compared is devmesh's prediction and a
published measurement. The efficiency is stated, not fitted: ``--tflops`` (default 396, 40%
of an H100 SXM's 989 dense bfloat16 TFLOP/s) for every row, including those the published
runs made faster with torch.compile and Float8; ``--in-host`` GB/s for the dims inside a host
of 8 GPUs (tp, and every dim of an 8-GPU job) and ``--between-hosts`` for the others.

    .venv/bin/python bench/published_jobs.py [--tflops 396] [--in-host 300]
        [--between-hosts 40] [--only t1,t5a]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

GiB = 2**30

# (name, the published run, model, mesh, checkpointing, more flags, GPUs, published
# memory GiB, published tokens per second per GPU)
ROWS = [
    ("t1", "8B FSDP 8, table 1", "llama3-8b:batch=16", "shard=8", "selective", [], 8,
     82.4, 5762),
    ("t3", "8B FSDP 128, table 3", "llama3-8b:batch=256", "shard=128", "selective", [], 128,
     67.0, 5605),
    ("t4", "70B FSDP 32 x TP 8, table 4 (compile, Float8)", "llama3-70b:batch=512",
     "shard=32,tp=8", "full", [], 256, 71.9, 829),
    ("t2a", "8B FSDP 8, seq 32K, table 2 (compile, Float8)", "llama3-8b:batch=8,seq=32768",
     "shard=8", "full", [], 8, 83.9, 3890),
    ("t2b", "8B FSDP 4 x CP 2, seq 64K, table 2", "llama3-8b:batch=4,seq=65536",
     "shard=4,cp=2", "full", [], 8, 84.2, 2540),
    ("t2c", "8B FSDP 2 x CP 4, seq 128K, table 2", "llama3-8b:batch=2,seq=131072",
     "shard=2,cp=4", "full", [], 8, 84.0, 1071),
    ("t2d", "8B FSDP 1 x CP 8, seq 256K, table 2", "llama3-8b:batch=1,seq=262144",
     "cp=8", "full", [], 8, 84.5, 548),
    ("t6a", "405B PP 8 x FSDP 8 x TP 8, seq 32K, table 6 (compile, Float8, async TP)",
     "llama3-405b:batch=64,seq=32768", "pp=8,shard=8,tp=8", "full",
     ["--microbatches", "8"], 512, 75.3, 76),
    ("t6b", "405B, FSDP 4 x CP 2, seq 64K, table 6", "llama3-405b:batch=32,seq=65536",
     "pp=8,shard=4,cp=2,tp=8", "full", ["--microbatches", "8"], 512, 75.9, 47),
    ("t6c", "405B, FSDP 2 x CP 4, seq 128K, table 6", "llama3-405b:batch=16,seq=131072",
     "pp=8,shard=2,cp=4,tp=8", "full", ["--microbatches", "8"], 512, 77.1, 31),
    ("t6d", "405B, FSDP 1 x CP 8, seq 256K, table 6", "llama3-405b:batch=8,seq=262144",
     "pp=8,cp=8,tp=8", "full", ["--microbatches", "8"], 512, 84.9, 16),
    # table 5 names no micro-batch count: torchtitan's of the time split a step into one
    # micro-batch per stage (8 of 4 sequences; interleaved, 16 stages: 16 of 2)
    ("t5a", "405B PP 8 x FSDP 8 x TP 8, 1F1B x 8, table 5", "llama3-405b:batch=256",
     "pp=8,shard=8,tp=8", "full", ["--microbatches", "8"], 512, 82.5, 100),
    ("t5b", "the same, interleaved 1F1B x 16, table 5", "llama3-405b:batch=256",
     "pp=8,shard=8,tp=8", "full", ["--microbatches", "16", "--schedule", "interleaved-1f1b"],
     512, 72.7, 128),
]


def bandwidths(mesh: str, gpus: int, in_host: float, between_hosts: float) -> str:
    """``--bandwidth``: every dim of a one-host job, and ``tp``, inside a host."""
    if gpus <= 8:
        return f"{in_host:g}"
    inside = [item.split("=")[0] for item in mesh.split(",") if item.startswith("tp=")]
    return ",".join([f"{dim}={in_host:g}" for dim in inside] + [f"{between_hosts:g}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tflops", type=float, default=396.0)
    parser.add_argument("--in-host", type=float, default=300.0)
    parser.add_argument("--between-hosts", type=float, default=40.0)
    parser.add_argument("--only", default=None, help="row names, e.g. t1,t5a")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else None
    print(f"at {args.tflops:g} TFLOP/s per GPU, {args.in_host:g} GB/s inside a host, "
          f"{args.between_hosts:g} GB/s between hosts; memory: the largest rank's device "
          "figure (default allowance)")
    print(f"{'row':<5}{'memory':>9}{'published':>11}{'ratio':>7}{'TPS/GPU':>10}"
          f"{'published':>11}{'ratio':>7}  slowest stage's parts (s)")
    for name, what, model, mesh, checkpointing, extra, gpus, memory, tps in ROWS:
        if only and name not in only:
            continue
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "devmesh", "plan", "--model", model, "--mesh", mesh,
             "--activation-checkpointing", checkpointing, *extra, "--tflops",
             f"{args.tflops:g}", "--bandwidth",
             bandwidths(mesh, gpus, args.in_host, args.between_hosts), "--json"],
            capture_output=True, text=True)
        if done.returncode not in (0, 1):
            print(f"{name}: the dry run failed: {done.stderr.strip()[-400:]}")
            continue
        report = json.loads(done.stdout)
        config = report["config"]
        slowest = max(report["ranks"], key=lambda r: r["predicted_seconds"]["step"])
        step = slowest["predicted_seconds"]["step"]
        predicted_memory = max(r["device_bytes"] for r in report["ranks"]) / GiB
        predicted_tps = config["batch"] * config["seq"] / gpus / step
        parts = ", ".join(f"{k} {v:.1f}" for k, v in slowest["predicted_seconds"].items()
                          if v and k != "step")
        print(f"{name:<5}{predicted_memory:>8.1f}G{memory:>10.1f}G{predicted_memory / memory:>7.2f}"
              f"{predicted_tps:>10,.0f}{tps:>11,}{predicted_tps / tps:>7.2f}  step {step:.2f}: "
              f"{parts}  [{what}; {time.perf_counter() - start:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
