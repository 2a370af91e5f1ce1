"""``GradScaler``: torch's loss scaler for float16 training, agreeing on every rank.

torch's ``torch.amp.GradScaler`` checks the gradients for inf/nan on each rank and skips the
optimizer step (and halves the scale) where it finds one. Under torch's FSDP2 and TP the
gradients are DTensors, whose dispatcher makes that check agree across the mesh. devmesh's
gradients are this rank's blocks as plain tensors, so with torch's scaler an overflow in one
rank's block skips the step on that rank only: the others update their blocks, and the ranks'
scales part ways — silently (reproduced under ``fully_shard``). This scaler takes torch's
arguments and behaviour and makes the check one decision for all ranks (one all-reduce of a
flag per step, over the default process group, as torch's FSDP1 ``ShardedGradScaler`` does).

Code written for torch's FSDP2 keeps torch's scaler: importing ``devmesh.parallel`` makes
``torch.amp.GradScaler`` agree the same way when its optimizer holds devmesh-sharded
parameters (:func:`route_torchs_grad_scaler`); for any other optimizer it is torch's own.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from devmesh import _torch_compat

__all__ = ["GradScaler", "route_torchs_grad_scaler"]


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/nan check is the same on every rank: a rank skips
    the step exactly when some rank found an inf or nan in its gradients."""

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool
                        ) -> dict[torch.device, torch.Tensor]:
        return _agreed(super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16),
                       found_inf)


def _agreed(per_device: dict[torch.device, torch.Tensor], found_inf: torch.Tensor
            ) -> dict[torch.device, torch.Tensor]:
    """Every rank's inf/nan flags made one: set where any rank found one."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return per_device
    anywhere = found_inf.new_zeros(())  # on the scaler's device
    for flag in per_device.values():
        anywhere = torch.maximum(anywhere, flag.to(anywhere.device).reshape(()))
    anywhere = anywhere.reshape(1)
    dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
    if not per_device:  # no gradient here: the decision still has to reach step()
        per_device[found_inf.device] = found_inf
    for device, flag in per_device.items():
        flag.copy_(anywhere.to(device).reshape(flag.shape))
    return per_device


_torchs_unscale = None  # torch's own, kept when routed


def route_torchs_grad_scaler() -> None:
    """Make ``torch.amp.GradScaler`` (and its subclasses) agree on every rank when its
    optimizer holds devmesh-sharded parameters, as :class:`GradScaler` does (idempotent):
    its public ``unscale_`` (which ``step`` calls too) is followed by the agreement on the
    flags it found; with any other optimizer it is torch's own, unchanged."""
    global _torchs_unscale
    if _torchs_unscale is not None:
        return
    from devmesh.parallel.param import get_layout

    torchs = _torchs_unscale = torch.amp.GradScaler.unscale_

    @functools.wraps(torchs)
    def unscale_(self, optimizer):
        torchs(self, optimizer)
        if not self.is_enabled() or isinstance(self, GradScaler) or not any(
                get_layout(p) is not None for group in optimizer.param_groups
                for p in group["params"]):
            return  # devmesh's own agrees in its override; other optimizers are torch's
        found_inf = torch.zeros((), dtype=torch.float32,
                                device=_torch_compat.grad_scaler_device(self))
        _agreed(_torch_compat.grad_scaler_flags(self, optimizer), found_inf)

    torch.amp.GradScaler.unscale_ = unscale_
