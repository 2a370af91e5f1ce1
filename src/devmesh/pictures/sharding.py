"""Pictures of a sharding: which rank holds which block of a 1-D or 2-D tensor.

Computed from the spec alone (every rank's block follows from its mesh coordinate), so it
needs no communication, handles nested splits such as ``("tp", "dp")`` exactly, and works
from a spec and a layout without any process (``visualize_sharding(spec, layout)``).
A terminal gets a table (rich), a file name gets a PNG (matplotlib, installed on demand:
``pip install matplotlib``).
"""

from __future__ import annotations

import itertools
import sys
from collections import defaultdict
from typing import Any

from devmesh.layout import MeshLayout
from devmesh.layout.spec import ShardingSpec, ShardingSpecError

__all__ = ["sharding_blocks", "visualize_sharding"]

Block = tuple[tuple[int, int], ...]  # (start, size) per tensor dim


def sharding_blocks(spec: ShardingSpec, layout: MeshLayout) -> dict[Block, list[int]]:
    """Every distinct block of the tensor and the ranks that hold it (replicas), in order."""
    if layout.shape != spec.mesh_shape:
        raise ShardingSpecError(f"spec is for a mesh of shape {spec.mesh_shape}, not {layout.shape}")
    blocks: dict[Block, list[int]] = defaultdict(list)
    for coord in itertools.product(*[range(s) for s in layout.shape]):
        blocks[spec.local_bounds(coord)].append(layout.rank_at(coord))
    return dict(blocks)


def _grid(spec: ShardingSpec, layout: MeshLayout):
    if spec.ndim not in (1, 2):
        raise ShardingSpecError(
            f"visualize_sharding draws 1-D and 2-D tensors; this one is {spec.ndim}-D "
            f"(shape {spec.global_shape})"
        )
    blocks = sharding_blocks(spec, layout)
    as2d = {((0, 1),) + b if spec.ndim == 1 else b: r for b, r in blocks.items()}
    rows = sorted({b[0] for b in as2d})
    cols = sorted({b[1] for b in as2d})
    return as2d, rows, cols


def _span(bounds: tuple[int, int]) -> str:
    start, size = bounds
    return f"{start}:{start + size}" if size else f"{start}:{start} (empty)"


def _title(spec: ShardingSpec) -> str:
    return f"tensor {tuple(spec.global_shape)}: {str(spec).split(': ', 1)[1]}"


def _text(spec: ShardingSpec, layout: MeshLayout) -> str:
    cells, rows, cols = _grid(spec, layout)
    header = ["rows \\ cols"] + [_span(c) for c in cols] if spec.ndim == 2 else \
             ["elements"] + [_span(c) for c in cols]
    table = [header]
    for r in rows:
        line = [_span(r) if spec.ndim == 2 else ""]
        for c in cols:
            ranks = cells.get((r, c))
            line.append("ranks " + ",".join(map(str, ranks)) if ranks else "")
        table.append(line)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [_title(spec)]
    lines += ["  " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths,
                                                                 strict=True)) for row in table]
    return "\n".join(lines)


def _png(spec: ShardingSpec, layout: MeshLayout, path: str) -> None:
    from devmesh._files import pyplot, save_figure

    plt = pyplot()
    from matplotlib.patches import Rectangle

    cells, rows, cols = _grid(spec, layout)
    height = spec.global_shape[0] if spec.ndim == 2 else 1
    width = spec.global_shape[-1]
    fig, ax = plt.subplots(figsize=(min(12, 2 + 0.8 * len(cols) * 1.5), min(9, 1.5 + 0.8 * len(rows))))
    cmap = plt.get_cmap("tab20")
    for i, ((r, c), ranks) in enumerate(sorted(cells.items())):
        if r[1] == 0 or c[1] == 0:
            continue
        ax.add_patch(Rectangle((c[0], r[0]), c[1], r[1], facecolor=cmap(i % 20),
                               edgecolor="black", linewidth=1))
        ax.text(c[0] + c[1] / 2, r[0] + r[1] / 2, "ranks\n" + ",".join(map(str, ranks)),
                ha="center", va="center", fontsize=9)
    ax.set_xlim(0, max(width, 1))
    ax.set_ylim(max(height, 1), 0)
    ax.set_xlabel("dim 1" if spec.ndim == 2 else "dim 0")
    if spec.ndim == 2:
        ax.set_ylabel("dim 0")
    ax.set_title(_title(spec), fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)  # never leave a half-written picture


def visualize_sharding(
    tensor_or_spec: Any,
    layout: MeshLayout | None = None,
    *,
    to_file: str | None = None,
    show: bool | None = None,
) -> str:
    """Show which rank holds which block; returns the table as text.

    Args:
        tensor_or_spec: a :class:`~devmesh.tensor.ShardedTensor`, or a spec with ``layout``.
        layout: the mesh layout, when a spec is given.
        to_file: also write a PNG there.
        show: print the table (rich in a terminal); default: only on the mesh's first rank.
    """
    if isinstance(tensor_or_spec, ShardingSpec):
        if layout is None:
            raise ShardingSpecError("visualize_sharding(spec) needs the mesh layout as well")
        spec, first = tensor_or_spec, True
    else:
        spec = tensor_or_spec.spec
        mesh = tensor_or_spec.device_mesh
        layout = mesh.layout
        first = mesh.get_rank() == layout.rank_list()[0]
    text = _text(spec, layout)
    if to_file:
        _png(spec, layout, to_file)
    if show if show is not None else first:
        if sys.stdout.isatty():
            from rich.console import Console
            from rich.table import Table

            cells, rows, cols = _grid(spec, layout)
            table = Table(title=_title(spec), show_lines=True)
            table.add_column("rows \\ cols" if spec.ndim == 2 else "")
            for c in cols:
                table.add_column(_span(c), justify="center")
            for r in rows:
                table.add_row(_span(r) if spec.ndim == 2 else "",
                              *["ranks " + ",".join(map(str, cells.get((r, c), []))) for c in cols])
            Console().print(table)
        else:
            print(text)
    return text
