"""``devmesh demo``: the digits demo on 8 local CPU ranks, checked against one process; or the
seeds' meshes with every group proved."""

from __future__ import annotations

import argparse
import sys


def add(sub) -> None:
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
    demo.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
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
