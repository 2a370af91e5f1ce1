"""Cutting a stage's autograd graph at its layers' outputs during a forward, so that
zero-bubble's weight-gradient pass (``W``) costs the same per layer however deep the stage.

Why: ``W`` starts one autograd call at each place where a layer's weight side leaves the
input-gradient chain (:mod:`~devmesh.parallel.pipeline.split_backward`), and autograd walks
the *whole* graph below the node it starts from before running anything (to count
dependencies). In one graph every call walks every layer below its own, so ``W`` cost
O(layers²) in graph walking: 256 ``Linear(64, 64)`` + ``Tanh`` layers per stage, 8
micro-batches, took 450 ms in ``W`` against 106 ms for a whole backward. In pieces, each
call walks its own piece only.

How: a forward hook on each layer (the stage's children, and the children of the plain
containers among them, ``nn.Sequential``/``nn.ModuleList``/``nn.ModuleDict``) replaces each
floating-point tensor of the layer's output that has a graph by a detached leaf that
requires grad, and records the pair (:class:`Cut`): after the first layer (the first
stage's ``I`` then runs down to its first layer's output, an embedding's, whose input needs
no gradient), then each time the layers run since the last cut hold
:data:`MIN_PARAMS_PER_PIECE` parameter tensors (a piece per transformer block; a piece per
small layer cost more in autograd calls than it saved). The next layer builds on the leaf,
so the graph ends there; the input-gradient pass then runs piece by piece, top down,
handing each piece's leaf gradients to the piece below as its seeds. Exact: every piece's
gradients are linear in its seeds, and a leaf is used only by pieces made after it.

A stage under torch's FSDP2 is not cut (its units reduce at the end of each autograd call
that ran their backward, and a whole backward of a cut graph is one call per piece); its
first layer's output is still recorded, for the first stage's ``I`` to stop at.

A leaf that requires grad cannot be changed in place (torch raises "a leaf Variable that
requires grad is being used in an in-place operation", as it does for a stage's input), so
no cut is made before a layer with ``inplace=True`` (``nn.ReLU(inplace=True)`` after a
``BatchNorm2d``); a layer changing its input in place by itself gets a
:class:`~devmesh.parallel.pipeline.PipelineError` naming the fix from the runner.

Only where the cuts are safe: while the runner records (its own forward of a micro-batch
whose backward is split), with grad on, and outside activation checkpointing, offloading
or a user's saved-tensor hooks (a recomputation would rebuild the uncut graph).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from devmesh.parallel.fsdp import users_saved_tensor_hooks

__all__ = ["Cut", "LayerCuts", "MIN_PARAMS_PER_PIECE"]

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
# a piece holds the layers of at least this many parameter tensors (a transformer block:
# one piece): every piece costs I an autograd call (~50 us of overhead on CPU) and a piece's
# boundaries cost W a call each, so cutting after every small layer, or rarely, cost more
# than it saved. Measured (single process, I + W of one micro-batch against a whole backward
# B), layers Linear+activation of width w, depth d, cut every k parameter tensors (a Linear
# has 2): w=256, d=256, 16 rows: B 33 ms; uncut 89; k=4 55, 8 51, 16 49, 32 49, 64 53;
# w=512, d=512, 8 rows: B 158; uncut 381; k=4 219, 8 203, 16 210, 32 212, 64 225
MIN_PARAMS_PER_PIECE = 8


@dataclass(frozen=True)
class Cut:
    """Where a layer's output was cut: the tensors its graph ends in (``originals``) and the
    leaves that replaced them for the rest of the forward (``leaves``), pairwise."""

    originals: tuple[torch.Tensor, ...]
    leaves: tuple[torch.Tensor, ...]


class LayerCuts:
    """The cut points of one stage: hooks on its layers, active inside :meth:`recording`."""

    def __init__(self, stage: nn.Module, min_params: int = MIN_PARAMS_PER_PIECE, *,
                 cut: bool = True) -> None:
        #: False: cut nothing, only record the first layer's output (a :class:`Cut` whose
        #: leaves are the originals): a first stage's ``I`` can still stop there
        self.cut = cut
        self.min_params = min_params
        self._made: list[Cut] | None = None  # a list while recording
        self._since = 0  # parameter tensors of the layers run since the last cut
        self._params: dict[int, int] = {}  # id(layer) -> its parameter tensors
        layers = list(_layers(stage))
        # a leaf that requires grad cannot be changed in place: no cut where the next layer
        # does that to its input (nn.ReLU(inplace=True) after a BatchNorm, as in ResNets)
        self._before_in_place = {id(layer) for layer, after in zip(layers, layers[1:])
                                 if getattr(after, "inplace", False) is True}
        self._handles = []
        for layer in layers:
            self._params[id(layer)] = sum(1 for _ in layer.parameters())
            self._handles.append(layer.register_forward_hook(self._cut))

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[Cut]]:
        """Cut the layers' outputs during the forward run inside; yields the cuts made, in
        the order made."""
        self._made = made = []
        self._since = 0
        try:
            yield made
        finally:
            self._made = None

    def remove(self) -> None:
        """Take the hooks off the stage's layers (a dry run's cuts last one step)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _cut(self, module: nn.Module, args: tuple, output: object) -> object:
        # first the compiled case (one autograd node anyway), so that torch.compile tracing
        # a compiled layer's hooks reads none of this object's state (no guard, no recompile)
        if (torch.compiler.is_compiling() or self._made is None or not torch.is_grad_enabled()
                or users_saved_tensor_hooks()):
            return None
        self._since += self._params.get(id(module), 0)
        if self._made and (self._since < self.min_params or not self.cut):
            return None  # the first layer is cut at once
        if id(module) in self._before_in_place:
            return None  # the next layer is, then
        if isinstance(output, torch.Tensor):
            items, rebuild = [output], lambda new: new[0]
        elif type(output) in (tuple, list):
            items, rebuild = list(output), type(output)
        else:  # a dict, a dataclass, a namedtuple: left whole (exact, just not cut)
            return None
        originals, leaves, new = [], [], []
        for item in items:
            if (isinstance(item, torch.Tensor) and item.grad_fn is not None
                    and item.is_floating_point()):
                leaf = item.detach().requires_grad_() if self.cut else item
                originals.append(item)
                leaves.append(leaf)
                item = leaf
            new.append(item)
        if not originals:
            return None
        self._made.append(Cut(tuple(originals), tuple(leaves)))
        self._since = 0
        return rebuild(new) if self.cut else None


def _layers(module: nn.Module) -> Iterator[nn.Module]:
    """The module's children, looking through plain containers (a nested block list)."""
    for child in module.children():
        if type(child) in _CONTAINERS:
            yield from _layers(child)
        else:
            yield child
