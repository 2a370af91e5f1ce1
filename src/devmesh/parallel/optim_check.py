"""Which optimizers can step devmesh's split parameters.

Under ``fully_shard`` and tensor parallelism a parameter is this rank's block as a plain
tensor (docs/design/index.md: parameters stay parameters, their layout beside them). An optimizer that updates
each element from that element's own gradient and state — SGD, Adam, AdamW, RMSprop, ... —
gives every block exactly what it would give the whole tensor's elements, so training equals
single-process training. An optimizer that looks across elements does not: torch's
``Adafactor`` factors the second moment into row and column means (a block's columns are
not the tensor's), ``Muon`` orthogonalizes the whole matrix, ``LBFGS`` takes dot products over
all gradients — each would silently compute on one rank's block (measured under
``fully_shard`` on 2 ranks, 3 steps: parameters 0.005, 0.03 and 0.1 away from single-process
training). torch's FSDP2 gets LBFGS and Muon right through DTensor arithmetic (its
Adafactor raises).

So, at an optimizer's first step over split parameters (found through torch's global step
hook, the same one :mod:`devmesh.parallel.optim_state` uses): torch's cross-element
optimizers are refused with the reason and the ways out, on every rank alike (the check
depends only on the optimizer's class, so every rank raises at the same step and none is
left waiting in a collective); a class devmesh does not know (a user's own ``step``) gets
one warning per class, since devmesh cannot tell what its ``step`` reads.
"""

from __future__ import annotations

import warnings

import torch

from devmesh.errors import BlockwiseOptimizerWarning, ParallelizeError

__all__ = ["check_optimizer"]

# torch's optimizers whose update of an element reads only that element's gradient and state
_ELEMENTWISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop",
    "Rprop", "ASGD", "SparseAdam") if hasattr(torch.optim, name))

# torch's optimizers that compute across the elements of a parameter (or of all of them)
_ACROSS_ELEMENTS = {
    "Adafactor": "factors its second moment into row and column means of each gradient",
    "Muon": "orthogonalizes each gradient matrix as a whole (Newton-Schulz)",
    "LBFGS": "takes dot products over all gradients and a line search on them",
}

_warned: set[type] = set()


def check_optimizer(optimizer: torch.optim.Optimizer, split: list[torch.Tensor]) -> None:
    """Refuse (or warn once per class about) ``optimizer`` stepping the ``split`` parameters
    (this rank's blocks), if its update may read beyond one element."""
    cls = type(optimizer)
    if any(cls.step is known.step for known in _ELEMENTWISE):
        return
    across = next((why for name, why in _ACROSS_ELEMENTS.items()
                   if isinstance(optimizer, getattr(torch.optim, name, ()))), None)
    if across is not None:
        raise ParallelizeError(
            f"{cls.__name__} {across}, but {len(split)} of its parameters are split "
            "(fully_shard / tensor parallel): each rank holds its block of them, and "
            f"{cls.__name__} would compute on that block alone and train differently from "
            "single-process training. Use an elementwise optimizer (AdamW, Adam, SGD, ...) "
            "for split parameters, keep these parameters whole on every rank (replicate the "
            "modules holding them; under fully_shard pass them as ignored_params and "
            "replicate those modules), or use torch's fully_shard, whose DTensor parameters "
            "compute LBFGS and Muon over the whole tensor.")
    if cls not in _warned:
        _warned.add(cls)
        warnings.warn(
            f"{cls.__name__} steps {len(split)} split parameters (fully_shard / tensor "
            "parallel), each this rank's block as a plain tensor. devmesh cannot tell what "
            f"{cls.__name__}.step reads: an update of each element from its own gradient and "
            "state (Adam-like, Lion) is right; one that reads across elements (norms per "
            "tensor as in LAMB, factored or matrix statistics as in Shampoo or Muon) would "
            "see one block and train differently from single-process training.",
            BlockwiseOptimizerWarning, stacklevel=3)
