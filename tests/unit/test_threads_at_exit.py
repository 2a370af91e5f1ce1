"""devmesh's background threads that talk to a store must not abort their process at exit.

A daemon thread inside a c10d store call (which releases the GIL in C++) when the
interpreter shuts down is ended by CPython with ``pthread_exit`` as it takes the GIL back;
that unwinds through torch's C++ frames and aborts the process ("terminate called without an
active exception", SIGABRT) after its work is done. Each thread here polls its store with no
pause, so without a stop at exit nearly every run would abort.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

RUNS = 3

_RECORDER = """
    from datetime import timedelta
    import time
    import torch.distributed as dist
    from devmesh.distributed import trace

    trace._store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    trace._POLL_SECONDS = 0.0  # the listener asks the store without a pause
    trace.install()
    trace._start_listener()
    time.sleep(0.05)
"""

_HEARTBEAT = """
    from datetime import timedelta
    import time
    import torch.distributed as dist
    from devmesh.fault import protocol, replicas

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    protocol.HEARTBEAT_SECONDS = 0.0  # the heartbeat writes without a pause
    beat = replicas._Heartbeat(f"127.0.0.1:{server.port}", group=0, rank=0,
                               silence=30.0)  # never stopped
    time.sleep(0.05)
"""


@pytest.mark.parametrize("script", [_RECORDER, _HEARTBEAT], ids=["recorder", "heartbeat"])
def test_a_process_with_the_thread_running_exits_0(script):
    for _ in range(RUNS):
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]


def test_the_exit_handler_waits_while_another_thread_is_runnable(monkeypatch):
    """On a loaded machine, a gloo thread woken for the GIL may wait longer than the handler's
    first moment for a core; the handler then waits on while a thread is runnable. A thread
    hashing without the GIL stands in for it here: one hash of a buffer sized to take about
    0.4 s, the GIL released throughout (so the thread never waits for it, runnable until it
    ends)."""
    import hashlib
    import threading
    import time

    from devmesh import _exit

    monkeypatch.setitem(sys.modules, "torch.distributed", sys)  # the handler acts with torch only
    probe = bytes(8 << 20)
    began = time.perf_counter()
    hashlib.sha256(probe).digest()
    per_byte = (time.perf_counter() - began) / len(probe)
    data = bytes(min(int(0.4 / per_byte), 4 << 30))  # calloc'd: no memory is touched
    ended = []

    def hash_once():
        hashlib.sha256(data).digest()  # releases the GIL for the whole buffer
        ended.append(time.monotonic())

    thread = threading.Thread(target=hash_once)
    thread.start()
    time.sleep(0.05)
    assert _exit._another_thread_runnable() and not ended
    _exit._settle()
    returned = time.monotonic()
    thread.join()
    # it returned once the thread had ended (its last check saw none runnable): not after
    # its first 20 ms, nor at its bound
    assert ended and ended[0] <= returned < ended[0] + _exit._MOST_SECONDS / 2, (ended, returned)
    assert not _exit._another_thread_runnable()
