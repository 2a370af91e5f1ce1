"""Pictures of a mesh layout in the terminal: the rank grid and every group of every dim.

Pure: needs only :class:`~devmesh.layout.MeshLayout` (no torch, no processes), so
``devmesh show`` answers instantly for any size. Large meshes are elided (``…``) so the output
stays readable; ``max_groups``/``max_cells`` raise the limits.

Two renderers share one description of what to show: :func:`layout_text` gives plain text
(for pipes, logs and tests) and :func:`layout_rich` gives rich renderables for a terminal.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np

from devmesh.layout import MeshLayout

__all__ = ["layout_text", "layout_rich", "group_lines"]


def _fmt_group(group: tuple[int, ...], max_items: int = 16) -> str:
    if len(group) <= max_items:
        return "[" + ", ".join(map(str, group)) + "]"
    head = ", ".join(map(str, group[: max_items // 2]))
    tail = ", ".join(map(str, group[-2:]))
    return f"[{head}, … {tail}] ({len(group)} ranks)"


def group_lines(layout: MeshLayout, max_groups: int = 8, max_items: int = 16) -> Iterator[str]:
    """One line per dim: its name, size, number of groups, and the groups (elided past
    ``max_groups`` groups and ``max_items`` ranks per group)."""
    for d in range(layout.ndim):
        array = layout.group_array(d)
        shown = [_fmt_group(tuple(row), max_items) for row in array[:max_groups].tolist()]
        more = f"… and {len(array) - max_groups} more" if len(array) > max_groups else ""
        head = (
            f"{layout.dim_name(d)} (size {layout.shape[d]}, {len(array)} group"
            f"{'s' if len(array) != 1 else ''}):"
        )
        one_line = " ".join([head, *shown, more]).rstrip()
        if len(one_line) <= 100:
            yield one_line
        else:  # long groups: one per line
            yield head
            yield from ("  " + text for text in shown + ([more] if more else []))


def _blocks(layout: MeshLayout, max_blocks: int) -> Iterator[tuple[str, np.ndarray]]:
    """2-D blocks of the rank array: the last two dims, one block per index of the others."""
    ranks = layout.ranks
    if layout.ndim == 1:
        yield "", ranks.reshape(1, -1)
        return
    lead = layout.shape[:-2]
    for i, index in enumerate(itertools.product(*[range(s) for s in lead])):
        if i == max_blocks:
            return
        title = ", ".join(f"{layout.dim_name(d)}={c}" for d, c in enumerate(index))
        yield title, ranks[index]


def _elide(values: list[Any], limit: int) -> list[Any]:
    if len(values) <= limit:
        return values
    return values[: limit - 2] + ["…"] + values[-1:]


def _block_rows(block: np.ndarray, max_cells: int) -> list[list[str]]:
    rows = _elide([[str(v) for v in row] for row in block.tolist()], max_cells)
    width = len(_elide(rows[0], max_cells))
    return [["⋮"] * width if row == "…" else _elide(row, max_cells) for row in rows]


def _header(layout: MeshLayout) -> str:
    dims = " × ".join(f"{layout.dim_name(d)}={s}" for d, s in enumerate(layout.shape))
    return f"Mesh {layout.shape}: {dims} — {layout.size} ranks"


def _rank_line(layout: MeshLayout, rank: int) -> str:
    coordinate = layout.coordinate_of(rank)
    if coordinate is None:
        return f"rank {rank} is not in this mesh"
    parts = [f"{layout.dim_name(d)}={_fmt_group(layout.group_of(rank, d))}"
             for d in range(layout.ndim)]
    return f"rank {rank} at {coordinate}: " + ", ".join(parts)


def layout_text(
    layout: MeshLayout, *, rank: int | None = None, max_groups: int = 8, max_cells: int = 16,
    max_blocks: int = 4,
) -> str:
    """Plain-text picture: header, rank grid(s), groups per dim, optionally one rank's view."""
    lines = [_header(layout)]
    row_dim = layout.dim_name(-2) if layout.ndim > 1 else None
    col_dim = layout.dim_name(-1)
    lines.append(
        f"rows: {row_dim}, columns: {col_dim}" if row_dim else f"columns: {col_dim}"
    )
    for title, block in _blocks(layout, max_blocks):
        rows = _block_rows(block, max_cells)
        width = max(len(cell) for row in rows for cell in row)
        if title:
            lines.append(f"[{title}]")
        lines.extend("  " + " ".join(cell.rjust(width) for cell in row) for row in rows)
    blocks = int(np.prod(layout.shape[:-2])) if layout.ndim > 2 else 1
    if blocks > max_blocks:
        lines.append(f"  … {blocks - max_blocks} more blocks")
    lines.append("groups:")
    lines.extend("  " + line for line in group_lines(layout, max_groups, max_cells))
    if rank is not None:
        lines.append(_rank_line(layout, rank))
    return "\n".join(lines)


def layout_rich(
    layout: MeshLayout, *, rank: int | None = None, max_groups: int = 8, max_cells: int = 16,
    max_blocks: int = 4,
) -> list[Any]:
    """The same picture as rich renderables (tables with the grid, colored by the last dim)."""
    from rich.table import Table
    from rich.text import Text

    palette = ["cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta"]
    highlight = set(layout.group_of(rank, -1)) if rank is not None and rank in layout else set()
    out: list[Any] = [Text(_header(layout), style="bold")]
    for title, block in _blocks(layout, max_blocks):
        rows = _block_rows(block, max_cells)
        table = Table(title=title or None, show_header=True, header_style="dim")
        table.add_column(layout.dim_name(-2) + " \\ " + layout.dim_name(-1) if layout.ndim > 1 else "")
        for c in range(len(rows[0])):
            table.add_column(str(c) if rows[0][c] != "…" else "…", justify="right")
        for r, row in enumerate(rows):
            cells = []
            for c, cell in enumerate(row):
                style = palette[r % len(palette)]
                if cell.isdigit() and int(cell) in highlight:
                    style += " reverse"
                cells.append(Text(cell, style=style))
            table.add_row(str(r) if layout.ndim > 1 else "", *cells)
        out.append(table)
    out.append(Text("groups:", style="bold"))
    out.extend(Text("  " + line) for line in group_lines(layout, max_groups, max_cells))
    if rank is not None:
        out.append(Text(_rank_line(layout, rank), style="bold"))
    return out
