"""Which of this machine's addresses and interfaces a multi-host run uses.

``devmesh run --nnodes N`` joins a rendezvous at ``--rdzv-endpoint HOST:PORT``; the ranks'
gloo connections must leave by the interface that reaches the other hosts, not the one the
machine's hostname happens to resolve to. The address is the one the kernel would send
from towards the rendezvous host (asked of a UDP socket's ``connect``, which sends nothing),
or ``--local-addr`` where given; the interface is the one that holds that address.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from collections.abc import Callable

__all__ = ["parse_endpoint", "local_address_towards", "interface_of",
           "use_interface_towards", "is_this_hosts"]

_SIOCGIFADDR = 0x8915


def parse_endpoint(endpoint: str, flag: str = "--rdzv-endpoint",
                   whose: str = "node 0's") -> tuple[str, int]:
    """``HOST:PORT`` as ``(host, port)``; a clear error for anything else, naming ``flag``."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag} {endpoint!r}: give HOST:PORT, e.g. 10.0.0.1:29500 "
                         f"({whose} address and a free port)")
    return host.strip("[]"), int(port)


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), port))
        return probe.getsockname()[0]


def use_interface_towards(host: str, port: int, local_addr: str | None = None) -> str:
    """This machine's address for a job that meets at ``host:port`` (``local_addr``, or the
    one on the route there); the ranks' gloo sockets take its interface
    (``GLOO_SOCKET_IFNAME``, unless set)."""
    local = local_addr or local_address_towards(host, port)
    interface = interface_of(local)
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    return local


def is_this_hosts(host: str) -> bool:
    """Whether ``host`` names an address of this machine (binding a socket to it works)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((socket.gethostbyname(host), 0))
    except OSError:
        return False
    return True


def interface_of(address: str) -> str | None:
    """The name of the network interface holding IPv4 ``address``, if one does."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return None


def _has_children() -> bool:
    """Whether a child of this process is still running (exited ones not yet reaped do not
    count)."""
    import glob

    for path in glob.glob("/proc/self/task/*/children"):
        try:
            with open(path) as f:
                children = f.read().split()
        except OSError:
            continue
        for child in children:
            try:
                with open(f"/proc/{child}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state not in ("Z", "X"):
                return True
    return False


def _reachable(host: str, port: int, seconds: float = 3.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=seconds):
            return True
    except OSError:
        return False


def exit_when_cut_off(host: str, port: int, node_rank: int, *, quiet_seconds: float = 20.0,
                      poll_seconds: float = 2.0,
                      before_exit: Callable[[], None] = lambda: None) -> None:
    """Watch, on a daemon thread, for this host being cut off from host 0: its ranks have all
    stopped for ``quiet_seconds`` and the rendezvous at ``host:port`` does not answer. Then
    say so, call ``before_exit`` (to remove what the run wrote) and exit (1) at once:
    torchrun's agent would otherwise wait on the unreachable rendezvous store for many
    minutes, and an exit through the interpreter would wait on the agent's threads."""
    import sys
    import threading
    import time

    def watch() -> None:
        quiet_since = None
        while True:
            time.sleep(poll_seconds)
            if _has_children():
                quiet_since = None
                continue
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= quiet_seconds and not _reachable(host, port):
                print(f"devmesh run: host 0's rendezvous at {host}:{port} cannot be reached from "
                      f"this host (host {node_rank}) and its ranks have stopped: this host is "
                      "cut off from the others; check its network link", file=sys.stderr,
                      flush=True)
                try:
                    before_exit()
                finally:  # whatever the removal raised, the host must not stay waiting
                    os._exit(1)

    threading.Thread(target=watch, name="devmesh-cut-off-watch", daemon=True).start()
