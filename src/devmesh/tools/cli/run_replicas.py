"""``devmesh run --replica-groups G -n N train.py``: G replica groups of N ranks, each a
``devmesh run`` of its own (its ranks, its restarts), and the coordinator that admits the
live groups to each step (:mod:`devmesh.fault`): a group that fails is restarted alone and
heals from a live one while the others step on."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

__all__ = ["run_replica_groups"]

_AGENT_ONLY = (("--nnodes", "nnodes"), ("--node-rank", "node_rank"),
               ("--rdzv-endpoint", "rdzv_endpoint"), ("--no-agent", "no_agent"))


def _group_command(args: argparse.Namespace, group: int) -> list[str]:
    # each group's devmesh run dies with this launcher (the child wrapper's PR_SET_PDEATHSIG),
    # its ranks with it: the coordinator lives here, and groups left without it would train
    # on as orphans, failing one by one
    command = [sys.executable, "-m", "devmesh.launching.child", "-m", "devmesh", "run",
               "-n", str(args.nproc),
               f"--max-restarts={args.max_restarts}"]
    if args.oversubscribe:
        command.append("--oversubscribe")
    if args.trace_collectives:
        command.append("--trace-collectives")
    if args.log_dir:
        command.append(f"--log-dir={os.path.join(args.log_dir, f'group{group}')}")
    if args.local_ranks_filter:
        command.append(f"--local-ranks-filter={args.local_ranks_filter}")
    if args.module:
        command.append("-m")
    return [*command, args.script, *args.args]


def run_replica_groups(args: argparse.Namespace) -> int:
    """Start the coordinator and the groups; wait for every group; the first failing group's
    exit code (a group that failed for good does not stop the others)."""
    given = [flag for flag, name in _AGENT_ONLY if getattr(args, name)]
    if args.replica_groups < 1:
        raise SystemExit(f"devmesh run: --replica-groups must be 1 or more, got "
                         f"{args.replica_groups}")
    if given:
        raise SystemExit(f"devmesh run: --replica-groups runs its groups on this host: drop "
                         f"{', '.join(given)}")
    if args.nproc is None:
        raise SystemExit("devmesh run: give -n N, the ranks of each replica group")
    from devmesh.fault import Coordinator
    from devmesh.fault import protocol
    from devmesh.launching.child import ARGV_VARIABLE

    try:
        timeout = protocol.timeout_from_environment()
    except ValueError as exc:
        raise SystemExit(f"devmesh run: {exc}") from None
    coordinator = Coordinator(args.replica_groups, args.nproc, timeout=timeout)
    groups = []
    received = [signal.SIGINT]

    def stopped(number, frame):  # SIGTERM (scancel, kill): stop the groups as Ctrl-C does
        received[0] = signal.Signals(number)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stopped)
    try:
        for group in range(args.replica_groups):
            env = dict({k: v for k, v in os.environ.items() if k != ARGV_VARIABLE}, **{
                protocol.ADDRESS_VARIABLE: coordinator.address,
                protocol.GROUP_VARIABLE: str(group),
                protocol.GROUPS_VARIABLE: str(args.replica_groups),
                "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": f"[group{group} rank${{rank}}]:",
            })
            groups.append(subprocess.Popen(_group_command(args, group), env=env))
        codes = [group.wait() for group in groups]
    except KeyboardInterrupt:
        for group in groups:
            if group.poll() is None:
                group.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 10
        for group in groups:
            try:
                group.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                group.kill()
        print(f"devmesh run: stopped by {received[0].name}; every group was stopped",
              file=sys.stderr)
        return 128 + int(received[0])
    finally:
        for group in groups:
            if group.poll() is None:
                group.kill()
                group.wait()
        coordinator.stop()
    failed = [(g, code) for g, code in enumerate(codes) if code != 0]
    steps = len(coordinator.commits)
    if failed:
        print(f"devmesh run: replica groups {[g for g, _ in failed]} failed for good "
              f"(exit codes {[c for _, c in failed]}); the others committed {steps} steps",
              file=sys.stderr)
        return failed[0][1]
    return 0
