"""Writing files so that a crash never leaves one half-written, and nothing planted at a
predictable name is followed.

Every file devmesh writes (checkpoints, pictures, CSV, JSON) goes through
:func:`atomic_file`: a fresh temporary file is created *exclusively* next to the target (a
unique name, ``O_EXCL``, so a symlink planted there is never followed), written, flushed and
fsynced, renamed over the target (atomic on POSIX), and the directory is fsynced so the rename
survives a power cut. On any failure the temporary file is removed and the old target stays.
A writer killed outright (SIGKILL) cannot clean up: its temporary file is hidden
(``.NAME.PID.*.devmesh-tmp``) and removed by the next write of the same target, unless its
process still runs (several ranks writing the same picture at once each keep their own).
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import IO, Any

__all__ = ["atomic_file", "atomic_write", "fsync_directory", "pyplot", "save_figure",
           "TMP_SUFFIX"]

TMP_SUFFIX = ".devmesh-tmp"


def fsync_directory(directory: str) -> None:
    """Make the renames into ``directory`` survive a power cut (a no-op where directories
    cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # a platform without directory fds: the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str, mode: str = "wb", *,
                sync_directory: bool = True) -> Iterator[IO[Any]]:
    """``with atomic_file(path) as f: ...`` writes ``path`` all or nothing.

    ``sync_directory=False`` leaves the directory's fsync to the caller: for many files
    renamed into one directory (a checkpoint's ranks' data files), one
    :func:`fsync_directory` after the last rename makes them all durable at once."""
    directory = os.path.dirname(os.path.abspath(path)) or "."
    prefix = f".{os.path.basename(path)}."
    for stale in glob.glob(os.path.join(glob.escape(directory), glob.escape(prefix) + "*"
                                        + TMP_SUFFIX)):
        if _writer_alive(os.path.basename(stale)[len(prefix):]):
            continue  # another process writing the same file now (every rank drawing it)
        with contextlib.suppress(OSError):
            os.remove(stale)  # left by a writer that was killed
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f"{prefix}{os.getpid()}.",
                               suffix=TMP_SUFFIX)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"newline": ""})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        if sync_directory:
            fsync_directory(directory)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _writer_alive(rest: str) -> bool:
    """Whether the temporary file whose name goes on with ``rest`` (``PID.RANDOM...``) belongs
    to a process that is still running on this machine (then it is being written, not left)."""
    pid = rest.split(".", 1)[0]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, but not ours to signal
        return True
    return True


def atomic_write(path: str, write: Callable[[IO[str]], Any]) -> None:
    """Call ``write(file)`` on a text file that becomes ``path`` only when complete."""
    with atomic_file(path, "w") as f:
        write(f)


def pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend (no display needed)."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "drawing pictures needs matplotlib: pip install 'devmesh[viz]' (or matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str) -> None:
    """Save a matplotlib figure as PNG atomically and close it."""
    try:
        with atomic_file(path, "wb") as f:
            fig.savefig(f, dpi=100, format="png")
    finally:
        pyplot().close(fig)
