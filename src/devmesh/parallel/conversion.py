"""What ``model.to_empty()``, ``model.to()``, ``model.double()`` do to a parallelized model.

torch's conversions (``nn.Module._apply``) keep a parameter object where they can (``param.data
= converted``) but make a new, plain ``nn.Parameter`` where the new tensor is of another kind —
always from the ``meta`` device, the way large models are built: construct on ``meta``, shard,
``to_empty(device=...)``, then initialize or load weights (torchtitan's flow). devmesh's
parameters are plain tensors holding this rank's block with the layout attached as an
attribute, so the new parameter would lose its layout, the FSDP unit and DDP buckets would keep
the old (meta) objects, and tied weights would come apart.

:class:`KeepsLayouts` is mixed into every module devmesh parallelizes (by ``fully_shard``,
``replicate`` and ``parallelize_module``): around torch's conversion it gives each new parameter
its predecessor's layout, ties again what was tied, and tells the module's devmesh states which
tensors replaced which (torch's FSDP2 and DTensor keep the objects by swapping tensors; the
effect for the user is the same).
"""

from __future__ import annotations

import torch

from devmesh.parallel.placement import keep_layout
from devmesh.parallel.swap import swap_parameter

__all__ = ["KeepsLayouts"]

_STATES = ("_devmesh_fsdp", "_devmesh_ddp")  # module attributes holding devmesh states


class KeepsLayouts:
    """Mixin: conversions keep devmesh's parameters laid out, tied and known to their states."""

    _devmesh_prefix = ""  # the module's class keeps its name (``Linear``)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001 - torch's signature
        modules = list(self.modules()) if recurse else [self]  # type: ignore[attr-defined]
        before = [(m, kind, name, t) for m in modules
                  for kind in ("_parameters", "_buffers")
                  for name, t in getattr(m, kind).items() if t is not None]
        result = super()._apply(fn, recurse)  # type: ignore[misc]
        replaced: dict[int, torch.Tensor] = {}
        for module, kind, name, old in before:
            slots = getattr(module, kind)
            new = slots.get(name)
            if new is None or new is old:
                continue
            if id(old) in replaced:  # a tied weight torch converted twice: one again
                if kind == "_parameters":
                    swap_parameter(module, name, replaced[id(old)])
                else:
                    slots[name] = replaced[id(old)]
                continue
            if kind == "_parameters":  # laid out as before, the same object kept
                keep_layout(old, new)
            replaced[id(old)] = new
        if replaced:
            for module in self.modules():  # type: ignore[attr-defined]
                for attr in _STATES:
                    state = module.__dict__.get(attr)
                    if state is not None:
                        state.follow(replaced)
        return result

