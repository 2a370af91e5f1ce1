"""Small helpers shared by test modules (run on the workers too, so import nothing heavy)."""

from __future__ import annotations

from devmesh.errors import DevmeshError


def caught(fn):
    """``(type name, message)`` of the devmesh error ``fn()`` raises, or ``None``."""
    try:
        fn()
    except DevmeshError as exc:
        return type(exc).__name__, str(exc)
    return None
