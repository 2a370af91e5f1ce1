"""``describe(model)``: every parameter's global shape, spec, local shape on every rank and
the bytes each rank holds — computed from the specs, no communication — and a PNG of bytes
per rank and parameter."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence

from torch import nn

from devmesh.distributed import consensus, groups
from devmesh.errors import MeshUsageError
from devmesh.layout import format_ranks, ranks_phrase
from devmesh.parallel.param import ParamLayout, layout_of, local_of
from devmesh.parallel.pipeline.runner import PipelineRunner
from devmesh.parallel.pipeline.whole_model import stage_ranks

__all__ = ["describe"]


def _shapes_by_rank(p: nn.Parameter, holders: Sequence[int] | None
                    ) -> dict[int, tuple[int, ...]]:
    """Every holding rank's local shape of ``p``, computed from the spec (no communication);
    a parameter that is not distributed counts only where ``holders`` are named."""
    layout = layout_of(p)
    if layout is None:
        return {rank: tuple(p.shape) for rank in holders or ()}
    out = {}
    for rank in layout.mesh.world_ranks() if holders is None else holders:
        coordinate = layout.mesh.coordinate_of(rank)
        if coordinate is not None:
            out[rank] = _held(layout, layout.spec.local_shape(coordinate))
    return out


def _held(layout: ParamLayout, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A block's shape in the parameter's own dims: a packed parameter's block of the view
    (its packed dim cut into parts) with the parts side by side again."""
    if layout.packed is None or len(shape) != len(layout.spec.global_shape):
        return shape  # (a packed parameter under tensor parallelism holds it so already)
    dim = layout.packed[0]
    return shape[:dim] + (shape[dim] * shape[dim + 1],) + shape[dim + 2:]


def _layout_text(layout: ParamLayout) -> str:
    what = str(layout.spec).split(": ", 1)[1]
    if layout.packed is None:
        return what
    dim, parts = layout.packed
    return f"{what}, of the view with dim {dim} cut into its {parts} packed parts"


def describe(model: nn.Module | PipelineRunner, *, to_file: str | None = None,
             ranks: Sequence[int] | None = None) -> str:
    """A table of every parameter: global shape, spec, local shape on every rank, and the
    bytes each rank holds (from the specs, no communication); ``to_file`` draws the bytes per
    rank and parameter as a PNG. ``ranks`` names the ranks holding ``model`` where only some
    do (a pipeline stage: the ranks of its pipeline index); by default every rank of each
    parameter's mesh holds it.

    Given a :class:`~devmesh.parallel.pipeline.PipelineRunner`, describes every stage of the
    pipelined model with the ranks holding it: every rank of the pipeline calls it (each
    holds only its own stages; their tables travel through the rendezvous store), and one
    called on some ranks alone raises :class:`~devmesh.errors.MeshUsageError` naming the
    others after :data:`PIPELINE_SECONDS`, where a collective would wait for the timeout."""
    if isinstance(model, PipelineRunner):
        return _describe_pipeline(model)
    rows = [("parameter", "global shape", "layout", "local shape (by rank)", "bytes here")]
    per_rank: dict[int, int] = defaultdict(int)
    by_param: dict[str, dict[int, int]] = {}
    total_global = 0
    for name, p in model.named_parameters():
        layout = layout_of(p)  # devmesh's, or a torch DTensor's (torch's TP)
        mine = local_of(p)  # this rank's block
        global_shape = layout.full_shape if layout else tuple(p.shape)
        what = _layout_text(layout) if layout else "not distributed"
        total_global += math.prod(global_shape) * p.element_size()
        shapes = _shapes_by_rank(p, ranks)
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for rank, shape in shapes.items():
            groups[shape].append(rank)
            per_rank[rank] += math.prod(shape) * p.element_size()
        by_param[name] = {r: math.prod(sh) * p.element_size() for r, sh in shapes.items()}
        if len(groups) <= 1:
            held = _held(layout, tuple(mine.shape)) if layout else tuple(mine.shape)
            local = f"{held} on " + ("every rank" if ranks is None
                                               else ranks_phrase(ranks))
        else:
            local = "; ".join(f"{shape} on {ranks_phrase(ranks)}"
                              for shape, ranks in sorted(groups.items(), key=lambda g: min(g[1])))
        rows.append((name, str(global_shape), what, local,
                     f"{mine.numel() * mine.element_size():,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    if per_rank:
        by_total: dict[int, list[int]] = defaultdict(list)
        for rank, nbytes in per_rank.items():
            by_total[nbytes].append(rank)
        lines.append("bytes per rank: " + "; ".join(
            f"{nbytes:,} on {ranks_phrase(ranks)}"
            for nbytes, ranks in sorted(by_total.items(), key=lambda g: min(g[1])))
            + (f" (the full model: {total_global:,})" if ranks is None
               else f" (the whole module, unsharded: {total_global:,})"))
    if to_file:
        _describe_png(by_param, sorted(per_rank), to_file)
    return "\n".join(lines)


#: How long ``describe(runner)`` waits for the other ranks of the pipeline to call it too.
PIPELINE_SECONDS = 60.0


def _describe_pipeline(runner: PipelineRunner) -> str:
    """Every stage's table: each rank of this rank's pipeline posts its stages' tables
    through the store, and waits :data:`PIPELINE_SECONDS` for the others' — called on one
    rank alone (to print there), a collective would wait for the timeout."""
    mine = {s: describe(runner.stages[s], ranks=stage_ranks(runner, s)) for s in runner.stages}
    pipeline = runner.mesh.layout.group_of(runner.mesh.get_rank(), (runner.dim,))
    calls = groups.world_cache()
    key = ("describe(runner)", pipeline)
    number = calls.get(key, 0)  # the ranks of a pipeline call it in the same order
    texts, missing = consensus.texts_through_store(
        json.dumps(mine), pipeline, f"describe {format_ranks(pipeline)} #{number}",
        seconds=PIPELINE_SECONDS)
    if missing:
        raise MeshUsageError(
            f"describe(runner) shows every stage, and each rank holds only its own: the "
            f"pipeline's ranks call it together, and "
            f"{ranks_phrase(missing)} did not "
            f"within {PIPELINE_SECONDS:g} s. Call it on every rank and print on one: "
            "text = describe(runner); if rank == 0: print(text)")
    calls[key] = number + 1  # a call refused on its own rank does not count
    tables = {int(s): t for text in texts.values() for s, t in json.loads(text).items()}
    return "\n".join(
        f"stage {s} (pipeline index {runner.schedule.rank_of(s)} of {runner.pp}, "
        f"{ranks_phrase(stage_ranks(runner, s))}):\n{tables[s]}" for s in sorted(tables))


def _describe_png(by_param: dict[str, dict[int, int]], ranks: list[int], path: str) -> None:
    from devmesh._files import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 1 + 0.6 * len(ranks)), 4.5))
    bottom = [0] * len(ranks)
    for name, sizes in by_param.items():
        heights = [sizes.get(r, 0) for r in ranks]
        ax.bar([str(r) for r in ranks], heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_xlabel("rank")
    ax.set_ylabel("parameter bytes")
    ax.set_title("parameter bytes held by each rank")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    save_figure(fig, path)
