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
devmesh's default process group) registers an exit handler that releases the GIL while the
interpreter is still whole, letting those threads finish: for a moment, and then for as long
as another thread of the process is still runnable (woken for the GIL but not yet given a
core, as on a loaded machine), up to a bound. Linux says which threads are runnable
(``/proc/self/task``); elsewhere the moment is all.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

__all__ = ["settle_collective_threads_at_exit"]

_SETTLE_SECONDS = 0.02
_MOST_SECONDS = 1.0  # a thread that computes (not one queued for the GIL) is not waited for longer
_TASKS = "/proc/self/task"
_registered = False


def _another_thread_runnable() -> bool:
    """Whether a thread of this process other than the caller is running or waits for a core."""
    try:
        tasks = os.listdir(_TASKS)
    except OSError:
        return False
    me = str(threading.get_native_id())
    for task in tasks:
        if task == me:
            continue
        try:
            with open(f"{_TASKS}/{task}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the thread has ended
            continue
        if stat[stat.rindex(b")") + 2:][:1] == b"R":  # the state follows "(name) "
            return True
    return False


def _settle() -> None:
    # after destroy_process_group() too: the threads of a destroyed group may still be queued
    if "torch.distributed" not in sys.modules:
        return
    time.sleep(_SETTLE_SECONDS)  # releases the GIL to the threads queued for it
    deadline = time.monotonic() + _MOST_SECONDS
    while _another_thread_runnable() and time.monotonic() < deadline:
        time.sleep(0.005)


def settle_collective_threads_at_exit() -> None:
    """Register the exit handler (once per process; costs nothing without torch imported)."""
    global _registered
    if not _registered:
        atexit.register(_settle)
        _registered = True
