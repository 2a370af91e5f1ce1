"""A distributed process that ends normally must exit 0, not abort.

gloo runs each collective on a worker thread of its process group. When the collective is
done, that thread drops its references to the collective's tensors, and a tensor that Python
also holds needs the GIL for that. If the main thread has just returned from its last
collective and goes straight into interpreter shutdown, the worker thread is still queued for
the GIL; once shutdown begins, CPython ends any thread that then takes the GIL with
``pthread_exit``, which unwinds through gloo's C++ frames and calls ``std::terminate``: the
process dies with SIGABRT ("terminate called without an active exception", exit code 134)
after it has finished its work, and the launcher reports the rank as failed. It happens with
torch alone (torchrun, torch's own mesh; ``destroy_process_group()`` does not prevent it) in
about one run in ten on this project's machines — pytorch/pytorch#190489.

So the first devmesh code to run in a distributed process (``devmesh run``'s rank wrapper,
devmesh's default process group) registers an exit handler that releases the GIL for a
moment while the interpreter is still whole, letting those threads finish.
"""

from __future__ import annotations

import atexit
import sys
import time

__all__ = ["settle_collective_threads_at_exit"]

_SETTLE_SECONDS = 0.02
_registered = False


def _settle() -> None:
    # after destroy_process_group() too: the threads of a destroyed group may still be queued
    if "torch.distributed" in sys.modules:
        time.sleep(_SETTLE_SECONDS)  # releases the GIL to the threads queued for it


def settle_collective_threads_at_exit() -> None:
    """Register the exit handler (once per process; costs nothing without torch imported)."""
    global _registered
    if not _registered:
        atexit.register(_settle)
        _registered = True
