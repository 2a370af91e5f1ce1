"""devmesh under a real Slurm: Debian's slurmctld, two slurmd and munged, started by these tests
in network namespaces of their own (``tests/slurm_cluster.py``) and stopped after. Jobs are
submitted with ``sbatch`` as a user would, the batch script written by ``devmesh plan
--sbatch``; nothing outside what the tests made is contacted. Where Slurm's daemons are not
installed or namespaces cannot be made, each test skips saying why (``.ci/run`` installs the
daemons; docs/how-to/run-under-slurm.md says how to run these tests by hand)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import slurm_cluster
from helpers import run_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "scripts"
WHY_NOT = slurm_cluster.missing()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def _environment() -> dict[str, str]:
    """What the jobs inherit from the submitting shell (sbatch exports it): this Python's
    ``devmesh`` first on PATH, torch's FutureWarnings quiet, devmesh's info lines on."""
    return {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
            "PYTHONWARNINGS": "ignore::FutureWarning", "DEVMESH_LOG": "info"}


def _planned_script(folder: Path, train: str, *, max_restarts: int = 0,
                    no_agent: bool = False) -> Path:
    """``devmesh plan``'s batch script for HSDP x TP (dp 2, shard 2, tp 2) on 2 nodes x 4
    (``no_agent``: one Slurm task per rank)."""
    script = folder / "train.sbatch"
    subprocess.run([sys.executable, "-m", "devmesh", "plan", "--hosts", "2",
                    "--devices-per-host", "4", "--dp", "2", "--shard", "2", "--tp", "2",
                    "--device", "cpu", "--time", "00:10:00", "--max-restarts",
                    str(max_restarts), "--sbatch", str(script), "--train", train,
                    *(["--no-agent"] if no_agent else [])],
                   check=True, capture_output=True, text=True, cwd=ROOT)
    return script


def _submit(cluster: slurm_cluster.SlurmCluster, script: Path, folder: Path) -> str:
    return cluster.command("sbatch", "--parsable", f"--chdir={folder}",
                           str(script)).stdout.strip().split(";")[0]


def _output(folder: Path, job: str) -> str:
    path = folder / f"devmesh-{job}.out"
    return path.read_text(errors="replace") if path.exists() else "(no output file)"


def _wait_for_file(path: Path, cluster, job: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        state = cluster.job_state(job)
        assert state not in DONE, (state, _output(path.parent.parent, job)[-4000:])
        assert time.monotonic() < deadline, f"{path.name} never written (job {state})"
        time.sleep(0.3)


def _trained_as_one_process_on_two_nodes(out: Path) -> None:
    """What the 8 ranks of hsdp_tp_hosts.py wrote: ranks 0-3 on the first node, only dp
    crossing nodes, every TP group inside one, talking over the node's own interface, and
    the parameters equal to one process's."""
    results = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")),
                     key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == list(range(8))
    for r in results:
        assert r["my_host"] == r["rank"] // 4
        assert r["crossing"] == ["dp"] and r["tp_group_hosts"] == [r["my_host"]]
        assert r["gloo_interface"] == "eth0" and r["max_difference"] < 1e-12, r


def _ranks_left(cluster) -> list[int]:
    """Processes on the nodes other than their slurmd (a step's slurmstepd, devmesh run, a
    rank)."""
    left = []
    for node in cluster.nodes:
        for pid in cluster.node_pids(node):
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            if name != "slurmd":
                left.append(pid)
    return left


def test_sbatch_of_the_planned_script_trains_hsdp_tp_on_two_nodes_as_one_process(tmp_path):
    """The script ``devmesh plan --sbatch`` writes, submitted with ``sbatch``: srun starts one
    devmesh run per node, which takes the hosts, its node rank and the rendezvous from
    Slurm's variables; the 8 ranks train equal to one process, ranks 0-3 on the first node,
    every TP group inside a node, only dp crossing nodes."""
    out = tmp_path / "out"
    out.mkdir()
    script = _planned_script(tmp_path, f"{SCRIPTS / 'hsdp_tp_hosts.py'} {out}")
    with slurm_cluster.slurm_cluster(tmp_path / "slurm", environment=_environment()) as cluster:
        job = _submit(cluster, script, tmp_path)
        state = cluster.wait_for(job, DONE, timeout=300)
        log = _output(tmp_path, job)
        assert state == "COMPLETED", (state, log[-4000:], cluster.log("slurmctld")[-2000:])
    _trained_as_one_process_on_two_nodes(out)
    for node in (0, 1):
        assert (f"from Slurm job {job} (nodes n1,n2): --nnodes 2, --node-rank {node}, "
                f"--rdzv-endpoint n1:29500, --rdzv-id slurm-{job}") in log, log[-4000:]


def test_one_slurm_task_per_rank_trains_hsdp_tp_as_one_process(tmp_path):
    """``devmesh plan --sbatch --no-agent``'s script (``srun devmesh run --no-agent``, 4
    tasks a node): each of the 8 Slurm tasks is a rank (no agent), its rank from Slurm;
    ranks 0-3 on the first node, the TP groups inside a node, equal to one process."""
    out = tmp_path / "out"
    out.mkdir()
    script = _planned_script(tmp_path, f"{SCRIPTS / 'hsdp_tp_hosts.py'} {out}",
                             no_agent=True)
    assert "#SBATCH --ntasks-per-node=4" in script.read_text()
    with slurm_cluster.slurm_cluster(tmp_path / "slurm", environment=_environment()) as cluster:
        job = _submit(cluster, script, tmp_path)
        state = cluster.wait_for(job, DONE, timeout=300)
        log = _output(tmp_path, job)
        assert state == "COMPLETED", (state, log[-4000:])
    _trained_as_one_process_on_two_nodes(out)
    assert (f"Slurm task 6 of job {job} (node 1, local rank 2): RANK 6 of 8, rendezvous "
            "n1:29500") in log, log[-4000:]


def test_scancel_stops_every_rank_within_seconds_and_leaves_no_process(tmp_path):
    """A job training on 2 nodes x 4 ranks is cancelled: the job is CANCELLED and no process
    of it (srun's step, devmesh run, a rank) is left on either node within seconds."""
    out, ckpt, marker = tmp_path / "out", tmp_path / "ckpt", tmp_path / "out" / "kill-me"
    out.mkdir()
    script = _planned_script(tmp_path, f"{SCRIPTS / 'hosts_restart.py'} {out} {ckpt} {marker}")
    with slurm_cluster.slurm_cluster(tmp_path / "slurm", environment=_environment()) as cluster:
        job = _submit(cluster, script, tmp_path)
        _wait_for_file(marker, cluster, job, timeout=300)   # every rank is past step 2
        assert _ranks_left(cluster)
        cancelled = time.monotonic()
        cluster.command("scancel", job)
        while _ranks_left(cluster) and time.monotonic() - cancelled < 60:
            time.sleep(0.2)
        gone = time.monotonic() - cancelled
        left = _ranks_left(cluster)
        state = cluster.wait_for(job, DONE, timeout=30)
    assert not left, f"still running {gone:.0f} s after scancel: {left}"
    assert gone < 15, f"the job's processes took {gone:.1f} s to stop"
    assert state == "CANCELLED", state
    assert not list(out.glob("rank*.pt"))  # nobody went on to finish


def test_a_node_lost_requeues_the_job_which_resumes_from_its_checkpoint_bit_for_bit(
        tmp_path, mesh_pool):
    """A job of ``devmesh plan --sbatch --max-restarts 1`` (so ``--requeue``) loses its second
    node after step 2's checkpoint — every process there killed at once, slurmd too, then the
    node's slurmd started again (the machine back). Slurm marks the node down, requeues the
    job, and runs it again when the node is back; every rank resumes from that checkpoint and
    ends with the parameters of an uninterrupted run, exactly (the reference: the same 8 ranks
    on the worker pool)."""
    import torch

    train = SCRIPTS / "hosts_restart.py"
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    for folder in (whole, broken):
        (folder / "out").mkdir(parents=True)
    mesh_pool.run(run_script, 8, str(train), [str(whole / "out"), str(whole / "ckpt")],
                  timeout=300)
    marker = broken / "out" / "kill-me"
    script = _planned_script(
        broken, f"{train} {broken / 'out'} {broken / 'ckpt'} {marker}", max_restarts=1)
    assert "#SBATCH --requeue" in script.read_text()
    with slurm_cluster.slurm_cluster(tmp_path / "slurm", environment=_environment()) as cluster:
        job = _submit(cluster, script, broken)
        _wait_for_file(marker, cluster, job, timeout=300)
        cluster.kill_node("n2")
        deadline = time.monotonic() + 120
        while cluster.node_state("n2").rstrip("*") not in ("down", "idle") and \
                time.monotonic() < deadline:
            time.sleep(0.5)
        state = cluster.wait_for(job, {"PENDING", *DONE}, timeout=120)
        assert state == "PENDING", (state, _output(broken, job)[-4000:])
        since = cluster.log_size("slurmd-n2")
        cluster.start_slurmd("n2")
        if cluster.wait_for_terminate("n2", job, since, timeout=120):
            cluster.start_now(job)  # else Slurm's own hold of a requeued job (121 s) ends
            # after the terminate's retry, and the job starts by itself
        fields: dict[str, str] = {}
        while time.monotonic() < deadline + 420:
            shown = cluster.command("scontrol", "-o", "show", "job", job, check=False).stdout
            fields = dict(f.split("=", 1) for f in shown.split() if "=" in f)
            if fields.get("JobState") in DONE:
                break
            time.sleep(0.5)
        log = _output(broken, job)
        assert fields.get("JobState") == "COMPLETED" and fields.get("Restarts") == "1", (
            fields, log[-4000:], cluster.log("slurmctld")[-3000:])
    expected = {int(p.stem[4:]): torch.load(p) for p in (whole / "out").glob("rank*.pt")}
    resumed = {int(p.stem[4:]): torch.load(p) for p in (broken / "out").glob("rank*.pt")}
    assert sorted(resumed) == list(range(8))
    for rank, result in resumed.items():
        assert result["start"] == 3, rank
        for name, value in expected[rank]["params"].items():
            assert torch.equal(result["params"][name], value), (rank, name)
