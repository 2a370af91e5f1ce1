"""Collective calls made inside ``if rank == 0:`` (the way torch code saves) warn, naming
the ranks that have not called them, instead of waiting silently for the timeout.

``save_checkpoint``, ``load_checkpoint``, ``state_dict(full=True)`` and a pipeline runner's
``state_dict(full=True)`` are collectives. Each rank posts its arrival in the rendezvous
store first and waits a while (60 s by default, 1 s here) for the others; ranks missing then
are named in a ``WaitingForRanksWarning``, and the call goes on: a rank only late (one that
evaluated alone first) still joins and the call succeeds, as here, where rank 1 comes 3 s
after rank 0. A call with nothing to gather (a replicated model's full state dict) is
local, and rank 0 alone takes it at once, as under torch's DDP.
"""

from __future__ import annotations

import os
import time
import warnings

import torch
from torch import nn

from devmesh import init_device_mesh
from devmesh.distributed import consensus
from devmesh.errors import WaitingForRanksWarning
from helpers import reported, stay_away_until_reported
from devmesh.parallel import (
    fully_shard,
    load_checkpoint,
    replicate,
    save_checkpoint,
    state_dict,
)


def late_rank_1(path: str):
    """Each collective call made by rank 0 first and by rank 1 3 s later: the warnings each
    rank got, and what the calls returned."""
    consensus.ALONE_SECONDS = 1.0  # the test's patience
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    fully_shard(model, mesh=mesh)
    calls = [("state_dict(full=True)", lambda: state_dict(model, full=True)),
             ("save_checkpoint", lambda: save_checkpoint(path, model, extra={"step": 1})),
             ("load_checkpoint", lambda: load_checkpoint(path, model))]
    results, heard = [], []
    replicated = nn.Linear(4, 2)
    replicate(replicated, mesh=mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if mesh.get_rank() == 0:  # local: nothing split, as torch DDP's state_dict()
            results.append(state_dict(replicated, full=True))
    heard.append([str(w.message) for w in caught])
    for what, call in calls:
        if mesh.get_rank() == 1:
            time.sleep(3)  # evaluating alone, say
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results.append(call())
        heard.append([str(w.message) for w in caught
                      if issubclass(w.category, WaitingForRanksWarning)])
    from devmesh.layout.schedule import build_schedule
    from devmesh.parallel.pipeline import PipelineRunner, split_sequential

    pipeline = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    stage = split_sequential(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), 2)
    runner = PipelineRunner({pipeline.get_rank(): stage[pipeline.get_rank()]}, pipeline,
                            build_schedule("1f1b", 2, 2), None)
    if pipeline.get_rank() == 1:
        time.sleep(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        whole = runner.state_dict(full=True)
    heard.append([str(w.message) for w in caught
                  if issubclass(w.category, WaitingForRanksWarning)])
    shapes = [{k: v.shape for k, v in full.items()} for full in (results[-3], whole)]
    return heard, shapes, results[-1]


def test_a_collective_called_on_rank_0_first_warns_naming_the_others(mesh_pool, tmp_path):
    (heard_0, shapes, extra), (heard_1, *_) = mesh_pool.run(late_rank_1, 2, str(tmp_path / "c"))
    assert heard_0[0] == []  # a replicated model's full state dict: rank 0 alone, no wait
    for what, warned in zip(("state_dict(full=True)", "save_checkpoint", "load_checkpoint",
                             "runner.state_dict(full=True)"), heard_0[1:], strict=True):
        assert warned == [f"{what} is a collective over ranks 0-1, and rank 1 has not "
                          "called it in 1 s: if it runs inside `if rank == 0:`, call it on "
                          "every rank and save or print on one. Waiting on, until the "
                          "timeout names them"], warned
    assert heard_1 == [[], [], [], [], []]  # the others were all there when it came
    assert shapes == [{"0.weight": (8, 4), "0.bias": (8,), "1.weight": (2, 8),
                       "1.bias": (2,)}] * 2
    assert extra == {"step": 1}


def mixed_layouts():
    """A model whose first layer is sharded over ``dp`` and second over ``tp`` (torch's
    tensor parallelism) on a (2, 2) mesh: each rank gathers over other groups, and all four
    call ``state_dict(full=True)`` together; then each rank its pipeline stage's. Returns
    the warnings and the model's state's shapes."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    consensus.ALONE_SECONDS = 1.0
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    fully_shard(model[0], mesh=mesh["dp"])
    parallelize_module(model[1], mesh["tp"], ColwiseParallel())
    # and a pipeline's stages on (pp, dp): stage 0 sharded over its copies, stage 1 plain
    stages = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = nn.Linear(4, 2)
    if stages.get_coordinate()[0] == 0:
        fully_shard(stage, mesh=stages["dp"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        full = state_dict(model, full=True)
        state_dict(stage, full=True)  # every rank its own stage: ranks 0 and 1 gather
    return [str(w.message) for w in caught], {k: v.shape for k, v in full.items()}


def test_ranks_that_gather_over_different_groups_still_arrive_together(mesh_pool):
    """The ranks a state dict's gathers reach, joined: the whole mesh for the model (a first
    version had each rank wait for its own groups' ranks — rank 0 for 0, 1 and 2, rank 3
    for 1, 2 and 3 — under names the others never posted, and warn after the wait), and a
    stage's copies alone for a stage (the root mesh's ranks would wait for stage 1's,
    which have nothing to gather)."""
    for heard, shapes in mesh_pool.run(mixed_layouts, 4):
        assert heard == []
        assert shapes == {"0.weight": (8, 4), "0.bias": (8,), "1.weight": (2, 8),
                          "1.bias": (2,)}


def called_on_rank_0_only(path: str, rank_1_exits: bool):
    """save_checkpoint on rank 0 alone under a 3 s mesh timeout, rank 1 busy past it (or gone
    at once); then devmesh's failure check entered by rank 0 alone. What rank 0 raised, and
    how long each took."""
    from devmesh.errors import CollectiveTimeoutError

    consensus.ALONE_SECONDS = 1.0
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",), timeout=3)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    fully_shard(model, mesh=mesh)
    consensus.settle_held()  # the setup's checks agreed on both ranks (a first forward would)
    if mesh.get_rank() == 1:
        if not rank_1_exits:  # busy until rank 0 has its errors
            stay_away_until_reported(os.path.dirname(path), (0,))
        return None
    out = []
    for call in (lambda: save_checkpoint(path, model),
                 lambda: consensus.failures(None, mesh.get_group())):
        began = time.monotonic()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                call()
                out.append(("returned", None, time.monotonic() - began))
            except CollectiveTimeoutError as exc:
                out.append(("CollectiveTimeoutError", (str(exc), exc.missing),
                            time.monotonic() - began))
            except Exception as exc:  # noqa: BLE001 - the test reports what it was
                out.append((type(exc).__name__, str(exc), time.monotonic() - began))
    reported(os.path.dirname(path), 0)
    return out


def test_a_collective_called_on_one_rank_names_the_other_within_the_timeout(mesh_pool,
                                                                              tmp_path):
    import os

    for rank_1_exits in (False, True):
        path = tmp_path / f"c{rank_1_exits}"
        saved, checked = mesh_pool.run(called_on_rank_0_only, 2, str(path), rank_1_exits,
                                       timeout=120)[0]
        assert saved[0] == "CollectiveTimeoutError", saved
        text, missing = saved[1]
        assert missing == [1]
        assert "save_checkpoint is a collective over ranks 0-1, and rank 1 has not called " \
               "it within the timeout (3 s)" in text, text
        assert saved[2] < 3 + 2  # within the mesh's timeout, not after it
        assert not os.path.exists(path)  # nothing written
        # devmesh's own agreement, entered alone: names rank 1 too, not gloo's bare timeout
        assert checked[0] == "CollectiveTimeoutError", checked
        assert checked[1][1] == [1] and "the failure check" in checked[1][0], checked
