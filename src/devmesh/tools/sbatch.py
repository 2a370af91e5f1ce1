"""``devmesh plan --hosts H --devices-per-host G ... --sbatch FILE``: the Slurm batch script
that runs a planned mesh — ``H`` nodes, one ``srun`` task per node, ``G`` GPUs each (or ``G``
CPU ranks, ``--device cpu``), and the ``srun devmesh run`` line, which takes the hosts, each node's rank and the rendezvous from
Slurm's environment (:mod:`devmesh.launching.slurm`). With ``--no-agent``, one task per
rank instead (``G`` per node), each made its rank by ``devmesh run --no-agent``."""

from __future__ import annotations

import os
import re
import shlex
import tempfile
from pathlib import Path

from devmesh.tools.cluster_plan import ClusterPlan

__all__ = ["sbatch_script", "write_sbatch"]

_TIME = re.compile(r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$")  # Slurm's forms: MM, HH:MM:SS, D-HH:MM


def sbatch_script(plan: ClusterPlan, train: str, *, time: str = "01:00:00",
                  max_restarts: int = 0, job_name: str = "devmesh",
                  device: str = "cuda", task_per_rank: bool = False) -> str:
    """The script's text (``train``: the script and its arguments, as typed; ``device``
    "cuda" asks for ``G`` GPUs per node, "cpu" for none; ``task_per_rank``: one Slurm task
    per rank, no agent — a failure then restarts nothing but the requeued job)."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device {device!r}: give 'cuda' or 'cpu'")
    if not plan.ok:
        raise ValueError("the plan is not valid: " + "; ".join(plan.errors))
    if not train.strip():
        raise ValueError("--sbatch needs --train 'SCRIPT ARGS...', the training command")
    if not _TIME.match(time):
        raise ValueError(f"--time {time!r}: give Slurm's form, e.g. 04:00:00 or 1-00:00:00")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts {max_restarts}: give 0 or more")
    names = [n for n in ("pp", "dp", "shard", "cp", "tp") if plan.degrees.get(n, 1) > 1]
    shape = ", ".join(str(plan.degrees[n]) for n in names) or "1"
    mesh = " x ".join(f"{n}={plan.degrees[n]}" for n in names) or "one rank"
    crossing = ", ".join(plan.crossing) or "none"
    g = plan.devices_per_host
    lines = [
        "#!/bin/bash",
        f"# devmesh plan: {mesh} on {plan.hosts} nodes x {g} "
        f"{'GPUs' if device == 'cuda' else 'CPU ranks'}; dims crossing nodes: {crossing}",
        f'# the script builds: init_device_mesh("{device}", ({shape}{"," if len(names) == 1 else ""}), '
        f"mesh_dim_names={tuple(names)!r})",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={plan.hosts}",
        f"#SBATCH --ntasks-per-node={g if task_per_rank else 1}",
        *([f"#SBATCH --gpus-per-node={g}"] if device == "cuda" else []),
        f"#SBATCH --time={time}",
        f"#SBATCH --output={job_name}-%j.out",
    ]
    if max_restarts:  # a node lost: Slurm may requeue the job, which resumes from its checkpoint
        lines.append("#SBATCH --requeue")
    command = " ".join(shlex.quote(part) for part in shlex.split(train))
    if task_per_rank:
        how = ["# one Slurm task per rank (a node's ranks consecutive: srun's block distribution);",
               "# each task takes its rank and the rendezvous from Slurm's environment"]
        launch = f"--distribution=block devmesh run --no-agent {command}"
    else:
        how = ["# one devmesh run per node: the hosts, its node rank and the rendezvous come from",
               "# Slurm's environment; it starts the node's ranks itself"]
        launch = f"devmesh run -n {g} --max-restarts {max_restarts} {command}"
    lines += ["", "set -euo pipefail", *how, f"srun --kill-on-bad-exit=1 {launch}", ""]
    return "\n".join(lines)


def write_sbatch(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a temporary file moved into place)."""
    target = Path(path)
    handle, staging = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent or ".")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(staging, 0o755)
        os.replace(staging, target)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
