"""A stage's autograd graph, read for zero-bubble's split backward
(:mod:`~devmesh.parallel.pipeline.split_backward`): which nodes lead to the stage's inputs
(the *input path*), which of them have edges into the rest (the *boundaries*, where ``I``
keeps gradients for ``W``), and whether walks from several nodes meet (then one backward
call starting them all would not be exact).

Nodes are kept in dicts, not sets, wherever their order decides the order of collectives: a
set of nodes iterates by address, which differs between processes."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from torch.autograd.graph import Node

__all__ = ["consumers_of", "input_path", "boundaries", "meet"]


def consumers_of(roots: Sequence[Node]) -> dict[Node, list[Node]]:
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


def input_path(stage_inputs: Sequence[Node], consumers: dict[Node, list[Node]]
               ) -> dict[Node, None]:
    """The nodes from which a stage input is reachable (the inputs' own included), in the
    order found from the inputs up. ``consumers``: :func:`consumers_of` of the roots.

    A dict, not a set: the boundaries come in this order, the same on every rank (a set of
    nodes iterates by address, which differs between processes; W then ran the units'
    all-gathers and reduce-scatters in different orders on a stage's data-parallel ranks:
    crossed data between units of one size, or a hang)."""
    path = dict.fromkeys(stage_inputs)
    queue = deque(path)
    while queue:
        for consumer in consumers.get(queue.popleft(), ()):
            if consumer not in path:
                path[consumer] = None
                queue.append(consumer)
    return path


def boundaries(roots: Sequence[Node], path: dict[Node, None]
               ) -> dict[Node, list[tuple[Node, int]]] | None:
    """Each node of ``path`` (the :func:`input_path`) with edges into the weight side,
    and those edges; ``None`` if an output does not depend on any input (its weight side
    would be reached from no boundary), or two of these edges lead into each other (or into
    one node), so that asking boundaries one at a time would not be exact."""
    if not roots:
        return {}
    found: dict[Node, list[tuple[Node, int]]] = {}
    for node in path:
        weight_side = [(n, nr) for n, nr in node.next_functions
                       if n is not None and n not in path]
        if weight_side:
            found[node] = weight_side
    if any(root not in path for root in roots):
        return None  # an output does not depend on the inputs
    # one node fed by two edges, or a weight-side path from one entry to another
    if meet([n for edges in found.values() for n, _ in edges]):
        return None
    return found


def meet(nodes: list[Node]) -> bool:
    """Is a node listed twice, or reached from another listed one (walking from all of
    them at once)?"""
    listed = set(nodes)
    if len(listed) != len(nodes):
        return True
    reached: set[Node] = set()
    queue = deque(nxt for node in listed for nxt, _ in node.next_functions if nxt is not None)
    while queue:
        node = queue.popleft()
        if node in listed:
            return True
        if node not in reached:
            reached.add(node)
            queue.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return False
