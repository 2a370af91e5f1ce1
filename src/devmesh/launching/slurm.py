"""``devmesh run`` inside a Slurm allocation: the hosts, this host's rank and the head node
from Slurm's environment, so that ``srun devmesh run train.py`` needs no host flags.

One ``devmesh run`` per node (``srun --ntasks-per-node=1``), which starts the node's ranks
itself, as torchtitan's sbatch script runs ``srun torchrun``. From Slurm's variables:

- the hosts: ``SLURM_JOB_NODELIST`` expanded (``node[01-04,07]``, by python-hostlist, the
  parser of Slurm's hostlist syntax), and so ``--nnodes``;
- this host's ``--node-rank``: ``SLURM_NODEID``, its index in that list;
- ``--rdzv-endpoint``: the first host, at port ``MASTER_PORT`` or 29500;
- ``--rdzv-id``: ``slurm-<SLURM_JOB_ID>`` (a requeued job keeps its id, so a restarted job
  rejoins as itself);
- ``-n``: the GPUs Slurm gave this node (``SLURM_GPUS_ON_NODE``), where ``-n`` is not given.

A flag given on the command line wins over what Slurm says; at ``DEVMESH_LOG=info`` devmesh
says which values it took from Slurm. Outside Slurm (no ``SLURM_JOB_ID``) nothing changes.

Or one Slurm task per rank (``srun --ntasks-per-node=G devmesh run --no-agent train.py``, as
Lightning and DeepSpeed read Slurm): each task becomes its rank with no agent in between,
its identity from :func:`rank_environment` — ``RANK`` from ``SLURM_PROCID``, ``WORLD_SIZE``
from ``SLURM_NTASKS``, ``LOCAL_RANK`` from ``SLURM_LOCALID``, the node's rank and task count,
and the first node as ``MASTER_ADDR``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["SlurmJob", "from_environment", "rank_environment", "DEFAULT_PORT"]

DEFAULT_PORT = 29500  # torchtitan's and torchrun's


@dataclass(frozen=True)
class SlurmJob:
    """What Slurm says of this job and node."""

    job_id: str
    nodes: tuple[str, ...]  # the allocation's hosts, in Slurm's order
    node_rank: int  # this node's index among them
    tasks_on_node: int  # Slurm tasks started on this node (srun's)
    gpus_on_node: int | None
    tasks_per_node: tuple[int, ...] = ()  # the step's tasks on each node, in node order

    @property
    def head(self) -> str:
        return self.nodes[0]


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"Slurm's {name}={value!r} is not a number") from None


def from_environment(env: Mapping[str, str] | None = None) -> SlurmJob | None:
    """This job as Slurm describes it in ``env`` (default: this process's environment), or
    ``None`` outside a Slurm job."""
    import hostlist

    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ValueError(f"Slurm job {job_id} without SLURM_JOB_NODELIST: run devmesh run "
                         "inside the allocation (srun, or an sbatch script)")
    try:
        nodes = tuple(hostlist.expand_hostlist(nodelist))
    except hostlist.BadHostlist as exc:
        raise ValueError(f"Slurm's SLURM_JOB_NODELIST={nodelist!r}: {exc}") from None
    node_rank = _int(env, "SLURM_NODEID")
    if node_rank is None:
        raise ValueError(f"Slurm job {job_id} without SLURM_NODEID (this node's index): "
                         "start devmesh run with srun on each node")
    if not 0 <= node_rank < len(nodes):
        raise ValueError(f"Slurm's SLURM_NODEID={node_rank} is outside the job's "
                         f"{len(nodes)} nodes ({nodelist})")
    # the tasks of this step (srun's) per node, in node order: "4(x2),1"
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
    counts: list[int] = []
    for part in spec.split(","):
        count, _, times = part.partition("(x")
        counts += [int(count)] * (int(times.rstrip(")")) if times else 1)
    tasks = counts[node_rank] if node_rank < len(counts) else 1
    return SlurmJob(job_id, nodes, node_rank, tasks, _int(env, "SLURM_GPUS_ON_NODE"),
                    tuple(counts))


def rank_environment(job: SlurmJob, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables torch's ``env://`` rendezvous and devmesh read, for this Slurm task run
    as one rank: its global rank, the world, its rank on the node, the node's rank and task
    count, and the first node as the rendezvous (``MASTER_ADDR``/``MASTER_PORT``, where not
    set). A node's ranks must be consecutive (Slurm's default block distribution), so that
    ``mesh.hosts()`` and the meshes' inner dims stay inside a node."""
    env = os.environ if env is None else env
    rank, world, local = (_int(env, name) for name in ("SLURM_PROCID", "SLURM_NTASKS",
                                                       "SLURM_LOCALID"))
    world = _int(env, "SLURM_STEP_NUM_TASKS") or world
    if rank is None or world is None or local is None:
        raise ValueError(f"Slurm job {job.job_id} without SLURM_PROCID, SLURM_NTASKS or "
                         "SLURM_LOCALID: start each rank as a task of srun "
                         "(srun --ntasks-per-node=G devmesh run --no-agent ...)")
    first = sum(job.tasks_per_node[:job.node_rank])
    if rank != first + local:
        raise ValueError(
            f"Slurm gave task {rank} the local id {local} on node {job.node_rank}, but a "
            f"node's ranks must be consecutive (this node's: {first}.."
            f"{first + job.tasks_on_node - 1}): use srun's block distribution "
            "(srun --distribution=block)")
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(job.tasks_on_node), "GROUP_RANK": str(job.node_rank),
            "GROUP_WORLD_SIZE": str(len(job.nodes)),
            "MASTER_ADDR": env.get("MASTER_ADDR") or job.head,
            "MASTER_PORT": env.get("MASTER_PORT") or str(DEFAULT_PORT)}
