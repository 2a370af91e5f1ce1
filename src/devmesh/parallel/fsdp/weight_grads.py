"""A pipeline's split backward and FSDP: keep a unit's gathered parameters from a backward
of the input gradients alone (zero-bubble's ``I``) until the backward of the weight
gradients (``W``) that needs them again, then drop them."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from devmesh.parallel.fsdp.unit import FSDPUnit

class _WeightGradientGathers:
    """Whether a pipeline computes input gradients only now (zero-bubble's ``I``, whose
    weight-gradient half ``W`` follows later and may need the units' gathered parameters
    again), and the units keeping a gather for such a ``W``."""

    def __init__(self) -> None:
        self.later = False
        self.kept: list[FSDPUnit] = []


_STATE = _WeightGradientGathers()


@contextlib.contextmanager
def weight_gradients_follow():
    """Around a backward of the input gradients alone whose weight gradients a later
    backward computes: units keep what they gathered for it until that one reduces, or
    until :func:`release_weight_gradient_gathers`."""
    before, _STATE.later = _STATE.later, True
    try:
        yield
    finally:
        _STATE.later = before


def weight_gradients_later() -> bool:
    """Whether the backward running now leaves the weight gradients to a later one."""
    return _STATE.later


def keep_for_weight_gradients(unit: FSDPUnit) -> None:
    _STATE.kept.append(unit)


def release_weight_gradient_gathers() -> None:
    """Drop what units kept for weight gradients still to come (a pipeline step's end: a
    unit whose parameters are frozen has no ``W`` that would reduce and drop it)."""
    while _STATE.kept:
        _STATE.kept.pop().release_weight_gradient_gather()
