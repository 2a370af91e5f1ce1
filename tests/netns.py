"""Hosts for the tests: network namespaces on one bridge (itself in a namespace of its own),
made by the test and removed after, every process left in them killed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator


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
