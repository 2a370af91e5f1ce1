"""The replica groups' all-reduce across groups in the collective recorder's records: one
record a round, ``done``, or ``failed`` when a member broke the round off."""

from __future__ import annotations

import pytest
import torch

from devmesh.distributed import trace
from devmesh.fault.replicas import _average


class _Members:
    """A process group of the member groups whose all-reduces finish, or break off."""

    def __init__(self, broken: bool) -> None:
        self.broken = broken

    def allreduce(self, tensors):
        broken = self.broken

        class Work:
            def wait(self) -> None:
                if broken:
                    raise RuntimeError("Connection closed by peer")

        return Work()


@pytest.fixture
def recorder():
    was = trace.installed()
    trace.install()
    yield
    if not was:
        trace.uninstall()


@pytest.mark.parametrize("broken, state", [(False, "done"), (True, "failed")])
def test_a_round_across_the_groups_is_one_record(recorder, broken, state):
    grads = [torch.ones(3, dtype=torch.float64), torch.ones(2, 2, dtype=torch.float64)]
    before = len([r for r in trace.records() if r.op == "all_reduce across replica groups"])
    if broken:
        with pytest.raises(RuntimeError, match="closed by peer"):
            _average(grads, _Members(broken), True, 2)
    else:
        averaged = _average(grads, _Members(broken), True, 2)
        assert torch.equal(averaged[0], torch.full((3,), 0.5, dtype=torch.float64))
    mine = [r for r in trace.records() if r.op == "all_reduce across replica groups"]
    assert len(mine) == before + 1
    assert (mine[-1].state, mine[-1].shapes, mine[-1].group) == (
        state, "2 tensors, 56 bytes", ())


def test_nothing_is_recorded_with_the_recorder_off():
    assert not trace.installed()
    assert trace.note("all_reduce across replica groups", "1 tensors, 8 bytes") is None
