"""Multi-rank tests without a fresh launch per test.

Importing torch costs ~2 s per process; a test that spawns 8 fresh processes pays it 8 times
on 2 cores. This module keeps one :class:`~devmesh.launching.launcher.WorkerPool` of 8 workers for the
whole test session and runs every multi-rank test on it (world sizes 1 to 8). Each task gets a
fresh default process group on a new port, and a task that fails or hangs replaces only the
workers it broke, so later tests are unaffected. Under pytest-xdist each pytest worker
process keeps its own pool (``pytest -n 2``: two pools, 16 rank processes).

Use it from pytest by adding to ``conftest.py``::

    pytest_plugins = ["devmesh.testing"]

    def test_all_reduce(mesh_pool):
        assert mesh_pool.run(my_fn, 4) == [...]

or without pytest through :func:`run`.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable
from typing import Any

from devmesh.launching.launcher import WorkerPool

__all__ = ["shared_pool", "run", "mesh_pool"]

_pool: WorkerPool | None = None


#: What the pool's workers import before their first task unless ``DEVMESH_TEST_PRELOAD``
#: (comma-separated module names) says otherwise: devmesh's parallelisms and what they use.
DEFAULT_PRELOAD = ("devmesh.parallel", "devmesh.parallel.pipeline", "devmesh.tensor",
                   "torch.distributed.checkpoint", "torch.distributed.pipelining")


def shared_pool(size: int | None = None) -> WorkerPool:
    """The process-wide pool (``DEVMESH_TEST_WORKERS`` workers, default 8), started on first
    use, its workers forked after importing ``DEVMESH_TEST_PRELOAD`` (see
    :data:`DEFAULT_PRELOAD`): a suite's workers, and those that replace broken ones, then
    import none of it again."""
    global _pool
    wanted = size or int(os.environ.get("DEVMESH_TEST_WORKERS", "8"))
    if _pool is not None and _pool.size < wanted:
        _pool.close()
        _pool = None
    if _pool is None:
        preload = os.environ.get("DEVMESH_TEST_PRELOAD")
        names = DEFAULT_PRELOAD if preload is None else [n.strip() for n in preload.split(",")
                                                         if n.strip()]
        _pool = WorkerPool(wanted, preload=names)
        atexit.register(_pool.close)
    return _pool


def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
        **kwargs: Any) -> list[Any]:
    """Run ``fn`` on ``world_size`` ranks of the shared pool; results in rank order."""
    return shared_pool(max(world_size, 1)).run(fn, world_size, *args, timeout=timeout, **kwargs)


try:  # the fixture exists only where pytest does
    import pytest

    @pytest.fixture(scope="session")
    def mesh_pool() -> WorkerPool:
        """A session-wide pool of 8 worker processes (see :func:`shared_pool`)."""
        return shared_pool()

except ImportError:  # pragma: no cover
    pass
