"""Random schedules, as a user might write by hand: any order of forwards and backwards that
can run (each rank taking its peers' messages in the order they are sent), whole and split
backwards mixed. The built-in schedules are four points of that space; the runner, the
message order and NCCL's placement must hold on all of it."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from devmesh.layout.pipeline_messages import (
    fifo_problem,
    forward_only,
    nccl_deadlock,
    nccl_placement,
    nccl_problem,
)
from devmesh.layout.schedule import Action, Schedule, ScheduleError, parse_schedule
from pipeline_cases import check_composed_like_one_process, reference, train_pipelined


def random_schedule(ranks: int, virtual: int, microbatches: int, seed: int,
                    split: float = 0.5) -> Schedule:
    """A schedule that plays each rank's actions in a random order among those ready.

    An action is ready when its input is the *next* message from the peer that sends it (a
    receiver takes a peer's messages in the order sent, as NCCL matches them); each
    (stage, micro-batch) backward is split into ``I`` and ``W`` with probability ``split``.
    The next message of every channel is always usable (a gradient comes back only after its
    forward ran here), so the draw never gets stuck."""
    rng = random.Random(seed)
    stages = ranks * virtual
    split_units = {(s, m) for s in range(stages) for m in range(microbatches)
                   if rng.random() < split}
    done: set[tuple[str, int, int]] = set()
    channels: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    actions: list[list[Action]] = [[] for _ in range(ranks)]
    remaining = stages * microbatches * 2 + len(split_units)
    while remaining:
        rank = rng.randrange(ranks)
        heads = {src: queue[0] for (src, dst), queue in channels.items() if dst == rank and queue}
        ready = []
        for s in range(rank, stages, ranks):
            for m in range(microbatches):
                backward = "I" if (s, m) in split_units else "B"
                if ("F", s, m) not in done:
                    if s == 0 or heads.get((s - 1) % ranks) == ("a", s, m):
                        ready.append(Action("F", s, m))
                elif (backward, s, m) not in done:
                    if s == stages - 1 or heads.get((s + 1) % ranks) == ("g", s, m):
                        ready.append(Action(backward, s, m))
                elif backward == "I" and ("W", s, m) not in done:
                    ready.append(Action("W", s, m))
        if not ready:
            continue
        action = rng.choice(ready)
        s, m = action.stage, action.microbatch
        actions[rank].append(action)
        done.add((action.kind, s, m))
        remaining -= 1
        if action.kind == "F":
            if s > 0:
                channels[((s - 1) % ranks, rank)].pop(0)
            if s < stages - 1:
                channels.setdefault((rank, (s + 1) % ranks), []).append(("a", s + 1, m))
        elif action.kind in ("B", "I"):
            if s < stages - 1:
                channels[((s + 1) % ranks, rank)].pop(0)
            if s > 0:
                channels.setdefault((rank, (s - 1) % ranks), []).append(("g", s - 1, m))
    return Schedule(f"random-{seed}", ranks, stages, microbatches, tuple(map(tuple, actions)))


@settings(max_examples=150, deadline=None)
@given(ranks=st.integers(2, 4), virtual=st.integers(1, 3), microbatches=st.integers(1, 8),
       seed=st.integers(0, 2**32), split=st.sampled_from([0.0, 0.5, 1.0]))
def test_every_runnable_order_has_a_deadlock_free_nccl_placement(ranks, virtual, microbatches,
                                                                 seed, split):
    # what the checks accept, the runner can post on NCCL: a placement found for the step
    # and for evaluate(), and playing it under NCCL's stream rules finishes every rank
    schedule = random_schedule(ranks, virtual, microbatches, seed, split)
    assert parse_schedule(str(schedule)) == schedule  # printed, it reads back the same
    assert fifo_problem(schedule) is None
    assert nccl_problem(schedule) is None
    for plan in (schedule, forward_only(schedule)):
        early = nccl_placement(plan)
        for shapes in ("held", "new", "changed"):
            assert nccl_deadlock(plan, "fused", shapes, early) is None, (str(plan), shapes)


@settings(max_examples=100, deadline=None)
@given(ranks=st.integers(2, 4), virtual=st.integers(1, 2), microbatches=st.integers(1, 4),
       seed=st.integers(0, 2**32), mutation=st.sampled_from(["drop", "repeat", "move"]),
       pick=st.randoms(use_true_random=False))
def test_a_schedule_missing_repeating_or_misplacing_an_action_is_refused(
        ranks, virtual, microbatches, seed, mutation, pick):
    # one action dropped (its micro-batch would lose a forward or gradients), repeated, or
    # moved to another rank's list: refused when built, naming the action
    schedule = random_schedule(ranks, virtual, microbatches, seed)
    lists = [list(actions) for actions in schedule.actions]
    rank = pick.randrange(ranks)
    index = pick.randrange(len(lists[rank]))
    action = lists[rank][index]
    if mutation == "drop":
        del lists[rank][index]
        expected = f"of stage {action.stage} has no"
    elif mutation == "repeat":
        lists[rank].insert(pick.randrange(len(lists[rank]) + 1), action)
        expected = f"{action} appears twice in rank {rank}'s list"
    else:
        del lists[rank][index]
        other = (rank + pick.randrange(1, ranks)) % ranks
        lists[other].insert(pick.randrange(len(lists[other]) + 1), action)
        expected = f"{action} is in rank {other}'s list, but stage {action.stage} lives on rank"
    with pytest.raises(ScheduleError) as refused:
        Schedule("mutated", ranks, schedule.stages, microbatches, tuple(map(tuple, lists)))
    assert expected in str(refused.value)


@pytest.mark.parametrize("seed, policy", [(1, "ahead"), (2, "ahead"), (3, "fused"),
                                          (4, "fused")])
def test_random_schedules_train_like_one_process(mesh_pool, seed, policy):
    # 4 ranks x 2 stages, micro-batches in random orders, whole and split backwards mixed;
    # "fused": the receives posted as on NCCL, with the placement found for this order
    schedule = random_schedule(4, 2, 4, seed)
    assert schedule.actions != random_schedule(4, 2, 4, seed + 1).actions
    ref_params, ref_losses = reference()
    owned = {}
    for params, losses, sends, _ in mesh_pool.run(train_pipelined, 4, schedule, 4, 2, policy):
        owned.update(params)
        if losses[0] is not None:
            assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert owned.keys() == ref_params.keys()
    for key, value in owned.items():
        torch.testing.assert_close(value, ref_params[key].detach(), rtol=1e-5, atol=1e-6,
                                   msg=f"{key} under {schedule}")


@pytest.mark.parametrize("seed, composition", [(5, "fsdp+tp"), (6, "ddp")])
def test_random_schedules_train_sharded_and_replicated_stages_like_one_process(
        mesh_pool, seed, composition):
    # each stage sharded over dp and tp, or replicated over dp: every micro-batch's gradients
    # accumulate without sync and reduce once, at the stage's last backward action — which a
    # random order places anywhere, after whole or split backwards
    schedule = random_schedule(2, 2, 4, seed)
    assert {a.kind for actions in schedule.actions for a in actions} == {"F", "B", "I", "W"}
    check_composed_like_one_process(mesh_pool, schedule, composition)
