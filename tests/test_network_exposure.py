"""A local launch listens on loopback only (issue 9, item 2): the rendezvous store that rank 0
serves and gloo's own sockets. Checked in the OS's socket table (Linux /proc)."""

from __future__ import annotations

import os
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def listening_addresses() -> list[str]:
    """Local addresses of the TCP sockets this process listens on."""
    import torch

    from devmesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.distributed.all_reduce(torch.ones(1), group=mesh.get_group("tp"))
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:  # 0A: LISTEN
                    found.append(local.split(":")[0])
    return found


LOOPBACK = {"0100007F", "00000000000000000000000001000000",
            "0000000000000000FFFF00000100007F"}


def test_a_local_launch_listens_on_loopback_only(mesh_pool):
    results = mesh_pool.run(listening_addresses, 4)
    assert results[0], "rank 0 serves the rendezvous store: it must listen somewhere"
    for addresses in results:
        assert set(addresses) <= LOOPBACK, addresses
