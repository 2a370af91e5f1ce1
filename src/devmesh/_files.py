"""Writing files so that a crash never leaves one half-written: write a temporary file next
to the target, then rename it over the target (atomic on POSIX). Used for every picture, CSV
and JSON devmesh writes."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import IO, Any

__all__ = ["atomic_write", "pyplot", "save_figure"]


def atomic_write(path: str, write: Callable[[IO[str]], Any]) -> None:
    """Call ``write(file)`` on a temporary file, then move it to ``path``."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", newline="") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend (no display needed)."""
    try:
        import matplotlib
    except ImportError:  # pragma: no cover - matplotlib is a dependency
        raise ImportError("drawing pictures needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str) -> None:
    """Save a matplotlib figure as PNG atomically and close it."""
    tmp = f"{path}.tmp.png"
    try:
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, path)
    finally:
        pyplot().close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)
