"""The one place devmesh puts a tensor into a module's parameter slot directly.

FSDP swaps a unit's parameters between their shards and the gathered tensors around each
forward and backward; DDP and the DTensor adoption put back the parameters a conversion
replaced; placing a parameter laid out on a mesh registers it. Each must bypass
``nn.Module.__setattr__`` and ``register_parameter``: those refuse a plain tensor (a
gathered view is one), and fire torch's registration hooks for what is only a change of view.
Writing the slot here, and nowhere else (a test holds the code to it), keeps those swaps in
sight: what may stand in a slot is what the callers below put there.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["swap_parameter"]


def swap_parameter(module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    """Put ``tensor`` in ``module``'s parameter slot ``name`` as it is: no checks, no hooks."""
    module._parameters[name] = tensor
