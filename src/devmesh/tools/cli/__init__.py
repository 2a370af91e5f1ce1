"""The ``devmesh`` command line: ``show``, ``plan``, ``doctor``, ``bench``, ``run``, ``demo``,
``ckpt``, one module each (``doctor`` and ``bench`` share ``checks``).

``show`` and ``plan`` are pure (they import no torch: only the layout and its pictures), so
they answer instantly; the other commands import torch only when they run. Every argument is
checked when it is parsed, before any process starts (:mod:`.arguments`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from devmesh.tools.cli import checks, ckpt, demo, plan, run, show
from devmesh.tools.cli.arguments import DefaultsOnce

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from devmesh import __version__

    parser = argparse.ArgumentParser(
        prog="devmesh", description="N-dimensional device meshes on PyTorch's distributed runtime.",
        formatter_class=DefaultsOnce,
    )
    parser.add_argument("--version", action="version", version=f"devmesh {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_parser = sub.add_parser

    def add_parser(name: str, **kw):  # every command shows its defaults in --help
        return _add_parser(name, formatter_class=DefaultsOnce, **kw)

    sub.add_parser = add_parser  # type: ignore[method-assign]

    for command in (show, plan, checks, run, demo, ckpt):
        command.add(sub)
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
