"""Hosts and topology (pure and with two simulated hosts), devmesh plan / doctor / bench,
and mesh pictures."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devmesh.tools.cluster_plan import ModelSize, plan_cluster
from helpers import port_for_a_server
from devmesh.errors import MeshShapeError
from devmesh.layout import MeshLayout
from devmesh.layout.topology import (
    check_heavy_dims,
    contiguous_hosts,
    crossing_dims,
    hybrid_layout,
)

ROOT = Path(__file__).resolve().parents[2]
DEVMESH = [sys.executable, "-m", "devmesh.tools.cli"]


def _run(args, timeout=300):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3)), min_size=1, max_size=3))
def test_hybrid_layout_puts_intra_factors_inside_hosts(factors):
    intra = tuple(a for a, _ in factors)
    inter = tuple(b for _, b in factors)
    layout = hybrid_layout(intra, inter)
    per_host = int(np.prod(intra))
    host_of = contiguous_hosts(layout.size, per_host)
    assert sorted(layout.rank_list()) == list(range(layout.size))
    for coord in itertools.product(*[range(s) for s in layout.shape]):
        inter_idx = [c // a for c, a in zip(coord, intra)]
        intra_idx = [c % a for c, a in zip(coord, intra)]
        host = int(np.ravel_multi_index(inter_idx, inter)) if inter else 0
        device = int(np.ravel_multi_index(intra_idx, intra))
        assert layout.rank_at(coord) == host * per_host + device
        assert host_of[layout.rank_at(coord)] == host
    for d in crossing_dims(layout, host_of):
        assert inter[d] > 1  # only dims with an across-host factor cross


def test_crossing_and_heavy_dims():
    hosts = contiguous_hosts(8, 4)
    assert crossing_dims(MeshLayout((2, 4), ("dp", "tp")), hosts) == [0]
    assert crossing_dims(MeshLayout((4, 2), ("dp", "tp")), hosts) == [0]
    assert crossing_dims(MeshLayout((2, 4), ("tp", "dp")), hosts) == [0]
    assert check_heavy_dims(MeshLayout((2, 4), ("dp", "tp")), hosts) == []
    [message] = check_heavy_dims(MeshLayout((2, 4), ("tp", "dp")), hosts, "tp")
    assert "mesh dim 'tp' (size 2) crosses hosts" in message
    with pytest.raises(MeshShapeError, match="do not fill hosts"):
        contiguous_hosts(8, 3)


def test_plan_prices_context_and_expert_parallelism_as_devmesh_runs_them():
    """cp: devmesh's ring sends K and V cp - 1 times forward and backward, and their
    gradients cp times; its ranks are data ranks for the parameters (FSDP over shard x cp,
    FSDP over cp alone, DDP over dp x cp). ep: each token to its top_k experts and back,
    forward and backward; ep splits shard's ranks (no dim of its own); groups spanning hosts
    are flagged. What parallelize refuses (cp beside dp and shard, ep beside dp or cp) the
    plan refuses too."""
    model = ModelSize(params=8e9, hidden=4096, seq=8192, batch=64, layers=32, top_k=2)
    plan = plan_cluster(4, 8, tp=4, cp=2, model=model)
    assert plan.ok and plan.degrees["shard"] == 4
    traffic = {t.dim: t for t in plan.traffic}
    act = 64 / 4 * 8192 / 2 * 4096 * 2  # this rank's tokens' activations, bytes
    assert traffic["cp"].bytes_per_step == pytest.approx(32 * (4 * 1 + 2 * 2) * act / 4)
    # FSDP over shard x cp (8 ranks): 3 (n-1)/n of the TP slice
    assert traffic["shard_cp"].degree == 8 and "shard" not in traffic
    assert traffic["shard_cp"].bytes_per_step == pytest.approx(3 * 7 / 8 * 8e9 / 4 * 2)
    alone = {t.what.split(":")[0]: t for t in plan_cluster(4, 8, tp=8, cp=4, model=model).traffic}
    assert alone["FSDP"].dim == "cp" and alone["FSDP"].degree == 4
    ddp = {t.dim: t for t in plan_cluster(4, 8, tp=4, cp=2, dp=4, shard=1, model=model).traffic}
    assert ddp["dp_cp"].degree == 8 and "dp" not in ddp
    assert ddp["dp_cp"].bytes_per_step == pytest.approx(2 * 7 / 8 * 8e9 / 4 * 2)

    plan = plan_cluster(4, 8, tp=4, ep=4, model=model)
    assert plan.ok and plan.degrees["ep"] == 4 and plan.degrees["shard"] == 8
    traffic = {t.dim: t for t in plan.traffic}
    act = 64 / 8 * 8192 * 4096 * 2
    assert traffic["ep"].bytes_per_step == pytest.approx(32 * 4 * 2 * 0.75 * act)
    # ep groups: 4 consecutive ranks of shard, a host holding 2 of them
    assert traffic["ep"].crosses_hosts and "ep" in plan.crossing
    assert "ep     size 4     crosses hosts" in str(plan)
    inside = plan_cluster(1, 8, tp=2, ep=2)  # shard 4: ep pairs on one host
    assert inside.ok and "ep" not in inside.crossing
    assert plan_cluster(4, 8, tp=8, ep=8).errors == [
        "ep=8 must divide shard = 4: expert parallelism splits the ranks whose tokens "
        "differ, FSDP's"]
    assert plan_cluster(4, 8, tp=4, cp=2, ep=4).errors == [
        "ep=4 with cp=2: both borrow the data-parallel ranks, and parallelize places one of "
        "them: drop one"]
    assert plan_cluster(4, 8, tp=8, dp=2, ep=2).errors == [
        "ep=2 with dp=2: build the plan with shard instead of dp beside ep"]
    assert plan_cluster(4, 8, tp=4, dp=2, cp=2).errors == [  # shard 2: HSDP
        "cp=2 with dp=2 and shard=2: context parallelism goes beside one data-parallel dim, "
        "as parallelize places it: make dp or shard 1"]


def test_plan_valid_layout_and_traffic():
    model = ModelSize(params=8e9, hidden=4096, seq=2048, batch=64, layers=32)
    plan = plan_cluster(4, 8, dp=2, tp=8, model=model)
    assert plan.ok and plan.degrees == {"pp": 1, "dp": 2, "shard": 2, "cp": 1, "tp": 8}
    assert plan.layout.shape == (2, 2, 8) and plan.layout.names == ("dp", "shard", "tp")
    assert plan.crossing == ["dp", "shard"]
    traffic = {t.dim: t for t in plan.traffic}
    assert not traffic["tp"].crosses_hosts and traffic["dp"].crosses_hosts
    # dp all-reduces the FSDP shard of the TP slice: 2 (n-1)/n * 8e9 / 8 / 2 * 2 bytes
    assert traffic["dp"].bytes_per_step == pytest.approx(2 * 0.5 * 8e9 / 8 / 2 * 2)
    # FSDP: 3 (n-1)/n of the TP slice
    assert traffic["shard"].bytes_per_step == pytest.approx(3 * 0.5 * 8e9 / 8 * 2)
    # TP: 4 all-gathers and 4 reduce-scatters per layer of (16 sequences x 2048 x 4096 x 2
    # bytes), as the dry run counts them
    act = 16 * 2048 * 4096 * 2
    assert traffic["tp"].bytes_per_step == pytest.approx(32 * 8 * 7 / 8 * act)
    assert traffic["tp"].what.startswith("per layer 4 all-gathers and 4 reduce-scatters")
    assert "plan is valid" in str(plan)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(tp=16), "tp=16 > 8 devices per host: TP traffic would cross hosts"),
        (dict(tp=3, shard=1, dp=1), "degrees multiply to 3"),
        (dict(tp=2, dp=5), "does not divide the 16 devices"),
    ],
)
def test_plan_flags_bad_plans(kwargs, words):
    plan = plan_cluster(2, 8, **kwargs)
    assert not plan.ok and any(words in e for e in plan.errors), plan.errors


def test_plan_cli_exit_codes():
    good = _run(DEVMESH + ["plan", "--hosts", "2", "--devices-per-host", "4", "--tp", "4",
                           "--params", "1e9", "--hidden", "2048", "--seq", "1024",
                           "--batch", "16"])
    assert good.returncode == 0 and "tp     size 4     within each host" in good.stdout
    assert "estimated traffic per rank per step" in good.stdout
    bad = _run(DEVMESH + ["plan", "--hosts", "2", "--devices-per-host", "4", "--tp", "8"])
    assert bad.returncode == 1 and "tp=8 > 4 devices per host" in bad.stdout
    incomplete = _run(DEVMESH + ["plan", "--hosts", "1", "--devices-per-host", "4",
                                 "--params", "1e9"])
    assert incomplete.returncode == 2 and "--params needs --hidden" in incomplete.stderr


def test_two_simulated_hosts_with_torchrun(tmp_path):
    port = port_for_a_server()
    script = str(ROOT / "tests" / "scripts" / "two_hosts.py")
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
             f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}", script],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            env=dict(os.environ, PYTHONWARNINGS="ignore::FutureWarning",
                     DEVMESH_TEST_OUT=str(tmp_path), TMPDIR=str(tmp_path)))
        for node in (0, 1)
    ]
    outputs = [a.communicate(timeout=240) for a in agents]
    for agent, (_, err) in zip(agents, outputs):
        assert agent.returncode == 0, err[-3000:]
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    for r in results:
        assert r["good_warnings"] == []                       # tp inside each host
        assert len(r["bad_warnings"]) == 1 and "'tp'" in r["bad_warnings"][0]
        assert r["strict"] and "crosses hosts" in r["strict"]
        assert r["hosts"] == [[0, 0], [1, 1]] and r["crossing"] == ["dp"]
        assert r["hybrid"] == [[0, 1], [2, 3]] and r["hybrid_crossing"] == ["dp"]


def test_doctor_passes_and_fails_clearly():
    ok = _run(DEVMESH + ["doctor", "-n", "4", "--mesh", "2,2", "--names", "dp,tp"])
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # every group of every dim, over all ranks, counted (issue 9, item 13)
    assert ("ok    collective on dim 'tp': 2 group(s) checked: all-reduce over group [0, 1] ok"
            in ok.stdout)
    assert "ranks with every check passing: 4 of 4" in ok.stdout
    assert ok.stdout.strip().splitlines()[-1] == "all checks passed"
    wrong = _run(DEVMESH + ["doctor", "-n", "2", "--mesh", "2,2"])
    assert wrong.returncode == 1
    # the same error on both ranks is one line naming them; the summary comes last
    assert wrong.stdout.count("WorldSizeMismatchError") == 1
    assert "FAIL  mesh agreement (ranks 0-1): WorldSizeMismatchError" in wrong.stdout
    assert "needs 4 ranks but the world has 2" in wrong.stdout
    # one FAIL line, one failed check (on both ranks)
    assert [line[:4] for line in wrong.stdout.splitlines()].count("FAIL") == 1
    assert wrong.stdout.strip().splitlines()[-1].startswith("1 check failed (on ranks 0-1)")
    unlaunched = _run(DEVMESH + ["doctor"])
    assert unlaunched.returncode == 1 and "devmesh doctor -n N" in unlaunched.stdout


def test_bench_cli_writes_csv_json_png(tmp_path):
    files = {k: tmp_path / f"bench.{k}" for k in ("csv", "json", "png")}
    result = _run(DEVMESH + ["bench", "-n", "2", "--sizes", "4K,64K", "--iters", "2",
                             "--ops", "all_reduce,all_gather"]
                  + [x for k, p in files.items() for x in (f"--{k}", str(p))])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "busbw GB/s" in result.stdout and "local memcpy" in result.stdout
    data = json.loads(files["json"].read_text())
    assert {r["op"] for r in data["collectives"]} == {"all_reduce", "all_gather"}
    for r in data["collectives"]:  # nccl-tests' bus bandwidth factors for n = 2
        factor = 1.0 if r["op"] == "all_reduce" else 0.5
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"] * factor)
    assert files["csv"].read_text().startswith("dim,ranks,op,bytes")
    assert files["png"].read_bytes()[:4] == b"\x89PNG"


def test_show_png(tmp_path):
    png = tmp_path / "mesh.png"
    result = _run(DEVMESH + ["show", "2,2,2", "--names", "replicate,shard,tp", "--png", str(png),
                             "--hosts", "2", "--outline", "shard"])
    assert result.returncode == 0, result.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"
    bad = _run(DEVMESH + ["show", "2,2", "--png", str(png), "--outline", "pp"])
    assert bad.returncode == 2 and "no dimension names" in bad.stderr


def visualize_mesh(path):
    from devmesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return mesh.visualize(to_file=f"{path}/mesh{mesh.get_rank()}.png", outline="dp")


def test_mesh_visualize(mesh_pool, tmp_path):
    text = mesh_pool.run(visualize_mesh, 4, str(tmp_path))[0]
    assert "hosts:" in text and "dp (size 2, 2 groups): [0, 2] [1, 3]" in text
    assert (tmp_path / "mesh0.png").read_bytes()[:4] == b"\x89PNG"


def test_every_commands_help_says_each_default_once():
    import argparse

    from devmesh.tools.cli import build_parser

    parser = build_parser()
    commands = [parser] + [sub for action in parser._actions
                           if isinstance(action, argparse._SubParsersAction)
                           for sub in action.choices.values()]
    nested = [sub for command in commands for action in command._actions
              if isinstance(action, argparse._SubParsersAction)
              for sub in action.choices.values()]
    for command in commands + nested:
        text = command.format_help()
        assert "(default: None)" not in text and "(default: False)" not in text, text
        formatter = command.formatter_class(prog=command.prog)
        for action in command._actions:
            shown = formatter._get_help_string(action) or ""
            if "default" in (action.help or ""):  # it says its default itself: nothing added
                assert shown == action.help, (command.prog, shown)


def test_devmesh_plan_writes_the_sbatch_script_of_its_plan(tmp_path):
    """``--sbatch``: one task per node on the plan's nodes and GPUs, the time limit, a
    requeue with restarts, and the srun devmesh run line with the training command as given;
    a plan that is not valid or no --train writes nothing."""
    import subprocess
    import sys

    job = tmp_path / "job.sh"
    command = [sys.executable, "-m", "devmesh", "plan", "--hosts", "4", "--devices-per-host",
               "8", "--dp", "2", "--tp", "8", "--sbatch", str(job)]
    done = subprocess.run(command + ["--train", "train.py --name 'a b'", "--time",
                                     "1-00:00:00", "--max-restarts", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = job.read_text().splitlines()
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --time=1-00:00:00", "#SBATCH --requeue",
                 "srun --kill-on-bad-exit=1 devmesh run -n 8 --max-restarts 2 train.py "
                 "--name 'a b'"):
        assert line in lines, line
    assert any("dp=2 x shard=2 x tp=8 on 4 nodes" in line for line in lines)
    assert subprocess.run(["bash", "-n", str(job)]).returncode == 0
    # a CPU job asks for no GPUs (Slurm refuses a GPU request where no node has GPUs)
    done = subprocess.run(command + ["--train", "train.py", "--device", "cpu"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    text = job.read_text()
    assert "--gpus-per-node" not in text and 'init_device_mesh("cpu", (2, 2, 8)' in text, text
    assert "devmesh run -n 8 " in text
    # one Slurm task per rank: 8 tasks a node, each its rank through devmesh run --no-agent
    done = subprocess.run(command + ["--train", "train.py --steps 3", "--no-agent",
                                     "--max-restarts", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = job.read_text().splitlines()
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --requeue",
                 "srun --kill-on-bad-exit=1 --distribution=block devmesh run --no-agent "
                 "train.py --steps 3"):
        assert line in lines, line
    assert "-n 8" not in job.read_text() and "--max-restarts" not in job.read_text()
    assert subprocess.run(["bash", "-n", str(job)]).returncode == 0
    job.unlink()
    for extra, says in ((["--train", "train.py", "--tp", "16"], "plan is not valid"),
                        ([], "--sbatch needs --train"),
                        (["--train", "t.py", "--time", "soon"], "--time 'soon'")):
        done = subprocess.run(command + extra, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and says in done.stderr, done.stderr
        assert not list(tmp_path.iterdir())
