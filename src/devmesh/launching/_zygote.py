"""The process a :class:`devmesh.launching.launcher.WorkerPool` forks its workers from.

A worker started as a fresh interpreter pays a torch import (~2.5 s of CPU): eight at once
take ten seconds on a two-core machine, and a pool replacing the workers a failed task broke
would pay it again for each. The zygote imports torch once, as a worker would (:func:`._worker.prepare`); each worker
is then a ``fork`` of it, ready in milliseconds, sharing its imported modules' memory until
written. Nothing in the zygote ever starts a thread, a process group or a torch operation, so
the forked copy is as clean as a fresh interpreter that imported the same modules (torch's
DataLoader forks its workers the same way).

Started as ``python -m devmesh.launching._zygote HOST PORT PARENT_PID REPORT_FD`` with the
pool's secret on the first line of stdin and the modules to preload (space-separated, maybe
none) on the second. Each further line, ``INDEX STACK_PATH``, asks for a
worker; the worker then connects to ``HOST:PORT`` and authenticates as one started directly
would. On ``REPORT_FD`` the zygote writes ``started INDEX PID`` for each worker it forked and
``ended PID CODE`` (the exit code, or minus the signal that killed it) when one ends: the pool
is not the workers' parent and cannot wait for them itself, and it names how a worker died.
If the imports fail (a torch devmesh does not support, a broken install), it writes
``failed TEXT`` and exits, so that the pool's error names the cause.
The zygote dies with the pool and the workers with the zygote (``PR_SET_PDEATHSIG``); stdin's
end (the pool closed) ends it too.
"""

from __future__ import annotations

import os
import select
import signal
import sys

from devmesh.launching import _worker
from devmesh.launching.child import die_with_parent

_POLL_SECONDS = 0.05  # how soon a worker's end is reported


def _exit_code(status: int) -> int:
    """``waitpid``'s status as ``subprocess`` gives a return code: minus the signal."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _reap(report) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        report.write(f"ended {pid} {_exit_code(status)}\n")


def _fork_worker(host: str, port: int, index: int, stack_path: str, key: bytes,
                 report_fd: int) -> int:
    zygote = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    try:  # the worker: none of the zygote's channels, its own signals
        os.close(report_fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        die_with_parent(zygote)
        _worker.serve_pool(host, port, index, stack_path, key)
        code = 0
    except BaseException:  # noqa: BLE001 - a worker never returns into the zygote's loop
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _read_line(fd: int, pending: bytes) -> tuple[bytes, bytes]:
    """The first line of ``pending`` plus what ``fd`` gives, and what is left after it
    (os.read, not a buffered reader: bytes read ahead must not be lost to ``select``)."""
    while b"\n" not in pending:
        chunk = os.read(fd, 4096)
        if not chunk:
            raise SystemExit(0)  # the pool closed its end
        pending += chunk
    line, rest = pending.split(b"\n", 1)
    return line, rest


def main(argv: list[str]) -> None:
    host, port, parent, report_fd = argv
    die_with_parent(int(parent))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the pool to handle
    key_hex, pending = _read_line(0, b"")
    key = bytes.fromhex(key_hex.decode())
    preload, pending = _read_line(0, pending)
    report = os.fdopen(int(report_fd), "w", buffering=1)
    try:
        _worker.prepare(preload.decode().split())
        import torch

        if torch.cuda.is_initialized():  # a forked child cannot use the CUDA its parent started
            raise RuntimeError("CUDA was initialized while the worker pool imported torch "
                               "(PYTHONSTARTUP, sitecustomize?); its workers could not use "
                               "the GPU")
    except Exception as exc:  # the pool's start error says why, not only an exit code
        text = " ".join(f"{type(exc).__name__}: {exc}".split())
        report.write(f"failed {text}\n")
        raise
    while True:
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            index, stack_path = line.decode().split(" ", 1)
            pid = _fork_worker(host, int(port), int(index), stack_path, key, int(report_fd))
            report.write(f"started {index} {pid}\n")
        ready, _, _ = select.select([0], [], [], _POLL_SECONDS)
        _reap(report)
        if ready:
            chunk = os.read(0, 4096)
            if not chunk:
                return  # the pool closed its end: no more workers
            pending += chunk


if __name__ == "__main__":
    main(sys.argv[1:])
