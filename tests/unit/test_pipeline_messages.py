"""The order pipeline messages cross each pair of ranks, and NCCL's stream rules played on it
(issue 11: P2P batched where possible, matched as NCCL matches them). No processes: the
runner's use of this order over gloo is checked in test_pipeline.py (policy "fused")."""

from __future__ import annotations

import itertools

import pytest

from devmesh.layout.pipeline_messages import (
    READY,
    SPECULATE,
    UNKNOWN,
    Message,
    ReceiveOrder,
    fifo_problem,
    forward_only,
    nccl_deadlock,
    nccl_placement,
    nccl_problem,
    sequences,
)
from devmesh.layout.schedule import SCHEDULES, Action, Schedule, build_schedule


def _all_schedules(names=tuple(SCHEDULES), ranks=range(2, 9), most=12):
    for name, p, m in itertools.product(names, ranks, range(1, most + 1)):
        if name.startswith("interleaved") and m % max(1, m // p):
            continue  # torch's rule too: rounds of at least p that cannot be equal
        if name == "dualpipe-v" and m < 2 * p:
            continue  # torch's rule too: at least as many micro-batches as stages
        yield name, p, m, build_schedule(name, p, m)


def test_messages_cross_a_pair_in_the_order_the_sender_makes_them():
    a = lambda s, m: Message("activation", s, m)  # noqa: E731
    g = lambda s, m: Message("gradient", s, m)  # noqa: E731
    assert sequences(build_schedule("1f1b", 2, 3)) == {
        (0, 1): (Message("header", 1), a(1, 0), a(1, 1), a(1, 2)),
        (1, 0): (g(0, 0), g(0, 1), g(0, 2))}
    # interleaved on 2 ranks: both links and the gradients share the pair, in rank 0's order
    seq = sequences(build_schedule("interleaved-1f1b", 2, 2))[(0, 1)]
    assert seq[:5] == (Message("header", 1), a(1, 0), a(1, 1), Message("header", 3), a(3, 0))
    assert g(1, 0) in seq and seq.index(g(1, 0)) > seq.index(a(3, 0))


def test_every_built_in_schedule_uses_each_peers_messages_in_the_order_sent():
    for name, p, m, schedule in _all_schedules():
        assert fifo_problem(schedule) is None, (name, p, m)
        assert fifo_problem(forward_only(schedule)) is None, (name, p, m)


def test_a_schedule_using_messages_out_of_order_is_named():
    gpipe = build_schedule("gpipe", 2, 2)
    ranks = list(gpipe.actions)
    ranks[1] = (Action("F", 1, 1), Action("F", 1, 0)) + ranks[1][2:]
    problem = fifo_problem(Schedule("swapped", 2, 2, 2, tuple(ranks)))
    assert problem is not None and "rank 1 uses rank 0's activations for stage 1 in " \
        "another order" in problem
    assert "sent a0@1, used a1@1" in problem


def test_receives_wait_for_a_header_after_a_first_activation_posted_in_the_old_shape():
    schedule = build_schedule("gpipe", 2, 3)
    order = ReceiveOrder(schedule, 1)
    read: set[int] = set()

    def state(message):
        if message.kind == "activation" and message.stage not in read:
            return SPECULATE if order.is_first(message) else UNKNOWN
        return READY

    a = lambda m: Message("activation", 1, m)  # noqa: E731
    posts, header = order.due([a(0), a(1)], state)
    # the header, then the first activation in the old shape; nothing past it until the
    # header says whether that shape held
    assert posts == [Message("header", 1), a(0)] and header == Message("header", 1)
    assert order.due([a(1)], state) == ([], Message("header", 1))
    read.add(1)
    assert order.header_read(1, shape_held=False)  # changed: the zeros filled it, post again
    assert order.due([a(1)], state) == ([a(0), a(1)], None)
    order.restart()
    read.clear()
    order.due([a(0)], state)
    read.add(1)
    assert not order.header_read(1, shape_held=True)  # held: the data is in that receive
    assert order.due([a(2)], state) == ([a(1), a(2)], None)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zero-bubble"])
def test_nccl_order_never_deadlocks_for_these_schedules(name):
    for _, p, m, schedule in _all_schedules((name,)):
        for shapes, plan in itertools.product(("held", "new", "changed"),
                                              (schedule, forward_only(schedule))):
            assert nccl_deadlock(plan, "fused", shapes) is None, (p, m, shapes)


def test_receives_posted_ahead_of_a_send_deadlock_on_nccl():
    # gloo's order (receives two actions ahead) on NCCL's rules: the first stage posts the
    # receive of its gradient before the batch sending its activation, which the last stage
    # needs before it can make that gradient — the model must see the cycle
    found = nccl_deadlock(build_schedule("1f1b", 2, 1), "ahead")
    assert found is not None and found.startswith("deadlock on NCCL: rank 0 waits")
    assert nccl_deadlock(build_schedule("1f1b", 2, 1), "fused") is None
    # interleaved 1F1B with more micro-batches than ranks: "fused" alone deadlocks ...
    assert nccl_deadlock(build_schedule("interleaved-1f1b", 2, 2), "fused") is None
    assert nccl_deadlock(build_schedule("interleaved-1f1b", 2, 4), "fused") is not None


def test_interleaved_1f1b_posts_some_receives_early_and_then_never_deadlocks_on_nccl():
    # ... until the placement moves the receives that must go ahead of a later send
    for ranks, virtual in itertools.product((2, 3, 4), (2, 3)):
        for microbatches in (ranks, 2 * ranks, 4 * ranks):
            schedule = build_schedule("interleaved-1f1b", ranks, microbatches, virtual)
            for plan in (schedule, forward_only(schedule)):
                early = nccl_placement(plan)
                assert early is not None, (ranks, virtual, microbatches)
                for shapes in ("held", "new", "changed"):
                    assert nccl_deadlock(plan, "fused", shapes, early) is None
            moved = sum(len(m) for by_boundary in nccl_placement(schedule).values()
                        for m in by_boundary.values())
            assert (moved > 0) == (microbatches > ranks)  # only where "fused" deadlocks
    assert nccl_problem(build_schedule("interleaved-1f1b", 8, 32)) is None
    # the counts only torch's flexible rounds run (one round shorter or longer than the
    # pipeline), and looped BFS (every micro-batch on a stage before the next): placed too
    for ranks, virtual in itertools.product((2, 3, 4), (2, 3)):
        flexible = [("interleaved-1f1b", m) for m in range(1, 2 * ranks) if m != ranks]
        for name, microbatches in flexible + [("looped-bfs", m) for m in (1, 3, 2 * ranks)]:
            schedule = build_schedule(name, ranks, microbatches, virtual)
            for plan in (schedule, forward_only(schedule)):
                early = nccl_placement(plan)
                assert early is not None, (name, ranks, virtual, microbatches)
                for shapes in ("held", "new", "changed"):
                    assert nccl_deadlock(plan, "fused", shapes, early) is None
    # two stages on one rank hand their tensors over in memory: no message at all (they were
    # messages to itself before, which no placement kept from deadlocking on NCCL)
    one_rank = build_schedule("interleaved-1f1b", 1, 2)
    assert nccl_problem(one_rank) is None and sequences(one_rank) == {}


def test_interleaved_placements_follow_the_schedules_timing_without_repairs():
    # why placing is quick at a GPU job's sizes (8 ranks x 64 micro-batches x 4 virtual
    # stages took 34 s by repair alone, 0.5 s so): the receives placed where the schedule's
    # own timing puts their sends already play through; the repair is only a fallback
    from devmesh.layout.pipeline_messages import _placement_by_time, _plays_through

    for ranks, microbatches, virtual in ((2, 8, 2), (3, 12, 3), (4, 16, 2), (8, 64, 4),
                                         (16, 64, 2)):
        schedule = build_schedule("interleaved-1f1b", ranks, microbatches, virtual)
        assert not _plays_through(schedule, {})  # "fused" alone deadlocks here
        for plan in (schedule, forward_only(schedule)):
            assert _plays_through(plan, _placement_by_time(plan)), (ranks, microbatches)


def test_the_model_posts_what_the_runner_posts():
    # the runner asks upcoming() at each boundary; the model computes every boundary's
    # "fused" receive at once — they must agree, or the model checks another order
    from devmesh.layout.pipeline_messages import _fused_receives, upcoming

    for _, _, _, schedule in _all_schedules(ranks=(2, 4), most=8):
        for actions in schedule.actions:
            fused = _fused_receives(schedule, actions)
            for start in range(len(actions) + 1):
                expected = [fused[start]] if fused[start] is not None else []
                assert upcoming(schedule, actions, start, "fused") == expected
