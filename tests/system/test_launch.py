"""The worker pool and devmesh.launch: results, remote errors, hangs, recovery, cleanup."""

from __future__ import annotations

import os
import time

import pytest

import devmesh
from devmesh.errors import RankFailedError, RankTimeoutError
from helpers import all_gone, alive


def whoami(offset):
    return int(os.environ["RANK"]) + offset, int(os.environ["WORLD_SIZE"]), os.getpid()


def fail_on_rank_two():
    if os.environ["RANK"] == "2":
        raise ValueError("bad batch on this rank")
    return "ok"


def fail_then_hang_others():
    import torch
    import torch.distributed as dist

    from devmesh import init_device_mesh

    mesh = init_device_mesh("cpu", (3,))
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 gives up")
    dist.all_reduce(torch.ones(1), group=mesh.get_group())  # waits for rank 1 forever
    return "unreachable"


def hang_forever_on_rank_one():
    if os.environ["RANK"] == "1":
        while True:
            time.sleep(0.05)
    return "done"


def test_results_in_rank_order_and_workers_reused(mesh_pool):
    first = mesh_pool.run(whoami, 4, 10)
    assert [r[:2] for r in first] == [(10, 4), (11, 4), (12, 4), (13, 4)]
    second = mesh_pool.run(whoami, 4, 0)
    assert [r[2] for r in first] == [r[2] for r in second]  # same processes


def test_remote_exception_names_rank_and_traceback(mesh_pool):
    with pytest.raises(RankFailedError) as info:
        mesh_pool.run(fail_on_rank_two, 4)
    assert info.value.rank == 2
    assert "rank 2 of 4 raised ValueError: bad batch on this rank" in str(info.value)
    assert "fail_on_rank_two" in info.value.remote_traceback
    assert mesh_pool.run(whoami, 4, 0)[2][0] == 2  # pool still healthy


def test_failure_while_others_wait_in_a_collective(mesh_pool):
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 of 3 raised RuntimeError: rank 1 gives up") as info:
        mesh_pool.run(fail_then_hang_others, 3, timeout=60)
    assert time.monotonic() - start < 60
    # the others' errors, when they come, are listed as consequences — never the cause itself
    first_line = str(info.value).splitlines()[0]
    assert "[1," not in first_line and "[1]" not in first_line, first_line
    assert [r[0] for r in mesh_pool.run(whoami, 3, 0)] == [0, 1, 2]


def test_hang_is_reported_with_stack_and_pool_recovers(mesh_pool):
    pids = [r[2] for r in mesh_pool.run(whoami, 2, 0)]
    with pytest.raises(RankTimeoutError) as info:
        mesh_pool.run(hang_forever_on_rank_one, 2, timeout=3)
    assert info.value.ranks == [1]
    assert "hang_forever_on_rank_one" in info.value.stacks[1]
    after = mesh_pool.run(whoami, 2, 0)
    assert after[0][2] == pids[0] and after[1][2] != pids[1]  # only the hung worker replaced


def test_launch_runs_a_lambda_and_leaves_no_process():
    results = devmesh.launch(lambda base: (base + int(os.environ["RANK"]), os.getpid()), 2, 100)
    assert [r[0] for r in results] == [100, 101]
    for _, pid in results:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_workers_are_forked_from_one_process_that_imported_torch():
    """A pool's workers (and those that replace broken ones) are children of one zygote that
    imported torch before forking them; the zygote going away takes its workers with it, and
    the pool starts a new one for its next task; closing the pool leaves neither behind."""
    with devmesh.WorkerPool(3, preload=["xml.dom.minidom"]) as pool:
        zygote = pool._zygote.process.pid
        seen = pool.run(lambda: (os.getppid(), "torch" in __import__("sys").modules,
                                 "xml.dom.minidom" in __import__("sys").modules), 3)
        assert seen == [(zygote, True, True)] * 3  # torch and the preloaded module, inherited
        replaced = pool._workers[1].process.pid
        pool._replace([1])
        assert not alive(replaced)
        assert pool.run(os.getppid, 3) == [zygote] * 3
        workers = [w.process.pid for w in pool._workers]
        os.kill(zygote, 9)
        assert all_gone(workers, within=15)
        assert [w.process.wait(timeout=15) for w in pool._workers] == [-9] * 3
        again = pool.run(os.getppid, 3)
        assert again == [pool._zygote.process.pid] * 3 and again[0] != zygote
        last = [pool._zygote.process.pid] + [w.process.pid for w in pool._workers]
    assert all_gone(last, within=15)


def test_bad_world_size_is_refused(mesh_pool):
    with pytest.raises(ValueError, match="between 1 and the pool size"):
        mesh_pool.run(whoami, 0, 0)


def uses_groups_of_every_dim():
    import torch

    from devmesh import init_device_mesh
    from devmesh.distributed import comm

    from devmesh.parallel import fully_shard, replicate

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for dims in ((0,), (1,), (0, 1), (1, 0)):
        comm.all_reduce(torch.ones(2), mesh, dims)
    # models under replicate / fully_shard, trained a step with an optimizer, then dropped
    for parallelize in (replicate, fully_shard):
        model = parallelize(torch.nn.Linear(4, 4), mesh=mesh["dp"])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    # torch's DTensor ops on a sub-mesh: its caches keyed by mesh (redistribution planners,
    # mesh topologies) held each task's meshes, and with them their groups
    from torch.distributed.tensor import Shard, distribute_tensor

    t = distribute_tensor(torch.randn(8, 8), mesh["tp"], [Shard(0)])
    (t @ t.T).full_tensor()


def gloo_threads() -> int:
    tasks = f"/proc/{os.getpid()}/task"
    return sum("gloo" in open(f"{tasks}/{t}/comm").read() for t in os.listdir(tasks))


def test_a_task_leaves_no_process_group_behind():
    """Each task's groups (and their gloo threads and sockets) go with its world: devmesh
    kept a module-level cache of groups, so every task left a few threads behind — hundreds
    per worker by the end of the suite; and replicate's gradient hooks (held by the tensors,
    out of the garbage collector's sight) kept every replicated model and its groups.
    Fresh workers: the shared pool's may still hold the thread of a collective an earlier
    test let time out on purpose (gloo cannot cancel it), which is not what this measures."""
    from devmesh.launching.launcher import WorkerPool

    with WorkerPool(4) as pool:
        assert pool.run(gloo_threads, 4) == [0, 0, 0, 0]
        for _ in range(3):
            pool.run(uses_groups_of_every_dim, 4)
        assert pool.run(gloo_threads, 4) == [0, 0, 0, 0]


def test_more_ranks_than_the_machine_holds_are_refused_before_anything_starts(tmp_path,
                                                                               monkeypatch):
    import subprocess
    import sys

    from devmesh.errors import LaunchCapacityError
    from devmesh.launching import capacity

    started = tmp_path / "started"
    script = tmp_path / "script.py"
    script.write_text(f"open({str(started)!r}, 'a').write('x')\n")
    monkeypatch.delenv(capacity.OVERSUBSCRIBE_VARIABLE, raising=False)
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "devmesh", "run", "-n", "999", str(script)],
                          capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items()
                               if k != capacity.OVERSUBSCRIBE_VARIABLE})
    assert proc.returncode != 0
    assert "devmesh run: -n 999: 999 local ranks need at least" in proc.stderr, proc.stderr
    assert "GiB available" in proc.stderr and "--oversubscribe" in proc.stderr
    assert not started.exists()  # no rank ran
    assert time.monotonic() - began < 60
    # the same for devmesh.launch and the pool, before any process starts
    with pytest.raises(LaunchCapacityError, match="oversubscribe=True"):
        devmesh.launch(whoami, 999, 0)
    # a footprint of one's own: two ranks of 10 TiB each do not fit
    monkeypatch.setenv(capacity.RANK_MEMORY_VARIABLE, "10240GB")
    with pytest.raises(LaunchCapacityError, match="2 local ranks need at least 20480.0 GiB"):
        devmesh.launch(whoami, 2, 0)
    # cores: many small ranks still need a share of a core each
    monkeypatch.setenv(capacity.RANK_MEMORY_VARIABLE, "1KB")
    cores = len(os.sched_getaffinity(0))
    too_many = capacity.RANKS_PER_CORE * cores + 1
    with pytest.raises(LaunchCapacityError, match=f"{too_many} local ranks on {cores} core"):
        capacity.check_local_ranks(too_many, what="test")
    monkeypatch.setenv(capacity.OVERSUBSCRIBE_VARIABLE, "1")  # lifted: nothing raises
    monkeypatch.setenv(capacity.RANK_MEMORY_VARIABLE, "10240GB")
    capacity.check_local_ranks(too_many, what="test")


def test_a_rank_killed_while_the_oom_counter_moved_is_named_as_out_of_memory(monkeypatch):
    from devmesh.launching import capacity, launcher

    monkeypatch.setattr(capacity, "oom_kills", lambda: 4)
    assert "out-of-memory killer" in launcher._death(-9, 3)
    assert "out-of-memory killer" not in launcher._death(-9, 4)
    assert "SIGKILL" in launcher._death(-9, 4)
    assert "out-of-memory" not in launcher._death(-15, 3)


def test_workers_that_start_too_slowly_say_what_to_set(monkeypatch):
    from devmesh.errors import WorkerStartError
    from devmesh.launching import capacity

    monkeypatch.setenv(capacity.START_TIMEOUT_VARIABLE, "0.2")
    before = {p for p in _children() if "devmesh.launching._zygote" in p}  # the shared pool's
    with pytest.raises(WorkerStartError) as caught:
        devmesh.launch(whoami, 2, 0)
    text = str(caught.value)
    assert "within 0.2 s" in text and "load average" in text, text
    assert "DEVMESH_START_TIMEOUT=600" in text
    monkeypatch.setenv(capacity.START_TIMEOUT_VARIABLE, "soon")
    with pytest.raises(devmesh.errors.LaunchCapacityError, match="not a positive number"):
        capacity.start_timeout(2)
    monkeypatch.delenv(capacity.START_TIMEOUT_VARIABLE)
    # the default grows with the ranks
    assert capacity.start_timeout(16) > capacity.start_timeout(2) >= 70
    # the pool that failed to start left none of its workers behind
    assert {p for p in _children() if "devmesh.launching._zygote" in p} <= before


def _children() -> list[str]:
    """The command lines of this process's living children."""
    import subprocess

    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(os.getpid())],
                         capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.strip()]


def test_a_pool_that_cannot_import_torch_says_why(monkeypatch, tmp_path, capfd):
    """The workers' imports fail in the process they are forked from (here a stand-in torch
    that raises, as an unsupported torch raises TorchVersionError): the pool's error carries
    that error's text, not only an exit code."""
    from devmesh.errors import WorkerStartError

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        "raise ImportError('this torch is broken (a test stand-in)')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # ahead of site-packages in the zygote
    before = {p for p in _children() if "devmesh.launching._zygote" in p}
    with pytest.raises(WorkerStartError) as caught:
        devmesh.launch(whoami, 2, 0)
    text = str(caught.value)
    assert "could not start" in text and "failed to import what they need" in text, text
    assert "ImportError: this torch is broken (a test stand-in)" in text, text
    assert {p for p in _children() if "devmesh.launching._zygote" in p} <= before
    capfd.readouterr()  # the zygote's own traceback went to the terminal


def test_a_module_to_preload_that_cannot_be_imported_is_named(capfd):
    from devmesh.errors import WorkerStartError

    with pytest.raises(ValueError, match="a sequence of module names"):
        devmesh.WorkerPool(1, preload="devmesh.parallel")  # a string, not a list of names
    with pytest.raises(WorkerStartError) as caught:
        devmesh.WorkerPool(1, preload=["devmesh.no_such_module"])
    assert "No module named 'devmesh.no_such_module'" in str(caught.value), caught.value
    capfd.readouterr()  # the zygote's own traceback went to the terminal
