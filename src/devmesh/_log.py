"""devmesh's loggers: ``logging.getLogger("devmesh.<area>")``, quiet by default.

``DEVMESH_LOG=info`` (or ``debug``, ``warning``) sends the ``devmesh`` hierarchy to standard
error with the rank in every line; without it devmesh adds no handler, so an application's own
``logging`` configuration decides (``logging.getLogger("devmesh").setLevel(logging.INFO)``).

- info: what a person running a job wants to know — a mesh built, and how many process groups
  it created or reused; a restart and its number; a checkpoint saved or loaded, its bytes and
  seconds; a rank of a local launch that failed, and how.
- debug: every collective devmesh issues, with its mesh dims and bytes.
"""

from __future__ import annotations

import logging
import os

__all__ = ["get_logger", "LEVEL_VARIABLE"]

LEVEL_VARIABLE = "DEVMESH_LOG"
_configured = False


class _RankFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        rank = os.environ.get("RANK")
        where = f"devmesh rank {rank}" if rank is not None else "devmesh"
        return f"[{where}] {record.levelname.lower()} {record.name}: {record.getMessage()}"


def _configure() -> None:
    global _configured
    _configured = True
    wanted = os.environ.get(LEVEL_VARIABLE, "").strip().upper()
    if not wanted:
        return
    level = logging.getLevelName(wanted)
    if not isinstance(level, int):
        raise ValueError(f"{LEVEL_VARIABLE}={wanted.lower()!r}: use warning, info or debug")
    root = logging.getLogger("devmesh")
    handler = logging.StreamHandler()
    handler.setFormatter(_RankFormatter())
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False


def get_logger(area: str) -> logging.Logger:
    """The logger ``devmesh.<area>`` (``DEVMESH_LOG`` read on first use)."""
    if not _configured:
        _configure()
    return logging.getLogger(f"devmesh.{area}")
