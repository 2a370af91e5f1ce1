"""A pipeline's split backward and FSDP: keep a unit's gathered parameters from a backward
of the input gradients alone (zero-bubble's ``I``) until the backward of the weight
gradients (``W``) that needs them again, then drop them."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from devmesh.parallel.fsdp.unit import FSDPUnit

# set while a pipeline computes input gradients only (zero-bubble's I): the weight-gradient
# half (W) follows later and may need the units' gathered parameters again
WEIGHT_GRADS_LATER = [False]
KEPT_FOR_WEIGHT_GRADS: list[FSDPUnit] = []  # units keeping a gather for a W to come


@contextlib.contextmanager
def weight_gradients_follow():
    """Around a backward of the input gradients alone whose weight gradients a later
    backward computes: units keep what they gathered for it until that one reduces, or
    until :func:`release_weight_gradient_gathers`."""
    before, WEIGHT_GRADS_LATER[0] = WEIGHT_GRADS_LATER[0], True
    try:
        yield
    finally:
        WEIGHT_GRADS_LATER[0] = before


def release_weight_gradient_gathers() -> None:
    """Drop what units kept for weight gradients still to come (a pipeline step's end: a
    unit whose parameters are frozen has no ``W`` that would reduce and drop it)."""
    while KEPT_FOR_WEIGHT_GRADS:
        unit = KEPT_FOR_WEIGHT_GRADS.pop()
        if unit._full_for_weight_grads:
            unit._release_full()

