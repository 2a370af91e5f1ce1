"""``devmesh run`` inside a Slurm job: what it takes from Slurm's environment (the hosts,
this node's rank, the head node, the job id, the GPUs per node), what a flag overrides, and
what it refuses. Slurm's variables as Slurm sets them for ``srun`` on each node."""

from __future__ import annotations

import argparse
import logging
import os

import pytest

from devmesh.launching.slurm import from_environment
from devmesh.tools.cli import run as run_cli

JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[01-04,07]", "SLURM_NODEID": "2",
       "SLURM_STEP_TASKS_PER_NODE": "1(x5)", "SLURM_GPUS_ON_NODE": "8"}


def test_the_nodes_this_nodes_rank_and_its_gpus_are_slurms():
    job = from_environment(JOB)
    assert job.nodes == ("node01", "node02", "node03", "node04", "node07")
    assert (job.node_rank, job.head, job.job_id, job.gpus_on_node, job.tasks_on_node) == (
        2, "node01", "4242", 8, 1)
    assert from_environment({"PATH": "/usr/bin"}) is None  # not in a Slurm job
    several = dict(JOB, SLURM_JOB_NODELIST="gpu-a[1-2],gpu-b3", SLURM_NODEID="0",
                   SLURM_STEP_TASKS_PER_NODE="4(x2),1")
    assert from_environment(several).nodes == ("gpu-a1", "gpu-a2", "gpu-b3")
    assert from_environment(several).tasks_on_node == 4


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    run_cli.add(parser.add_subparsers())
    return parser.parse_args(["run", *flags, "train.py"])


def test_devmesh_run_takes_what_slurm_says_and_a_flag_wins_and_says_so(caplog):
    args = _args()
    with caplog.at_level(logging.INFO, logger="devmesh"):
        run_cli._fill_in(args, dict(JOB, MASTER_PORT="29600"))
    assert (args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id, args.nproc) == (
        5, 2, "node01:29600", "slurm-4242", 8)
    assert ("from Slurm job 4242 (nodes node01,node02,node03,node04,node07): --nnodes 5, "
            "--node-rank 2, --rdzv-endpoint node01:29600, --rdzv-id slurm-4242, --nproc 8"
            in caplog.text)
    given = _args("-n", "2", "--rdzv-endpoint", "10.0.0.9:1234")
    run_cli._fill_in(given, JOB)
    assert (given.nproc, given.rdzv_endpoint, given.node_rank) == (2, "10.0.0.9:1234", 2)
    alone = _args("-n", "3")
    run_cli._fill_in(alone, {})  # outside Slurm: one host, as before
    assert (alone.nnodes, alone.node_rank, alone.rdzv_endpoint, alone.rdzv_id) == (
        1, 0, None, "devmesh-run")


@pytest.mark.parametrize("env, says", [
    (dict(JOB, SLURM_STEP_TASKS_PER_NODE="4(x5)"),
     "Slurm started 4 tasks on this node, but devmesh run starts the node's ranks itself: "
     "run one task per node (srun --ntasks-per-node=1 devmesh run ...), or make each task "
     "a rank (devmesh run --no-agent)"),
    (dict(JOB, SLURM_NODEID="9"), "SLURM_NODEID=9 is outside the job's 5 nodes"),
    (dict(JOB, SLURM_JOB_NODELIST="node[01-"), "SLURM_JOB_NODELIST='node[01-'"),
    ({k: v for k, v in JOB.items() if k != "SLURM_NODEID"}, "without SLURM_NODEID"),
    ({k: v for k, v in JOB.items() if k != "SLURM_GPUS_ON_NODE"}, "give -n N"),
])
def test_what_slurm_does_not_say_or_says_wrong_is_refused_by_name(env, says):
    with pytest.raises(SystemExit, match="devmesh run: ") as caught:
        run_cli._fill_in(_args(), env)
    assert says in str(caught.value)


TASK = dict(JOB, SLURM_JOB_NODELIST="node[01-02]", SLURM_NODEID="1",
            SLURM_STEP_TASKS_PER_NODE="4(x2)", SLURM_PROCID="6", SLURM_NTASKS="8",
            SLURM_LOCALID="2")


def test_a_slurm_task_run_as_one_rank_gets_its_rank_from_slurm():
    """srun --ntasks-per-node=4 on 2 nodes, task 6 (node 1's third): what torch's env://
    rendezvous and devmesh's mesh read, the first node as the rendezvous."""
    from devmesh.launching.slurm import rank_environment

    ranks = rank_environment(from_environment(TASK), TASK)
    assert ranks == {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
                     "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "node01",
                     "MASTER_PORT": "29500"}
    uneven = dict(TASK, SLURM_STEP_TASKS_PER_NODE="3,5", SLURM_PROCID="5")
    assert rank_environment(from_environment(uneven), uneven)["LOCAL_WORLD_SIZE"] == "5"
    with pytest.raises(ValueError, match=r"ranks must be consecutive \(this node's: 4\.\.7\): "
                                         r"use srun's block distribution"):
        cyclic = dict(TASK, SLURM_PROCID="5", SLURM_LOCALID="2")  # --distribution=cyclic
        rank_environment(from_environment(cyclic), cyclic)


@pytest.mark.parametrize("flags, env, says", [
    (("-n", "4"), TASK, "--no-agent takes the ranks from Slurm's tasks: drop -n"),
    (("--max-restarts", "2"), TASK, "drop --max-restarts"),
    (("--log-dir", "logs"), TASK, "no agent to apply --log-dir: drop it"),
    (("--local-ranks-filter", "0", "--oversubscribe"), TASK,
     "no agent to apply --local-ranks-filter, --oversubscribe: drop it"),
    ((), {"PATH": "/usr/bin"}, "--no-agent runs one Slurm task as one rank"),
    ((), {k: v for k, v in TASK.items() if k != "SLURM_PROCID"}, "without SLURM_PROCID"),
])
def test_no_agent_outside_a_slurm_task_or_with_agent_flags_is_refused(flags, env, says,
                                                                        monkeypatch):
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    def ran(*argv):
        raise AssertionError(f"--no-agent ran the script, ignoring {flags}")

    monkeypatch.setattr(run_cli.os, "execv", ran)
    with pytest.raises(SystemExit, match="devmesh run: ") as caught:
        run_cli.run(_args("--no-agent", *flags))
    assert says in str(caught.value)
