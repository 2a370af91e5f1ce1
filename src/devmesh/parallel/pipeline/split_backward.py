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

In pieces: the runner's forward cuts a stage's graph at its layers' outputs
(:mod:`~devmesh.parallel.pipeline.layer_cuts`), since autograd walks everything below the
node a call starts from and ``W``'s calls start at every layer. Each piece (from a cut's
original tensors, or the stage's outputs, down to the stage inputs and earlier cuts' leaves
it reaches) splits as above; ``I`` runs the pieces top down, seeding each with the gradients
its leaves got from the pieces above; ``W`` gathers every piece's boundaries and decides
once between the two ways above, so a ``fully_shard`` unit whose layers lie in several
pieces still reduces once. Pieces are separate graphs, so where their input paths are
apart ``W`` starts the j-th boundary of every piece in one autograd call (no start reaches
another's weight side): as many calls as a piece has boundaries, not one per layer (each
call costs ~50 us of engine and Python; one per layer made ``W`` 113 ms against 102 now on
512 ``Linear(512)`` layers, 8 rows). A node two pieces reach (a later layer reading a tensor an
earlier one kept in its state, past the cut) is a boundary of both: ``W`` sums its kept
gradients and runs it once; ``I`` runs the nodes between for each piece's share (correct,
linear; the extra input-gradient work of those nodes).

Some nodes run their backward as one piece that cannot be kept for a second call: a
``torch.compile``d region (its saved buffers are donated to its backward, so torch raises if
the graph is retained) and reentrant activation checkpointing (its backward re-runs the
forward and refuses ``autograd.grad``). Such a node computes its weight gradients with its
input gradient anyway, so splitting around it saves nothing: where the stage's graph holds
one, ``I`` does the whole backward (piece by piece) and ``W`` nothing
(:attr:`SplitBackward.whole`) — where
torch's zero-bubble schedules fail on compiled stages. The same goes for a stage under
torch's own ``fully_shard`` (FSDP2): it reduces a unit's gradients when the backward reaches
the unit's inputs — in ``I``, before ``W`` made the weight gradients — so a split backward
would reduce too early (devmesh's ``fully_shard`` reduces on the weight side, in ``W``).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from devmesh.parallel.fsdp import weight_gradients_follow
from devmesh.parallel.pipeline.backward_graph import boundaries, consumers_of, input_path, meet
from devmesh.parallel.pipeline.layer_cuts import Cut

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
    reachable. ``cuts``: where the forward cut the stage's graph at its layers' outputs
    (:mod:`~devmesh.parallel.pipeline.layer_cuts`), in the order made: the graph is then
    one piece per few layers, and ``I`` runs them top down."""

    def __init__(self, output: torch.Tensor | Sequence[torch.Tensor],
                 grad: torch.Tensor | None | Sequence[torch.Tensor | None],
                 stage_input: torch.Tensor | Sequence[torch.Tensor],
                 params: Sequence[torch.Tensor], cuts: Sequence[Cut] = ()) -> None:
        self.single_input = isinstance(stage_input, torch.Tensor)
        self.outputs = [output] if isinstance(output, torch.Tensor) else list(output)
        self.grads = [grad] if grad is None or isinstance(grad, torch.Tensor) else list(grad)
        self.inputs = [stage_input] if self.single_input else list(stage_input)
        self.params = [p for p in params if p.requires_grad]
        self.cuts = list(cuts)
        # where a piece's graph can end: the stage's inputs and the cuts' leaves, by node
        ends: dict[Node, list[torch.Tensor]] = {}
        for x in itertools.chain(self.inputs, (leaf for cut in self.cuts for leaf in cut.leaves)):
            if x.requires_grad:
                ends.setdefault(get_gradient_edge(x).node, []).append(x)
        # the top piece (from the stage's outputs), then the cut pieces from the last made
        self._pieces = [_Piece(self.outputs, ends)]
        self._pieces += [_Piece(list(cut.originals), ends) for cut in reversed(self.cuts)]
        self._ends = ends
        #: ``I`` does the whole backward and ``W`` nothing: the graph holds a node that
        #: cannot be split around (a compiled region, reentrant checkpointing, torch's
        #: FSDP2; see above)
        self.whole = any(piece.indivisible for piece in self._pieces)

    def input_grad(self) -> torch.Tensor | None | tuple[torch.Tensor | None, ...]:
        """The gradient of the stage's input (or of the tensor the split is made at: any
        tensor of the stage's graph), a tuple of them for several inputs; the graph is kept
        for :meth:`weight_grads` (unless :attr:`whole`: then the parameters' gradients are
        accumulated too, and the graph freed)."""
        got: dict[int, torch.Tensor] = {}  # id(input or leaf) -> its gradient so far
        for piece, seeds in zip(self._pieces, self._seeds_of_pieces(got), strict=True):
            for tensor, grad in piece.run_input_grad(seeds, whole=self.whole):
                if grad is not None:
                    got[id(tensor)] = grad if id(tensor) not in got else got[id(tensor)] + grad
        grads = tuple(got.get(id(x)) for x in self.inputs)
        return grads[0] if self.single_input else grads

    def _seeds_of_pieces(self, got: dict[int, torch.Tensor]
                         ) -> Iterator[list[torch.Tensor | None]]:
        """Each piece's output gradients, top down: the stage's own, then each cut's leaves'
        as the pieces above left them in ``got`` (read lazily, after those pieces ran)."""
        yield self.grads
        for cut in reversed(self.cuts):
            yield [got.get(id(leaf)) for leaf in cut.leaves]

    def weight_grads(self) -> None:
        """Accumulate the parameters' gradients of this micro-batch into their ``.grad``."""
        if not self.params or self.whole:  # whole: input_grad did it
            return
        # fully_shard units keep their gathers through W's several calls (a Linear's
        # AddmmBackward unpacks its weight even when asked for the weight gradient only):
        # each unit reduces, and drops them, in the one call that reaches its gather node
        with weight_gradients_follow():
            self._weight_grads()

    def _weight_grads(self) -> None:
        by_piece = [piece.entries() for piece in self._pieces]
        entries = _merged([entry for piece_entries in by_piece for entry in piece_entries])
        own = _own_parameters(entries, self.params)
        rounds = self._rounds(by_piece, entries, own is None)
        if own is not None:  # weight sides apart: each entry's straight into its .grad
            for entry_round in rounds:
                chosen = [i for i in entry_round if entries[i][0] and own[i]]
                if chosen:
                    seeds = [seed for i in chosen for seed in entries[i][0]]
                    torch.autograd.backward([e for e, _ in seeds], [g for _, g in seeds],
                                            inputs=[p for i in chosen for p in own[i]])
        else:
            edges, grads = [], []
            for entry_round in rounds:
                seeds, wanted = [], {}
                for i in entry_round:
                    entry_seeds, weight_edges = entries[i]
                    if weight_edges is _WHOLE:  # a piece not split: its roots go in as is
                        edges += [e for e, _ in entry_seeds]
                        grads += [g for _, g in entry_seeds]
                    elif entry_seeds and weight_edges:
                        seeds += entry_seeds
                        wanted.update(dict.fromkeys(weight_edges))
                if not seeds:
                    continue
                asked = [GradientEdge(n, nr) for n, nr in wanted]
                # kept: a piece W runs whole may pass through these nodes again
                found = torch.autograd.grad([e for e, _ in seeds], asked,
                                            [g for _, g in seeds], allow_unused=True,
                                            retain_graph=True)
                for edge, g in zip(asked, found, strict=True):
                    if g is not None:
                        edges.append(edge)
                        grads.append(g)
            if edges:
                torch.autograd.backward(edges, grads, inputs=self.params)
        for piece in self._pieces:
            piece.kept.clear()

    def _rounds(self, by_piece: list[list], entries: list, asking: bool) -> list[list[int]]:
        """The entries W can start in one autograd call, as index lists into the merged
        ``entries``: where the pieces' input paths are apart, the j-th boundary of every
        piece together (pieces are separate graphs, so no call reaches from one start into
        another's weight side: O(boundaries per piece) calls instead of one per layer, each
        ~50 us of engine and Python); else one entry per call. ``asking``: W asks for the
        entries' weight-side edges (its second way), which must then not meet
        (:func:`_entries_meet`: ``x @ W`` in one piece feeds ``W``'s accumulator directly,
        ``F.linear(x, W)`` in another through a transpose; asked together, the transpose's
        gradient was counted at both)."""
        merged = len(entries)
        if (merged != sum(map(len, by_piece)) or not self._pieces_apart()
                or (asking and _entries_meet(entries))):
            return [[i] for i in range(merged)]
        rounds: list[list[int]] = []
        start = 0
        for piece_entries in by_piece:
            for j in range(len(piece_entries)):
                if j == len(rounds):
                    rounds.append([])
                rounds[j].append(start + j)
            start += len(piece_entries)
        return rounds

    def _pieces_apart(self) -> bool:
        """Are the pieces' input paths apart (the leaves where they meet aside)? Then no
        start of W in one piece reaches another piece's boundaries; weight sides may still
        meet below (a ``fully_shard`` unit's gather node), where no call of a round goes."""
        owner: dict[Node, int] = {}
        for index, piece in enumerate(self._pieces):
            for node in piece.input_path:
                if node not in self._ends and owner.setdefault(node, index) != index:
                    return False
        return True


def _merged(entries: list[tuple[list[tuple[GradientEdge, torch.Tensor]],
                               list[tuple[Node, int]]]]
            ) -> list[tuple[list[tuple[GradientEdge, torch.Tensor]], list[tuple[Node, int]]]]:
    """One entry per boundary node, its gradients summed: a node two pieces reach (a later
    layer reading a tensor an earlier one kept, past the cut) is a boundary of both, and
    runs once."""
    by_node: dict[Node, tuple[dict[int, torch.Tensor], list[tuple[Node, int]]]] = {}
    merged: list = []
    for seeds, weight_edges in entries:
        if weight_edges is _WHOLE or not seeds:
            merged.append((seeds, weight_edges))
            continue
        node = seeds[0][0].node
        if node not in by_node:
            by_node[node] = ({}, weight_edges)
            merged.append(node)
        grads = by_node[node][0]
        for edge, grad in seeds:
            nr = edge.output_nr
            grads[nr] = grad if nr not in grads else grads[nr] + grad
    return [entry if not isinstance(entry, Node) else
            ([(GradientEdge(entry, nr), g) for nr, g in sorted(by_node[entry][0].items())],
             by_node[entry][1]) for entry in merged]


def _entries_meet(entries: list) -> bool:
    """Do two entries' weight-side edges lead into one node (``x @ W`` in two pieces), or
    a weight-side path from one entry's nodes to another's? Then a call starting several
    entries would carry one's gradient, down its piece's input path or weight side, into
    what it asks for another."""
    return meet([node for _, weight_edges in entries if weight_edges is not _WHOLE
                  for node, _ in weight_edges])


# an entry's weight edges when its piece is not split: W runs the piece's whole backward
# from the seeds (its roots) — exact, and only that piece's input chain computed again
_WHOLE: list[tuple[Node, int]] = []


class _Piece:
    """One piece of a stage's graph: from ``outputs`` down to the stage inputs and earlier
    cuts' leaves it reaches (or, without cuts, the whole stage)."""

    def __init__(self, outputs: list[torch.Tensor], ends: dict[Node, list[torch.Tensor]]
                 ) -> None:
        self.outputs = outputs
        self.roots = [o.grad_fn for o in outputs if o.grad_fn is not None]
        self.consumers = consumers_of(self.roots)
        self.indivisible = any(node.name() in _INDIVISIBLE
                               for node in itertools.chain(self.roots, self.consumers))
        #: the stage inputs and cut leaves this piece's graph reaches, each once (only
        #: leaves of earlier cuts: a leaf is used only after its cut)
        self.inputs = list({id(x): x for node in self.nodes()
                            for x in ends.get(node, ())}.values())
        #: the outputs that are such tensors themselves (a skip connection passed on): their
        #: gradient is their seed, besides what reaches them through the graph
        self.passed = {id(o) for o in outputs if o.grad_fn is None and o.requires_grad
                       and any(o is x for x in ends.get(get_gradient_edge(o).node, ()))}
        # boundary node -> its weight-side edges; None when the fast split is not exact
        self.boundaries: dict[Node, list[tuple[Node, int]]] | None = None
        # the nodes I ran on the way to the inputs (a piece W runs whole: all of them)
        self.input_path: dict[Node, None] = {}
        self.kept: dict[Node, tuple[torch.Tensor | None, ...]] = {}
        self.seeds: list[tuple[GradientEdge, torch.Tensor]] = []  # for a piece W runs whole

    def run_input_grad(self, grads: Sequence[torch.Tensor | None], *, whole: bool
                       ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """This piece's part of ``I`` (``whole``: of the whole backward) from its outputs'
        gradients ``grads``: the gradient reaching each of its inputs."""
        pairs = [(o, g) for o, g in zip(self.outputs, grads, strict=True)
                 if o.requires_grad and (g is not None or o.numel() == 1)]
        passed = [(o, g) for o, g in pairs if id(o) in self.passed]
        pairs = [(o, g) for o, g in pairs if o.grad_fn is not None]
        if not pairs:  # nothing flows (or the piece's outputs are leaves themselves)
            return passed
        outputs, seeds = [o for o, _ in pairs], [g for _, g in pairs]
        inputs = self.inputs
        if whole:
            leaves = [x for x in inputs if x.grad_fn is None]
            before = [x.grad for x in leaves]
            for x in leaves:
                x.grad = None
            torch.autograd.backward(outputs, seeds)
            got = [(x, x.grad) for x in leaves]
            for x, grad in zip(leaves, before, strict=True):
                x.grad = grad
            return passed + got
        if not inputs:  # nothing of the input path here: W runs all of it
            self.seeds = [(get_gradient_edge(o), g) for o, g in zip(outputs, seeds, strict=True)
                          if g is not None]
            self.input_path = self.nodes()
            return passed
        nodes = [get_gradient_edge(x).node for x in inputs]
        # an input computed in the stage by an operation with several outputs (a chunk)
        # would keep the gradient of this output only: not exact, so W does it all
        several = any(len(getattr(node, "_input_metadata", ())) > 1 for node in nodes)
        self.input_path = input_path(nodes, self.consumers)
        self.boundaries = None if several else boundaries(self.roots, self.input_path)
        if self.boundaries is None:
            self.seeds = [(get_gradient_edge(o), g) for o, g in zip(outputs, seeds, strict=True)
                          if g is not None]
            self.input_path = self.nodes()  # W runs all of it
        handles = [node.register_prehook(self._keeper(node)) for node in self.boundaries or ()]
        try:
            with weight_gradients_follow():  # fully_shard units keep their gathers for W
                grads = torch.autograd.grad(outputs, inputs, seeds, retain_graph=True,
                                            allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        for x, grad in zip(inputs, grads, strict=True):
            edge = get_gradient_edge(x)
            if self.boundaries and edge.node in self.boundaries and grad is not None:
                # an input computed inside the stage (the first stage splits at its first
                # child's output): autograd stopped at it, so its node's gradient is this one
                self.kept.setdefault(edge.node, (None,) * edge.output_nr + (grad,))
        return passed + list(zip(inputs, grads, strict=True))

    def nodes(self) -> dict[Node, None]:
        """Every node of this piece's graph."""
        return dict.fromkeys(itertools.chain(self.roots, self.consumers))

    def _keeper(self, node: Node):
        def keep(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            self.kept[node] = tuple(grad_outputs)
        return keep

    def entries(self) -> list[tuple[list[tuple[GradientEdge, torch.Tensor]],
                                    list[tuple[Node, int]]]]:
        """What W starts from in this piece: per boundary, the gradients ``I`` kept there
        and its weight-side edges; for a piece not split, its roots' gradients and
        :data:`_WHOLE`."""
        if self.boundaries is None:
            return [(self.seeds, _WHOLE)] if self.seeds else []
        return [([(GradientEdge(node, i), g) for i, g in enumerate(self.kept.get(node, ()))
                  if g is not None], weight_edges)
                for node, weight_edges in self.boundaries.items()]


def _own_parameters(entries: Sequence[tuple[list[tuple[GradientEdge, torch.Tensor]],
                                             list[tuple[Node, int]]]],
                    params: Sequence[torch.Tensor]) -> list[list[torch.Tensor]] | None:
    """Each entry's parameters (see :meth:`_Piece.entries`), when no node is reached from two
    entries (a plain stage: every layer's weight side is its own); ``None`` when one is
    (``fully_shard`` gathers a unit's parameters in one node, which must run once, with
    every layer's gradient). A piece W runs whole is walked from its roots."""
    wanted = {id(p) for p in params}
    owner: dict[Node, int] = {}  # node -> the entry that reaches it
    own: list[list[torch.Tensor]] = []
    for index, (seeds, weight_edges) in enumerate(entries):
        mine: list[torch.Tensor] = []
        own.append(mine)
        starts = [e.node for e, _ in seeds] if weight_edges is _WHOLE else \
            [node for node, _ in weight_edges]
        queue = deque(starts)
        while queue:
            node = queue.popleft()
            if node in owner:
                if owner[node] != index:
                    return None
                continue
            owner[node] = index
            leaf = getattr(node, "variable", None)  # AccumulateGrad: a leaf tensor
            if leaf is not None and id(leaf) in wanted:
                mine.append(leaf)
            queue.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return own
