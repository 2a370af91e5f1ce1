"""``devmesh show SHAPE``: a picture of a mesh and its groups (pure: no torch, no process)."""

from __future__ import annotations

import argparse
import sys

from devmesh.tools.cli.arguments import parse_names, parse_shape


def add(sub) -> None:
    """``devmesh show SHAPE``: a picture of a mesh and its groups."""
    show = sub.add_parser(
        "show", help="draw a mesh and list every group of every dim (no processes, no torch)"
    )
    show.add_argument("shape", type=parse_shape, help="mesh shape, e.g. 2,2,2")
    show.add_argument("--names", type=parse_names, default=None,
                      help="dimension names, e.g. replicate,shard,tp")
    show.add_argument("--rank", type=int, default=None, help="also show what this rank sees")
    show.add_argument("--all", action="store_true", help="list every group, however many")
    show.add_argument("--plain", action="store_true", help="plain text even in a terminal")
    show.add_argument("--png", default=None, help="also draw the mesh to this PNG file")
    show.add_argument("--hosts", type=int, default=None,
                      help="shade the PNG by host: this many hosts of consecutive ranks")
    show.add_argument("--outline", default=None,
                      help="dim whose groups the PNG outlines (default: the innermost)")
    show.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from devmesh.errors import DevmeshError
    from devmesh.layout import MeshLayout
    from devmesh.pictures.render import layout_rich, layout_text

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
        from devmesh.pictures.render_png import layout_png
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
