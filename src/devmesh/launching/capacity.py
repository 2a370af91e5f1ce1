"""What this machine can hold, asked before a local launch starts any process.

``devmesh run -n 999`` on a 24 GiB machine once started ranks until the kernel's
out-of-memory killer took the launcher (and unrelated processes with it) nine minutes later.
A local launch now compares the request with the machine first: every rank costs at least
the memory of a process that imported torch and joined a gloo group (measured: about 230 MB
resident, 150 MB of it its own; :data:`RANK_MEMORY` rounds up to 256 MiB), and a rank gets a
share of the cores (more than :data:`RANKS_PER_CORE` ranks a core and collectives time out
waiting for ranks that are not scheduled). Both limits name the option that lifts them.

The same module says, after the fact, whether a rank killed by ``SIGKILL`` was the kernel's
out-of-memory killer (the cgroup's ``oom_kill`` counter moved), and how long starting
``n`` workers may take on a machine this busy.
"""

from __future__ import annotations

import os
import re

from devmesh.errors import LaunchCapacityError

__all__ = ["RANK_MEMORY", "RANKS_PER_CORE", "OVERSUBSCRIBE_VARIABLE", "RANK_MEMORY_VARIABLE",
           "START_TIMEOUT_VARIABLE", "check_local_ranks", "memory_available", "oom_kills",
           "start_timeout", "describe_kill"]

#: The least memory a local rank takes: torch imported and a gloo group joined (230 MB
#: resident measured here with torch 2.13, 80 MB of it shared libraries), rounded up.
RANK_MEMORY = 256 << 20
#: Ranks a core can carry before collectives wait for ranks the scheduler does not run.
RANKS_PER_CORE = 16
OVERSUBSCRIBE_VARIABLE = "DEVMESH_OVERSUBSCRIBE"
RANK_MEMORY_VARIABLE = "DEVMESH_RANK_MEMORY"
START_TIMEOUT_VARIABLE = "DEVMESH_START_TIMEOUT"
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def _bytes(text: str, variable: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise LaunchCapacityError(f"{variable}={text!r} is not a size: write e.g. 512MB or 2GB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def memory_available() -> int | None:
    """Bytes a new process can still take: the kernel's ``MemAvailable``, or less where this
    process's cgroup (v2 or v1) has a lower limit. ``None`` where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None and limit < 1 << 60:
            found.append(max(0, limit - usage))
    return min(found) if found else None


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _oversubscribe_allowed() -> bool:
    return os.environ.get(OVERSUBSCRIBE_VARIABLE, "").strip().lower() in ("1", "true", "yes")


def check_local_ranks(ranks: int, *, what: str, override: str | None = None,
                      oversubscribe: bool = False) -> None:
    """Refuse, before anything starts, ``ranks`` local processes that this machine cannot
    hold: more than its available memory at :data:`RANK_MEMORY` each (``DEVMESH_RANK_MEMORY``
    sets a measured footprint of your own), or more than :data:`RANKS_PER_CORE` a core.
    ``what`` names the launch in the message (``"devmesh run -n 999"``) and ``override`` the
    option that lifts the check (``DEVMESH_OVERSUBSCRIBE=1`` lifts it everywhere)."""
    if oversubscribe or _oversubscribe_allowed():
        return
    lift = (f"{override} or " if override else "") + f"{OVERSUBSCRIBE_VARIABLE}=1"
    per_rank = RANK_MEMORY
    if os.environ.get(RANK_MEMORY_VARIABLE):
        per_rank = _bytes(os.environ[RANK_MEMORY_VARIABLE], RANK_MEMORY_VARIABLE)
    available = memory_available()
    if available is not None and ranks * per_rank > available:
        fits = available // per_rank
        raise LaunchCapacityError(
            f"{what}: {ranks} local ranks need at least {ranks * per_rank / 2**30:.1f} GiB "
            f"({per_rank / 2**20:.0f} MiB a rank: a process with torch and a gloo group), but "
            f"this machine has {available / 2**30:.1f} GiB available: it holds about {fits} "
            f"ranks. Run fewer ranks, spread them over hosts (devmesh run --nnodes), or, if "
            f"your ranks are smaller than that, set {RANK_MEMORY_VARIABLE} to their measured "
            f"size or {lift} to launch anyway")
    cores = _usable_cores()
    if ranks > RANKS_PER_CORE * cores:
        raise LaunchCapacityError(
            f"{what}: {ranks} local ranks on {cores} core(s) is more than {RANKS_PER_CORE} a "
            f"core: collectives would time out waiting for ranks the scheduler does not run. "
            f"Run at most {RANKS_PER_CORE * cores} ranks here, or {lift} to launch anyway")


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has killed in this cgroup (v2's
    ``memory.events`` or v1's ``memory.oom_control``); ``None`` where it cannot be read."""
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def describe_kill(signal_name: str, kills_before: int | None) -> str:
    """Words for a rank that ``signal_name`` killed: where it was ``SIGKILL`` and the
    out-of-memory counter moved since ``kills_before``, the kernel killed it for memory."""
    if signal_name != "SIGKILL":
        return ""
    now = oom_kills()
    if kills_before is not None and now is not None and now > kills_before:
        return (" — the kernel's out-of-memory killer: the machine ran out of memory; run "
                "fewer ranks or a smaller model per rank")
    return " (SIGKILL: killed by another process, or by the kernel for memory)"


def start_timeout(ranks: int) -> float:
    """Seconds ``ranks`` new workers may take to start and connect back (a pool's first start
    includes its one torch import, in the process the workers are forked from):
    ``DEVMESH_START_TIMEOUT`` where set, else 60 s plus 5 s a rank, scaled by how busy the
    machine is (the load average per core, when it is above 1): a torch import takes 2 s on
    an idle core and grows with the load."""
    if os.environ.get(START_TIMEOUT_VARIABLE):
        text = os.environ[START_TIMEOUT_VARIABLE]
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise LaunchCapacityError(
                f"{START_TIMEOUT_VARIABLE}={text!r} is not a positive number of seconds")
        return value
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    busy = max(1.0, load / _usable_cores())
    return (60.0 + 5.0 * ranks) * busy
