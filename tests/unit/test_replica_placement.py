"""Which replica groups a host runs (``devmesh run --replica-groups G --groups I,J
--coordinator HOST:PORT``), and the refusals of what cannot be placed, each naming the fix."""

from __future__ import annotations

import pytest

from devmesh.tools.cli import build_parser
from devmesh.tools.cli.run_replicas import _groups_here


def _args(*flags: str):
    return build_parser().parse_args(["run", "-n", "1", *flags, "train.py"])


def test_a_host_runs_every_group_unless_told_which():
    assert _groups_here(_args("--replica-groups", "3")) == [0, 1, 2]
    assert _groups_here(_args("--replica-groups", "3", "--groups", "2,0",
                              "--coordinator", "10.0.0.1:29600")) == [0, 2]


@pytest.mark.parametrize("flags, says", [
    (("--groups", "0"), "runs 1 of the 3 groups here; the others' hosts reach the coordinator "
                        "at --coordinator HOST:PORT"),
    (("--groups", "0,0", "--coordinator", "h:1"), "each of the 3 groups is numbered 0..2, "
                                                  "given once"),
    (("--groups", "3", "--coordinator", "h:1"), "each of the 3 groups is numbered 0..2"),
    (("--groups", "one", "--coordinator", "h:1"), "give the groups this host runs as numbers "
                                                  "in 0..2 separated by commas"),
])
def test_groups_that_cannot_be_placed_are_refused_naming_the_fix(flags, says):
    with pytest.raises(SystemExit, match="devmesh run: --groups") as caught:
        _groups_here(_args("--replica-groups", "3", *flags))
    assert says in str(caught.value)


def test_placing_groups_without_replica_groups_is_refused():
    from devmesh.tools.cli.run import run

    with pytest.raises(SystemExit) as caught:
        run(_args("--groups", "0", "--coordinator", "10.0.0.1:29600"))
    assert str(caught.value) == ("devmesh run: --groups and --coordinator place replica "
                                 "groups on hosts: give --replica-groups G too")


def test_serving_the_coordinator_at_another_hosts_address_is_refused_at_once(monkeypatch):
    from devmesh.tools.cli.run_replicas import _serve_or_reach

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # what it sets stays in this test

    args = _args("--replica-groups", "2", "--groups", "0", "--coordinator", "10.99.99.99:29600",
                 "--local-addr", "127.0.0.1")
    with pytest.raises(SystemExit) as caught:
        _serve_or_reach(args, [0], 3.0)
    assert str(caught.value) == (
        "devmesh run: this host runs group 0, so it serves the coordinator at --coordinator "
        "10.99.99.99:29600, but 10.99.99.99 is not one of its addresses: give this host's "
        "own address (the other hosts give the same)")


def test_a_coordinator_address_that_is_not_host_and_port_is_refused(monkeypatch):
    from devmesh.tools.cli.run_replicas import _serve_or_reach

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    with pytest.raises(SystemExit) as caught:
        _serve_or_reach(_args("--replica-groups", "2", "--groups", "1", "--coordinator",
                              "host0"), [1], 3.0)
    assert str(caught.value) == ("devmesh run: --coordinator 'host0': give HOST:PORT, e.g. "
                                 "10.0.0.1:29500 (group 0's host's address and a free port)")
