"""Which of this machine's addresses and interfaces a multi-host run uses.

``devmesh run --nnodes N`` joins a rendezvous at ``--rdzv-endpoint HOST:PORT``; the ranks'
gloo connections must leave by the interface that reaches the other hosts, not the one the
machine's hostname happens to resolve to. The address is the one the kernel would send
from towards the rendezvous host (asked of a UDP socket's ``connect``, which sends nothing),
or ``--local-addr`` where given; the interface is the one that holds that address.
"""

from __future__ import annotations

import fcntl
import socket
import struct

__all__ = ["parse_endpoint", "local_address_towards", "interface_of"]

_SIOCGIFADDR = 0x8915


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` as ``(host, port)``; a clear error for anything else."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--rdzv-endpoint {endpoint!r}: give HOST:PORT, e.g. 10.0.0.1:29500 "
                         "(node 0's address and a free port)")
    return host.strip("[]"), int(port)


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), port))
        return probe.getsockname()[0]


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
