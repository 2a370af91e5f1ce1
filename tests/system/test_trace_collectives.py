"""The opt-in collective recorder (``devmesh run --trace-collectives``): when a collective
fails because the ranks diverged, the error names the rank that went elsewhere, the
operation and both source lines — for collectives devmesh does not issue (the user's own
``dist.all_reduce``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from devmesh.distributed.trace import Record, compare

# rank 1 skips the second all_reduce of step 1: from its 4th collective on, the ranks pair
# different lines, and rank 0's 6th waits for a collective rank 1 never calls
_SKIPS_ONE = textwrap.dedent("""
    import datetime, os, pathlib, time
    import torch
    import torch.distributed as dist
    pathlib.Path(f"started{{os.environ['RANK']}}").touch()  # a short timeout starts together
    while not all(pathlib.Path(f"started{{r}}").exists() for r in (0, 1)): time.sleep(0.05)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))  # < the sleep
    rank = dist.get_rank()
    x = torch.ones(4)
    for step in range(3):
        dist.all_reduce(x)  # line 12
        if not (rank == 1 and step == 1):
            dist.all_reduce(x)  # line 14
    if rank == 1 and {rank_1_stays}:
        time.sleep(30)  # alive, elsewhere in its code
""")


@pytest.mark.parametrize("rank_1_stays", [False, True], ids=["rank-1-exits", "rank-1-elsewhere"])
def test_a_skipped_all_reduce_names_the_rank_and_both_lines(tmp_path, rank_1_stays):
    script = tmp_path / "train.py"
    script.write_text(_SKIPS_ONE.format(rank_1_stays=rank_1_stays))
    done = subprocess.run([sys.executable, "-m", "devmesh", "run", "-n", "2",
                           "--trace-collectives", str(script)],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "CollectiveTimeoutError" in out and "all_reduce #6 over ranks [0, 1] at train.py:14" \
        in out, out[-4000:]
    assert ("ranks [0, 1] diverged at collective #4: rank 0 called all_reduce at train.py:14 "
            "((4,) float32); rank 1 called all_reduce at train.py:12 ((4,) float32)") in out
    assert "rank 0 waits in all_reduce #6 at train.py:14" in out
    where = "it exited" if not rank_1_stays else "it is elsewhere in its code"
    assert (f"rank 1 never called #6 on ranks [0, 1] (its last there: #5, all_reduce at "
            f"train.py:14; {where})") in out, out[-4000:]


def test_without_the_flag_nothing_is_recorded(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SKIPS_ONE.format(rank_1_stays=False))
    done = subprocess.run([sys.executable, "-m", "devmesh", "run", "-n", "2", str(script)],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode != 0
    assert "diverged" not in done.stdout + done.stderr


def _post(rank, calls, exited=False):
    return {"rank": rank, "exited": exited, "records": [
        dict(op=op, group=[0, 1, 2], seq=i + 1, shapes="(2,) float32", where=where,
             state=state) for i, (op, where, state) in enumerate(calls)]}


def test_the_comparison_finds_the_first_difference_and_who_never_came():
    same = [("all_reduce", "a.py:1", "done"), ("broadcast", "a.py:2", "done")]
    posted = {0: _post(0, same + [("all_reduce", "a.py:3", "running")]),
              1: _post(1, same[:1] + [("all_gather", "a.py:9", "done")], exited=True)}
    failed = Record("all_reduce", (0, 1, 2), 3, "(2,) float32", "a.py:3")
    report, missing = compare(posted, failed)
    assert missing == [1, 2]
    lines = report.splitlines()
    assert lines[0] == ("ranks [0, 1, 2] diverged at collective #2: rank 0 called broadcast "
                        "at a.py:2 ((2,) float32); rank 1 called all_gather at a.py:9 "
                        "((2,) float32)")
    assert "rank 0 waits in all_reduce #3 at a.py:3" in lines[1]
    assert "rank 1 never called #3" in lines[2] and "it exited" in lines[2]
    assert lines[3] == "rank 2 did not answer (stuck in native code, or gone)"


_DTENSOR_ON_ONE_RANK = textwrap.dedent("""
    import datetime, os, pathlib, time
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor
    from devmesh import init_device_mesh
    pathlib.Path(f"started{os.environ['RANK']}").touch()  # a short timeout starts together
    while not all(pathlib.Path(f"started{r}").exists() for r in (0, 1)): time.sleep(0.05)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))  # < the sleep
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    w = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    full = w.full_tensor()  # line 13: both ranks
    if dist.get_rank() == 0:
        again = w.full_tensor()  # line 15: rank 0 alone
    time.sleep(20)
""")


def test_a_dtensor_collective_on_one_rank_is_named_too(tmp_path):
    """torch's DTensor communicates through functional collectives: recorded and compared
    alike (their timeout surfaces inside the call here, or at the tensor's wait)."""
    script = tmp_path / "train.py"
    script.write_text(_DTENSOR_ON_ONE_RANK)
    done = subprocess.run([sys.executable, "-m", "devmesh", "run", "-n", "2",
                           "--trace-collectives", str(script)],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "CollectiveTimeoutError" in out, out[-3000:]
    waits = [line for line in out.splitlines() if line.startswith("rank 0 waits in all_gather")]
    assert waits and waits[0].split(" at ")[1].startswith("train.py:15"), out[-3000:]
    never = [line for line in out.splitlines() if line.startswith("rank 1 never called")]
    assert never and "all_gather" in never[0] and "train.py:13" in never[0], out[-3000:]
