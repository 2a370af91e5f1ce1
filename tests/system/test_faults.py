"""Fault injection (issue 9): a killed rank is named with its signal within seconds, a
stranger on the pool's port is refused before anything is unpickled, the pool's secret is not
on any command line, a killed parent leaves no worker behind, and ``devmesh run`` validates
its process count and passes on a failing rank's exit code. Processes are checked in the OS
process table."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from devmesh import WorkerPool
from devmesh.errors import RankFailedError
from helpers import all_gone, alive, reported, stay_away_until_reported


def kill_rank_two():
    import torch

    from devmesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("x",))
    if mesh.get_rank() == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    torch.distributed.all_reduce(torch.ones(1), group=mesh.get_group())
    return "unreachable"


def test_a_killed_rank_is_named_with_its_signal_within_seconds():
    with WorkerPool(4) as pool:
        pids = [w.process.pid for w in pool._workers]
        start = time.monotonic()
        with pytest.raises(RankFailedError) as info:
            pool.run(kill_rank_two, 4, timeout=120)
        elapsed = time.monotonic() - start
        assert info.value.rank == 2
        assert "SIGKILL" in str(info.value) and "exit code -9" in str(info.value)
        assert elapsed < 20, elapsed  # not after restarting workers (a torch import each)
        assert not alive(pids[2])
        assert pool.run(lambda: 1, 4) == [1, 1, 1, 1]  # the pool recovers
    for pid in pids:
        assert not alive(pid)


def crash_rank_one_in_native_code():
    import ctypes

    if int(os.environ["RANK"]) == 1:
        ctypes.string_at(0)  # reads address 0: a segmentation fault in C, no Python exception
    return "survived"


def test_a_rank_crashed_in_native_code_is_named_with_its_python_stack(mesh_pool):
    """A segmentation fault sends no traceback; faulthandler's stacks of the crashed rank
    (where its Python code was when the signal came) are the error's remote traceback."""
    with pytest.raises(RankFailedError) as info:
        mesh_pool.run(crash_rank_one_in_native_code, 2, timeout=60)
    assert info.value.rank == 1
    assert "SIGSEGV" in str(info.value)
    assert "Fatal Python error: Segmentation fault" in info.value.remote_traceback
    assert "crash_rank_one_in_native_code" in info.value.remote_traceback
    assert mesh_pool.run(crash_rank_one_in_native_code, 1) == ["survived"]  # replaced


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {_MARK}",))


_MARK = "/tmp/devmesh-test-unpickled-by-pool"


def test_a_stranger_on_the_pool_port_is_refused_before_unpickling():
    if os.path.exists(_MARK):
        os.remove(_MARK)
    with WorkerPool(1) as pool:
        host, port = pool._server.getsockname()
        stranger = socket.create_connection((host, port))
        payload = pickle.dumps((_Evil(), 0, 0))
        stranger.sendall(len(payload).to_bytes(4, "big") + payload)
        pool._replace([0])  # the pool accepts (and must reject) the stranger while starting
        stranger.close()
        assert pool.run(lambda: 2, 1) == [2]
        cmdlines = [open(f"/proc/{w.process.pid}/cmdline", "rb").read() for w in pool._workers]
        assert all(pool._authkey.hex().encode() not in c for c in cmdlines)
    assert not os.path.exists(_MARK)


def test_killing_the_parent_leaves_no_worker(tmp_path):
    script = textwrap.dedent("""
        import os, sys, time
        from devmesh import WorkerPool
        pool = WorkerPool(3)
        print(" ".join(str(w.process.pid) for w in pool._workers), flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, TMPDIR=str(tmp_path)))  # killed: no cleanup
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 3 and all(alive(p) for p in pids)
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=30)
    assert all_gone(pids, within=15)


def _devmesh(*args, **kw):
    return subprocess.run([sys.executable, "-m", "devmesh.tools.cli", *args], capture_output=True,
                          text=True, timeout=300, **kw)


@pytest.mark.parametrize("n", ["0", "-2", "100000"])
def test_devmesh_run_refuses_impossible_process_counts(tmp_path, n):
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    proc = _devmesh("run", "-n", n, str(script))
    assert proc.returncode != 0 and "ran" not in proc.stdout
    assert "devmesh run: -n" in proc.stderr


# A script that has done its work while one of gloo's threads waits for the GIL (to drop its
# reference to a finished collective's tensor, which Python also holds): the main thread keeps
# the GIL from before the collective ends until the interpreter shuts down, as a script whose
# last collective ends just before it does. CPython then ends the waiting thread, which aborts
# the process ("terminate called without an active exception", SIGABRT): about one ordinary
# run in ten did so here, with torch alone too (pytorch/pytorch#190489).
_ENDS_WITH_A_QUEUED_GLOO_THREAD = """
import sys, time, torch, torch.distributed as dist
{setup}
t = torch.ones(1000)
dist.barrier()
print("done", flush=True)  # output releases the GIL: none after the collective
sys.setswitchinterval(100)  # no switch: the main thread keeps the GIL
dist.all_reduce(t, async_op=True)  # gloo's thread drops the last reference to the work
end = time.perf_counter() + 0.3
while time.perf_counter() < end:
    pass
sys.setswitchinterval(0.0005)
"""


@pytest.mark.parametrize("launcher", ["devmesh run, torch alone", "torchrun, devmesh mesh"])
def test_a_run_that_ended_well_exits_zero(tmp_path, launcher):
    """Before, both ranks died with SIGABRT after their work, every time: ``devmesh run``
    reported them failed (exit code 134)."""
    script = tmp_path / "ends.py"
    if launcher.startswith("devmesh run"):
        script.write_text(_ENDS_WITH_A_QUEUED_GLOO_THREAD.format(
            setup='dist.init_process_group("gloo")\nimport logging\n'
                  'logging.getLogger("torch.distributed").warning("said by torch")'))
        proc = _devmesh("run", "-n", "2", str(script))
        # torch's own log line carries devmesh run's rank prefix, once
        assert re.search(r"^\[rank1\]:W\d{4} [^\n]*ends.py:\d+\] said by torch$", proc.stderr,
                         re.M) and "[rank1]:[rank1]:" not in proc.stderr, proc.stderr[-2000:]
    else:
        script.write_text(_ENDS_WITH_A_QUEUED_GLOO_THREAD.format(
            setup='from devmesh import init_device_mesh\ninit_device_mesh("cpu", (2,))'))
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run",
                               "--nproc_per_node", "2", str(script)], capture_output=True,
                              text=True, timeout=300,
                              env=dict(os.environ, TMPDIR=str(tmp_path)))  # its log folders
    assert "terminate called" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 0 and proc.stdout.count("done") == 2, proc.stderr[-2000:]


def test_devmesh_run_passes_on_a_failing_ranks_exit_code(tmp_path):
    script = tmp_path / "exit3.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    proc = _devmesh("run", "-n", "2", str(script))
    assert proc.returncode == 3, proc.stderr


def late_rank(folder: str):
    from devmesh import init_device_mesh
    from devmesh.errors import MeshTimeoutError

    rank = int(os.environ["RANK"])
    if rank == 3:  # later than the others' 4 s timeout: comes once they gave up
        stay_away_until_reported(folder, (0, 1, 2))
    try:
        init_device_mesh("cpu", (4,), timeout=4)
    except MeshTimeoutError as exc:
        return str(exc)
    finally:
        reported(folder, rank)
    return None


def test_a_rank_late_for_the_first_mesh_is_named(mesh_pool, tmp_path):
    """Issue 9, item 9: not torch's "3/4 clients joined" but the late rank, by number, on
    every rank that waited; the late rank itself is told the others gave up."""
    start = time.monotonic()
    results = mesh_pool.run(late_rank, 4, str(tmp_path), timeout=60)
    assert time.monotonic() - start < 30
    for message in results[:3]:
        assert message is not None and "ranks 3 of 4 did not start" in message
    assert results[3] is not None
    assert mesh_pool.run(lambda: "recovered", 4) == ["recovered"] * 4


def slow_to_connect():
    import torch.distributed as dist

    from devmesh.distributed.env import ensure_default_group

    rank = int(os.environ["RANK"])
    connected = []
    if rank == 2:  # still connecting (inside init_process_group) when the others are done
        real = dist.init_process_group

        def slow(*args, **kwargs):
            real(*args, **kwargs)
            time.sleep(2.0)
            connected.append(time.time())

        dist.init_process_group = slow
    try:
        ensure_default_group("cpu")
    finally:
        if rank == 2:
            dist.init_process_group = real
    return connected[0] if connected else time.time()


def test_no_rank_leaves_the_first_mesh_before_every_rank_has_connected(mesh_pool):
    """A rank whose work ends at once must not close its connections while a slower peer is
    still making them (gloo: "connectFullMesh failed ... Connection closed by peer")."""
    left = mesh_pool.run(slow_to_connect, 4)  # rank 2: when it finished connecting
    assert min(left[r] for r in (0, 1, 3)) >= left[2], left


def test_killing_devmesh_run_leaves_no_rank(tmp_path):
    """SIGKILL of `devmesh run` itself (torchrun's agent runs in it): its ranks die too."""
    script = tmp_path / "sleeper.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        open(os.path.join({str(tmp_path)!r}, "pid" + os.environ["RANK"]), "w").write(
            str(os.getpid()))
        assert sys.argv[1:] == ["--flag", "x"]
        time.sleep(600)
    """))
    run = subprocess.Popen([sys.executable, "-m", "devmesh", "run", "-n", "2", str(script),
                            "--flag", "x"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env=dict(os.environ, TMPDIR=str(tmp_path)))  # killed: cannot clean up
    deadline = time.monotonic() + 120
    files = [tmp_path / "pid0", tmp_path / "pid1"]
    while not all(f.exists() and f.read_text() for f in files) and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = [int(f.read_text()) for f in files]
    assert all(alive(p) for p in pids)
    run.send_signal(signal.SIGKILL)
    run.wait(timeout=30)
    assert all_gone(pids, within=15)


def test_the_root_exit_code_is_not_masked_by_the_agents_sigterm():
    from types import SimpleNamespace

    from devmesh.tools.cli.run import root_exit_code

    stopped = SimpleNamespace(exitcode=-signal.SIGTERM, timestamp=100)
    failed = SimpleNamespace(exitcode=3, timestamp=100)
    killed = SimpleNamespace(exitcode=-signal.SIGKILL, timestamp=99)
    assert root_exit_code({0: stopped, 1: failed}) == 3
    assert root_exit_code({0: stopped, 1: failed, 2: killed}) == 128 + signal.SIGKILL
    assert root_exit_code({0: stopped}) == 128 + signal.SIGTERM


def one_rank_never_enters_the_collective():
    import torch

    from devmesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("x",))
    if mesh.get_rank() == 1:
        time.sleep(600)  # stuck in its own code
    torch.distributed.all_reduce(torch.ones(1), group=mesh.get_group())


def test_a_hung_rank_is_named_as_the_cause(mesh_pool):
    """Issue 9, item 9: the rank that never entered the collective is named, not rank 0."""
    from devmesh.errors import RankTimeoutError

    with pytest.raises(RankTimeoutError) as info:
        mesh_pool.run(one_rank_never_enters_the_collective, 4, timeout=8)
    assert "ranks [1] never entered it" in str(info.value)
    assert "Ranks [0, 2, 3] wait inside a collective" in str(info.value)
    assert mesh_pool.run(lambda: 5, 4) == [5, 5, 5, 5]


def fails_before_its_process_group(fail_rank: int):
    from devmesh import init_device_mesh

    if int(os.environ["RANK"]) == fail_rank:
        raise ValueError("bad config on this rank")
    init_device_mesh("cpu", (4,), timeout=60)


@pytest.mark.parametrize("fail_rank", [0, 2])
def test_the_pool_recovers_after_a_failure_in_process_group_setup(mesh_pool, fail_rank):
    """Issue 9, item 10: a rank failing before the others finish setting up the world (rank 0
    serves the store) breaks nothing for the next task."""
    with pytest.raises(RankFailedError) as info:
        mesh_pool.run(fails_before_its_process_group, 4, fail_rank, timeout=60)
    assert info.value.rank == fail_rank and "bad config" in str(info.value)
    assert mesh_pool.run(lambda: "next", 4) == ["next"] * 4


def rank_one_hangs_in_its_own_code(folder: str):
    import torch

    from devmesh import init_device_mesh
    from devmesh.distributed import comm
    from devmesh.errors import CollectiveTimeoutError

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), timeout=3)
    comm.all_reduce(torch.ones(2), mesh, (0, 1))  # collective #1: everyone is there
    if mesh.get_rank() == 1:  # outlives the others' 3 s timeout and their reports
        stay_away_until_reported(folder, (0, 2, 3))
        return None
    try:
        comm.all_reduce(torch.ones(2), mesh, (0, 1))
    except CollectiveTimeoutError as exc:
        return exc.missing, exc.waited, str(exc)
    finally:
        reported(folder, mesh.get_rank())
    return "no error"


def test_a_collective_timeout_names_the_rank_that_never_entered(mesh_pool, tmp_path):
    """Issue 9, item 9, from inside the ranks (so under torchrun and devmesh run too): every
    rank that timed out says which rank never entered the collective, not torch's bare
    'Timed out waiting 3000ms for recv'."""
    results = mesh_pool.run(rank_one_hangs_in_its_own_code, 4, str(tmp_path), timeout=60)
    for rank in (0, 2, 3):
        missing, waited, text = results[rank]
        assert missing == [1] and waited == [0, 2, 3], text
        assert "all_reduce over dp+tp (collective #2 on ranks [0, 1, 2, 3])" in text
        # torch's own error stays in the message: the rank's own timeout, or — where another
        # waiting rank's timeout fired first and gloo closed its connections (a loaded
        # machine) — the closed connection, which devmesh reads as the collective broken off
        assert ("timed out: ranks [1] never entered it" in text and "Timed out waiting" in text
                ) or "broke off: ranks [1] never entered it" in text, text
    assert results[1] is None


def peers_hear_a_timeout_as_a_closed_connection(folder: str):
    from devmesh import init_device_mesh
    from devmesh.distributed.timeouts import Watch

    mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("dp",), timeout=30)
    watch = Watch("all_reduce", [0, 1, 2], lambda: "dp")
    if mesh.get_rank() == 2:  # never enters; outlives the others' grace periods
        stay_away_until_reported(folder, (0, 1))
        return None
    # rank 1 timed out; gloo closed its connections, so rank 0 hears of it this way
    error = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234" if
                         mesh.get_rank() == 0 else "Timed out waiting 3000ms for recv")
    try:
        explained = watch.explain(error)
    finally:
        reported(folder, mesh.get_rank())
    return (type(explained).__name__, getattr(explained, "missing", None), str(explained))


def test_a_rank_that_hears_of_the_timeout_as_a_closed_connection_names_the_culprit(mesh_pool,
                                                                                   tmp_path):
    """gloo closes a timed-out rank's connections: its peers fail at once with 'Connection
    closed by peer' instead of timing out. They name the culprit too (they did not before,
    and rank 0 — which serves the store — then exited and took the store from the rank that
    had timed out: the CI failure of test_devmesh_run_names_a_hung_rank)."""
    results = mesh_pool.run(peers_hear_a_timeout_as_a_closed_connection, 3, str(tmp_path),
                            timeout=60)
    for rank, wording in ((0, "broke off"), (1, "timed out")):
        kind, missing, text = results[rank]
        assert kind == "CollectiveTimeoutError" and missing == [2], text
        assert f"{wording}: ranks [2] never entered it" in text


def test_devmesh_run_names_a_hung_rank(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent("""
        import os, time, torch
        from devmesh import init_device_mesh
        from devmesh.distributed import comm
        # every rank started (on a loaded machine that takes more than 3 s); then the mesh
        # whose collectives wait 3 s
        init_device_mesh("cpu", (3,), mesh_dim_names=("start",))
        mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("dp",), timeout=3)
        if os.environ["RANK"] == "2":
            time.sleep(120)
        comm.all_reduce(torch.ones(2), mesh, (0,))
    """))
    start = time.monotonic()
    proc = _devmesh("run", "-n", "3", str(script))
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "ranks [2] never entered it" in output, "\n".join(
        line for line in output.splitlines() if "devmesh" in line or "Error" in line)[-6000:]
    # named, and the run stopped, long before the hung rank would wake (starting three
    # ranks took 43 s of this on a loaded 2-core machine)
    assert time.monotonic() - start < 80


def a_pipeline_stage_hangs_in_its_forward(folder: str, shape: tuple[int, ...] = (4,)):
    """4 ranks: 4 pipeline ranks, or 2 pipelines of 2 (``shape`` (2, 2): ``(pp, dp)``),
    1F1B; rank 2's forward sticks in its second step for longer than the others' 3 s timeout
    and their reports. Returns each rank's error."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from devmesh import init_device_mesh
    from devmesh.layout.schedule import build_schedule
    from devmesh.parallel.pipeline import PipelineRunner

    class Stuck(nn.Linear):
        calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls == 6:  # the second step's second micro-batch: until all reported
                stay_away_until_reported(folder, (0, 1, 3))
            return super().forward(x)

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp")[:len(shape)], timeout=3)
    me, pp = mesh.get_coordinate()[0], shape[0]
    stage = Stuck(8, 8) if mesh.get_rank() == 2 else nn.Linear(8, 8)
    runner = PipelineRunner({me: stage}, mesh, build_schedule("1f1b", pp, 4), F.mse_loss)
    x = torch.randn(8, 8)
    try:
        for _ in range(3):
            runner.step(x if me == 0 else None, x if me == pp - 1 else None)
    except RuntimeError as exc:
        return type(exc).__name__, getattr(exc, "missing", None), str(exc)
    finally:
        reported(folder, mesh.get_rank())
    return None


def test_a_pipeline_stage_stuck_in_its_code_is_named_by_every_other_rank(mesh_pool, tmp_path):
    """Before, every rank of a pipeline whose stage hung raised torch's bare 'Timed out
    waiting 3000ms for recv' (the stage's neighbours and the ranks waiting on them down the
    chain alike); now each names the stuck rank, whichever message it waited for."""
    results = mesh_pool.run(a_pipeline_stage_hangs_in_its_forward, 4, str(tmp_path), timeout=90)
    for rank in (0, 1, 3):
        kind, missing, text = results[rank]
        assert kind == "CollectiveTimeoutError" and missing == [2], text
        assert "pipeline step over pp" in text and "ranks [2] never timed out waiting for " \
            "a message — they are stuck in their own code" in text, text
    assert results[2] is not None  # the stuck rank fails too, once it wakes: no one is left
    assert mesh_pool.run(lambda: 5, 4) == [5, 5, 5, 5]


def test_a_stuck_rank_is_named_by_the_other_pipelines_too(mesh_pool, tmp_path):
    """Two pipelines of two ranks, ``(pp, dp) = (2, 2)``, rank 2 stuck: its pipeline's other
    rank names it, as above; the other pipeline's ranks, done with their step, wait in the
    end-of-step failure flag, which spans the mesh (a stage's copies must hear of each
    other's failures), and name the ranks that never reached it."""
    results = mesh_pool.run(a_pipeline_stage_hangs_in_its_forward, 4, str(tmp_path), (2, 2),
                            timeout=90)
    kind, missing, text = results[0]
    assert kind == "CollectiveTimeoutError" and missing == [2], text
    assert "ranks [2] never timed out waiting for a message" in text, text
    for rank in (1, 3):
        kind, missing, text = results[rank]
        assert kind == "CollectiveTimeoutError" and missing == [0, 2], text
        assert "pipeline step's end over pp+dp" in text and "ranks [0, 2] never reached the " \
            "end of the step — they are stuck in their own code" in text, text
    assert mesh_pool.run(lambda: 5, 4) == [5, 5, 5, 5]


def test_devmesh_run_takes_a_module_a_log_dir_and_a_ranks_filter(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    # rank 1 fails once rank 0 has printed: the launcher then stops rank 0, which on a
    # loaded machine might otherwise not have started printing yet
    (package / "train.py").write_text(
        "import os, sys, time\nprint('rank', os.environ['RANK'], sys.argv[1:], flush=True)\n"
        f"marker = {str(tmp_path / 'printed')!r}\n"
        "if os.environ['RANK'] == '0':\n    open(marker, 'w').close()\n"
        "if os.environ['RANK'] == '1':\n"
        "    deadline = time.monotonic() + 120\n"
        "    while not os.path.exists(marker) and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n"
        "    raise SystemExit(3)\n")
    proc = _devmesh("run", "-n", "2", "--log-dir", str(tmp_path / "logs"),
                    "--local-ranks-filter", "0", "-m", "pkg.train", "--lr", "3", cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "rank 0 ['--lr', '3']" in proc.stdout and "rank 1" not in proc.stdout
    # the summary names the user's module, not devmesh's rank wrapper
    assert "pkg.train FAILED" in proc.stderr and "devmesh.launching.child" not in proc.stderr
    logged = sorted(p.read_text() for p in (tmp_path / "logs").rglob("stdout.log"))
    assert logged == ["rank 0 ['--lr', '3']\n", "rank 1 ['--lr', '3']\n"]
    (run,) = (tmp_path / "logs").iterdir()  # and the run's last line says where they are
    assert (f"devmesh run: each rank's output is under {run}: attempt_0 (one per start), "
            "each LOCAL_RANK/stdout.log and stderr.log") in proc.stderr


@pytest.mark.parametrize("whole_group", [False, True])
def test_ctrl_c_stops_every_rank_and_exits_130(tmp_path, whole_group):
    """SIGINT to the launcher alone, or to its whole process group as a terminal's Ctrl-C
    sends it: every rank says where it was in one line, without a traceback."""
    import signal
    import time

    script = tmp_path / "sleepy.py"
    # "ready" and the sleep on one line: the signal can come as soon as "ready" is written,
    # before the rank has reached a later line, and either way it is at line 2
    script.write_text("import os, time\n"
                      "print('ready', os.environ['RANK'], flush=True); time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-m", "devmesh", "run", "-n", "2", str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=whole_group)
    # each rank's own "ready" line: under load the launcher's output may hold other lines
    # with the word in them ("address already in use" while a port is retried)
    ready, before, deadline = set(), [], time.monotonic() + 120
    while ready != {0, 1} and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:  # the launcher ended
            break
        before.append(line)
        found = re.fullmatch(r"\[rank(\d)\]:ready (\d)", line.strip())
        if found and found.group(1) == found.group(2):
            ready.add(int(found.group(1)))
    assert ready == {0, 1}, "".join(before)[-2000:]
    if whole_group:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out[-2000:]
    assert "stopped by SIGINT" in out
    if whole_group:
        assert "Traceback" not in out and "death signal" not in out, out
        shown = "".join(before) + "--- after SIGINT:\n" + out
        assert "[rank0]:interrupted at sleepy.py:2" in out, shown[-3000:]
        assert "[rank1]:interrupted at sleepy.py:2" in out, shown[-3000:]
    left = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True).stdout
    assert not left.strip()


@pytest.mark.parametrize("folder", ["", "devmesh"])  # a user's folder may be named devmesh
def test_a_failure_is_summarised_once_naming_the_first_rank_and_the_script(tmp_path, folder):
    (tmp_path / folder).mkdir(exist_ok=True)
    script = tmp_path / folder / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        from devmesh import init_device_mesh

        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))


        def step(batch):
            if mesh.get_rank() == 1:
                raise ValueError("a bad batch on rank 1")
            return batch.sum()


        step(torch.ones(2))
        torch.distributed.barrier()
    """))
    proc = _devmesh("run", "-n", "4", str(script))
    assert proc.returncode == 1
    err = proc.stderr
    assert f"devmesh run: rank 1 of 4 failed first, running {script}:" in err, err[-3000:]
    assert 'train.py", line 10, in step' in err
    assert "ValueError: a bad batch on rank 1" in err
    # the launcher's and runpy's frames are hidden, and the traceback is printed once
    assert "runpy" not in err and "devmesh/launching" not in err and "child.py" not in err
    assert err.count("Traceback (most recent call last)") == 1
    for rank in (0, 2, 3):
        assert (f"  rank {rank}: at train.py:15: lost its peers (a collective broke off or "
                "timed out after rank 1 failed)") in err
    assert "devmesh.launching.child FAILED" not in err


def test_each_line_of_every_rank_reaches_the_console_whole_with_its_rank(tmp_path):
    """print with several arguments writes them in pieces; the console still gets each line
    whole, prefixed with the rank that printed it, and no line of one rank inside another's."""
    script = tmp_path / "chatty.py"
    script.write_text(textwrap.dedent("""
        import os
        rank = int(os.environ["RANK"])
        for i in range(300):
            print("line", rank, i, "of", "a", "chatty", "rank")
    """))
    proc = _devmesh("run", "-n", "2", str(script))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for line in lines:
        match = re.fullmatch(r"\[rank(\d)\]:line (\d) (\d+) of a chatty rank", line)
        assert match and match[1] == match[2], line
    assert sorted(lines) == sorted(f"[rank{r}]:line {r} {i} of a chatty rank"
                                   for r in (0, 1) for i in range(300))


def test_the_summary_says_which_ranks_had_finished(tmp_path):
    from devmesh.launching.reports import summary

    folder = tmp_path / "reports"
    folder.mkdir()
    (folder / "rank1.json").write_text(json.dumps({
        "rank": 1, "world": 3, "attempt": 0, "time": 1.0, "consequence": False,
        "where": "train.py:9", "exception": "ValueError: bad", "traceback": "Traceback ...\n"}))
    told = summary(str(folder), "train.py", {1: 1, 2: -15}, ranks=3)
    assert "rank 1 of 3 failed first, running train.py" in told
    assert "  rank 0: had finished (exit code 0)" in told
    assert "  rank 2: stopped by signal 15 after rank 1 failed" in told


def test_the_summary_of_a_second_host_names_its_ranks_globally(tmp_path):
    """On host 1 of 2 x 4 ranks, the ranks started there are 4..7: the failing one and the
    others are named by their global ranks, and no rank of host 0 is said to have finished."""
    from devmesh.launching.reports import summary

    folder = tmp_path / "reports"
    folder.mkdir()
    (folder / "rank6.json").write_text(json.dumps({
        "rank": 6, "world": 8, "attempt": 0, "time": 1.0, "consequence": False,
        "where": "train.py:9", "exception": "ValueError: bad", "traceback": "Traceback ...\n"}))
    told = summary(str(folder), "train.py", {6: 1, 7: -15}, ranks=range(4, 8))
    assert "rank 6 of 8 failed first" in told
    assert "  rank 4: had finished (exit code 0)" in told
    assert "  rank 5: had finished (exit code 0)" in told
    assert "  rank 7: stopped by signal 15 after rank 6 failed" in told
    assert "rank 0" not in told and "rank 3" not in told
