"""A rank that stops mid-step says so, and a rank waiting for it in a collective gives up.

:mod:`devmesh.distributed.stops` on its own, two real ranks over gloo: the announcement names
how many collectives of each group the stopped rank entered, so a collective it entered
before stopping still finishes, the next one is given up on within a poll, and devmesh then
refuses every collective on that world (the one given up on stays posted).
"""

from __future__ import annotations

import time

import pytest
import torch

from devmesh import init_device_mesh
from devmesh.distributed import comm, stops
from devmesh.errors import CollectiveAbandonedError, MeshBrokenError


def stop_after(entered: int):
    """Rank 1 enters ``entered`` all-reduces, then announces it stopped; rank 0 all-reduces
    until it gives up. Returns rank 0's results and error, then what each rank's next
    collective does after the scope."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",), timeout=60)
    rank = mesh.get_rank()
    seen: list = []
    with stops.scope("a step"):
        if rank == 1:
            for _ in range(entered):
                comm.all_reduce(torch.ones(2), mesh, (0,))
            stops.announce("stage 0, forward: IndexError: index out of range", (0, 1))
        else:
            try:
                for _ in range(entered + 1):
                    seen.append(comm.all_reduce(torch.ones(2), mesh, (0,)).tolist())
            except CollectiveAbandonedError as exc:
                seen.append((str(exc), exc.stopped, exc.collective))
    if rank == 1:  # hears of it through the store, as a pipeline step's end does
        deadline = time.monotonic() + 30
        while stops.learn_broken() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    try:  # neither rank runs another collective on this world
        comm.all_reduce(torch.ones(2), mesh, (0,))
        seen.append("ran")
    except MeshBrokenError as exc:
        seen.append(str(exc))
    return seen


@pytest.mark.parametrize("entered", [0, 2])
def test_a_wait_gives_up_on_a_rank_that_stopped_before_entering(mesh_pool, entered):
    rank0, rank1 = mesh_pool.run(stop_after, 2, entered)
    *finished, (message, stopped, collective), refused = rank0
    assert finished == [[2.0, 2.0]] * entered  # entered before it stopped: they finished
    assert stopped == 1 and collective == f"all_reduce over dp (collective #{entered + 1})"
    assert message.startswith(f"[rank 0] all_reduce over dp (collective #{entered + 1}) on "
                              "ranks [0, 1] cannot finish: rank 1 stopped before entering it "
                              "— stage 0, forward: IndexError: index out of range. It stays "
                              "posted"), message
    assert refused.startswith("[rank 0] this world's collectives are out of step (rank 0 gave "
                              f"up on all_reduce over dp (collective #{entered + 1}): rank 1 "
                              "stopped before entering it"), refused
    assert rank1 == [refused.replace("[rank 0] ", "[rank 1] ")]
