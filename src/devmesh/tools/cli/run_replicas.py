"""``devmesh run --replica-groups G -n N train.py``: G replica groups of N ranks, each a
``devmesh run`` of its own (its ranks, its restarts), and the coordinator that admits the
live groups to each step (:mod:`devmesh.fault`): a group that fails is restarted alone and
heals from a live one while the others step on.

Over several hosts each host runs some of the groups (``--groups``) and every host names
the coordinator's ``--coordinator HOST:PORT``; the launcher of the host running group 0
serves it there and outlives its own groups until every other host's group has finished or
gone silent, so a group restarted late is still told where things stand."""

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


def _groups_here(args: argparse.Namespace) -> list[int]:
    """The groups this host runs: ``--groups`` (``0,2``), or all of them."""
    count = args.replica_groups
    if args.groups is None:
        return list(range(count))
    try:
        here = [int(g) for g in args.groups.split(",")]
    except ValueError:
        raise SystemExit(f"devmesh run: --groups {args.groups!r}: give the groups this host "
                         f"runs as numbers in 0..{count - 1} separated by commas, e.g. 0,1"
                         ) from None
    if not here or len(set(here)) != len(here) or not all(0 <= g < count for g in here):
        raise SystemExit(f"devmesh run: --groups {args.groups!r}: each of the "
                         f"{count} groups is numbered 0..{count - 1}, given once")
    if len(here) < count and args.coordinator is None:
        raise SystemExit(
            f"devmesh run: --groups {args.groups} runs {len(here)} of the {count} groups "
            "here; the others' hosts reach the coordinator at --coordinator HOST:PORT (the "
            "address of the host running group 0 and a free port): give it on every host")
    return sorted(here)


def _serve_or_reach(args: argparse.Namespace, here: list[int], timeout: float):
    """The coordinator this launcher serves (``None`` if another host's serves it) and the
    address the groups reach it at. Over several hosts the ranks' gloo sockets use the
    interface that reaches the coordinator (``GLOO_SOCKET_IFNAME``, unless set)."""
    from devmesh.fault import Coordinator
    from devmesh.launching.hosts import (is_this_hosts, parse_endpoint,
                                         use_interface_towards)

    if args.coordinator is None:
        coordinator = Coordinator(args.replica_groups, args.nproc, timeout=timeout)
        return coordinator, coordinator.address
    try:
        host, port = parse_endpoint(args.coordinator, "--coordinator", "group 0's host's")
    except ValueError as exc:
        raise SystemExit(f"devmesh run: {exc}") from None
    use_interface_towards(host, port, args.local_addr)
    if 0 not in here:
        return None, f"{host}:{port}"
    if not is_this_hosts(host):
        raise SystemExit(
            f"devmesh run: this host runs group 0, so it serves the coordinator at "
            f"--coordinator {args.coordinator}, but {host} is not one of its addresses: give "
            "this host's own address (the other hosts give the same)")
    try:
        coordinator = Coordinator(args.replica_groups, args.nproc, timeout=timeout,
                                  host=host, port=port)
    except (RuntimeError, OSError) as exc:  # torch's DistNetworkError is a RuntimeError
        raise SystemExit(
            f"devmesh run: this host runs group 0, so it serves the coordinator at "
            f"--coordinator {args.coordinator}, but cannot listen there "
            f"({str(exc).splitlines()[0]}): give this host's own address and a free port"
        ) from None
    return coordinator, coordinator.address


def run_replica_groups(args: argparse.Namespace) -> int:
    """Start the coordinator (or reach another host's) and this host's groups; wait for
    them, and, serving the coordinator, for the other hosts' groups; the first failing
    group's exit code (a group that failed for good does not stop the others)."""
    given = [flag for flag, name in _AGENT_ONLY if getattr(args, name)]
    if args.replica_groups < 1:
        raise SystemExit(f"devmesh run: --replica-groups must be 1 or more, got "
                         f"{args.replica_groups}")
    if given:
        raise SystemExit(f"devmesh run: --replica-groups places its groups on hosts itself "
                         f"(--groups, --coordinator): drop {', '.join(given)}")
    if args.nproc is None:
        raise SystemExit("devmesh run: give -n N, the ranks of each replica group")
    from devmesh.fault import protocol
    from devmesh.launching.child import ARGV_VARIABLE

    try:
        timeout = protocol.timeout_from_environment()
    except ValueError as exc:
        raise SystemExit(f"devmesh run: {exc}") from None
    here = _groups_here(args)
    coordinator, address = _serve_or_reach(args, here, timeout)
    elsewhere = [g for g in range(args.replica_groups) if g not in here]
    groups = []
    received = [signal.SIGINT]

    def stopped(number, frame):  # SIGTERM (scancel, kill): stop the groups as Ctrl-C does
        received[0] = signal.Signals(number)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stopped)
    try:
        for group in here:
            env = dict({k: v for k, v in os.environ.items() if k != ARGV_VARIABLE}, **{
                protocol.ADDRESS_VARIABLE: address,
                protocol.GROUP_VARIABLE: str(group),
                protocol.GROUPS_VARIABLE: str(args.replica_groups),
                "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": f"[group{group} rank${{rank}}]:",
            })
            groups.append(subprocess.Popen(_group_command(args, group), env=env))
        codes = [group.wait() for group in groups]
        silent = []
        if coordinator is not None and elsewhere:
            silent = coordinator.wait_for(elsewhere, grace=protocol.silence_seconds(timeout))
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
        if coordinator is not None:
            coordinator.stop()
    if silent:
        print(f"devmesh run: replica groups {silent} (on other hosts) went silent before "
              "finishing: their hosts stopped, or were cut off from this one",
              file=sys.stderr)
    failed = [(g, code) for g, code in zip(here, codes, strict=True) if code != 0]
    if failed:
        committed = (f"; the others committed {len(coordinator.commits)} steps"
                     if coordinator is not None else "")
        print(f"devmesh run: replica groups {[g for g, _ in failed]} failed for good "
              f"(exit codes {[c for _, c in failed]}){committed}", file=sys.stderr)
        return failed[0][1]
    return 0
