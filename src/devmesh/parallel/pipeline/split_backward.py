"""Zero-bubble's split backward: the stage's input gradient now (``I``), its weight gradients
later (``W``), without computing the input-gradient chain twice.

Why: ``I`` is on the critical path (the previous stage waits for it) and ``W`` fills the
bubbles. The obvious split, ``autograd.grad(out, x)`` and later ``autograd.backward(out,
inputs=params)``, is correct but walks the whole chain again in ``W``: to reach the first
layer's weight it recomputes every later layer's input gradient, so ``I + W`` costs up to twice
``B``.

How: the stage's autograd graph splits into the *input path* (nodes from which the stage's
input is reachable: ``I`` runs them) and the *weight side* (everything else; it only leads to
parameters and never back to the input path). An input-path node with edges into the weight
side is a *boundary*. ``I`` keeps the gradient that arrives at each boundary (a node pre-hook).
``W`` then (1) asks each boundary for its weight-side outputs only, seeded with the kept
gradient — autograd computes just the outputs on the way to what it is asked for, so a
Linear's ``AddmmBackward`` computes the weight and bias gradients and not the input's again —
and (2) runs the whole weight side once, from those edges into the parameters, with
``autograd.backward``: gradients accumulate in ``.grad`` and the hooks on the way fire as in an
ordinary backward (``replicate``'s buckets; ``fully_shard``'s gather node, which
reduce-scatters the unit once). Where no weight-side node is reached from two boundaries (a
plain stage: each layer's weights are its own), ``W`` skips (1) and seeds each boundary with
its kept gradient, asking for that boundary's own parameters only: autograd then computes the
weight-side outputs straight into ``.grad`` (keeping every weight gradient as a tensor between
(1) and (2) made ``W`` 1.4x the weight half of a backward, 8.6 vs 6.0 ms on 8 Linear(512, 512)).

Step (1) asks one boundary at a time; that is only exact when no boundary's weight-side edge
can be reached from another one (autograd would walk the input path down to it, recomputing
and counting it twice). A parameter used directly by two layers of a stage (not through a
per-use ``t()`` or ``view``) is such a case; the split then falls back to the obvious
(correct, slower) ``W``. Torch's ``torch.distributed.pipelining`` splits the same way (its
``stage_backward_input``/``stage_backward_weight``); this is written from the idea.

Some nodes run their backward as one piece that cannot be kept for a second call: a
``torch.compile``d region (its saved buffers are donated to its backward, so torch raises if
the graph is retained) and reentrant activation checkpointing (its backward re-runs the
forward and refuses ``autograd.grad``). Such a node computes its weight gradients with its
input gradient anyway, so splitting around it saves nothing: where the stage's graph holds
one, ``I`` does the whole backward and ``W`` nothing (:attr:`SplitBackward.whole`) — where
torch's zero-bubble schedules fail on compiled stages. The same goes for a stage under
torch's own ``fully_shard`` (FSDP2): it reduces a unit's gradients when the backward reaches
the unit's inputs — in ``I``, before ``W`` made the weight gradients — so a split backward
would reduce too early (devmesh's ``fully_shard`` reduces on the weight side, in ``W``).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from devmesh.parallel.fully_shard import weight_gradients_follow

# nodes whose backward runs as one piece and cannot be kept for another call (see above),
# and torch's fully_shard's node on a unit's inputs: its backward reduce-scatters the unit's
# gradients, which must all be there by then (torch's own pipelining calls FSDP's private
# post-backward by hand after W instead)
_INDIVISIBLE = frozenset({"CompiledFunctionBackward", "CheckpointFunctionBackward",
                          "RegisterPostBackwardFunctionBackward"})


class SplitBackward:
    """One micro-batch's backward through one stage, in two parts: :meth:`input_grad`, then
    :meth:`weight_grads` (once each, in that order).

    A stage may have several outputs and inputs (tensors in a tuple): ``I`` asks for every
    input's gradient at once, and the input path is the nodes from which any input is
    reachable."""

    def __init__(self, output: torch.Tensor | Sequence[torch.Tensor],
                 grad: torch.Tensor | None | Sequence[torch.Tensor | None],
                 stage_input: torch.Tensor | Sequence[torch.Tensor],
                 params: Sequence[torch.Tensor]) -> None:
        self.single_input = isinstance(stage_input, torch.Tensor)
        self.outputs = [output] if isinstance(output, torch.Tensor) else list(output)
        self.grads = [grad] if grad is None or isinstance(grad, torch.Tensor) else list(grad)
        self.inputs = [stage_input] if self.single_input else list(stage_input)
        self.params = [p for p in params if p.requires_grad]
        self._roots = [o.grad_fn for o in self.outputs if o.grad_fn is not None]
        self._consumers = _consumers(self._roots)
        #: ``I`` does the whole backward and ``W`` nothing: the graph holds a node that
        #: cannot be split around (a compiled region, reentrant checkpointing, torch's
        #: FSDP2; see above)
        self.whole = any(node.name() in _INDIVISIBLE
                         for node in itertools.chain(self._roots, self._consumers))
        # boundary node -> its weight-side edges; None when the fast split is not exact
        self._boundaries: dict[Node, list[tuple[Node, int]]] | None = None
        self._kept: dict[Node, tuple[torch.Tensor | None, ...]] = {}

    def input_grad(self) -> torch.Tensor | None | tuple[torch.Tensor | None, ...]:
        """The gradient of the stage's input (or of the tensor the split is made at: any
        tensor of the stage's graph), a tuple of them for several inputs; the graph is kept
        for :meth:`weight_grads` (unless :attr:`whole`: then the parameters' gradients are
        accumulated too, and the graph freed)."""
        if self.whole:
            torch.autograd.backward(self.outputs, self.grads)
            grads = tuple(x.grad if x.is_leaf else None for x in self.inputs)
            return grads[0] if self.single_input else grads
        nodes = [get_gradient_edge(x).node for x in self.inputs]
        # an input computed in the stage by an operation with several outputs (a chunk)
        # would keep the gradient of this output only: not exact, so W does it all
        several = any(len(getattr(node, "_input_metadata", ())) > 1 for node in nodes)
        self._boundaries = None if several else _boundaries(self._roots, nodes,
                                                              self._consumers)
        handles = [node.register_prehook(self._keeper(node)) for node in self._boundaries or ()]
        try:
            with weight_gradients_follow():  # fully_shard units keep their gathers for W
                grads = torch.autograd.grad(self.outputs, self.inputs, self.grads,
                                            retain_graph=True, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        for x, grad in zip(self.inputs, grads):
            edge = get_gradient_edge(x)
            if self._boundaries and edge.node in self._boundaries and grad is not None:
                # an input computed inside the stage (the first stage splits at its first
                # child's output): autograd stopped at it, so its node's gradient is this one
                self._kept.setdefault(edge.node, (None,) * edge.output_nr + (grad,))
        return grads[0] if self.single_input else tuple(grads)

    def _keeper(self, node: Node):
        def keep(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            self._kept[node] = tuple(grad_outputs)
        return keep

    def _seeds(self, node: Node) -> list[tuple[GradientEdge, torch.Tensor]]:
        """The gradients ``I`` kept at boundary ``node``, one per output that got one."""
        return [(GradientEdge(node, i), g) for i, g in enumerate(self._kept.get(node, ()))
                if g is not None]

    def weight_grads(self) -> None:
        """Accumulate the parameters' gradients of this micro-batch into their ``.grad``."""
        if not self.params or self.whole:  # whole: input_grad did it
            return
        if self._boundaries is None:  # not exact one boundary at a time: the whole backward
            torch.autograd.backward(self.outputs, self.grads, inputs=self.params)
            return
        own = _own_parameters(self._boundaries, self.params)
        if own is not None:  # weight sides apart: each boundary's straight into its .grad
            for node, params in own.items():
                seeds = self._seeds(node)
                if seeds and params:
                    torch.autograd.backward([e for e, _ in seeds], [g for _, g in seeds],
                                            inputs=params)
            self._kept.clear()
            return
        edges, grads = [], []
        for node, weight_edges in self._boundaries.items():
            seeds = self._seeds(node)
            if not seeds or not weight_edges:
                continue
            wanted = [GradientEdge(n, nr) for n, nr in weight_edges]
            found = torch.autograd.grad([e for e, _ in seeds], wanted,
                                        [g for _, g in seeds], allow_unused=True)
            for edge, g in zip(wanted, found):
                if g is not None:
                    edges.append(edge)
                    grads.append(g)
        self._kept.clear()
        if edges:
            torch.autograd.backward(edges, grads, inputs=self.params)


def _consumers(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """Every node reached from ``roots`` (the roots only where reached again), each with the
    nodes that have an edge into it."""
    consumers: dict[Node, list[Node]] = {}
    seen, queue = set(roots), deque(roots)
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            consumers.setdefault(nxt, []).append(node)
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return consumers


def _boundaries(roots: Sequence[Node], stage_inputs: Sequence[Node],
                consumers: dict[Node, list[Node]]) -> dict[Node, list[tuple[Node, int]]] | None:
    """Each input-path node with edges into the weight side, and those edges; ``None`` if
    an output does not depend on any input (its weight side would be reached from no
    boundary), or two of these edges lead into each other (or into one node), so that asking
    boundaries one at a time would not be exact. ``consumers``: :func:`_consumers` of
    ``roots``."""
    if not roots:
        return {}
    # a dict, not a set: the boundaries come in the order they are found, the same on every
    # rank (a set of nodes iterates by address, which differs between processes; W then ran
    # the units' all-gathers and reduce-scatters in different orders on a stage's
    # data-parallel ranks: crossed data between units of one size, or a hang)
    input_path = dict.fromkeys(stage_inputs)
    queue = deque(input_path)
    while queue:
        for consumer in consumers.get(queue.popleft(), ()):
            if consumer not in input_path:
                input_path[consumer] = None
                queue.append(consumer)
    boundaries: dict[Node, list[tuple[Node, int]]] = {}
    for node in input_path:
        weight_side = [(n, nr) for n, nr in node.next_functions
                       if n is not None and n not in input_path]
        if weight_side:
            boundaries[node] = weight_side
    entry_nodes = [n for edges in boundaries.values() for n, _ in edges]
    entries = set(entry_nodes)
    if any(root not in input_path for root in roots) or len(entries) != len(entry_nodes):
        return None  # an output does not depend on the inputs; one node fed by two edges
    # does any weight-side path lead from one entry to another? (from all entries at once)
    reached: set[Node] = set()
    queue = deque(nxt for entry in entries for nxt, _ in entry.next_functions
                  if nxt is not None)
    while queue:
        node = queue.popleft()
        if node in entries:
            return None
        if node not in reached:
            reached.add(node)
            queue.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return boundaries


def _own_parameters(boundaries: dict[Node, list[tuple[Node, int]]], params: Sequence[torch.Tensor]
                    ) -> dict[Node, list[torch.Tensor]] | None:
    """Each boundary's parameters, when no weight-side node is reached from two boundaries
    (a plain stage: every layer's weight side is its own); ``None`` when one is (``fully_shard``
    gathers a unit's parameters in one node, which must run once, with every layer's
    gradient)."""
    wanted = {id(p) for p in params}
    owner: dict[Node, Node] = {}  # weight-side node -> the boundary that reaches it
    own: dict[Node, list[torch.Tensor]] = {}
    for boundary, weight_edges in boundaries.items():
        mine = own[boundary] = []
        queue = deque(node for node, _ in weight_edges)
        while queue:
            node = queue.popleft()
            if node in owner:
                if owner[node] is not boundary:
                    return None
                continue
            owner[node] = boundary
            leaf = getattr(node, "variable", None)  # AccumulateGrad: a leaf tensor
            if leaf is not None and id(leaf) in wanted:
                mine.append(leaf)
            queue.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return own
