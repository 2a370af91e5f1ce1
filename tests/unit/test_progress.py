"""Progress off a terminal: plain lines at most every DEVMESH_PROGRESS_SECONDS, none for work
shorter than that, and the checkpoint's save and load reporting their bytes."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from devmesh._progress import Progress, bytes_text


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = _Clock()
    monkeypatch.setattr("devmesh._progress.time.monotonic", fake)
    return fake


def test_off_a_terminal_a_plain_line_every_interval(monkeypatch, clock):
    monkeypatch.setenv("DEVMESH_PROGRESS_SECONDS", "5")
    out = io.StringIO()
    with Progress("training", 10, stream=out, unit="steps") as progress:
        for _ in range(10):
            clock.now += 2
            progress.advance()
    lines = out.getvalue().splitlines()
    # after 6 s (3 steps), 12 s (6 steps), 18 s (9 steps), then the end
    assert lines == ["training: 3 of 10 steps (30%), 6 s, about 14 s left",
                     "training: 6 of 10 steps (60%), 12 s, about 8 s left",
                     "training: 9 of 10 steps (90%), 18 s, about 2 s left",
                     "training: 10 of 10 steps (100%), 20 s"]


def test_work_shorter_than_the_interval_prints_nothing(monkeypatch, clock):
    monkeypatch.setenv("DEVMESH_PROGRESS_SECONDS", "5")
    out = io.StringIO()
    with Progress("checkpoint save", 4 << 20, stream=out, bar=False,
                  amount=bytes_text) as progress:
        clock.now += 4
        progress.advance(4 << 20)
    assert out.getvalue() == ""


@pytest.mark.parametrize("show, seconds", [(False, "1"), (True, "0")])
def test_a_rank_that_does_not_report_or_zero_seconds_prints_no_progress(monkeypatch, clock,
                                                                         show, seconds):
    monkeypatch.setenv("DEVMESH_PROGRESS_SECONDS", seconds)
    out = io.StringIO()
    with Progress("training", 3, stream=out, show=show) as progress:
        for _ in range(3):
            clock.now += 10
            progress.advance()
        progress.print("epoch 1: loss 0.1")
    assert out.getvalue() == ("epoch 1: loss 0.1\n" if show else "")


@pytest.mark.parametrize("value", ["soon", "-1"])
def test_a_bad_interval_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("DEVMESH_PROGRESS_SECONDS", value)
    with pytest.raises(ValueError, match="DEVMESH_PROGRESS_SECONDS"):
        Progress("training", 3, stream=io.StringIO())


def test_bytes_read_as_people_read_them():
    assert [bytes_text(n) for n in (512, 1536, 5 << 20, 3 << 30)] == [
        "512 B", "1.5 KiB", "5.0 MiB", "3.0 GiB"]


def test_checkpoint_save_and_load_report_their_bytes(tmp_path, monkeypatch, capsys):
    from devmesh.parallel import load_checkpoint, save_checkpoint

    monkeypatch.setenv("DEVMESH_PROGRESS_SECONDS", "1e-9")  # every block
    model = nn.Linear(256, 256)
    save_checkpoint(str(tmp_path / "ckpt"), model).wait()
    saved = capsys.readouterr().err
    assert "checkpoint save (rank 0's blocks): 257.0 KiB of 257.0 KiB (100%)" in saved
    other = nn.Linear(256, 256)
    load_checkpoint(str(tmp_path / "ckpt"), other)
    loaded = capsys.readouterr().err
    assert "checkpoint load (rank 0's blocks): 256.0 KiB of 257.0 KiB" in loaded
    assert torch.equal(other.weight, model.weight)


