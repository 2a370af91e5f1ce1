"""The pool's side of its zygote (:mod:`devmesh.launching._zygote`): starting it, asking it
for workers, and a handle on each worker that answers as ``subprocess.Popen`` would.

The zygote, not the pool, is each worker's parent, so only the zygote can wait for a worker;
it reports each worker's pid when forked and its exit code when it ends, and a thread here
reads those reports. A worker's handle is then what the pool needs of a process: its pid,
``poll()``, ``wait(timeout)``, ``kill()`` and ``returncode`` (minus the signal that killed
it, as ``subprocess`` gives it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

__all__ = ["Zygote", "ForkedProcess"]


class ForkedProcess:
    """A worker forked by the zygote, as the pool sees it."""

    def __init__(self, zygote: Zygote, index: int) -> None:
        self._zygote = zygote
        self.index = index
        self.pid: int | None = None  # known once the zygote has forked it
        self.returncode: int | None = None

    def poll(self) -> int | None:
        with self._zygote.changed:
            self._zygote.notice_its_death()
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._zygote.changed:
            ended = self._zygote.changed.wait_for(
                lambda: self._zygote.notice_its_death() or self.returncode is not None, timeout)
            if not ended:
                raise subprocess.TimeoutExpired(f"devmesh worker {self.index}", timeout)
            assert self.returncode is not None
            return self.returncode

    def kill(self) -> None:
        with self._zygote.changed:
            if self.returncode is None and self.pid is not None:
                try:  # not reaped yet (the zygote reports it when it is): the pid is still its
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                return
            if self.returncode is not None:
                return
        # not forked yet: the zygote has not finished importing torch (a start that timed
        # out, a pool closed while starting). Waiting for it could take for ever; it goes,
        # and every worker with it (the pool starts a new one for its next task)
        self._zygote.stop()


class Zygote:
    """One zygote process for one pool: started with the environment the workers get."""

    def __init__(self, host: str, port: int, key: bytes, env: dict[str, str],
                 preload: Sequence[str] = ()) -> None:
        read_end, write_end = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "devmesh.launching._zygote", host, str(port),
             str(os.getpid()), str(write_end)],
            env=env, stdin=subprocess.PIPE, pass_fds=(write_end,),
        )
        os.close(write_end)
        self.changed = threading.Condition()
        self._unforked: list[ForkedProcess] = []  # asked for, in order, not reported yet
        self._by_pid: dict[int, ForkedProcess] = {}
        #: why the zygote could not prepare the workers' imports, as it reported it
        self.failure: str | None = None
        assert self.process.stdin is not None
        self._requests = self.process.stdin
        self._requests.write(key.hex().encode() + b"\n")  # the pool's secret: never argv
        self._requests.write(" ".join(preload).encode() + b"\n")
        self._requests.flush()
        self._reader = threading.Thread(target=self._read_reports, args=(read_end,),
                                        name="devmesh-zygote-reports", daemon=True)
        self._reader.start()

    def fork(self, index: int, stack_path: str) -> ForkedProcess:
        """Ask for worker ``index``; it connects to the pool once forked."""
        worker = ForkedProcess(self, index)
        with self.changed:
            self._unforked.append(worker)
        try:
            self._requests.write(f"{index} {stack_path}\n".encode())
            self._requests.flush()
        except (BrokenPipeError, ValueError):  # the zygote died: poll() says how
            pass
        return worker

    def notice_its_death(self) -> bool:
        """If the zygote has ended, its workers have too (they die with it): each gets the
        zygote's own exit code if it was never forked, else SIGKILL's. Call holding
        ``changed``; returns whether the zygote has ended."""
        code = self.process.poll()
        if code is None or self._reader.is_alive():
            return False  # alive, or its last reports (a worker's own exit code) still unread
        for worker in self._unforked:
            worker.returncode = code if code != 0 else -signal.SIGKILL
        self._unforked.clear()
        for worker in self._by_pid.values():
            if worker.returncode is None:
                worker.returncode = -signal.SIGKILL
        return True

    def _read_reports(self, fd: int) -> None:
        with os.fdopen(fd, "r") as reports:
            for line in reports:
                if line.startswith("failed "):
                    self.failure = line[len("failed "):].strip()
                    continue
                what, first, second = line.split()
                with self.changed:
                    forked = [w for w in self._unforked if w.index == int(first)]
                    if what == "started" and forked:
                        worker = forked[0]
                        self._unforked.remove(worker)
                        worker.pid = int(second)
                        self._by_pid[worker.pid] = worker
                    elif what == "ended" and int(first) in self._by_pid:
                        self._by_pid.pop(int(first)).returncode = int(second)
                    self.changed.notify_all()
        with self.changed:  # the zygote closed its end: it has ended
            self.changed.notify_all()

    def stop(self) -> None:
        """End the zygote (its workers die with it)."""
        try:
            self._requests.close()
        except OSError:
            pass
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
