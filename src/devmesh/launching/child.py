"""``python -m devmesh.launching.child SCRIPT ARGS...``: run a user's script as a rank of
``devmesh run``, dying with the launcher.

torchrun's agent starts the ranks; if the agent's process is killed outright (SIGKILL), its
children would live on as orphans holding ports and memory. On Linux this wrapper asks the
kernel to send SIGKILL when the launching process dies (``PR_SET_PDEATHSIG``), exits at once
if that already happened, then runs the script as ``__main__`` with its own arguments — and
lets gloo's threads finish before the interpreter stops (:mod:`devmesh._exit`: a script that
ended well exited with SIGABRT in about one run in ten).
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

from devmesh._exit import settle_collective_threads_at_exit
from devmesh.launching.reports import REPORTS_VARIABLE, where_in_script, write_report


def die_with_parent(parent: int | None = None) -> None:
    """Ask the kernel to kill this process when its parent dies; exit at once if the parent
    (``parent``, or whoever it is now) is already gone."""
    parent = os.getppid() if parent is None else parent
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the launcher died before the request took effect
        os._exit(1)


ARGV_VARIABLE = "DEVMESH_RUN_ARGV"


def main(argv: list[str]) -> None:
    """Run ``argv[0]`` with ``argv``; ``devmesh run`` passes the script's arguments in
    ``DEVMESH_RUN_ARGV`` (JSON) instead, because torchrun's parser would otherwise try its own
    option abbreviations on them (``--log`` "could match --log-dir")."""
    if ARGV_VARIABLE in os.environ:
        import json

        target = 2 if argv[:1] == ["-m"] else 1  # the script, or -m and the module
        argv = argv[:target] + json.loads(os.environ[ARGV_VARIABLE])
    if not argv:
        raise SystemExit("usage: python -m devmesh.launching.child SCRIPT [ARGS...]")
    die_with_parent()
    settle_collective_threads_at_exit()
    # whole lines: the launcher copies each rank's output to the console line by line, and a
    # line written in pieces (print's arguments, unbuffered) would reach it in pieces
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True, write_through=False)
    if argv[0] == "-m" and len(argv) < 2:
        raise SystemExit("usage: python -m devmesh.launching.child -m MODULE [ARGS...]")
    try:
        if argv[0] == "-m":  # devmesh run -m package.module: as python -m runs it
            sys.argv = list(argv[1:])
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except KeyboardInterrupt as exc:  # Ctrl-C reaches every rank: one line each, not a traceback
        if not os.environ.get(REPORTS_VARIABLE):
            raise
        print(f"interrupted at {where_in_script(exc)}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGINT) from None
    except Exception as exc:
        report = write_report(exc) if os.environ.get(REPORTS_VARIABLE) else None
        if report is None:
            raise
        # devmesh run prints the traceback once, in its summary; a rank failing on its own
        # (not one that lost its peers) says so at once too
        if not report["consequence"]:
            print(f"{report['exception'].splitlines()[0][:300]} "
                  f"(at {report['where']}; devmesh run's summary follows)", file=sys.stderr,
                  flush=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main(sys.argv[1:])
