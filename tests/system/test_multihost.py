"""devmesh run over several hosts, the hosts simulated by network namespaces this test makes
(each host its own namespace and address, joined by a bridge in a namespace of its own) and
removes: nothing outside what it made is contacted. Where namespaces cannot be made, the
hosts are loopback aliases (127.0.0.2, 127.0.0.3, ...)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import netns
from netns import Host, simulated_hosts
from helpers import run_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "scripts"


def _start(host: Host, node: int | None, nodes: int, endpoint: str | None, nproc: int,
           script: Path, *args: str, extra: tuple[str, ...] = (), scratch: Path,
           env: dict[str, str] | None = None) -> subprocess.Popen:
    """Host ``node``'s ``devmesh run``, its temporary files in ``scratch/host<node>``
    (``node`` and ``endpoint`` None: no host flags, as under Slurm, whose variables ``env``
    adds)."""
    temporary = scratch / f"host{node if node is not None else host.address}"
    temporary.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONWARNINGS="ignore::FutureWarning", TMPDIR=str(temporary),
               **(env or {}))
    if not host.prefix:  # loopback aliases: the ranks' connections stay on lo
        env["GLOO_SOCKET_IFNAME"] = "lo"
    flags = (["--nnodes", str(nodes), "--node-rank", str(node), "--rdzv-endpoint", endpoint]
             if node is not None else [])
    command = [*host.prefix, sys.executable, "-m", "devmesh", "run", "-n", str(nproc), *flags,
               "--local-addr", host.address, *extra, str(script), *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env, start_new_session=True)


def test_hsdp_over_tp_on_two_hosts_trains_as_one_process_with_tp_inside_each_host(tmp_path):
    with simulated_hosts(2) as hosts:
        endpoint = f"{hosts[0].address}:29511"
        runs = [_start(host, node, 2, endpoint, 4, SCRIPTS / "hsdp_tp_hosts.py", str(tmp_path),
                       scratch=tmp_path) for node, host in enumerate(hosts)]
        outputs = [run.communicate(timeout=300) for run in runs]
    for run, (out, err) in zip(runs, outputs):
        assert run.returncode == 0, (out + err)[-4000:]
    results = sorted((json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")),
                     key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == list(range(8))
    for r in results:
        assert r["my_host"] == r["rank"] // 4           # ranks 0-3 on host 0, 4-7 on host 1
        assert r["crossing"] == ["dp"]                  # only the replicas span hosts
        assert r["tp_group_hosts"] == [r["my_host"]]    # every TP group inside one host
        assert r["max_difference"] < 1e-12, r
        if hosts[0].prefix:  # namespaces: the ranks talk over the host's own interface
            assert r["gloo_interface"] == "eth0"


def _four_ranks_written(runs: list[subprocess.Popen], folder: Path):
    """Each host's output, and what ranks 0-3 of node_ranks.py wrote, by rank."""
    outputs = [run.communicate(timeout=300) for run in runs]
    for run, (out, err) in zip(runs, outputs):
        assert run.returncode == 0, (out + err)[-4000:]
    results = {r["rank"]: r for r in (json.loads(p.read_text())
                                      for p in folder.glob("rank*.json"))}
    assert sorted(results) == [0, 1, 2, 3]
    return outputs, results


def test_each_host_runs_the_ranks_of_its_node_rank_whatever_the_addresses(tmp_path):
    """Host 0 (the rendezvous host) has the higher address: it still runs ranks 0-1 — in its
    ranks' RANK and GROUP_RANK, its output's [rankN] lines, and mesh.hosts() — and host 1
    ranks 2-3 (torch's c10d rendezvous alone numbers hosts by sorting their addresses)."""
    with simulated_hosts(2, descending=True) as hosts:
        assert hosts[0].address > hosts[1].address
        endpoint = f"{hosts[0].address}:29516"
        runs = [_start(host, node, 2, endpoint, 2, SCRIPTS / "node_ranks.py", str(tmp_path),
                       endpoint, scratch=tmp_path) for node, host in enumerate(hosts)]
        outputs, results = _four_ranks_written(runs, tmp_path)
    for rank, r in results.items():
        node = rank // 2
        assert r["address"] == hosts[node].address, r
        assert r["env_rank"] == rank and r["group_rank"] == node
        assert r["hosts"] == [[0, 0], [1, 1]] and not r["tp_crosses"]
    for node, (out, _) in enumerate(outputs):
        for rank in (2 * node, 2 * node + 1):
            assert f"[rank{rank}]:rank {rank} runs on {hosts[node].address}" in out, out


def test_inside_a_slurm_job_devmesh_run_needs_no_host_flags(tmp_path):
    """Each host's devmesh run started as srun starts it on each node of a job — Slurm's
    variables in its environment, no --nnodes, --node-rank or --rdzv-endpoint: the hosts
    come from SLURM_JOB_NODELIST, each host's ranks from its SLURM_NODEID (the first listed
    host runs ranks 0-1), the rendezvous at the first host, the job's id as its name."""
    with simulated_hosts(2) as hosts:
        nodelist = ",".join(h.address for h in hosts)
        runs = []
        for node, host in enumerate(hosts):
            slurm = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": nodelist,
                     "SLURM_NODEID": str(node), "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
                     "MASTER_PORT": "29519", "DEVMESH_LOG": "info"}
            runs.append(_start(host, None, 2, None, 2, SCRIPTS / "node_ranks.py", str(tmp_path),
                               f"{hosts[0].address}:29519", scratch=tmp_path, env=slurm))
        outputs, results = _four_ranks_written(runs, tmp_path)
    for rank, r in results.items():
        assert r["address"] == hosts[rank // 2].address and r["group_rank"] == rank // 2
    for node, (_, err) in enumerate(outputs):
        assert (f"from Slurm job 77 (nodes {nodelist}): --nnodes 2, --node-rank {node}, "
                f"--rdzv-endpoint {hosts[0].address}:29519, --rdzv-id slurm-77") in err, err


def test_two_hosts_given_one_node_rank_are_refused_naming_them(tmp_path):
    with simulated_hosts(2) as hosts:
        endpoint = f"{hosts[0].address}:29517"
        runs = [_start(host, 0, 2, endpoint, 1, SCRIPTS / "node_ranks.py", str(tmp_path),
                       endpoint, scratch=tmp_path) for host in hosts]
        outputs = [run.communicate(timeout=300) for run in runs]
    for run, (out, err) in zip(runs, outputs):
        assert run.returncode != 0
        assert (f"each of the 2 hosts needs its own --node-rank in 0..1, but --node-rank 0 on "
                in err), err[-3000:]
    assert not list(tmp_path.glob("rank*.json"))


def _kill_host(host: Host, run: subprocess.Popen) -> None:
    """Every process of the host, at once (a machine lost), or the run's process group."""
    if host.prefix:
        netns.kill_all(host.prefix[-1])
    else:
        os.killpg(run.pid, signal.SIGKILL)
    run.wait(timeout=60)


def _final(folder: Path) -> dict[int, dict]:
    import torch

    return {int(p.stem[4:]): torch.load(p) for p in sorted(folder.glob("rank*.pt"))}


def test_a_host_killed_under_max_restarts_resumes_bit_for_bit(tmp_path, mesh_pool):
    """Host 1 is killed outright after step 2's checkpoint and started again (as a cluster
    scheduler would); host 0's ranks restart (--max-restarts 1), every rank resumes from the
    checkpoint, and the final parameters equal an uninterrupted run's exactly (run on the
    worker pool: the same 8 ranks, one host)."""
    import time

    import torch

    script = SCRIPTS / "hosts_restart.py"
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    for folder in (whole, broken):
        (folder / "out").mkdir(parents=True)
    restarts = ("--max-restarts", "1")
    mesh_pool.run(run_script, 8, str(script), [str(whole / "out"), str(whole / "ckpt")],
                  timeout=300)
    with simulated_hosts(2) as hosts:
        marker = broken / "kill-me"
        args = (str(broken / "out"), str(broken / "ckpt"), str(marker))
        endpoint = f"{hosts[0].address}:29513"
        runs = [_start(h, n, 2, endpoint, 4, script, *args, extra=restarts, scratch=tmp_path)
                for n, h in enumerate(hosts)]
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert time.monotonic() < deadline and runs[0].poll() is None, "never reached step 2"
            time.sleep(0.2)
        _kill_host(hosts[1], runs[1])
        runs[1] = _start(hosts[1], 1, 2, endpoint, 4, script, *args, extra=restarts,
                         scratch=tmp_path)
        outputs = [run.communicate(timeout=300) for run in runs]
    for run, (out, err) in zip(runs, outputs):
        assert run.returncode == 0, (out + err)[-4000:]
    expected, resumed = _final(whole / "out"), _final(broken / "out")
    assert sorted(resumed) == list(range(8))
    for rank, result in resumed.items():
        assert result["start"] == 3, rank  # every rank resumed after step 2's checkpoint
        for name, value in expected[rank]["params"].items():
            assert torch.equal(result["params"][name], value), (rank, name)


def test_a_host_cut_off_makes_every_other_rank_raise_naming_it_and_nothing_is_left(tmp_path):
    """After a first all-reduce, host 1's link goes down (its interface, in its namespace); the
    next all-reduce over dp (across the hosts, timeout 15 s) raises on every rank of host 0
    naming host 1, the ranks of host 1 raise too, host 1's devmesh run says it is cut off,
    and both runs end, leaving no process in either host."""
    import time

    with simulated_hosts(2) as hosts:
        if not hosts[0].prefix:
            pytest.skip("a link can be cut only between network namespaces; this machine "
                        "cannot make them (the other multi-host tests ran on loopback aliases)")
        endpoint = f"{hosts[0].address}:29514"
        runs = [_start(h, n, 2, endpoint, 4, SCRIPTS / "hosts_link_cut.py", str(tmp_path),
                       scratch=tmp_path) for n, h in enumerate(hosts)]
        deadline = time.monotonic() + 240
        while len(list(tmp_path.glob("ready*"))) < 8:
            assert time.monotonic() < deadline and all(r.poll() is None for r in runs)
            time.sleep(0.2)
        netns.ip("-n", hosts[1].prefix[-1], "link", "set", "eth0", "down")
        (tmp_path / "cut").touch()
        cut = time.monotonic()
        outputs = [run.communicate(timeout=180) for run in runs]
        took = time.monotonic() - cut
        left = {h.prefix[-1]: subprocess.run(["ip", "netns", "pids", h.prefix[-1]],
                                             capture_output=True, text=True).stdout.split()
                for h in hosts}
    assert left == {h.prefix[-1]: [] for h in hosts}
    written = {node: sorted(p.name for p in (tmp_path / f"host{node}").iterdir()
                            if p.name.startswith("devmesh-")) for node in (0, 1)}
    assert written == {0: [], 1: []}  # both runs removed their folders, the cut-off one too
    assert took < 120, took
    assert [run.returncode for run in runs] == [1, 1]
    assert ("devmesh run: host 0's rendezvous at 10.201.0.1:29514 cannot be reached from this "
            "host (host 1) and its ranks have stopped: this host is cut off from the others; "
            "check its network link") in outputs[1][1]
    results = {r["rank"]: r for r in (json.loads(p.read_text())
                                      for p in tmp_path.glob("rank*.json"))}
    assert sorted(results) == list(range(8))
    for rank in range(4):
        error = results[rank]["error"]
        assert error.startswith(f"CollectiveTimeoutError: [rank {rank}] all_reduce over dp"), error
        assert (f"ranks [{rank + 4}] never entered it — they are stuck elsewhere in their code, "
                "or dead, or host 1 cannot be reached (its link down)") in error
        assert results[rank]["seconds"] < 15 + 10  # the timeout, and the grace to ask
    for rank in range(4, 8):
        assert results[rank]["error"] is not None
