"""``devmesh doctor`` and ``devmesh bench``: checks and collective benchmarks, on the ranks of
the launcher they run under, or on ``-n`` local ranks they launch themselves."""

from __future__ import annotations

import argparse
import os
import sys

from devmesh.tools.cli.arguments import parse_names, parse_ops, parse_shape, parse_sizes, positive


def add(sub) -> None:
    """``devmesh doctor`` and ``devmesh bench``: they launch ranks the same way."""
    for name, text in (("doctor", "check the launch, backend, devices, hosts, mesh agreement "
                                   "and every group's collective; say what to fix"),
                       ("bench", "collective bandwidth per mesh dim (time, algbw, busbw; CSV, "
                                 "JSON, PNG)")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("-n", "--nproc", type=positive, default=None,
                         help="launch this many local ranks (default: run under torchrun / "
                              "devmesh run)")
        cmd.add_argument("--mesh", type=parse_shape, default=None,
                         help="mesh shape, e.g. 2,4 (default: 1-D over the world)")
        cmd.add_argument("--names", type=parse_names, default=None,
                         help="dimension names, e.g. dp,tp")
        cmd.add_argument("--timeout", type=float, default=30.0,
                         help="seconds before a check or collective counts as hung")
        if name == "doctor":
            cmd.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
            cmd.set_defaults(handler=_cmd_doctor)
        else:
            cmd.add_argument("--sizes", type=parse_sizes, default="4K,64K,1M,8M",
                             help="message sizes in bytes, comma-separated (K, M, G suffixes)")
            cmd.add_argument("--ops", type=parse_ops,
                             default="all_reduce,all_gather,reduce_scatter,all_to_all",
                             help="collectives to measure, comma-separated: all_reduce, "
                                  "all_gather, reduce_scatter, all_to_all")
            cmd.add_argument("--iters", type=positive, default=5,
                             help="timed runs per point (median)")
            cmd.add_argument("--csv", default=None, help="write the results as CSV")
            cmd.add_argument("--json", default=None, help="write the results as JSON")
            cmd.add_argument("--png", default=None, help="plot bus bandwidth against size")
            cmd.set_defaults(handler=_cmd_bench)


def on_every_rank(fn, args: argparse.Namespace, *fn_args):
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
        reports = on_every_rank(run_checks, args, args.mesh, args.names, args.device, args.timeout)
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
        result = on_every_rank(bench_rank, args, args.mesh, args.names, args.sizes,
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
