"""PNG picture of a mesh layout: ranks on a grid, hosts shaded, the groups of one dim outlined.

The grid has one column per index of the innermost dim and one row per combination of the
other dims (row-major), so every mesh of any rank draws as a 2-D table. Written atomically
(to a temporary name, then renamed).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from devmesh._files import pyplot, save_figure
from devmesh.layout import Dim, MeshLayout

__all__ = ["layout_png"]


def layout_png(
    layout: MeshLayout,
    path: str,
    *,
    host_of: Sequence[int] | np.ndarray | None = None,
    outline: Dim | None = None,
    max_cells: int = 4096,
) -> None:
    if layout.size > max_cells:
        raise ValueError(
            f"a picture of {layout.size} ranks would be unreadable; draw at most {max_cells}"
        )
    plt = pyplot()  # a clear error if matplotlib is missing
    from matplotlib.patches import Rectangle


    cols = layout.shape[-1]
    grid = layout.ranks.reshape(-1, cols)
    rows = grid.shape[0]
    position = {int(r): (i, j) for i, row in enumerate(grid.tolist()) for j, r in enumerate(row)}
    hosts = None if host_of is None else np.asarray(host_of)
    fig, ax = plt.subplots(figsize=(min(16, max(6.0, 3 + 0.9 * cols)),
                                    min(12, max(3.0, 1.2 + 0.7 * rows))))
    shades = plt.get_cmap("Pastel1")
    for (i, j), rank in np.ndenumerate(grid):
        color = shades(int(hosts[rank]) % 9) if hosts is not None else "whitesmoke"
        ax.add_patch(Rectangle((j, i), 1, 1, facecolor=color, edgecolor="grey", linewidth=0.5))
        label = f"{rank}" + (f"\nhost {int(hosts[rank])}" if hosts is not None else "")
        ax.text(j + 0.5, i + 0.5, label, ha="center", va="center", fontsize=8)
    dim = layout.dim(outline) if outline is not None else layout.ndim - 1
    lines = plt.get_cmap("tab10")
    for g, group in enumerate(layout.groups(dim)):
        points = [position[r] for r in group]
        color = lines(g % 10)
        for i, j in points:
            ax.add_patch(Rectangle((j + 0.06, i + 0.06), 0.88, 0.88, fill=False,
                                   edgecolor=color, linewidth=2))
        if len(points) > 1:
            ax.plot([j + 0.5 for _, j in points], [i + 0.5 for i, _ in points], color=color,
                    linewidth=1.5, alpha=0.7)
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_xticks([j + 0.5 for j in range(cols)], [str(j) for j in range(cols)])
    lead = [layout.dim_name(d) for d in range(layout.ndim - 1)]
    labels = [", ".join(f"{n}={int(c)}" for n, c in
                        zip(lead, np.unravel_index(i, layout.shape[:-1]), strict=True))
              if lead else "" for i in range(rows)]
    ax.set_yticks([i + 0.5 for i in range(rows)], labels)
    ax.set_xlabel(layout.dim_name(-1))
    ax.set_ylabel(", ".join(lead))
    title = " × ".join(f"{layout.dim_name(d)}={s}" for d, s in enumerate(layout.shape))
    ax.set_title(f"mesh {title}\nboxes: groups of {layout.dim_name(dim)!r}"
                 + ("; shading: hosts" if hosts is not None else ""), fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)
