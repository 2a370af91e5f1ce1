"""Splitting a model into pipeline stages: contiguous runs of an ``nn.Sequential``'s
children, chosen by name or balanced by parameter count.

torch's ``torch.distributed.pipelining`` traces a model to split it anywhere; devmesh splits
between the top-level children of an ``nn.Sequential`` (a stack of layers, as pipelined
models are built), which needs no tracing and keeps the stage modules the model's own
modules: their parameters are the model's parameters, under the model's names (stage 1 of
``Sequential(a, b, c, d)`` split at ``"2"`` names its children ``"2"`` and ``"3"``), so a
tensor-parallel plan, a state dict or a checkpoint written for the whole model applies to a
stage unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from devmesh.errors import PipelineError
from devmesh.parallel.pipeline.tied import mark_ties

__all__ = ["PipelineError", "split_sequential", "balanced_boundaries", "SplitPart",
           "split_mismatch"]

_PART = "pipeline_part"  # set on every stage split_sequential returns


@dataclass(frozen=True)
class SplitPart:
    """Where a stage came from: part ``index`` of ``count`` that :func:`split_sequential`
    cut, holding the model's layers ``first`` to ``last``. The runner reads it to refuse a
    pipeline that would run only some of the parts (a model split into 4 given to a 2-stage
    schedule trains half the model, and nothing else would notice)."""

    index: int
    count: int
    first: str
    last: str


def split_mismatch(stages: Mapping[int, nn.Module], schedule_stages: int) -> str | None:
    """What is wrong with running ``stages`` (this rank's, by stage index) under a schedule
    of ``schedule_stages`` stages, judged by the parts :func:`split_sequential` recorded on
    them; ``None`` when they agree (or were not made by ``split_sequential``)."""
    for s, module in sorted(stages.items()):
        part = getattr(module, _PART, None)
        if not isinstance(part, SplitPart):
            continue
        if part.count != schedule_stages:
            lost = (f"layers {part.first}..{part.last} of part {part.index} and those of the "
                    f"other parts past stage {schedule_stages - 1} would never run"
                    if part.count > schedule_stages else
                    f"the schedule's stages {part.count}..{schedule_stages - 1} have no layers")
            return (f"split_sequential split the model into {part.count} stages, the schedule "
                    f"runs {schedule_stages} ({lost}): split with "
                    f"split_sequential(model, schedule.stages), i.e. "
                    f"split_sequential(model, {schedule_stages})")
        if part.index != s:
            return (f"stage {s} was given split_sequential's part {part.index} (layers "
                    f"{part.first}..{part.last}): give part s as stage s, "
                    f"{{s: parts[s] for s in range(schedule.stages) "
                    f"if schedule.rank_of(s) == rank}}")
    return None


def balanced_boundaries(weights: Sequence[int], parts: int) -> list[int]:
    """Start indices of ``parts`` contiguous runs of ``weights`` minimizing the heaviest run
    (ties: the earliest split), by dynamic programming; the first start is 0."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the heaviest run when the first i items form k runs; cut[k][i]: last start
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def split_sequential(model: nn.Module, stages: int, *, starts: Sequence[str] | None = None
                     ) -> list[nn.Sequential]:
    """``model``'s children in ``stages`` contiguous runs, each an ``nn.Sequential`` of the
    model's own modules under the model's names. ``starts`` names the child that begins each
    stage after the first (``["4", "8", "12"]`` for 4 stages); a dotted name splits inside a
    nested ``nn.Sequential`` (``"blocks.4"`` for ``Sequential(embed, blocks, head)``, as
    torch's ``split_spec`` names split points): each stage then holds the part of ``blocks``
    it runs, as an ``nn.Sequential`` under the same names (a container a stage holds whole
    stays the model's own module). Without ``starts``, stages are balanced by parameter count
    over the top-level children.

    A parameter used by several stages (an embedding tied to the output head) is recorded on
    the stages (:mod:`~devmesh.parallel.pipeline.tied`): the runner keeps its copies on
    different ranks one tensor, summing their gradients after each step."""
    if not isinstance(model, nn.Sequential):
        raise PipelineError(
            f"pipeline stages are runs of an nn.Sequential's children; got a "
            f"{type(model).__name__}. Build the model as nn.Sequential(embedding, *blocks, head)")
    if isinstance(stages, (list, tuple)) and all(isinstance(n, str) for n in stages):
        raise PipelineError(
            f"split_sequential takes the number of stages, then the names where stages after "
            f"the first begin as starts=: split_sequential(model, {len(stages) + 1}, "
            f"starts={list(stages)!r}), got the names as the number of stages")
    if hasattr(stages, "mesh_dim_names") and hasattr(stages, "get_group"):  # a mesh
        raise PipelineError(
            "split_sequential takes the number of stages, got a DeviceMesh: pass the "
            "schedule's stage count, split_sequential(model, schedule.stages) (the pp dim's "
            "size times the stages each rank holds), and take this rank's stages by "
            "schedule.rank_of(s)")
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise PipelineError(f"the number of stages must be a positive integer, got {stages!r}")
    units = _units(model, starts or ())
    if len(units) < stages:
        raise PipelineError(
            f"the model has {len(units)} layers (children) for {stages} pipeline stages: every "
            f"stage needs at least one; use at most {len(units)} stages, or split the layers")
    if starts is not None:
        if len(starts) != stages - 1:
            raise PipelineError(f"starts names {len(starts)} children; {stages} stages need "
                                f"{stages - 1} (the first child of every stage after the first)")
        index = [0] + [_first_unit(units, name) for name in starts]
        if index != sorted(set(index)):
            raise PipelineError(f"starts {list(starts)} must name children in increasing order, "
                                "after the first")
    else:
        weights = [sum(p.numel() for p in child.parameters()) for _, child in units]
        index = balanced_boundaries([max(w, 1) for w in weights], stages)
    bounds = index + [len(units)]
    parts = [_assemble(model, units[a:b]) for a, b in zip(bounds, bounds[1:])]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        setattr(parts[i], _PART, SplitPart(i, stages, ".".join(units[a][0]),
                                           ".".join(units[b - 1][0])))
    mark_ties(parts)
    return parts


def _units(model: nn.Module, starts: Sequence[str]) -> list[tuple[tuple[str, ...], nn.Module]]:
    """The modules a split runs over, in order, with their paths: the model's children, with
    each nested ``nn.Sequential`` that a dotted name in ``starts`` splits inside replaced by
    its own children."""
    inside = {tuple(name.split("."))[:i] for name in starts for i in range(1, name.count(".") + 1)}

    def walk(module: nn.Module, path: tuple[str, ...]):
        for name, child in module.named_children():
            here = path + (name,)
            if here not in inside:
                yield here, child
                continue
            if type(child).forward is not nn.Sequential.forward:
                raise PipelineError(
                    f"starts split inside {'.'.join(here)!r}, a {type(child).__name__}: a "
                    "split point may lie inside an nn.Sequential only (its forward runs its "
                    f"children in order); name a child of the model, or of an nn.Sequential")
            yield from walk(child, here)
    return list(walk(model, ()))


def _first_unit(units: Sequence[tuple[tuple[str, ...], nn.Module]], name: str) -> int:
    """The index of the first unit at or inside the module named ``name``."""
    path = tuple(name.split("."))
    for i, (unit, _) in enumerate(units):
        if unit[:len(path)] == path:
            return i
    known = [".".join(unit) for unit, _ in units]
    raise PipelineError(f"starts {name!r} is not a child of the model (children: {known}; a "
                        "dotted name splits inside a nested nn.Sequential)")


def _assemble(model: nn.Module, run: Sequence[tuple[tuple[str, ...], nn.Module]]
              ) -> nn.Sequential:
    """One stage: the units of ``run`` under their names, each container the run holds only
    part of rebuilt as an ``nn.Sequential`` of that part (same names, same modules)."""
    tree: OrderedDict = OrderedDict()  # name -> module, or a subtree for a split container
    for path, module in run:
        node = tree
        for name in path[:-1]:
            node = node.setdefault(name, OrderedDict())
        node[path[-1]] = module

    def build(container: nn.Module, subtree: OrderedDict) -> nn.Module:
        children = OrderedDict()
        for name, sub in subtree.items():
            children[name] = build(container._modules[name], sub) if isinstance(
                sub, OrderedDict) else sub
        whole = list(children) == list(container._modules) and all(
            children[n] is container._modules[n] for n in children)
        return container if whole and container is not model else nn.Sequential(children)
    return build(model, tree)
