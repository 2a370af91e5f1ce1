"""Elastic restart (issue 10, item 5): a rank killed mid-training under
``devmesh run --max-restarts`` (torchrun underneath) restarts every rank, which resume from the
last complete checkpoint with the losses of a run never interrupted, bit for bit; the same
checkpoint resumes on a smaller world (4 -> 2 ranks: HSDP to DDP) with the losses of one plain
process.

Only the run that is killed needs the launcher (its restart is what is tested); the runs it is
compared with run the same script on the test's worker pool, which launches ranks the way the
launcher does (one thread each, the same environment variables), so they give the same
numbers without paying for fresh processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from helpers import run_script

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "examples", "elastic_training.py")


def _train(tmp_path, name: str, n: int, *extra: str, ckpt: str | None = None,
           pool=None) -> dict[int, str]:
    """Run the example on ``n`` ranks (1: a plain process), under ``devmesh run
    --max-restarts 3`` or, given ``pool``, on it; the last loss logged per step, as text
    (repr), so equality is bit for bit."""
    ckpt = ckpt or str(tmp_path / f"{name}-ckpt")
    losses = tmp_path / f"{name}.log"
    args = ["--ckpt", ckpt, "--losses", str(losses), *extra]
    if pool is not None:
        pool.run(run_script, n, SCRIPT, args, timeout=300)
    else:
        proc = subprocess.run([sys.executable, "-m", "devmesh", "run", "-n", str(n),
                               "--max-restarts", "3", SCRIPT, *args],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        _train.stderr = proc.stderr  # why a run restarted when none should have
    steps: dict[int, str] = {}
    lines = losses.read_text().split("\n")
    for line in filter(None, lines):
        step, loss = line.split()
        # a step run again after a restart gives the same loss, bit for bit
        assert steps.setdefault(int(step), loss) == loss, (step, steps[int(step)], loss)
    return steps, [int(line.split()[0]) for line in filter(None, lines)]


def test_a_killed_rank_restarts_and_resumes_bit_for_bit(tmp_path, mesh_pool):
    # 4 ranks: HSDP (2, 2), the smallest mesh that both replicates and shards (the 8 ranks of
    # HSDP x TP restart on two hosts in test_multihost); every fresh rank costs a torch import
    uninterrupted, _ = _train(tmp_path, "whole", 4, pool=mesh_pool)
    resumed, order = _train(tmp_path, "killed", 4, "--kill-at", "5")
    # died at 5, resumed from 3 (the launcher's log says why, if it restarted elsewhere)
    assert order[:5] == [0, 1, 2, 3, 4] and order[5] == 3, (order, _train.stderr[-3000:])
    assert resumed == uninterrupted
    # the checkpoint of step 6 (HSDP (2, 2) on 4 ranks) on a smaller world (DDP on 2 ranks)
    # and in one plain process: the same losses for the steps after it
    smaller, plain = str(tmp_path / "smaller"), str(tmp_path / "plain")
    shutil.copytree(tmp_path / "killed-ckpt", smaller)
    shutil.copytree(tmp_path / "killed-ckpt", plain)
    on_two, order = _train(tmp_path, "two", 2, "--steps", "10", ckpt=smaller, pool=mesh_pool)
    assert order == [6, 7, 8, 9]  # from step 6 to the end
    alone, _ = _train(tmp_path, "alone", 1, "--steps", "10", ckpt=plain, pool=mesh_pool)
    values = {k: float(v) for k, v in on_two.items()}
    assert values == pytest.approx({k: float(v) for k, v in alone.items()}, rel=1e-6)
    assert [values[6], values[7]] == pytest.approx([float(uninterrupted[6]),
                                                    float(uninterrupted[7])], rel=1e-6)
