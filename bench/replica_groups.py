"""Replica groups against torch's DDP: the quorum's cost on a healthy step, and the time a
failure costs — a group healed from a live one while the other steps on, against the whole
job restarted from its last checkpoint.

Same model (bench/train_step.py's 8.4M-parameter MLP, batch 32 per rank), same data, in one
run, every rank one process on this host:

- **healthy steps**: ``devmesh run --replica-groups 2 -n 1`` (two groups of one rank, each
  step through ``ReplicaGroups.step()``) against ``devmesh run -n 2`` with torch's
  ``DistributedDataParallel`` (the same two replicas, gradients averaged by DDP), and
  against the same averaging without the quorum (a copy of each gradient, all all-reduced at
  once after backward, over a plain gloo group of the two). Each is launched ``--repeats``
  times, in turn; a run's step time is the time between its steps after ``--warmup`` (the
  period: what the job pays per step), and the median over the repeats is printed with the
  spread of the runs, since launches of the same job differ by several percent here. The
  quorum's own cost is measured inside the step, where it is paid: the seconds each
  ``step()`` waited on the coordinator (``StepResult.quorum_seconds``: the round's quorum
  and its decision, the other group's lateness included), as a share of the step;
- **a failure**: the second replica SIGKILLed at step ``--kill-at``. Replica groups: the seconds
  from the death until the survivor committed its next step, and until the restarted group
  healed from it (no checkpoint read). DDP with ``--max-restarts 1``: every rank restarts and
  loads the checkpoint saved after each step (``torch.save`` of the model and optimizer, rank 0:
  the best case of a whole-job restart, no step lost); the seconds from the death until the
  first step after the restart. The healthy DDP run saves no checkpoint.

    .venv/bin/python bench/replica_groups.py [--steps 60] [--repeats 3] [--kill-at 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent('''
    import json, os, signal, sys, time
    import torch
    import torch.distributed as dist
    from torch import nn

    out, mode, steps, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    sys.path.insert(0, sys.argv[5])
    from train_step import build_model

    torch.set_num_threads(1)
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if mode == "replicas":
        from devmesh.fault import ReplicaGroups
        replicas = ReplicaGroups(model, opt)
        who, count = replicas.group, lambda: replicas.step_count
    elif mode == "plain":  # ReplicaGroups' averaging without its quorum
        dist.init_process_group("gloo")
        who, step_no = dist.get_rank(), [0]
        count = lambda: step_no[0]
    else:
        dist.init_process_group("gloo")
        who = dist.get_rank()
        ckpt = os.path.join(out, "ckpt.pt")
        start = 0
        if os.path.exists(ckpt):
            saved = torch.load(ckpt, weights_only=False)
            model.load_state_dict(saved["model"]); opt.load_state_dict(saved["opt"])
            start = saved["step"] + 1
        model = nn.parallel.DistributedDataParallel(model)
        step_no = [start]
        count = lambda: step_no[0]
    log = open(os.path.join(out, f"{mode}-{who}.jsonl"), "a")
    while count() < steps:
        step = count()
        if (kill_at >= 0 and who == 1 and step == kill_at and attempt == "0"
                and not os.path.exists(os.path.join(out, "died"))):
            open(os.path.join(out, "died"), "w").write(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        began = time.perf_counter()
        g = torch.Generator().manual_seed(1000 * who + step)
        x = torch.randn(32, 512, generator=g)
        nn.functional.mse_loss(model(x), x).backward()
        healed, waited = False, 0.0
        if mode == "replicas":
            result = replicas.step()
            healed, waited = result.healed, result.quorum_seconds
        elif mode == "plain":
            with torch.no_grad():
                grads = [p.grad for p in model.parameters()]
                copies = [g.clone() for g in grads]
                for work in [dist.all_reduce(c, async_op=True) for c in copies]:
                    work.wait()
                for g, c in zip(grads, copies):
                    g.copy_(c.div_(2))
            opt.step()
            step_no[0] += 1
        else:
            opt.step()
            if who == 0 and kill_at >= 0:  # the fault run resumes from it
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "step": step}, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
            step_no[0] += 1
        opt.zero_grad()
        log.write(json.dumps({"step": step, "t": time.time(), "healed": healed, "quorum": waited,
                              "attempt": attempt,
                              "seconds": time.perf_counter() - began}) + "\\n")
        log.flush()
    if mode == "replicas":
        replicas.close()
''')


def _run(folder: Path, mode: str, steps: int, kill_at: int) -> dict[int, list[dict]]:
    folder.mkdir()
    script = folder / "train.py"
    script.write_text(SCRIPT)
    launch = (["--replica-groups", "2", "-n", "1"] if mode == "replicas" else ["-n", "2"])
    command = [sys.executable, "-m", "devmesh", "run", *launch, "--max-restarts", "1",
               str(script), str(folder), mode, str(steps), str(kill_at), str(ROOT / "bench")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, DEVMESH_REPLICA_TIMEOUT="3"))
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
    return {who: [json.loads(line) for line in
                  (folder / f"{mode}-{who}.jsonl").read_text().splitlines()]
            for who in (0, 1)}


def _period(logs: dict[int, list[dict]], warmup: int) -> float:
    """Seconds per step after ``warmup`` steps: the time between the steps' ends, the
    slower replica's."""
    return max((rows[-1]["t"] - rows[warmup]["t"]) / (len(rows) - 1 - warmup)
               for rows in logs.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        tmp = Path(tmp)
        periods: dict[str, list[float]] = {"ddp": [], "plain": [], "replicas": []}
        waits: list[float] = []
        for repeat in range(args.repeats):
            for mode in periods:
                logs = _run(tmp / f"healthy-{mode}-{repeat}", mode, args.steps, -1)
                periods[mode].append(_period(logs, args.warmup))
                if mode == "replicas":
                    waits += [statistics.median(r["quorum"] for r in rows[args.warmup:])
                              for rows in logs.values()]
        step = {mode: statistics.median(values) for mode, values in periods.items()}

        def runs(mode):
            return ", ".join(f"{v * 1e3:.1f}" for v in periods[mode])

        print(f"healthy step (time per step after {args.warmup}, slower replica; median of "
              f"{args.repeats} runs each, in turn):")
        print(f"  replica groups {step['replicas'] * 1e3:.1f} ms ({runs('replicas')}), torch "
              f"DDP {step['ddp'] * 1e3:.1f} ms ({runs('ddp')}): ratio "
              f"{step['replicas'] / step['ddp']:.3f}")
        print(f"  the same averaging without the quorum {step['plain'] * 1e3:.1f} ms "
              f"({runs('plain')}): replica groups {step['replicas'] / step['plain']:.3f} of it")
        wait = statistics.median(waits)
        print(f"the quorum's own cost, timed inside step() (waiting for the round's quorum and "
              f"its decision): median {wait * 1e3:.1f} ms a step, "
              f"{100 * wait / step['replicas']:.1f}% of the step")
        rows = {}
        for mode in ("ddp", "replicas"):
            folder = tmp / f"fault-{mode}"
            logs = _run(folder, mode, args.steps, args.kill_at)
            died = float((folder / "died").read_text())
            survivor_next = min(r["t"] for r in logs[0] if r["step"] >= args.kill_at)
            if mode == "replicas":
                back = min(r["t"] for r in logs[1] if r["healed"])
            else:
                back = min(r["t"] for r in logs[0] if r["attempt"] != "0")
            rows[mode] = (survivor_next - died, back - died)
        print(f"a replica SIGKILLed at step {args.kill_at}:")
        print(f"  replica groups: the other committed its next step {rows['replicas'][0]:.2f} s "
              f"after the death, the restarted group healed {rows['replicas'][1]:.2f} s after it")
        print(f"  torch DDP + whole-job restart from the checkpoint: the first step after the "
              f"restart {rows['ddp'][1]:.2f} s after the death (nothing stepped meanwhile)")


if __name__ == "__main__":
    main()
