"""Run a function on N local processes over gloo, from a script, a notebook or a test.

``launch(fn, 8)`` is the one-liner: it starts 8 processes, gives each torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...), calls ``fn`` on every rank, and returns the
results in rank order. An exception on any rank is raised here with that rank's remote
traceback; a rank that hangs is reported (with every hung rank's stack) after ``timeout``;
no process is left behind.

:class:`WorkerPool` keeps the processes alive between calls, so the test suite runs hundreds
of multi-rank tests on one pool (see ``devmesh.testing``). Its workers are forked from one
process that imported torch (:mod:`._zygote`), so a pool of eight pays one torch import
(~2.5 s of CPU), not eight, and a failed or hung task, which kills and replaces only the
workers that did not finish cleanly, costs a fork per worker.

Functions are shipped with cloudpickle, so lambdas and functions defined in ``__main__`` or a
notebook cell work; functions from importable modules are sent by reference.
"""

from __future__ import annotations

import itertools
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import cloudpickle

from devmesh._log import get_logger
from devmesh.launching import _auth, capacity
from devmesh.launching.forking import ForkedProcess, Zygote
from devmesh.launching.store import RUN_STORE_VARIABLE, serve_loopback_store
from devmesh.errors import RankFailedError, RankTimeoutError, WorkerStartError, is_peer_gone

__all__ = ["launch", "WorkerPool"]

#: How long the other ranks get to finish after one rank raised, before they are killed.
FAILURE_GRACE_SECONDS = 5.0
#: How often a starting pool looks whether a worker it waits for has died.
_START_POLL_SECONDS = 0.5


def _death(code: int, oom_kills_before: int | None = None) -> str:
    """How a worker process ended, in words; a ``SIGKILL`` while the cgroup's out-of-memory
    counter moved past ``oom_kills_before`` is named as the kernel's out-of-memory killer."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return (f"its process was killed by {name} (exit code {code})"
                f"{capacity.describe_kill(name, oom_kills_before)}")
    return f"its process exited with code {code} without reporting"


def _in_collective(stack: str) -> bool:
    """Whether a rank's Python stack is inside torch.distributed (waiting in a collective or
    the rendezvous) rather than in the user's own code."""
    return "torch/distributed/" in stack


def _culprits(unfinished: list[int], stacks: dict[int, str]) -> str:
    """When some hung ranks wait inside a collective and others are elsewhere, the others are
    what the collective waits for: name them."""
    waiting = [r for r in unfinished if _in_collective(stacks.get(r, ""))]
    elsewhere = [r for r in unfinished if r not in waiting]
    if not waiting or not elsewhere:
        return ""
    return (f" Ranks {waiting} wait inside a collective; ranks {elsewhere} never entered it "
            "(they are elsewhere in their code, see their stacks): they are the cause.")


class _Worker:
    def __init__(self, index: int, process: ForkedProcess, stack_path: str) -> None:
        self.index = index
        self.process = process
        self.stack_path = stack_path
        self.conn: Connection | None = None

    def alive(self) -> bool:
        return self.conn is not None and self.process.poll() is None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def crash_stacks(self) -> str:
        """What faulthandler wrote when this worker crashed in native code (its threads'
        Python stacks at the fatal signal), or ``""`` when it wrote nothing."""
        try:
            with open(self.stack_path) as f:
                text = f.read()
        except OSError:
            return ""
        start = text.rfind("Fatal Python error")
        return text[start:].strip() if start >= 0 else ""

    def stack(self) -> str:
        """Ask the worker for its threads' stacks (faulthandler on SIGUSR1)."""
        if self.process.poll() is not None:
            return f"(process exited with code {self.process.returncode})"
        with open(self.stack_path) as f:
            f.seek(0, os.SEEK_END)
            start = f.tell()
        os.kill(self.process.pid, signal.SIGUSR1)
        time.sleep(0.5)  # faulthandler writes from a signal handler; give it a moment
        with open(self.stack_path) as f:
            f.seek(start)
            text = f.read()
        return text.strip() or "(no stack received)"


class WorkerPool:
    """A pool of ``size`` local worker processes that run SPMD functions on ``1..size`` ranks.

    Use as a context manager (or call :meth:`close`). Not thread-safe: one task at a time.
    ``preload`` names modules the workers import before their first task, once for all of
    them (the process they are forked from imports them): what the tasks import anyway,
    such as ``"devmesh.parallel"`` or torch's compiler, then costs no worker its import.

    Example:
        >>> with WorkerPool(4) as pool:                        # doctest: +SKIP
        ...     pool.run(lambda: int(os.environ["RANK"]) ** 2, 4)
        [0, 1, 4, 9]
    """

    def __init__(self, size: int, *, start_timeout: float | None = None,
                 oversubscribe: bool = False, preload: Sequence[str] = ()) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"a WorkerPool needs a positive number of workers, got {size!r}")
        if isinstance(preload, str) or not isinstance(preload, Iterable) or not all(
                isinstance(name, str) and name and not any(c.isspace() for c in name)
                for name in preload):
            raise ValueError(f"preload takes a sequence of module names, such as "
                             f"['devmesh.parallel'], got {preload!r}")
        self.preload = tuple(preload)
        capacity.check_local_ranks(size, what=f"a local launch of {size} ranks",
                                   override="oversubscribe=True", oversubscribe=oversubscribe)
        self.size = size
        self._start_timeout = start_timeout  # None: scaled to the ranks and the machine's load
        self._oom_kills = capacity.oom_kills()
        self._authkey = secrets.token_bytes(32)  # sent to each worker on its stdin, never argv
        self._server = socket.create_server(("127.0.0.1", 0))
        self._stack_dir = tempfile.TemporaryDirectory(prefix="devmesh-pool-")
        self._workers: list[_Worker | None] = [None] * size
        self._zygote: Zygote | None = None
        self._task_ids = itertools.count()
        self._closed = False
        try:
            self._start(list(range(size)))
        except BaseException:
            self.close()  # no worker outlives a pool that failed to start
            raise

    # -- process management ----------------------------------------------------------------

    def _start_zygote(self) -> Zygote:
        """The process the workers are forked from (:mod:`._zygote`), started with the
        environment they need: one OpenMP thread each, devmesh importable, output unbuffered."""
        host, port = self._server.getsockname()
        # PYTORCH_NVML_BASED_CUDA_CHECK: torch.cuda.is_available(), if anything in the zygote
        # asks it, reads NVML instead of starting CUDA's driver, which a fork cannot inherit
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   PYTORCH_NVML_BASED_CUDA_CHECK="1")
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(
            [package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        return Zygote(host, port, self._authkey, env, self.preload)

    def _start(self, indices: list[int]) -> None:
        if self._zygote is None or self._zygote.process.poll() is not None:
            self._zygote = self._start_zygote()
        for index in indices:
            stack_path = os.path.join(self._stack_dir.name, f"worker{index}.stack")
            open(stack_path, "w").close()
            self._workers[index] = _Worker(index, self._zygote.fork(index, stack_path),
                                           stack_path)
        pending = set(indices)
        limit = self._start_timeout or capacity.start_timeout(len(indices))
        deadline = time.monotonic() + limit
        while pending:
            # in slices: a worker (or the zygote, and so every worker) that died while
            # starting is reported at once, not when the deadline passes
            self._server.settimeout(min(_START_POLL_SECONDS,
                                        max(0.1, deadline - time.monotonic())))
            try:
                sock, _ = self._server.accept()
            except TimeoutError:
                died = [i for i in pending if self._workers[i].process.poll() is not None]
                if died or time.monotonic() >= deadline:
                    raise self._start_failed(sorted(pending), "did not start", limit) from None
                continue
            sock.settimeout(None)
            conn = Connection(sock.detach())
            try:  # HMAC challenge both ways before anything is unpickled from the peer
                trusted = _auth.challenge(conn, self._authkey)
            except OSError:
                trusted = False
            if not trusted:
                conn.close()  # not one of ours: a stranger on the port, or a broken start
                continue
            index, pid = conn.recv()
            worker = self._workers[index] if 0 <= index < self.size else None
            if index not in pending or worker is None:
                conn.close()
                continue
            worker.conn = conn
            pending.discard(index)
            if time.monotonic() > deadline:
                break
        if pending:  # the deadline passed between two workers' connections
            raise self._start_failed(sorted(pending), "did not start", limit)
        for index in indices:
            worker = self._workers[index]
            assert worker is not None and worker.conn is not None
            if not worker.conn.poll(max(1.0, deadline - time.monotonic())):
                late = [i for i in indices if not self._workers[i].conn.poll(0)]
                raise self._start_failed(late, "did not say they were ready", limit)
            worker.conn.recv()  # "ready"

    def _start_failed(self, workers: list[int], what: str, limit: float) -> WorkerStartError:
        """The error for workers that did not start in time: what happened, how busy the
        machine was, and what to set."""
        died = [i for i in workers if self._workers[i] is not None
                and self._workers[i].process.poll() is not None]
        if died:
            codes = ", ".join(
                f"worker {i}: {_death(self._workers[i].process.returncode, self._oom_kills)}"
                for i in died)
            zygote = self._zygote
            if zygote is not None and zygote.failure is not None:
                return WorkerStartError(
                    f"devmesh worker(s) {died} could not start: the process they are forked "
                    f"from failed to import what they need: {zygote.failure}")
            return WorkerStartError(f"devmesh worker(s) {died} died while starting ({codes})")
        try:
            load = f"{os.getloadavg()[0]:.1f}"
        except OSError:
            load = "unknown"
        return WorkerStartError(
            f"devmesh worker(s) {workers} of {self.size} {what} within {limit:g} s (load "
            f"average {load} on {os.cpu_count()} cores: the pool imports torch before its "
            f"workers start, which takes seconds on an idle core and longer on a busy "
            f"machine). Wait for the machine to "
            f"be less busy, run fewer ranks, or allow more time: "
            f"{capacity.START_TIMEOUT_VARIABLE}=600 (seconds)")

    def _kill(self, indices: list[int]) -> None:
        for index in indices:
            worker = self._workers[index]
            if worker is not None:
                worker.kill()
                self._workers[index] = None

    def _replace(self, indices: list[int]) -> None:
        self._kill(indices)
        if not self._closed and indices:
            self._start(indices)

    def close(self) -> None:
        """Stop every worker. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            if worker is None:
                continue
            try:
                if worker.conn is not None:
                    worker.conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 5.0  # for all workers together, not each in turn
        for worker in self._workers:
            if worker is None:
                continue
            try:
                worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            worker.kill()
        if self._zygote is not None:
            self._zygote.stop()
        self._server.close()
        self._stack_dir.cleanup()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # last resort: never leave processes behind
        try:
            self.close()
        except Exception:
            pass

    # -- running tasks ---------------------------------------------------------------------
    def run(
        self, fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on ranks ``0..world_size-1``; return results by rank.

        Raises :class:`~devmesh.errors.RankFailedError` (the rank that caused the failure —
        one that died, else one with an error of its own rather than a closed connection,
        lowest first — with its remote traceback) if any rank raised, and :class:`~devmesh.errors.RankTimeoutError`
        (with the stacks of the hung ranks) if some did not finish within ``timeout`` seconds.
        """
        if self._closed:
            raise RuntimeError("this WorkerPool is closed")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or not (
            1 <= world_size <= self.size
        ):
            raise ValueError(
                f"world_size must be between 1 and the pool size {self.size}, got {world_size!r}"
            )
        dead = [i for i in range(world_size)
                if self._workers[i] is None or not self._workers[i].alive()]  # type: ignore[union-attr]
        self._replace(dead)
        self._oom_kills = capacity.oom_kills()  # a SIGKILL after this and a moved count: OOM
        task_id = next(self._task_ids)
        payload = cloudpickle.dumps((fn, args, kwargs))
        # the pool serves each task's rendezvous store (as torchrun's agent does): its port is
        # held from the moment it is chosen, so two pools on one machine can never share one
        store, port = serve_loopback_store()
        paths = [p for p in sys.path if p]
        workers = [self._workers[r] for r in range(world_size)]
        for rank, worker in enumerate(workers):
            assert worker is not None and worker.conn is not None
            task_env = {
                "RANK": str(rank), "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
                "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "TORCHELASTIC_RUN_ID": f"devmesh-{task_id}",
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                RUN_STORE_VARIABLE: "",  # not a devmesh run's store, if one launched this pool
                # a local launch stays on this machine: gloo's sockets on loopback too
                "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
            }
            worker.conn.send((task_id, payload, task_env, paths))
        try:
            return self._collect(task_id, workers, timeout)
        finally:
            # the ranks are done with it (finished, or killed); a traceback of this frame,
            # kept by the caller, must not keep its server and port alive
            del store

    def _collect(self, task_id: int, workers: list[Any], timeout: float) -> list[Any]:
        results: dict[int, tuple] = {}
        conn_rank = {w.conn: r for r, w in enumerate(workers)}
        deadline = time.monotonic() + timeout
        failed_at: float | None = None
        while len(results) < len(workers):
            now = time.monotonic()
            limit = deadline if failed_at is None else min(deadline, failed_at + FAILURE_GRACE_SECONDS)
            if now >= limit:
                break
            waiting = [w.conn for r, w in enumerate(workers) if r not in results]
            for conn in wait(waiting, timeout=limit - now):
                rank = conn_rank[conn]
                try:
                    got_id, result = conn.recv()
                except (EOFError, OSError):
                    code = workers[rank].process.wait()
                    result = ("error", _death(code, self._oom_kills),
                              workers[rank].crash_stacks() if code < 0 else "")
                    got_id = task_id
                if got_id != task_id:
                    continue
                results[rank] = result
                if result[0] == "error" and failed_at is None:
                    failed_at = time.monotonic()
        unfinished = [r for r in range(len(workers)) if r not in results]
        stacks = {r: workers[r].stack() for r in unfinished} if failed_at is None else {}
        died = [r for r, res in results.items() if res[0] == "error" and not workers[r].alive()]
        # stop the broken workers now; new ones are forked when the next task starts, so the
        # error is raised at once
        self._kill(sorted(set(unfinished) | set(died)))
        errors = sorted(r for r, res in results.items() if res[0] == "error")
        if errors:
            # a rank that died (killed, crashed) is the cause, then one that raised its own
            # error; the others' errors (connection closed by peer: the failed rank's task
            # ended and its groups closed their connections) are consequences
            rank = min(errors, key=lambda r: (r not in died, is_peer_gone(results[r][1]), r))
            _, summary, remote_tb = results[rank]
            get_logger("launch").info("rank %d of %d failed: %s", rank, len(workers), summary)
            rest = [r for r in errors if r != rank]
            others = f" (ranks {rest} failed too)" if rest else ""
            stuck = f"; ranks {unfinished} were stopped" if unfinished else ""
            raise RankFailedError(
                f"rank {rank} of {len(workers)} raised {summary}{others}{stuck}\n"
                f"--- remote traceback of rank {rank} ---\n{remote_tb}",
                rank=rank,
                remote_traceback=remote_tb,
            )
        if unfinished:
            shown = "\n".join(f"--- stack of rank {r} ---\n{stacks[r]}" for r in unfinished)
            raise RankTimeoutError(
                f"ranks {unfinished} of {len(workers)} did not finish within {timeout:g} s "
                f"(a hang: a collective that not every rank called?); they were stopped."
                f"{_culprits(unfinished, stacks)}\n{shown}",
                ranks=unfinished,
                stacks=stacks,
            )
        return [cloudpickle.loads(results[r][1]) for r in range(len(workers))]


def launch(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0,
    start_timeout: float | None = None, oversubscribe: bool = False, **kwargs: Any
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh local processes; return their results.

    Each process sees torchrun's environment, so ``init_device_mesh("cpu", ...)`` inside
    ``fn`` just works. Errors and hangs are raised here, naming the rank (a rank killed by a
    signal is named with the signal, the kernel's out-of-memory killer as such).

    ``start_timeout`` bounds starting the processes (default: scaled to ``world_size`` and
    the machine's load, or ``DEVMESH_START_TIMEOUT``). A ``world_size`` this machine cannot
    hold (memory, cores) is refused before any process starts
    (:class:`~devmesh.errors.LaunchCapacityError`); ``oversubscribe=True`` launches anyway.
    """
    with WorkerPool(world_size, start_timeout=start_timeout,
                    oversubscribe=oversubscribe) as pool:
        return pool.run(fn, world_size, *args, timeout=timeout, **kwargs)
