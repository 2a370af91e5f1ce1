"""The ``devmesh`` command line: ``show``, ``plan``, ``doctor``, ``bench``, ``run``, ``demo``,
``ckpt``.

``show`` and ``plan`` are pure (they import no torch: only the layout and its pictures), so
they answer instantly; the other commands import torch only when they run. Every argument is
checked when it is parsed, before any process starts.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _parse_shape(text: str) -> tuple[int, ...]:
    """``"2,4"`` (or ``"2x4"``) -> ``(2, 4)``; every part a positive integer, none empty."""
    parts = text.replace("x", ",").split(",")
    if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"mesh shape {text!r} must be positive integers separated by commas, e.g. 2,2,2 "
            "(no empty or non-numeric parts)"
        )
    return tuple(int(p) for p in parts)


def _parse_names(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(
            f"dimension names {text!r} must be non-empty and separated by commas, e.g. dp,tp")
    return names


def _parse_sizes(text: str) -> list[int]:
    from devmesh.tools.commbench import parse_size

    try:
        return [parse_size(part) for part in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parse_ops(text: str) -> tuple[str, ...]:
    from devmesh.tools.commbench import OPS

    ops = tuple(part.strip() for part in text.split(","))
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown collective(s) {', '.join(map(repr, unknown))}; choose from "
            f"{', '.join(OPS)}")
    return ops


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return value


def _cmd_show(args: argparse.Namespace) -> int:
    from devmesh.errors import DevmeshError
    from devmesh.layout import MeshLayout
    from devmesh.inspect.render import layout_rich, layout_text

    try:
        layout = MeshLayout(args.shape, args.names)
        if args.rank is not None and args.rank not in layout:
            raise DevmeshError(
                f"--rank {args.rank} is not in this mesh of {layout.size} ranks", with_rank=False
            )
    except DevmeshError as exc:
        print(f"devmesh show: error: {exc}", file=sys.stderr)
        return 2
    if args.png:
        from devmesh.inspect.render_png import layout_png
        from devmesh.layout.topology import contiguous_hosts

        try:
            host_of = (contiguous_hosts(layout.size, layout.size // args.hosts)
                       if args.hosts else None)
            layout_png(layout, args.png, host_of=host_of, outline=args.outline)
        except (DevmeshError, ValueError) as exc:
            print(f"devmesh show: error: {exc}", file=sys.stderr)
            return 2
    big = 10**9
    limits = dict(max_groups=big if args.all else 8, max_cells=big if args.all else 16,
                  max_blocks=big if args.all else 4)
    if args.plain or not sys.stdout.isatty():
        print(layout_text(layout, rank=args.rank, **limits))
    else:
        from rich.console import Console

        console = Console()
        for renderable in layout_rich(layout, rank=args.rank, **limits):
            console.print(renderable)
    return 0


def _cmd_schedule(args: argparse.Namespace) -> int:
    from devmesh.layout.schedule import SCHEDULES, ScheduleError, build_schedule, parse_schedule

    microbatches = args.microbatches if args.microbatches is not None else 2 * args.pp
    try:
        if args.schedule not in SCHEDULES and os.path.isfile(args.schedule):
            try:
                with open(args.schedule, encoding="utf-8") as file:  # text, never unpickled
                    text = file.read()
            except (OSError, UnicodeDecodeError) as exc:
                raise ScheduleError(f"cannot read {args.schedule} as text: {exc}") from None
            schedule = parse_schedule(text)
            if args.pp not in (1, schedule.ranks):
                raise ScheduleError(f"--pp {args.pp}, but {args.schedule} lists "
                                    f"{schedule.ranks} ranks")
        else:
            schedule = build_schedule(args.schedule, args.pp, microbatches, args.virtual)
        bubble = schedule.bubble()
        if args.program and args.rank is not None and not 0 <= args.rank < schedule.ranks:
            raise ScheduleError(f"--rank {args.rank}, but the schedule has {schedule.ranks} "
                                f"ranks (0 to {schedule.ranks - 1})")
    except ScheduleError as exc:
        print(f"devmesh plan: error: {exc}", file=sys.stderr)
        return 2
    print(schedule)
    print(f"bubble: {bubble:.1%} of rank-time idle (forward = 1, backward = 2, or 1 + 1 when "
          "split into input and weight gradients)")
    if args.messages:
        from devmesh.layout.pipeline_messages import message_plan

        print(message_plan(schedule, args.messages))
    if args.program:
        from devmesh.layout.pipeline_program import format_programs

        print(format_programs(schedule, args.program, args.rank))
    if args.png:
        from devmesh.inspect.schedule_png import draw_schedule

        draw_schedule(schedule, args.png)
        print(f"wrote {args.png}")
    return 0


def _cmd_dry_run(args: argparse.Namespace) -> int:
    """``devmesh plan --model CONFIG --mesh ...``: one rank per role measured in this
    process (devmesh.tools.dry_run)."""
    from devmesh.errors import DryRunError
    from devmesh.tools.dry_run import dry_run, parse_mesh, ranks_to_report, read_config
    from devmesh.tools.dry_run.report import format_reports, parse_bytes, read_costs

    if args.search or args.world is not None:
        return _cmd_search(args)
    try:
        if args.mesh is None:
            raise DryRunError("--model needs --mesh, e.g. --mesh pp=4,dp=32,tp=8 (or --world "
                              "N --search to choose one)")
        config = read_config(args.model)
        dims = parse_mesh(args.mesh)
        schedule = args.schedule or "1f1b"
        pp = dims.get("pp", 1)
        microbatches = args.microbatches or (2 * pp if pp > 1 else 1)
        costs = read_costs(args.tflops, args.bandwidth, args.costs, args.latency)
        memory = parse_bytes(args.device_memory) if args.device_memory else None
        ranks = [args.rank] if args.rank is not None else ranks_to_report(dims)
        reports = [dry_run(config, dims, rank=rank, schedule=schedule,
                           microbatches=microbatches) for rank in ranks]
        print(format_reports(config, dims, reports, schedule=schedule,
                             microbatches=microbatches, costs=costs, device_memory=memory))
    except DryRunError as exc:
        print(f"devmesh plan: error: {exc}", file=sys.stderr)
        return 2
    fits = memory is None or all(r.total_bytes <= memory for r in reports)
    return 0 if fits else 1


def _cmd_search(args: argparse.Namespace) -> int:
    """``devmesh plan --model CONFIG --world N --search``: the candidates ranked
    (devmesh.tools.dry_run.search)."""
    from devmesh.errors import DryRunError
    from devmesh.tools.dry_run import read_config
    from devmesh.tools.dry_run.report import parse_bytes, read_costs
    from devmesh.tools.dry_run.search import format_search, search

    try:
        if not (args.search and args.world is not None):
            raise DryRunError("a mesh search needs both --world N (the ranks) and --search")
        if args.mesh is not None:
            raise DryRunError("--search chooses the mesh: drop --mesh (or drop --search and "
                              "--world to dry-run that mesh)")
        config = read_config(args.model)
        costs = read_costs(args.tflops, args.bandwidth, args.costs, args.latency)
        if costs is None:
            raise DryRunError("--search ranks meshes by predicted step time: give --tflops "
                              "and --bandwidth (e.g. --tflops 400 --bandwidth tp=300,25) or "
                              "--costs FILE from devmesh bench --json")
        memory = parse_bytes(args.device_memory) if args.device_memory else None
        if args.top < 1 or args.verify < 0:
            raise DryRunError("--top must be at least 1 and --verify at least 0")
        result = search(config, args.world, costs, device_memory=memory,
                        devices_per_host=args.devices_per_host or 8, verify=args.verify,
                        progress=lambda text: print(text, file=sys.stderr, flush=True))
    except DryRunError as exc:
        print(f"devmesh plan: error: {exc}", file=sys.stderr)
        return 2
    print(format_search(result, top=args.top))
    return 0 if result.ranked else 1


def _cmd_plan(args: argparse.Namespace) -> int:
    from devmesh.tools.cluster_plan import ModelSize, plan_cluster

    if args.model is not None:
        return _cmd_dry_run(args)
    if args.schedule is not None:
        return _cmd_schedule(args)
    missing = [f"--{n.replace('_', '-')}" for n in ("hosts", "devices_per_host")
               if getattr(args, n) is None]
    if missing:
        print(f"devmesh plan: error: a cluster plan needs {' and '.join(missing)} (or use "
              "--schedule NAME --pp N for a pipeline schedule)", file=sys.stderr)
        return 2

    model = None
    if args.params is not None:
        missing = [n for n in ("hidden", "seq", "batch") if getattr(args, n) is None]
        if missing:
            print(f"devmesh plan: error: --params needs --{', --'.join(missing)} too",
                  file=sys.stderr)
            return 2
        model = ModelSize(args.params, args.hidden, args.seq, args.batch, args.layers,
                          top_k=args.top_k)
    plan = plan_cluster(args.hosts, args.devices_per_host, dp=args.dp, shard=args.shard,
                        tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, model=model)
    print(plan)
    return 0 if plan.ok else 1


def _distributed(fn, args: argparse.Namespace, *fn_args):
    """Run ``fn`` on every rank: under a launcher directly, else on ``-n`` local ranks.
    Returns rank 0's result (None on other ranks), or raises LaunchEnvironmentError."""
    if "RANK" in os.environ:
        return fn(*fn_args)
    if not args.nproc:
        from devmesh.distributed.env import read_launch_env

        read_launch_env()  # raises, saying how to launch
    from devmesh.launching.launcher import launch

    return launch(fn, args.nproc, *fn_args, timeout=max(120.0, 4 * args.timeout))[0]


def _cmd_doctor(args: argparse.Namespace) -> int:
    from devmesh.tools.doctor import format_report, run_checks
    from devmesh.errors import DevmeshError

    try:
        reports = _distributed(run_checks, args, args.mesh, args.names, args.device, args.timeout)
    except DevmeshError as exc:
        print(f"FAIL  launch environment: {exc}\n(or run `devmesh doctor -n N` to check N local "
              "ranks)")
        return 1
    if reports is None:
        return 0  # not rank 0: rank 0 prints the report
    text, ok = format_report(reports)
    print(text)
    return 0 if ok else 1


def _cmd_bench(args: argparse.Namespace) -> int:
    from devmesh.tools.commbench import bench_rank, format_table, write_outputs
    from devmesh.errors import DevmeshError

    try:
        result = _distributed(bench_rank, args, args.mesh, args.names, args.sizes,
                              args.ops, args.iters)
    except DevmeshError as exc:
        print(f"devmesh bench: error: {exc}", file=sys.stderr)
        return 2
    if result is None or int(os.environ.get("RANK", "0")) != 0:
        return 0
    rows, memcpy = result
    print(format_table(rows, memcpy))
    write_outputs(rows, memcpy, csv_path=args.csv, json_path=args.json, png_path=args.png)
    return 0


def _check_nproc(n: int, oversubscribe: bool) -> None:
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


def _killed_for_memory(failures: dict, oom_kills_before: int | None) -> str:
    """A line naming the ranks the kernel's out-of-memory killer took, or ``""``."""
    from devmesh.launching.capacity import describe_kill

    killed = sorted(r for r, f in failures.items() if f.exitcode == -signal.SIGKILL)
    why = describe_kill("SIGKILL", oom_kills_before) if killed else ""
    return f"devmesh run: ranks {killed} were killed by SIGKILL{why}" if killed else ""


def _root_exit_code(failures: dict) -> int:
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


def _hosts_of_run(args: argparse.Namespace) -> list[str] | None:
    """torchrun's options for a run over several hosts (``None`` for one): node 0 hosts the
    rendezvous at ``--rdzv-endpoint``; every node's ranks talk over the interface that
    reaches it (``GLOO_SOCKET_IFNAME``, unless set)."""
    if args.nnodes == 1 and args.rdzv_endpoint is None:
        return None
    from devmesh.launching.hosts import (exit_when_cut_off, interface_of,
                                         local_address_towards, parse_endpoint)

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
    local = args.local_addr or local_address_towards(host, port)
    if args.node_rank != 0:  # host 0 serves the rendezvous; another host can lose it
        exit_when_cut_off(host, port, args.node_rank)
    interface = interface_of(local)
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    return [f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={host}:{port}", f"--rdzv-id={args.rdzv_id}",
            f"--rdzv-conf=is_host={'true' if args.node_rank == 0 else 'false'},"
            f"read_timeout={RDZV_READ_TIMEOUT}",
            f"--local-addr={local}"]


def _cmd_run(args: argparse.Namespace) -> int:
    _check_nproc(args.nproc, args.oversubscribe)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from devmesh.launching.capacity import oom_kills
    from torch.distributed.run import main as torchrun_main

    hosts = _hosts_of_run(args)  # (torchrun's rendezvous options) for --nnodes > 1
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
    import tempfile

    # a store per restart (pytorch/pytorch#135712), served by rank 0 on loopback only
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # torchrun --standalone's agent serves its rendezvous store on every interface; this
    # process serves it on loopback instead and the agent joins it as a client
    from devmesh.distributed.env import serve_loopback_store

    if hosts is None:
        store, port = serve_loopback_store()
        torchrun_args = ["--nnodes=1", f"--nproc_per_node={args.nproc}", "--rdzv-backend=c10d",
                         f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=devmesh-run-{port}",
                         "--rdzv-conf=is_host=false", "--local-addr=127.0.0.1",
                         f"--max-restarts={args.max_restarts}"]
    else:
        store, torchrun_args = None, [f"--nproc_per_node={args.nproc}", *hosts,
                                      f"--max-restarts={args.max_restarts}"]
    # every rank's output goes to a file that torchrun's agent copies to the console a whole
    # line at a time, each line prefixed "[rank3]:" (global rank): lines of several ranks
    # never mix; --log-dir keeps the files, else they are removed with the run
    logs = None if args.log_dir else tempfile.TemporaryDirectory(prefix="devmesh-run-logs-")
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

    from devmesh.launching.reports import REPORTS_VARIABLE, relay_restarts, summary

    reports = tempfile.TemporaryDirectory(prefix="devmesh-run-")
    os.environ[REPORTS_VARIABLE] = reports.name  # each failing rank reports there
    # the failure is summarised below, once: torchrun's own error lines would repeat it
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    relay_restarts(args.max_restarts)  # DEVMESH_LOG=info: a failed rank and each restart
    try:
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
        memory = _killed_for_memory(exc.failures, kills_before)
        if memory:
            print(memory, file=sys.stderr)
        return _root_exit_code(exc.failures)
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
        reports.cleanup()
        if logs is not None:
            logs.cleanup()
    return 0


def _cmd_ckpt_info(args: argparse.Namespace) -> int:
    from devmesh.errors import CheckpointError
    from devmesh.parallel.checkpoint.offline import info

    try:
        print(info(args.path, verify=args.verify))
    except CheckpointError as exc:
        print(f"devmesh ckpt info: {exc}", file=sys.stderr)
        return 1
    return 0


def _cmd_ckpt_consolidate(args: argparse.Namespace) -> int:
    from devmesh.errors import CheckpointError
    from devmesh.parallel.checkpoint.offline import consolidate

    try:
        names = consolidate(args.path, args.out, buffer_mb=args.buffer_mb)
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"devmesh ckpt consolidate: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {len(names)} tensors to {args.out}: load them with "
          f"safetensors.torch.load_file({args.out!r})"
          + ("" if _installed("safetensors") else
             " (safetensors is not installed here: pip install 'devmesh[safetensors]')"))
    return 0


def _installed(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def _cmd_demo(args: argparse.Namespace) -> int:
    from devmesh.tools.demo import run_demo, run_training_demo

    plain = args.plain or not sys.stdout.isatty()
    if args.meshes:
        return run_demo(world_size=8, plain=plain)
    try:
        if args.pp:
            from devmesh.tools.demo import run_pipeline_demo

            return run_pipeline_demo(plain=plain, epochs=args.epochs, mesh_text=args.mesh)
        return run_training_demo(plain=plain, epochs=args.epochs, plot=args.plot,
                                 mesh_text=args.mesh)
    except ValueError as exc:  # a bad --mesh, found before anything is launched
        print(f"devmesh demo: error: {exc}", file=sys.stderr)
        return 2


def _add_show(sub) -> None:
    """``devmesh show SHAPE``: a picture of a mesh and its groups."""
    show = sub.add_parser(
        "show", help="draw a mesh and list every group of every dim (no processes, no torch)"
    )
    show.add_argument("shape", type=_parse_shape, help="mesh shape, e.g. 2,2,2")
    show.add_argument("--names", type=_parse_names, default=None,
                      help="dimension names, e.g. replicate,shard,tp")
    show.add_argument("--rank", type=int, default=None, help="also show what this rank sees")
    show.add_argument("--all", action="store_true", help="list every group, however many")
    show.add_argument("--plain", action="store_true", help="plain text even in a terminal")
    show.add_argument("--png", default=None, help="also draw the mesh to this PNG file")
    show.add_argument("--hosts", type=int, default=None,
                      help="shade the PNG by host: this many hosts of consecutive ranks")
    show.add_argument("--outline", default=None,
                      help="dim whose groups the PNG outlines (default: the innermost)")
    show.set_defaults(handler=_cmd_show)


def _add_plan(sub) -> None:
    """``devmesh plan``: a mesh for a cluster, with estimated traffic."""
    plan = sub.add_parser("plan", help="choose and check a mesh for a cluster, with estimated "
                                       "traffic per dim (no processes)")
    plan.add_argument("--hosts", type=int, default=None, help="required for a cluster plan")
    plan.add_argument("--devices-per-host", type=int, default=None,
                      help="required for a cluster plan")
    for name, default, text in (("dp", 1, "replicas (DDP, or HSDP's replicate dim)"),
                                ("tp", 1, "tensor parallel"), ("pp", 1, "pipeline stages"),
                                ("cp", 1, "context parallel"),
                                ("ep", 1, "expert parallel (splits shard x cp's ranks)")):
        plan.add_argument(f"--{name}", type=int, default=default, help=text)
    plan.add_argument("--shard", "--fsdp", type=int, default=None,
                      help="FSDP shard degree (default: the devices left over)")
    plan.add_argument("--params", type=float, default=None, help="model parameters, e.g. 7e9")
    plan.add_argument("--hidden", type=int, default=None)
    plan.add_argument("--seq", type=int, default=None)
    plan.add_argument("--batch", type=int, default=None, help="global batch, in sequences")
    plan.add_argument("--top-k", type=int, default=2, help="experts per token, with --ep")
    plan.add_argument("--layers", type=int, default=None)
    plan.add_argument("--schedule", default=None,
                      help="instead: print a pipeline schedule for --pp ranks (gpipe, 1f1b, "
                           "interleaved-1f1b, looped-bfs, zero-bubble, interleaved-zero-bubble, "
                           "zbv-zero-bubble, dualpipe-v) with its bubble, or check one written in a file "
                           "(one 'rank R: F0@0 B0@0 ...' line per rank, as printed)")
    plan.add_argument("--microbatches", type=int, default=None,
                      help="micro-batches per step (with --schedule; default 2 x --pp)")
    plan.add_argument("--virtual", type=int, default=2,
                      help="stages per rank for interleaved-1f1b, looped-bfs and "
                           "interleaved-zero-bubble")
    plan.add_argument("--png", default=None, help="with --schedule: draw its timeline")
    plan.add_argument("--messages", choices=("gloo", "nccl"), default=None,
                      help="with --schedule: the batches of sends and receives each rank "
                           "starts on that backend, and for nccl whether it can deadlock")
    plan.add_argument("--program", choices=("gloo", "nccl"), default=None,
                      help="with --schedule: each rank's step as the runner plays it on that "
                           "backend (computes, the posts of messages between them, where each "
                           "stage's gradients are reduced), checked (--rank R: one rank's)")
    dry = plan.add_argument_group(
        "dry run of a model (one process, no devices: meta tensors, torch's fake process group)")
    dry.add_argument("--model", default=None,
                     help="a transformer: a preset (llama3-8b, llama3-70b, llama3-405b, tiny), "
                          "a JSON file of its fields, or PRESET:key=value,... (e.g. "
                          "llama3-8b:seq=4096,batch=512)")
    dry.add_argument("--mesh", default=None,
                     help="with --model: the mesh, outer to inner, e.g. pp=4,dp=32,tp=8 "
                          "(dp replicates; shard (or fsdp) shards; both: HSDP)")
    dry.add_argument("--rank", type=int, default=None,
                     help="with --model: this rank only (default: one rank per pipeline stage)")
    dry.add_argument("--device-memory", default=None,
                     help="with --model: say whether each rank fits, e.g. 80GB or 80GiB")
    dry.add_argument("--tflops", type=float, default=None,
                     help="with --model: the device's dense throughput, for a predicted step "
                          "time")
    dry.add_argument("--bandwidth", default=None,
                     help="with --tflops: bus bandwidth in GB/s, one number or per dims "
                          "(tp=300,dp=25)")
    dry.add_argument("--costs", default=None,
                     help="with --tflops: bandwidths measured by devmesh bench --json")
    dry.add_argument("--latency", default=None,
                     help="with --tflops: what each collective call or message costs besides "
                          "its bytes, e.g. 20us")
    dry.add_argument("--world", type=int, default=None,
                     help="with --model --search: the number of ranks to choose a mesh for")
    dry.add_argument("--search", action="store_true",
                     help="with --model --world: rank every mesh, schedule and micro-batch "
                          "count by predicted step time (needs --tflops and --bandwidth or "
                          "--costs); drops those over --device-memory; tp at most "
                          "--devices-per-host (default 8)")
    dry.add_argument("--top", type=int, default=5, help="with --search: candidates printed")
    dry.add_argument("--verify", type=int, default=5,
                     help="with --search: the best this many by the closed form are measured "
                          "by the dry run and ranked again (0: none)")
    plan.set_defaults(handler=_cmd_plan)


def _add_doctor_and_bench(sub) -> None:
    """``devmesh doctor`` and ``devmesh bench``: they launch ranks the same way."""
    for name, text in (("doctor", "check the launch, backend, devices, hosts, mesh agreement "
                                   "and every group's collective; say what to fix"),
                       ("bench", "collective bandwidth per mesh dim (time, algbw, busbw; CSV, "
                                 "JSON, PNG)")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("-n", "--nproc", type=_positive, default=None,
                         help="launch this many local ranks (default: run under torchrun / "
                              "devmesh run)")
        cmd.add_argument("--mesh", type=_parse_shape, default=None,
                         help="mesh shape, e.g. 2,4 (default: 1-D over the world)")
        cmd.add_argument("--names", type=_parse_names, default=None,
                         help="dimension names, e.g. dp,tp")
        cmd.add_argument("--timeout", type=float, default=30.0,
                         help="seconds before a check or collective counts as hung")
        if name == "doctor":
            cmd.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
            cmd.set_defaults(handler=_cmd_doctor)
        else:
            cmd.add_argument("--sizes", type=_parse_sizes, default="4K,64K,1M,8M",
                             help="message sizes in bytes, comma-separated (K, M, G suffixes)")
            cmd.add_argument("--ops", type=_parse_ops,
                             default="all_reduce,all_gather,reduce_scatter,all_to_all",
                             help="collectives to measure, comma-separated: all_reduce, "
                                  "all_gather, reduce_scatter, all_to_all")
            cmd.add_argument("--iters", type=_positive, default=5,
                             help="timed runs per point (median)")
            cmd.add_argument("--csv", default=None, help="write the results as CSV")
            cmd.add_argument("--json", default=None, help="write the results as JSON")
            cmd.add_argument("--png", default=None, help="plot bus bandwidth against size")
            cmd.set_defaults(handler=_cmd_bench)


def _add_run(sub) -> None:
    """``devmesh run -n N script``: torchrun --standalone with safer defaults."""
    run = sub.add_parser("run", help="run a script on N local processes (torchrun --standalone)")
    run.add_argument("-n", "--nproc", type=int, required=True, help="processes to start")
    run.add_argument("--max-restarts", type=int, default=0,
                     help="restart every rank this many times after one fails (torchrun's "
                          "elastic restart: resume from your last checkpoint)")
    run.add_argument("--oversubscribe", action="store_true",
                     help="start -n ranks even where this machine's memory or cores cannot "
                          "hold them (refused by default, before anything starts)")
    run.add_argument("--trace-collectives", action="store_true",
                     help="record each rank's collectives; on a timeout, name the ranks that "
                          "diverged and their source lines (DEVMESH_TRACE_COLLECTIVES=1 does "
                          "the same under torchrun)")
    run.add_argument("-m", "--module", action="store_true",
                     help="run the script as a module, as python -m (devmesh run -n 2 -m pkg.train)")
    run.add_argument("--log-dir", default=None,
                     help="also write each rank's output to a file of its own in this folder")
    run.add_argument("--local-ranks-filter", default=None,
                     help="show only these ranks' output on the console, e.g. 0 or 0,3")
    run.add_argument("--nnodes", type=int, default=1,
                     help="hosts taking part, each running devmesh run with its --node-rank "
                          "(default 1: this machine alone)")
    run.add_argument("--node-rank", type=int, default=0,
                     help="this host's index, 0..nnodes-1 (host 0 serves the rendezvous); its "
                          "ranks are node_rank x nproc ... ")
    run.add_argument("--rdzv-endpoint", default=None,
                     help="HOST:PORT of host 0, the same on every host (with --nnodes)")
    run.add_argument("--rdzv-id", default="devmesh-run",
                     help="the job's name at the rendezvous, the same on every host")
    run.add_argument("--local-addr", default=None,
                     help="this host's address for the job (default: the one that reaches "
                          "--rdzv-endpoint); its ranks' connections use its interface")
    run.add_argument("script", help="the Python script (with -m: the module)")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    run.set_defaults(handler=_cmd_run)


def _add_demo(sub) -> None:
    """``devmesh demo``: the digits demo, or the seeds' meshes."""
    demo = sub.add_parser("demo", help="8 local CPU ranks: train digits with HSDP + TP and check "
                                       "it against single-process training")
    demo.add_argument("--meshes", action="store_true",
                      help="instead: build the seeds' meshes and prove every group")
    demo.add_argument("--pp", action="store_true",
                      help="instead: train digits with pipeline x FSDP x TP on (2, 2, 2)")
    demo.add_argument("--mesh", default=None,
                      help="the mesh to train on, e.g. dp=2,shard=2,tp=2 (the default) or, with "
                           "--pp, pp=2,shard=2,tp=2 (the default) or pp=2,dp=2,shard=2,tp=2 "
                           "(PP x HSDP x TP, 16 ranks)")
    demo.add_argument("--epochs", type=int, default=5)
    demo.add_argument("--plot", default="digits_loss.png", help="loss-curve PNG ('' for none)")
    demo.add_argument("--plain", action="store_true", help="plain text even in a terminal")
    demo.set_defaults(handler=_cmd_demo)


def _add_ckpt(sub) -> None:
    """``devmesh ckpt info|consolidate``: a checkpoint without launching anything."""
    ckpt = sub.add_parser("ckpt", help="inspect a sharded checkpoint, or consolidate it into "
                                       "one safetensors file (no processes)")
    actions = ckpt.add_subparsers(dest="action", metavar="ACTION", required=True)
    info = actions.add_parser("info", help="tensors, shapes, layouts, bytes and files")
    info.add_argument("path", help="the checkpoint directory")
    info.add_argument("--verify", action="store_true",
                      help="also read every block and check it against its checksums")
    info.set_defaults(handler=_cmd_ckpt_info)
    merge = actions.add_parser(
        "consolidate", help="write the model's full tensors as one safetensors file, streaming",
        formatter_class=_DefaultsOnce)
    merge.add_argument("path", help="the checkpoint directory")
    merge.add_argument("out", help="the safetensors file to write")
    merge.add_argument("--buffer-mb", type=float, default=64.0,
                       help="memory used for reading, whatever the model's size")
    merge.set_defaults(handler=_cmd_ckpt_consolidate)


class _DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults in --help, but only where the help does not already say its
    default, and never ``(default: None)`` (an option with no default)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from devmesh import __version__

    parser = argparse.ArgumentParser(
        prog="devmesh", description="N-dimensional device meshes on PyTorch's distributed runtime.",
        formatter_class=_DefaultsOnce,
    )
    parser.add_argument("--version", action="version", version=f"devmesh {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_parser = sub.add_parser

    def add_parser(name: str, **kw):  # every command shows its defaults in --help
        return _add_parser(name, formatter_class=_DefaultsOnce, **kw)

    sub.add_parser = add_parser  # type: ignore[method-assign]

    for add in (_add_show, _add_plan, _add_doctor_and_bench, _add_run, _add_demo, _add_ckpt):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:  # a bare `devmesh`: say what there is
        parser.print_help()
        return 0
    try:
        return int(args.handler(args) or 0)
    except BrokenPipeError:  # `devmesh show ... | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
