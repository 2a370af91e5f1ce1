"""``devmesh run -n N script``: torchrun with safer defaults — the rendezvous on loopback, a
wrapper per rank that dies with the launcher, one summary of a failure, the failing rank's
exit code — on one host or several (``--nnodes``)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable

__all__ = ["add", "run", "root_exit_code", "hosts_of_run", "RDZV_READ_TIMEOUT"]


def add(sub) -> None:
    """``devmesh run -n N script``: torchrun --standalone with safer defaults."""
    parser = sub.add_parser("run", help="run a script on N local processes (torchrun --standalone)")
    parser.add_argument("-n", "--nproc", type=int, default=None,
                        help="processes to start (in a Slurm job: default the GPUs Slurm gave "
                             "this node)")
    parser.add_argument("--max-restarts", type=int, default=0,
                     help="restart every rank this many times after one fails (torchrun's "
                          "elastic restart: resume from your last checkpoint)")
    parser.add_argument("--oversubscribe", action="store_true",
                     help="start -n ranks even where this machine's memory or cores cannot "
                          "hold them (refused by default, before anything starts)")
    parser.add_argument("--trace-collectives", action="store_true",
                     help="record each rank's collectives; on a timeout, name the ranks that "
                          "diverged and their source lines (DEVMESH_TRACE_COLLECTIVES=1 does "
                          "the same under torchrun)")
    parser.add_argument("-m", "--module", action="store_true",
                     help="run the script as a module, as python -m (devmesh run -n 2 -m pkg.train)")
    parser.add_argument("--log-dir", default=None,
                     help="also write each rank's output to a file of its own in this folder")
    parser.add_argument("--local-ranks-filter", default=None,
                     help="show only these ranks' output on the console, e.g. 0 or 0,3")
    parser.add_argument("--nnodes", type=int, default=None,
                     help="hosts taking part, each running devmesh run with its --node-rank "
                          "(default 1: this machine alone; in a Slurm job, its nodes)")
    parser.add_argument("--node-rank", type=int, default=None,
                     help="this host's index, 0..nnodes-1 (host 0 serves the rendezvous); its "
                          "ranks are node_rank x nproc ... ")
    parser.add_argument("--rdzv-endpoint", default=None,
                     help="HOST:PORT of host 0, the same on every host (with --nnodes)")
    parser.add_argument("--rdzv-id", default=None,
                     help="the job's name at the rendezvous, the same on every host")
    parser.add_argument("--local-addr", default=None,
                     help="this host's address for the job (default: the one that reaches "
                          "--rdzv-endpoint); its ranks' connections use its interface")
    parser.add_argument("--no-agent", action="store_true",
                     help="in a Slurm job, run this Slurm task as one rank itself (srun "
                          "--ntasks-per-node=G devmesh run --no-agent train.py): no agent, "
                          "no restarts (Slurm's --requeue restarts the job)")
    parser.add_argument("--replica-groups", type=int, default=None, metavar="G",
                     help="run G replica groups of -n ranks, each restarted alone "
                          "(--max-restarts) and healed from a live group while the others "
                          "step on: the script steps through devmesh.fault.ReplicaGroups")
    parser.add_argument("--groups", default=None, metavar="I,J",
                     help="with --replica-groups over several hosts: the groups this host "
                          "runs (default: all of them)")
    parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                     help="with --replica-groups over several hosts: where the coordinator "
                          "listens, the same on every host; the host running group 0 serves "
                          "it there (HOST is that host's address)")
    parser.add_argument("script", help="the Python script (with -m: the module)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(handler=run)


def _fill_in(args: argparse.Namespace, env=None) -> None:
    """The options not given: from Slurm's environment inside a Slurm job
    (:mod:`devmesh.launching.slurm`), else one host; says at ``DEVMESH_LOG=info`` what it
    took from Slurm."""
    from devmesh._log import get_logger
    from devmesh.launching.slurm import DEFAULT_PORT, from_environment

    env = os.environ if env is None else env
    try:
        job = from_environment(env)
    except ValueError as exc:
        raise SystemExit(f"devmesh run: {exc}") from None
    if job is not None:
        if job.tasks_on_node > 1:
            raise SystemExit(
                f"devmesh run: Slurm started {job.tasks_on_node} tasks on this node, but "
                "devmesh run starts the node's ranks itself: run one task per node "
                "(srun --ntasks-per-node=1 devmesh run ...), or make each task a rank "
                "(devmesh run --no-agent)")
        port = env.get("MASTER_PORT") or DEFAULT_PORT
        taken = {"nnodes": len(job.nodes), "node_rank": job.node_rank,
                 "rdzv_endpoint": f"{job.head}:{port}", "rdzv_id": f"slurm-{job.job_id}"}
        if job.gpus_on_node:
            taken["nproc"] = job.gpus_on_node
        used = []
        for name, value in taken.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
                used.append(f"--{name.replace('_', '-')} {value}")
        get_logger("run").info("from Slurm job %s (nodes %s): %s", job.job_id,
                               ",".join(job.nodes), ", ".join(used) or "nothing (all given)")
    for name, default in (("nnodes", 1), ("node_rank", 0), ("rdzv_id", "devmesh-run")):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.nproc is None:
        raise SystemExit("devmesh run: give -n N, the processes to start on this host")


def _run_as_slurm_task(args: argparse.Namespace) -> int:
    """``--no-agent``: this Slurm task becomes its rank (:func:`devmesh.launching.slurm.
    rank_environment`), the script run in this process's place through devmesh's rank
    wrapper (it dies with its Slurm step); its ranks talk over the interface that reaches
    the first node."""
    from devmesh._log import get_logger
    from devmesh.launching.child import ARGV_VARIABLE
    from devmesh.launching.hosts import use_interface_towards
    from devmesh.launching.slurm import from_environment, rank_environment

    try:
        job = from_environment()
        if job is None:
            raise ValueError("--no-agent runs one Slurm task as one rank and reads Slurm's "
                             "environment: start it with srun inside a job (outside Slurm, "
                             "devmesh run -n N starts the ranks)")
        given = [flag for flag, value in (("-n", args.nproc), ("--nnodes", args.nnodes),
                                          ("--node-rank", args.node_rank),
                                          ("--rdzv-endpoint", args.rdzv_endpoint))
                 if value is not None]
        if args.max_restarts:
            given.append("--max-restarts")
        if given:
            raise ValueError(f"--no-agent takes the ranks from Slurm's tasks: drop "
                             f"{', '.join(given)} (srun's -n and --ntasks-per-node set them; "
                             "sbatch --requeue restarts a job)")
        # the agent's options: without an agent nothing would honour them
        agent = [flag for flag, value in (("--log-dir", args.log_dir),
                                          ("--local-ranks-filter", args.local_ranks_filter),
                                          ("--oversubscribe", args.oversubscribe))
                 if value]
        if agent:
            raise ValueError(f"--no-agent runs the script in the Slurm task itself, with no "
                             f"agent to apply {', '.join(agent)}: drop it (srun's --output "
                             "and --error name each task's log files, e.g. "
                             "--output=rank-%t.out)")
        ranks = rank_environment(job)
    except ValueError as exc:
        raise SystemExit(f"devmesh run: {exc}") from None
    os.environ.update(ranks)
    os.environ.pop(ARGV_VARIABLE, None)
    if args.trace_collectives:
        os.environ["DEVMESH_TRACE_COLLECTIVES"] = "1"
    use_interface_towards(ranks["MASTER_ADDR"], int(ranks["MASTER_PORT"]), args.local_addr)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    get_logger("run").info(
        "Slurm task %s of job %s (node %s, local rank %s): RANK %s of %s, rendezvous %s:%s",
        ranks["RANK"], job.job_id, job.node_rank, ranks["LOCAL_RANK"], ranks["RANK"],
        ranks["WORLD_SIZE"], ranks["MASTER_ADDR"], ranks["MASTER_PORT"])
    target = ["-m", args.script] if args.module else [args.script]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "devmesh.launching.child", *target,
                              *args.args])
    return 0  # not reached: the script runs in this process's place


def run(args: argparse.Namespace) -> int:
    placed = [flag for flag, value in (("--groups", args.groups),
                                       ("--coordinator", args.coordinator)) if value]
    if args.replica_groups is None and placed:
        raise SystemExit(f"devmesh run: {' and '.join(placed)} place replica groups on "
                         "hosts: give --replica-groups G too")
    if args.replica_groups is not None:
        from devmesh.tools.cli.run_replicas import run_replica_groups

        return run_replica_groups(args)
    if args.no_agent:
        return _run_as_slurm_task(args)
    _fill_in(args)
    check_nproc(args.nproc, args.oversubscribe)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from devmesh.launching.capacity import oom_kills
    from torch.distributed.run import main as torchrun_main

    import tempfile

    # each failing rank reports in one folder; every rank's output goes to files in another
    # (kept with --log-dir); both are removed when the run ends, also when this host finds
    # itself cut off from the others and exits at once
    reports = tempfile.TemporaryDirectory(prefix="devmesh-run-")
    logs = None if args.log_dir else tempfile.TemporaryDirectory(prefix="devmesh-run-logs-")

    def remove_folders() -> None:
        reports.cleanup()
        if logs is not None:
            logs.cleanup()

    hosts = hosts_of_run(args, before_exit=remove_folders)  # torchrun's options, --nnodes > 1
    if hosts is None:
        # the workers' own gloo sockets stay on loopback (torchrun's agent store is torch's)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # each rank runs through a wrapper that dies with this process (no orphans on SIGKILL)
    if args.max_restarts < 0:
        raise SystemExit(f"devmesh run: --max-restarts must be 0 or more, got {args.max_restarts}")
    # the script's own arguments travel in the environment: torchrun's parser would expand
    # abbreviations of its options among them
    import json

    from devmesh.launching.child import ARGV_VARIABLE

    os.environ[ARGV_VARIABLE] = json.dumps(list(args.args))
    if args.trace_collectives:  # each rank records its collectives (devmesh.distributed.trace)
        os.environ["DEVMESH_TRACE_COLLECTIVES"] = "1"
    # a store per restart (pytorch/pytorch#135712), served by rank 0 on loopback only
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # torchrun --standalone's agent serves its rendezvous store on every interface; this
    # process serves it on loopback instead and the agent joins it as a client
    from devmesh.launching.store import RUN_STORE_VARIABLE, serve_loopback_store

    if hosts is None:
        store, port = serve_loopback_store()
        # the ranks' process group meets in this store too (a prefix per restart attempt)
        os.environ[RUN_STORE_VARIABLE] = f"127.0.0.1:{port}"
        torchrun_args = ["--nnodes=1", f"--nproc_per_node={args.nproc}", "--rdzv-backend=c10d",
                         f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=devmesh-run-{port}",
                         "--rdzv-conf=is_host=false", "--local-addr=127.0.0.1",
                         f"--max-restarts={args.max_restarts}"]
    else:
        os.environ.pop(RUN_STORE_VARIABLE, None)  # one of devmesh run's ranks may launch this
        store, torchrun_args = None, [f"--nproc_per_node={args.nproc}", *hosts,
                                      f"--max-restarts={args.max_restarts}"]
    # every rank's output goes to a file that torchrun's agent copies to the console a whole
    # line at a time, each line prefixed "[rank3]:" (global rank): lines of several ranks
    # never mix; --log-dir keeps the files, else they are removed with the run
    torchrun_args += [f"--log-dir={args.log_dir or logs.name}", "--tee=3"]
    os.environ.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]:")
    # torchrun's own default, set here so that it does not print a banner saying so
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.local_ranks_filter:
        torchrun_args += [f"--local-ranks-filter={args.local_ranks_filter}"]
    target = ["-m", args.script] if args.module else [args.script]
    torchrun_args += ["-m", "devmesh.launching.child", *target]
    kills_before = oom_kills()
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from devmesh.launching.reports import (ELASTIC_LOGGERS, REPORTS_VARIABLE, relay_restarts,
                                           summary)

    os.environ[REPORTS_VARIABLE] = reports.name  # each failing rank reports there
    # the failure is summarised below, once: torchrun's own error lines would repeat it
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    for name in ELASTIC_LOGGERS:  # torch gives these a level of their own (its warnings)
        logging.getLogger(name).setLevel(logging.CRITICAL)
    relay_restarts(args.max_restarts)  # DEVMESH_LOG=info: a failed rank and each restart
    kept_before = _entries(args.log_dir)
    from devmesh.launching.console import one_rank_prefix

    try:
        with one_rank_prefix():  # torch's log lines carry "[rankN]:" already
            torchrun_main(torchrun_args)
    except SystemExit as exc:
        return int(exc.code or 0)
    except ChildFailedError as exc:  # the failing rank's own exit code, as a shell would
        # torchrun keys the failures by global rank; this host's ranks are consecutive
        codes = {rank: f.exitcode for rank, f in exc.failures.items()}
        first = next((rank - f.local_rank for rank, f in exc.failures.items()), 0)
        told = summary(reports.name, args.script, codes,
                       ranks=range(first, first + args.nproc))
        # torchrun names the entry point it ran: the rank wrapper; name the user's script
        print(told or str(exc).replace("devmesh.launching.child", args.script),
              file=sys.stderr)
        memory = killed_for_memory(exc.failures, kills_before)
        if memory:
            print(memory, file=sys.stderr)
        return root_exit_code(exc.failures)
    except (KeyboardInterrupt, SignalException) as exc:  # Ctrl-C: 130, as a shell says
        number = getattr(exc, "sigval", signal.SIGINT)
        print(f"devmesh run: stopped by {signal.Signals(number).name}; every rank was stopped",
              file=sys.stderr)
        return 128 + int(number)
    except Exception as exc:
        print(str(exc), file=sys.stderr)
        return 1
    finally:
        del store  # the loopback rendezvous of a one-host run
        remove_folders()
        if args.log_dir:
            _say_where_the_logs_are(args.log_dir, kept_before)
    return 0


def _entries(folder: str | None) -> set[str]:
    return set(os.listdir(folder)) if folder and os.path.isdir(folder) else set()


def _say_where_the_logs_are(folder: str, before: set[str]) -> None:
    """torchrun's layout under ``--log-dir``: ``RUN/attempt_K/LOCAL_RANK/{stdout,stderr}.log``
    (RUN named after the run and a random suffix; one attempt per restart)."""
    for run in sorted(_entries(folder) - before):
        attempts = sorted(_entries(os.path.join(folder, run)))
        print(f"devmesh run: each rank's output is under {os.path.join(folder, run)}: "
              f"{', '.join(attempts)} (one per start), each LOCAL_RANK/stdout.log and "
              "stderr.log", file=sys.stderr)


def check_nproc(n: int, oversubscribe: bool) -> None:
    """Refuse a process count that cannot work before spawning anything: fewer than one, or
    more than this machine's memory and cores hold (:mod:`devmesh.launching.capacity`)."""
    from devmesh.errors import LaunchCapacityError
    from devmesh.launching.capacity import check_local_ranks

    if n < 1:
        raise SystemExit(f"devmesh run: -n must be at least 1, got {n}")
    try:
        check_local_ranks(n, what=f"devmesh run: -n {n}", override="--oversubscribe",
                          oversubscribe=oversubscribe)
    except LaunchCapacityError as exc:
        raise SystemExit(str(exc)) from None



def killed_for_memory(failures: dict, oom_kills_before: int | None) -> str:
    """A line naming the ranks the kernel's out-of-memory killer took, or ``""``."""
    from devmesh.launching.capacity import describe_kill

    killed = sorted(r for r, f in failures.items() if f.exitcode == -signal.SIGKILL)
    why = describe_kill("SIGKILL", oom_kills_before) if killed else ""
    return f"devmesh run: ranks {killed} were killed by SIGKILL{why}" if killed else ""



def root_exit_code(failures: dict) -> int:
    """The exit code of the rank that failed first on its own: the agent then stops the
    others with SIGTERM, and their -15 must not mask it (a signal n gives 128 + n)."""
    if not failures:
        return 1
    own = {r: f for r, f in failures.items() if f.exitcode != -signal.SIGTERM} or failures
    rank = min(own, key=lambda r: (own[r].timestamp, r))
    code = own[rank].exitcode
    return code if code > 0 else 128 - code if code < 0 else 1


# seconds a host's agent waits on one rendezvous-store operation (torchrun's default: 60):
# a host cut off from host 0 gives up after a few of these, not after minutes
RDZV_READ_TIMEOUT = 15


def hosts_of_run(args: argparse.Namespace,
                 before_exit: Callable[[], None] = lambda: None) -> list[str] | None:
    """torchrun's options for a run over several hosts (``None`` for one): node 0 hosts the
    rendezvous at ``--rdzv-endpoint``; every node's ranks talk over the interface that
    reaches it (``GLOO_SOCKET_IFNAME``, unless set). A host other than 0 exits when it finds
    itself cut off from host 0, calling ``before_exit`` first."""
    if args.nnodes == 1 and args.rdzv_endpoint is None:
        return None
    from devmesh.launching.hosts import (exit_when_cut_off, parse_endpoint,
                                         use_interface_towards)

    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise SystemExit(f"devmesh run: --node-rank {args.node_rank} must be in 0..{args.nnodes - 1} "
                         f"for --nnodes {args.nnodes}")
    if args.rdzv_endpoint is None:
        raise SystemExit(f"devmesh run: --nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, "
                         "node 0's address and a free port, the same on every node")
    try:
        host, port = parse_endpoint(args.rdzv_endpoint)
    except ValueError as exc:
        raise SystemExit(f"devmesh run: {exc}") from None
    local = use_interface_towards(host, port, args.local_addr)
    if args.node_rank != 0:  # host 0 serves the rendezvous; another host can lose it
        exit_when_cut_off(host, port, args.node_rank, before_exit=before_exit)
    from devmesh.launching.rendezvous import register

    # torch's c10d rendezvous, each host taking the ranks of its --node-rank (torch's own
    # numbers hosts by their addresses' order)
    return [f"--nnodes={args.nnodes}", f"--rdzv-backend={register(args.node_rank)}",
            f"--rdzv-endpoint={host}:{port}", f"--rdzv-id={args.rdzv_id}",
            f"--rdzv-conf=is_host={'true' if args.node_rank == 0 else 'false'},"
            f"read_timeout={RDZV_READ_TIMEOUT}",
            f"--local-addr={local}"]
