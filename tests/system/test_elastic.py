"""Elastic restart (issue 10, item 5): a rank killed mid-training under
``devmesh run --max-restarts`` (torchrun underneath) restarts every rank, which resume from the
last complete checkpoint with the losses of a run never interrupted, bit for bit; the same
checkpoint resumes on a smaller world (8 -> 4 ranks) with the losses of one plain process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "examples", "elastic_training.py")


def _train(tmp_path, name: str, n: int, *extra: str, ckpt: str | None = None) -> dict[int, str]:
    """Run the example on ``n`` ranks (1: a plain process); the last loss logged per step,
    as text (repr), so equality is bit for bit."""
    ckpt = ckpt or str(tmp_path / f"{name}-ckpt")
    losses = tmp_path / f"{name}.log"
    args = ["--ckpt", ckpt, "--losses", str(losses), *extra]
    command = ([sys.executable, SCRIPT, *args] if n == 1 else
               [sys.executable, "-m", "devmesh", "run", "-n", str(n), "--max-restarts", "3",
                SCRIPT, *args])
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _train.stderr = proc.stderr  # why a run restarted when none should have
    steps: dict[int, str] = {}
    lines = losses.read_text().split("\n")
    for line in filter(None, lines):
        step, loss = line.split()
        # a step run again after a restart gives the same loss, bit for bit
        assert steps.setdefault(int(step), loss) == loss, (step, steps[int(step)], loss)
    return steps, [int(line.split()[0]) for line in filter(None, lines)]


def test_a_killed_rank_restarts_and_resumes_bit_for_bit(tmp_path):
    uninterrupted, _ = _train(tmp_path, "whole", 8)
    resumed, order = _train(tmp_path, "killed", 8, "--kill-at", "5")
    # died at 5, resumed from 3 (the launcher's log says why, if it restarted elsewhere)
    assert order[:5] == [0, 1, 2, 3, 4] and order[5] == 3, (order, _train.stderr[-3000:])
    assert resumed == uninterrupted
    # the checkpoint of step 6 (HSDP (2, 4) on 8 ranks) on a smaller world (HSDP (2, 2) on 4
    # ranks) and in one plain process: the same losses for the steps after it
    smaller, plain = str(tmp_path / "smaller"), str(tmp_path / "plain")
    shutil.copytree(tmp_path / "killed-ckpt", smaller)
    shutil.copytree(tmp_path / "killed-ckpt", plain)
    on_four, order = _train(tmp_path, "four", 4, "--steps", "10", ckpt=smaller)
    # from step 6 to the end, in order. A run may go on past that: torch's gloo sometimes
    # aborts in the interpreter's C++ teardown after the script finished ("terminate called
    # without an active exception", no Python frame; about 1 run in 7 of this 4-rank job
    # here, as in pytorch#190489), torchrun restarts the job, and it resumes from the last
    # checkpoint and runs step 9 again (with the same loss, checked above)
    assert order[:4] == [6, 7, 8, 9] and set(order) == {6, 7, 8, 9}, _train.stderr[-3000:]
    alone, _ = _train(tmp_path, "alone", 1, "--steps", "10", ckpt=plain)
    values = {k: float(v) for k, v in on_four.items()}
    assert values == pytest.approx({k: float(v) for k, v in alone.items()}, rel=1e-6)
    assert [values[6], values[7]] == pytest.approx([float(uninterrupted[6]),
                                                    float(uninterrupted[7])], rel=1e-6)
