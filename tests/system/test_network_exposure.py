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
    return _listening({os.getpid()})


LOOPBACK = {"0100007F", "00000000000000000000000001000000",
            "0000000000000000FFFF00000100007F"}


def test_a_local_launch_listens_on_loopback_only(mesh_pool):
    results = mesh_pool.run(listening_addresses, 4)
    assert results[0], "rank 0 serves the rendezvous store: it must listen somewhere"
    for addresses in results:
        assert set(addresses) <= LOOPBACK, addresses


def _tree(root: int) -> set[int]:
    """``root`` and every process descending from it (from /proc/*/stat)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, grew = {root}, True
    while grew:
        new = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= new
        grew = bool(new)
    return tree


def _listening(pids: set[int]) -> list[str]:
    """Local addresses the processes ``pids`` listen on (TCP, v4 and v6)."""
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    found.append(fields[1].split(":")[0])
    return found


def test_devmesh_run_listens_on_loopback_only(tmp_path):
    """`devmesh run` serves torchrun's rendezvous store itself, on loopback (torchrun
    --standalone's agent would serve it on every interface), and the workers' store and gloo
    sockets stay on loopback too: every process of the launch is checked."""
    import subprocess
    import time

    ready, done = tmp_path / "ready", tmp_path / "done"
    proc = subprocess.Popen(
        [sys.executable, "-m", "devmesh", "run", "-n", "2",
         os.path.join(os.path.dirname(__file__), "..", "scripts", "hold_mesh.py"), str(ready),
         str(done)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ready.exists(), proc.communicate(timeout=30)[0] if proc.poll() is not None else ""
        pids = _tree(proc.pid)
        assert len(pids) >= 3  # devmesh run (the agent) and its two ranks
        addresses = _listening(pids)
        assert addresses, "the launch must serve its stores somewhere"
        assert set(addresses) <= LOOPBACK, addresses
    finally:
        done.write_text("done")
        out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out


def test_devmesh_runs_ranks_need_no_port_after_the_launch_chose_it(tmp_path):
    """torchrun hands the ranks a ``MASTER_PORT`` it found free and closed again; another
    process on the machine may bind it before rank 0 does (seen under a loaded test run:
    ``OSError: [Errno 98] Address already in use`` in rank 0). A rank of ``devmesh run``
    joins the store its launcher holds instead, so a taken ``MASTER_PORT`` does not matter.
    Rank 0 of a one-rank world, with the environment torchrun gives it and its
    ``MASTER_PORT`` held by this test."""
    import socket
    import subprocess

    from devmesh.launching.store import RUN_STORE_VARIABLE, serve_loopback_store

    store, port = serve_loopback_store()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(taken.getsockname()[1]), TORCHELASTIC_RUN_ID="taken-port",
               GLOO_SOCKET_IFNAME="lo", **{RUN_STORE_VARIABLE: f"127.0.0.1:{port}"})
    script = ("import torch\nfrom devmesh import init_device_mesh\n"
              "mesh = init_device_mesh('cpu', (1,))\n"
              "t = torch.ones(2)\ntorch.distributed.all_reduce(t)\nprint('sum', t.sum().item())")
    try:
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=120, cwd=tmp_path)
    finally:
        taken.close()
        del store
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sum 2.0" in done.stdout
