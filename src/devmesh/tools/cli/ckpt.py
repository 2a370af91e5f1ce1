"""``devmesh ckpt info|consolidate``: a sharded checkpoint read without launching anything."""

from __future__ import annotations

import argparse
import sys

from devmesh.tools.cli.arguments import DefaultsOnce


def add(sub) -> None:
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
        formatter_class=DefaultsOnce)
    merge.add_argument("path", help="the checkpoint directory")
    merge.add_argument("out", help="the safetensors file to write")
    merge.add_argument("--buffer-mb", type=float, default=64.0,
                       help="memory used for reading, whatever the model's size")
    merge.set_defaults(handler=_cmd_ckpt_consolidate)


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
