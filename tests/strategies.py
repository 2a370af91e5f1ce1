"""The small model and the parallel strategies that several rank tests train and compare
with one process (data, fully sharded, hybrid and tensor parallel, and their compositions)."""

from __future__ import annotations

import torch
from torch import nn

from devmesh.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    fully_shard,
    parallelize_module,
    replicate,
)


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 14), nn.ReLU(),
                         nn.Linear(14, 5))


def apply_strategy(name, model, mesh):
    tp_plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    if name.startswith("ddp_2d") or name == "ddp":
        replicate(model, mesh=mesh)
        return mesh
    if name in ("fsdp", "fsdp_uneven", "fsdp_no_reshard", "hsdp"):
        reshard = name != "fsdp_no_reshard"
        for i in (0, 2, 4):
            fully_shard(model[i], mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        return mesh
    if name == "tp":
        parallelize_module(model, mesh, tp_plan)
        return None
    if name == "ddp+tp":
        parallelize_module(model, mesh["tp"], tp_plan)
        replicate(model, mesh=mesh["dp"])
        return mesh["dp"]
    if name == "fsdp+tp":
        parallelize_module(model, mesh["tp"], tp_plan)
        for i in (0, 2, 4):
            fully_shard(model[i], mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return mesh["dp"]
    if name == "hsdp+tp":
        parallelize_module(model, mesh["tp"], tp_plan)
        dp = mesh["replicate", "shard"]
        for i in (0, 2, 4):
            fully_shard(model[i], mesh=dp)
        fully_shard(model, mesh=dp)
        return dp
    raise ValueError(name)
