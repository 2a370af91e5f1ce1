"""The ``devmesh`` command line: ``show``, ``run`` and ``demo``.

``show`` is pure (it imports neither torch nor numpy-heavy modules beyond the layout), so it
answers instantly; the other commands import torch only when they run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.replace("x", ",").split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"mesh shape {text!r} must be integers separated by commas, e.g. 2,2,2"
        ) from None


def _parse_names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _cmd_show(args: argparse.Namespace) -> int:
    from devmesh.errors import DevmeshError
    from devmesh.layout import MeshLayout
    from devmesh.render import layout_rich, layout_text

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
        from devmesh.render_png import layout_png
        from devmesh.topology import contiguous_hosts

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


def _cmd_run(args: argparse.Namespace) -> int:
    from torch.distributed.run import main as torchrun_main

    torchrun_args = ["--standalone", f"--nproc_per_node={args.nproc}", args.script, *args.args]
    try:
        torchrun_main(torchrun_args)
    except SystemExit as exc:  # torchrun exits with the failing child's code
        return int(exc.code or 0)
    except Exception as exc:  # ChildFailedError carries a readable summary
        print(str(exc), file=sys.stderr)
        return 1
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from devmesh.demo import run_demo, run_training_demo

    plain = args.plain or not sys.stdout.isatty()
    if args.meshes:
        return run_demo(world_size=8, plain=plain)
    return run_training_demo(plain=plain, epochs=args.epochs, plot=args.plot)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="devmesh", description="N-dimensional device meshes on PyTorch's distributed runtime."
    )
    sub = parser.add_subparsers(dest="command", required=True)

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

    run = sub.add_parser("run", help="run a script on N local processes (torchrun --standalone)")
    run.add_argument("-n", "--nproc", type=int, required=True, help="processes to start")
    run.add_argument("script", help="the Python script")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    run.set_defaults(handler=_cmd_run)

    demo = sub.add_parser("demo", help="8 local CPU ranks: train digits with HSDP + TP and check "
                                       "it against single-process training")
    demo.add_argument("--meshes", action="store_true",
                      help="instead: build the seeds' meshes and prove every group")
    demo.add_argument("--epochs", type=int, default=5)
    demo.add_argument("--plot", default="digits_loss.png", help="loss-curve PNG ('' for none)")
    demo.add_argument("--plain", action="store_true", help="plain text even in a terminal")
    demo.set_defaults(handler=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
