"""One conversion for an activation that several column-sharded modules read.

Attention's q, k and v projections read one hidden state, and so do an MLP's gate and up
projections. Each colwise module replicates its input across the TP ranks (or gathers it,
under sequence parallelism), and the conversion's backward reduces the input's gradient
(an all-reduce, or a reduce-scatter). Converted once per module, the same input's gradient
is reduced once per module: five all-reduces a transformer layer in backward where two do.
Megatron's layers convert a block's input once by hand; torchtitan's plan does it with a
``PrepareModuleInput`` on the block. devmesh does it for any plan: the modules that receive
the same tensor object in one forward share one conversion, so autograd sums their gradient
parts first and the sum is reduced in one collective (in forward, a sequence-parallel input is
gathered once instead of once per module).

Only the latest conversion is remembered: the modules reading one input run one after another.
It is reused only for the same tensor object, unchanged since (its version), converted the
same way over the same mesh, with the same grad mode (an inference tensor, which keeps no
version, is converted for each module). The converted tensor is held only while
the input's Python object lives (a weak reference to the input drops it): the modules' forward,
not the step.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from devmesh.mesh import DeviceMesh

__all__ = ["converted_once"]


class _Latest:
    __slots__ = ("source", "version", "key", "result", "result_version")

    def __init__(self) -> None:
        self.source: weakref.ref | None = None
        self.version = -1
        self.key: tuple = ()
        self.result: torch.Tensor | None = None
        self.result_version = -1


_latest = _Latest()


def _forget(source: weakref.ref) -> None:
    """The input is gone: so is the reason to hold its conversion."""
    if _latest.source is source:
        _latest.source = _latest.result = None


def converted_once(x: torch.Tensor, mesh: DeviceMesh, how: object,
                   convert: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``convert()``'s result for ``x``, or the one already made for this very ``x`` (unchanged,
    over ``mesh``, converted as ``how`` says, same grad mode) by the module before."""
    if x.is_inference():  # keeps no version to tell a change by: converted for each module
        return convert()
    key = (id(mesh), how, torch.is_grad_enabled())
    latest = _latest
    result = latest.result
    if (result is not None and latest.source() is x  # type: ignore[misc]
            and latest.version == x._version and latest.key == key
            and result._version == latest.result_version):
        return result
    result = convert()
    if result is x:  # nothing converted (a mesh of one rank): nothing to share
        return result
    latest.source, latest.version, latest.key = weakref.ref(x, _forget), x._version, key
    latest.result, latest.result_version = result, result._version
    return result
