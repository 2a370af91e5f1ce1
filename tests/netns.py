"""Hosts for the tests: network namespaces on one bridge (itself in a namespace of its own),
made by the test and removed after, every process left in them killed; where namespaces
cannot be made, loopback aliases (127.0.0.2, 127.0.0.3, ...)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def pids(namespace: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,
                         text=True).stdout
    return [int(p) for p in out.split()]


def kill_all(namespace: str) -> None:
    for pid in pids(namespace):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def bridged(tag: str, addresses: list[str]) -> Iterator[list[str]]:
    """Namespaces ``<tag>h0``, ``<tag>h1``, ..., the i-th with ``eth0`` at ``addresses[i]``
    (a /24) on a bridge in ``<tag>sw``: their names. Removed after, their processes killed."""
    switch, names = f"{tag}sw", [f"{tag}h{i}" for i in range(len(addresses))]
    made: list[str] = []
    try:
        for name in (switch, *names):
            ip("netns", "add", name)
            made.append(name)
            ip("-n", name, "link", "set", "lo", "up")
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        for i, (name, address) in enumerate(zip(names, addresses)):
            ip("-n", switch, "link", "add", f"port{i}", "type", "veth", "peer", "name", "eth0",
               "netns", name)
            ip("-n", switch, "link", "set", f"port{i}", "master", "br0")
            ip("-n", switch, "link", "set", f"port{i}", "up")
            ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")
        yield names
    finally:
        for name in made:
            kill_all(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@dataclass
class Host:
    address: str
    prefix: list[str]  # what runs a command on the host


def _namespaces_work() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    probe = f"dm{os.getpid()}probe"
    try:
        ip("netns", "add", probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"cannot make a network namespace ({exc})"
    ip("netns", "del", probe)
    return None


@contextlib.contextmanager
def simulated_hosts(count: int, *, descending: bool = False) -> Iterator[list[Host]]:
    """``count`` hosts: namespaces ``dm<pid>h<i>`` at 10.201.0.<i+1>/24 on a bridge in
    ``dm<pid>sw`` (``descending``: host i at 10.201.0.<count-i>, the first host's address
    the highest); every process left in them is killed and the namespaces deleted after."""
    why = ("DEVMESH_TEST_HOSTS=aliases" if os.environ.get("DEVMESH_TEST_HOSTS") == "aliases"
           else _namespaces_work())

    def number(i: int) -> int:
        return count - i if descending else i + 1

    if why is not None:  # loopback aliases: every 127/8 address is this machine's lo
        yield [Host(f"127.0.0.{number(i) + 1}", []) for i in range(count)]
        return
    addresses = [f"10.201.0.{number(i)}" for i in range(count)]
    with bridged(f"dm{os.getpid()}", addresses) as names:
        yield [Host(address, ["ip", "netns", "exec", name])
               for address, name in zip(addresses, names)]
