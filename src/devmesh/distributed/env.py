"""The launch environment, and the default process group started from it.

torchrun (and ``devmesh run`` / ``devmesh.launch``, which use the same variables) tells each
process who it is through ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. This module reads them once, turns a
missing variable into an error that says how to launch, and initializes the default process
group with the right backend for the device type (gloo for CPU, NCCL for CUDA), binding each
process to its GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from devmesh._exit import settle_collective_threads_at_exit
from devmesh._log import get_logger
from devmesh.errors import DeviceUnavailableError, LaunchEnvironmentError, MeshTimeoutError
from devmesh.launching.store import RUN_STORE_VARIABLE, serve_loopback_store
from devmesh.layout import format_ranks

__all__ = ["LaunchEnv", "read_launch_env", "launched_world_size", "backend_for",
           "ensure_default_group", "host_index"]

_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

_HOW_TO_LAUNCH = (
    "start the script with a launcher, e.g. `torchrun --nproc_per_node=N script.py` or "
    "`devmesh run -n N script.py`, or from Python/a notebook with "
    "`devmesh.launch(fn, N)`"
)


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int  # index of this host (torchrun's node rank)
    master_addr: str
    master_port: int


def _int_var(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise LaunchEnvironmentError(f"environment variable {name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchEnvironmentError(
            f"environment variable {name}={raw!r} is not an integer"
        ) from None


def read_launch_env() -> LaunchEnv:
    """Read torchrun's variables; raise :class:`LaunchEnvironmentError` naming what is missing."""
    missing = [name for name in _REQUIRED if name not in os.environ]
    if missing:
        raise LaunchEnvironmentError(
            f"this process was not started by a distributed launcher: "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set. To fix it, "
            + _HOW_TO_LAUNCH
        )
    rank = _int_var("RANK")
    world_size = _int_var("WORLD_SIZE")
    if not 0 <= rank < world_size:
        raise LaunchEnvironmentError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
    local_world_size = _int_var("LOCAL_WORLD_SIZE", world_size)
    return LaunchEnv(
        rank=rank,
        world_size=world_size,
        local_rank=_int_var("LOCAL_RANK", rank % max(1, local_world_size)),
        local_world_size=local_world_size,
        group_rank=_int_var("GROUP_RANK", rank // max(1, local_world_size)),
        master_addr=os.environ["MASTER_ADDR"],
        master_port=_int_var("MASTER_PORT"),
    )


def host_index() -> int:
    """This process's host (torchrun's node rank, ``GROUP_RANK``); 0 without a launcher."""
    if "GROUP_RANK" in os.environ:
        return _int_var("GROUP_RANK")
    if "RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        return _int_var("RANK") // max(1, _int_var("LOCAL_WORLD_SIZE"))
    return 0


def backend_for(device_type: str) -> str:
    """The c10d backend devmesh uses for a device type: gloo for CPU, NCCL for CUDA."""
    return {"cpu": "gloo", "cuda": "nccl"}.get(device_type, "gloo")


def check_device(device_type: str, local_world_size: int | None = None) -> None:
    """Refuse a device type this machine cannot serve, before any group is created.

    torch accepts ``init_device_mesh("cuda", ...)`` on a CPU-only machine and fails later;
    devmesh says so up front, and also when there are fewer GPUs than local ranks. Under
    torch's ``fake`` process group (a dry run: one process plans a large job's mesh, no
    collective runs) any device type is taken, as torch takes it.
    """
    if device_type == "cpu" or is_fake_world():
        return
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(
                "device_type 'cuda' was requested but this machine has no usable CUDA GPU "
                f"(torch {torch.__version__}, torch.cuda.is_available() is False); use "
                "device_type='cpu' to run the same mesh over gloo on CPU processes"
            )
        if local_world_size is not None and torch.cuda.device_count() < local_world_size:
            raise DeviceUnavailableError(
                f"{local_world_size} processes per host share {torch.cuda.device_count()} "
                "GPU(s), and NCCL needs one GPU per process; launch at most "
                f"--nproc_per_node={torch.cuda.device_count()} per host, or use "
                "device_type='cpu'"
            )
        return
    raise DeviceUnavailableError(
        f"device_type {device_type!r} is not supported; use 'cpu' (gloo) or 'cuda' (NCCL)"
    )


def is_fake_world() -> bool:
    """Whether the default process group is torch's ``fake`` backend (a dry run)."""
    if not dist.is_initialized():
        return False
    try:
        return "fake" in str(dist.get_backend()).lower()
    except (RuntimeError, ValueError):
        return False


def launched_world_size() -> int | None:
    """The world size the launcher announced (``WORLD_SIZE``), read before any process
    group exists; ``None`` without a launcher (or an unreadable value: the group's own
    setup then says what is wrong)."""
    try:
        return int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None


def ensure_default_group(
    device_type: str, *, expected_world_size: int | None = None,
    timeout: datetime.timedelta | None = None,
) -> None:
    """Initialize the default process group from the launch environment if none exists.

    Without a launcher and with ``expected_world_size == 1`` a one-process world is started
    in place (a ``(1,)`` or ``(1, 1)`` mesh then works in a plain script or notebook, where
    torch raises ``KeyError: 'RANK'``). Otherwise a missing launcher is a clear error.
    On GPUs the group pairs NCCL for the device's tensors with gloo for CPU tensors (torch's
    ``"cpu:gloo,cuda:nccl"``), so devmesh's small agreements and users' CPU collectives work
    on a GPU mesh too.
    """
    settle_collective_threads_at_exit()  # a run that ended well must not abort on its way out
    if dist.is_initialized():
        return
    backend = backend_for(device_type)
    if backend != "gloo":  # CPU tensors too: devmesh's agreements, users' CPU collectives
        backend = f"cpu:gloo,{device_type}:{backend}"
    kwargs: dict = {"backend": backend}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if expected_world_size == 1 and not any(v in os.environ for v in _REQUIRED):
        check_device(device_type, 1)
        if device_type == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        return
    env = read_launch_env()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart:
        get_logger("launch").info(
            "restart %d (of at most %s): rank %d of %d joins again; resume from your last "
            "checkpoint", restart, os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?"), env.rank,
            env.world_size)
    check_device(device_type, env.local_world_size)
    if device_type == "cuda":
        torch.cuda.set_device(env.local_rank)
        kwargs["device_id"] = torch.device("cuda", env.local_rank)
    store = _launcher_store(env, timeout) or _loopback_store(env, timeout)
    if store is not None:
        _wait_for_every_rank(store, env, timeout)
        kwargs.update(store=store, rank=env.rank, world_size=env.world_size)
    dist.init_process_group(**kwargs)
    if store is not None:
        _wait_until_every_rank_connected(store, env, timeout)


def _wait_until_every_rank_connected(store, env: LaunchEnv,
                                     timeout: datetime.timedelta | None) -> None:
    """Leave ``init_process_group`` only once every rank has: gloo counts a connection as
    made on the side that opened it before the other side has read it, so a rank whose work
    ends at once (an error, a script with no collective) would otherwise close its side
    while a slower peer still connects — that peer fails with gloo's "connectFullMesh
    failed ... Connection closed by peer" (torch's ``TORCH_DIST_INIT_BARRIER`` does the same
    wait; it is off by default)."""
    wait = timeout or datetime.timedelta(minutes=30)
    missing = _check_in(store, env, "connected", wait)
    if missing:
        raise MeshTimeoutError(
            f"ranks {format_ranks(missing)} of {env.world_size} did not finish connecting "
            f"the process group within {wait.total_seconds():g} s (they started it; the "
            "others waited for them). Their own output says why, or raise the timeout: "
            "init_device_mesh(..., timeout=seconds)")


def _keys_of(what: str) -> str:
    """The prefix of this launch's store keys for ``what`` (arrived, connected)."""
    return f"devmesh/{what}/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"


def _check_in(store, env: LaunchEnv, what: str, wait: datetime.timedelta) -> list[int]:
    """Say in the store that this rank has ``what`` (arrived, connected), wait up to ``wait``
    for every rank to say so, and return the ranks that did not."""
    prefix = _keys_of(what)
    store.set(prefix + str(env.rank), "1")
    keys = [prefix + str(r) for r in range(env.world_size)]
    try:
        store.wait(keys, wait)
    except Exception:  # torch raises DistStoreError / RuntimeError on a store timeout
        return [r for r, key in enumerate(keys) if not store.check([key])]
    return []


def _wait_for_every_rank(store, env: LaunchEnv, timeout: datetime.timedelta | None) -> None:
    """Each rank checks in; a rank that does not within ``timeout`` is *named* in a
    :class:`MeshTimeoutError` on every rank that did (instead of torch's "7/8 clients
    joined", or a hang in the backend's first connection). A rank that comes after the others
    gave up is told so, where the store outlives them (it is served by the launcher)."""
    wait = timeout or datetime.timedelta(minutes=30)
    prefix = _keys_of("arrived")
    advice = ("Find out why they are late or stuck (their own output says), or raise the "
              "timeout: init_device_mesh(..., timeout=seconds)")
    missing = _check_in(store, env, "arrived", wait)
    if missing:
        store.set(f"{prefix}gave_up", format_ranks(missing))
        # rank 0 may serve the store: it stays until every rank that came has read who is missing
        store.set(f"{prefix}told/{env.rank}", "1")
        if env.rank == 0:
            told = [f"{prefix}told/{r}" for r in range(env.world_size) if r not in missing]
            with contextlib.suppress(Exception):
                store.wait(told, datetime.timedelta(seconds=10))
        raise MeshTimeoutError(
            f"ranks {format_ranks(missing)} of {env.world_size} did not start the process "
            f"group within {wait.total_seconds():g} s (the ranks that did waited for them). "
            + advice)
    if store.check([f"{prefix}gave_up"]):
        missing_text = store.get(f"{prefix}gave_up").decode()
        raise MeshTimeoutError(
            f"ranks {missing_text} of {env.world_size} did not start the process group within "
            f"{wait.total_seconds():g} s, and the ranks that did gave up waiting before this "
            f"rank ({env.rank}) arrived. " + advice)


def _launcher_store(env: LaunchEnv, timeout: datetime.timedelta | None):
    """A client of the store the launcher serves, with a prefix per restart attempt: ``devmesh
    run``'s (its address in ``DEVMESH_RUN_STORE``) or torchrun's shared agent store
    (``TORCHELASTIC_USE_AGENT_STORE``, at ``MASTER_ADDR:MASTER_PORT``). ``None``: no launcher
    serves one.

    The launcher holds the store for the whole launch, so no rank has to bind a port another
    process may have taken since it was chosen, and a rank arriving after the others gave up
    is still told so. torch (2.5 to at least 2.13) reuses the agent's store for every restart
    without a prefix, so after ``--max-restarts`` restarts the ranks read the previous
    attempt's addresses (gloo: ``connectFullMesh failed ... Connection refused``; NCCL: a
    stale unique id — pytorch/pytorch#135712). All ranks of a single-node job restart
    together, so ``TORCHELASTIC_RESTART_COUNT`` is the same on each and names the attempt."""
    served = os.environ.get(RUN_STORE_VARIABLE)
    if served:
        host, _, port_text = served.rpartition(":")
        port = int(port_text)
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        host, port = env.master_addr, env.master_port
    else:
        return None
    wait = timeout or datetime.timedelta(minutes=30)
    store = dist.TCPStore(host, port, env.world_size, False, wait)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"devmesh/attempt_{attempt}", store)


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def is_loopback(address: str) -> bool:
    return address in _LOOPBACK or address.startswith("127.")


def _loopback_store(env: LaunchEnv, timeout: datetime.timedelta | None):
    """For a local launch (``MASTER_ADDR`` on loopback, no torchrun agent store), the
    rendezvous store rank 0 serves, listening on loopback only — torch's own ``env://``
    store listens on every interface, open to any machine on the network. ``None``: let
    torch do it (a multi-host launch, or torchrun's agent store)."""
    if not is_loopback(env.master_addr):
        return None
    host = "::1" if env.master_addr == "::1" else "127.0.0.1"
    wait = timeout or datetime.timedelta(minutes=30)
    if env.rank != 0:
        try:
            return dist.TCPStore(host, env.master_port, env.world_size, False, wait)
        except Exception:  # DistNetworkError / DistStoreError: nobody serves the store
            raise MeshTimeoutError(
                f"rank 0 did not start the rendezvous store on {host}:{env.master_port} within "
                f"{wait.total_seconds():g} s; rank 0 is late, stuck or gone (its own output "
                "says which), or raise the timeout: init_device_mesh(..., timeout=seconds)"
            ) from None
    return serve_loopback_store(host, env.master_port, env.world_size, wait)[0]
