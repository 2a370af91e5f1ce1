"""A pipeline schedule drawn as a timeline: one row per rank, one box per action (forward,
backward, input-gradient, weight-gradient), at the times the schedule's simulation gives —
the bubble is the white space."""

from __future__ import annotations

from collections.abc import Mapping

from devmesh._files import pyplot, save_figure
from devmesh.layout.schedule import Schedule

__all__ = ["draw_schedule"]

_COLORS = {"F": "#4C78A8", "B": "#F58518", "I": "#E45756", "W": "#72B7B2"}
_NAMES = {"F": "forward", "B": "backward", "I": "backward (input grad)",
          "W": "backward (weight grad)"}


def draw_schedule(schedule: Schedule, path: str, costs: Mapping[str, float] | None = None
                  ) -> None:
    """Write ``schedule``'s simulated timeline as a PNG at ``path``."""
    plt = pyplot()
    timeline = schedule.simulate(costs)
    makespan = max(t.end for t in timeline)
    fig, ax = plt.subplots(figsize=(max(6.0, makespan * 0.35), 0.6 * schedule.ranks + 1.4))
    for t in timeline:
        ax.broken_barh([(t.start, t.end - t.start)], (t.rank - 0.4, 0.8),
                       facecolors=_COLORS[t.action.kind], edgecolors="white")
        label = str(t.action.microbatch)
        if schedule.stages > schedule.ranks:  # virtual stages: say which
            label += f"/{t.action.stage}"
        ax.text((t.start + t.end) / 2, t.rank, label, ha="center", va="center", fontsize=7,
                color="white")
    ax.set_yticks(range(schedule.ranks), [f"rank {r}" for r in range(schedule.ranks)])
    ax.invert_yaxis()
    ax.set_xlabel("time (forward = 1)")
    kinds = sorted({t.action.kind for t in timeline}, key="FBIW".index)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=_COLORS[k]) for k in kinds],
              labels=[_NAMES[k] for k in kinds], loc="upper center", ncol=len(kinds),
              bbox_to_anchor=(0.5, -0.35 if schedule.ranks < 4 else -0.2), fontsize=8)
    ax.set_title(f"{schedule.name}: {schedule.stages} stages, {schedule.microbatches} "
                 f"micro-batches, bubble {schedule.bubble(costs):.1%}")
    fig.tight_layout()
    save_figure(fig, path)
