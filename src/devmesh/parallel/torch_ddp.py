"""torch's ``DistributedDataParallel`` over a model devmesh has split: refused by name.

DDP takes every parameter for a whole tensor that each rank holds alike: at construction it
broadcasts rank 0's parameters over every rank's, and in backward it averages each
parameter's gradient over the whole process group. A parameter devmesh's ``fully_shard``,
``parallelize_module`` or ``parallelize`` split is this rank's *block*, so DDP would overwrite
every rank's blocks with rank 0's and average different blocks as if they were one tensor:
training runs, silently unlike one process. Code that wraps whatever model it is handed —
transformers' ``Trainer`` (through accelerate), many training scripts — does exactly that.
The model devmesh returned already reduces its own gradients, so the refusal says to drop
the wrapper.

What is refused is a parameter whose blocks differ *within DDP's process group*. DDP over
the ranks that hold the same blocks — over the ``dp`` dim of a tensor-parallel model
(``process_group=mesh["dp"].get_group()`` or ``device_mesh=mesh["dp"]``) — is data
parallelism composed with devmesh's and stays accepted, as do parameters devmesh keeps whole
(its own DDP, ``replicate``: DDP's broadcast and average of equal tensors leave them equal)
and those listed in torch's ``_ddp_params_and_buffers_to_ignore`` (torch's way to keep DDP
off them).
"""

from __future__ import annotations

import functools
import inspect

import torch.distributed as dist
from torch import nn

from devmesh.errors import ParallelizeError
from devmesh.parallel.param import ParamLayout, get_layout

__all__ = ["refuse_ddp_over_blocks", "route_torchs_ddp"]


def _other_blocks(layout: ParamLayout) -> frozenset[int]:
    """The ranks of the layout's mesh that hold another block than this rank's: those
    whose coordinate differs from this rank's on a mesh dim that splits the tensor."""
    ranks = layout.mesh.mesh
    mine = layout.mesh.get_coordinate()
    if mine is None:
        return frozenset()
    split = {m for dims in layout.spec.dim_map for m in dims}
    same = ranks[tuple(mine[d] if d in split else slice(None) for d in range(ranks.ndim))]
    return frozenset(ranks.flatten().tolist()) - frozenset(same.flatten().tolist())


def _ddp_ranks(process_group, device_mesh) -> frozenset[int]:
    """The global ranks DDP averages over: its ``process_group``, its ``device_mesh``'s
    group, or the whole world."""
    if process_group is None and device_mesh is not None:
        process_group = device_mesh.get_group()
    if process_group is None:
        return frozenset(range(dist.get_world_size()))
    return frozenset(dist.get_process_group_ranks(process_group))


def refuse_ddp_over_blocks(module: nn.Module, process_group=None, device_mesh=None) -> None:
    """Raise if ``module`` holds parameters devmesh split whose blocks differ between ranks
    of DDP's process group, which DDP would take as one whole tensor. Every rank has the
    same parameters and layouts, so every rank raises alike, before DDP's first collective."""
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    laid_out = [(name, layout) for name, param in module.named_parameters()
                if name not in ignored and (layout := get_layout(param)) is not None
                and any(layout.spec.dim_map)]
    if not laid_out or not dist.is_initialized():
        return
    group = _ddp_ranks(process_group, device_mesh)
    others: dict[tuple, frozenset[int]] = {}  # one computation per mesh and split dims
    split = []
    for name, layout in laid_out:
        key = (id(layout.mesh), layout.spec.dim_map)
        if key not in others:
            others[key] = _other_blocks(layout)
        if others[key] & group:
            split.append(name)
    if not split:
        return
    shown = ", ".join(split[:3]) + (f" and {len(split) - 3} more" if len(split) > 3 else "")
    raise ParallelizeError(
        f"torch's DistributedDataParallel over {type(module).__name__}: its parameters "
        f"{shown} are this rank's blocks of tensors devmesh split (fully_shard, "
        "parallelize_module or parallelize), other ranks of DDP's process group hold "
        "other blocks, and DDP would broadcast rank 0's blocks over theirs and average "
        "different blocks as one tensor. The model devmesh "
        "returned reduces its own gradients: train it without the DDP wrapper, or give DDP "
        "only the ranks that hold the same blocks (process_group=mesh['dp'].get_group()). "
        "transformers' Trainer wraps it so (through accelerate); with Trainer, let "
        "transformers split the model (from_pretrained(..., distributed_config=...), which "
        "runs on devmesh's process group), or train devmesh's model in a loop of your own")


def route_torchs_ddp() -> None:
    """Make ``torch.nn.parallel.DistributedDataParallel`` refuse a model devmesh split
    (:func:`refuse_ddp_over_blocks`) before it touches it (idempotent); any other model is
    torch's own, unchanged."""
    ddp = nn.parallel.DistributedDataParallel
    if getattr(ddp.__init__, "__devmesh_routed__", False):
        return
    torchs_init = ddp.__init__
    signature = inspect.signature(torchs_init)

    @functools.wraps(torchs_init)
    def init(self, module, *args, **kwargs):
        given = signature.bind(self, module, *args, **kwargs).arguments
        refuse_ddp_over_blocks(module, given.get("process_group"), given.get("device_mesh"))
        torchs_init(self, module, *args, **kwargs)

    init.__devmesh_routed__ = True  # type: ignore[attr-defined]
    ddp.__init__ = init
