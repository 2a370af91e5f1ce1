"""A tensor saved for backward under a saved-tensor hook, kept as autograd keeps it without.

``fully_shard`` sets saved-tensor hooks around a unit's forward to swap the gathered parameters
autograd saves for handles; every other tensor the forward saves passes through the same hook
and is kept here."""

from __future__ import annotations

import torch

__all__ = ["SavedActivation"]


class SavedActivation:
    """A tensor saved for backward inside a unit's forward, kept the way autograd keeps it
    without hooks. Two things autograd does for a saved tensor stop once a saved-tensor hook
    is set, so they are done here:

    - no reference cycle: the tensor is kept detached. Kept as it is (with its ``grad_fn``), an
      operation's own output saved by that operation (tanh, sigmoid, exp, softmax save theirs)
      holds its node, which holds it: a cycle through C++ that the garbage collector cannot
      see, so every graph not freed by a backward (a forward without backward, a
      ``retain_graph=True`` backward, zero-bubble's input-gradient pass) stayed alive for
      good, with its activations, units and process groups;
    - the in-place check: a saved tensor changed in place before backward is refused, with
      autograd's own message (without it, backward used the changed values: wrong gradients).
    """

    __slots__ = ("tensor", "version", "origin")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t.detach()  # shares t's data and version counter, not its graph
        self.version = t._version
        self.origin = f", which is output {t.output_nr} of {t.grad_fn.name()}" if t.grad_fn else ""

    def unpack(self) -> torch.Tensor:
        now = self.tensor._version
        if now != self.version:
            kind = f"{self.tensor.type()} {list(self.tensor.shape)}"
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{kind}]{self.origin}, is at version {now}; expected "
                f"version {self.version} instead. Hint: change the tensor out of place (x = x + "
                "y, not x += y), or clone it before changing it")
        return self.tensor
