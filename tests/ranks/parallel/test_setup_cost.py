"""What setting a model up costs in communication: ``fully_shard`` checks one rank's own
arguments and agrees on what its unit holds, a model's calls together in a single
collective at the root's call (inside ``batched_checks()``, two collectives for all the
calls), and
``parallelize_module`` agrees on its whole plan (styles, and the shapes and dtypes of the
parameters they split) once, then sends the split parameters' source values in buckets
(torch's sends each parameter on its own).
Counted on real gloo ranks (every collective entered on a process group); the refusals and
disagreements these single agreements still catch on every rank are in
the errors tests."""

from __future__ import annotations

import torch
from torch import nn

from devmesh import init_device_mesh
from devmesh.distributed.entered import entered_collectives

BLOCKS = 6


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
                           for _ in range(BLOCKS)])


def setup_collectives() -> dict[str, int]:
    from devmesh.parallel import ColwiseParallel, RowwiseParallel, batched_checks, \
        fully_shard, parallelize_module

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = _model()
    with entered_collectives() as sharding:
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model = _model()
    with entered_collectives() as batched, batched_checks():
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model = _model()
    plan = {}
    for i in range(BLOCKS):
        plan[f"{i}.0"], plan[f"{i}.2"] = ColwiseParallel(), RowwiseParallel()
    with entered_collectives() as splitting:
        parallelize_module(model, mesh, plan)
    return {"fully_shard": sum(sharding.values()), "parallelize_module": sum(splitting.values()),
            "broadcasts": splitting["broadcast"], "batched": sum(batched.values())}


def test_a_models_setup_costs_one_agreement_and_its_split_parameters_one_bucket(mesh_pool):
    for counts in mesh_pool.run(setup_collectives, 2):
        assert counts["fully_shard"] == 1, counts  # one for the calls, at the root's call
        assert counts["batched"] == 2, counts  # a failure flag, then one digest of them all
        # two Linear layers per block, a weight and a bias each: 24 parameters, 10 KB in all,
        # one bucket
        assert counts["broadcasts"] == 1, counts
        assert counts["parallelize_module"] == 1 + 2, counts     # + refusal + plan
