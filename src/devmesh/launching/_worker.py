"""A long-lived worker process of a :class:`devmesh.launching.launcher.WorkerPool`.

Forked from the pool's zygote (:mod:`devmesh.launching._zygote`), which imported torch once
(:func:`prepare`); it authenticates to the pool (:mod:`devmesh.launching._auth`) before
anything is unpickled, and dies with the zygote, which dies with the pool's process. It runs
tasks sent by the pool: each task sets torchrun's environment variables for its rank,
calls the function, sends back its result (or its traceback), and tears down whatever the
function left (the default process group, devmesh's group cache) so the next task starts
clean. ``SIGUSR1`` dumps every thread's stack to a file the pool reads when a task hangs.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import os
import signal
import socket
import sys
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection

from devmesh.launching import _auth
from devmesh.launching.store import RUN_STORE_VARIABLE

_TASK_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "GLOO_SOCKET_IFNAME", RUN_STORE_VARIABLE,
)


def _cleanup() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group must not take the worker down
            pass
    if "devmesh.distributed.groups" in sys.modules:
        sys.modules["devmesh.distributed.groups"].reset()
    _forget_torch_mesh_caches()
    for name in _TASK_ENV:
        os.environ.pop(name, None)
    # a task's process groups sit in reference cycles (meshes, modules, autograd graphs):
    # collect them now, or each task leaves its groups' gloo threads and sockets behind
    # until a collection happens to run (hundreds of threads per worker over the suite,
    # busy enough to starve the ranks of later tests)
    gc.collect()


def _forget_torch_mesh_caches() -> None:
    """Drop DTensor's plan and sharding caches: they are keyed by mesh *value*, so an entry
    made in an earlier task's world would hand the next task a mesh whose process groups are
    gone (torch's caches assume one world per process)."""
    if "torch" in sys.modules:
        from devmesh import _torch_compat

        _torch_compat.clear_dtensor_caches()


def _serve(conn: Connection) -> None:
    import cloudpickle

    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the pool is gone
        if message is None:
            return
        task_id, payload, task_env, paths = message
        for path in reversed(paths):
            if path not in sys.path:
                sys.path.insert(0, path)
        os.environ.update(task_env)
        try:
            fn, args, kwargs = cloudpickle.loads(payload)
            result = ("ok", cloudpickle.dumps(fn(*args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - report everything to the caller
            result = ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
        finally:
            _cleanup()
        try:
            conn.send((task_id, result))
        except Exception as exc:  # an unpicklable result
            conn.send((task_id, ("error", f"cannot send result back: {exc}", "")))


def prepare(preload: Sequence[str] = ()) -> None:
    """Import what every task needs, once, before any task runs (in the zygote the workers
    are forked from: :mod:`._zygote`), and the modules named in ``preload``: the pool's
    tasks will import them anyway, and each worker (and each that replaces a broken one)
    would pay the import again."""
    import torch  # noqa: F401 - pay the import once, before the first task
    import torch.distributed  # noqa: F401
    from devmesh import _torch_compat

    # torch's dynamo (imported by the first optimizer a task builds) keeps the process group
    # that is alive when it is imported, for the life of the process: import it now, while
    # none is, or the first task to build an optimizer leaves its gloo threads behind
    _torch_compat.import_dynamo()

    for name in preload:
        importlib.import_module(name)
    torch.set_num_threads(1)
    # what is imported so far lives as long as the process: out of the collector's sight,
    # the full collection after each task (_cleanup) scans only what tasks made (~0.2 s per
    # worker and task with torch's objects in view, a few ms without)
    gc.collect()
    gc.freeze()


def serve_pool(host: str, port: int, index: int, stack_path: str, key: bytes) -> None:
    """Be worker ``index`` of the pool listening on ``host:port``: authenticate with ``key``
    before anything is unpickled, say it is ready, run tasks until the pool says stop."""
    stack_file = open(stack_path, "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    # a crash in native code (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL) leaves no Python
    # traceback to send: its stacks go to the same file, where the pool reads them
    faulthandler.enable(file=stack_file, all_threads=True)
    sock = socket.create_connection((host, port))
    conn = Connection(sock.detach())
    if not _auth.respond(conn, key):
        os._exit(2)  # whoever listens there is not our pool
    conn.send((index, os.getpid()))
    conn.send("ready")
    _serve(conn)
