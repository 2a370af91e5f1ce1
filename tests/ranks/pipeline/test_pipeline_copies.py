"""A pipeline stage's data-parallel copies fail a step together.

On a ``(pp, dp)`` mesh each stage runs on two ranks that share its collectives (FSDP's
all-gathers and reduce-scatters, DDP's all-reduce). Before, a step one copy could not start —
a batch its micro-batches do not divide, gradients off — or whose loss function failed (a
target out of range in one copy's data) failed on that copy and its pipeline only: the other
copy computed, waited in the stage's collectives for it until the mesh's timeout, and raised
"ranks [1] never entered it — they are stuck elsewhere" (or gloo's bare "Connection closed by
peer"); copies that built different schedules (the micro-batch count from each copy's own
data) mismatched the stage's collectives the same way. Now the copies agree at the start of
each step (one tiny all-reduce), a failed loss lets the step go on with a zero loss (the loss
runs none of the stage's collectives), the end-of-step check spreads each pipeline's failures
to every copy, and the whole mesh agrees on the schedule when the runner is built: every rank
raises the same error at once, and the steps after it train as one process.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from devmesh import init_device_mesh
from devmesh.errors import MeshBrokenError
from devmesh.layout.schedule import build_schedule
from devmesh.parallel import fully_shard, replicate
from devmesh.parallel.pipeline import PipelineError, PipelineRunner, split_sequential
from helpers import seeded_batch, train_alone

STEPS, MICRO = 2, 4


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)) for _ in range(4)]
    return nn.Sequential(*blocks, nn.Linear(16, 4))


def trained_after(runner, half: int, first: bool, last: bool) -> dict[str, torch.Tensor]:
    """The whole model after ``STEPS`` clean steps from the failed one's partial gradients
    zeroed, each copy on its half of the batch (the reference trains on all of it)."""
    opt = torch.optim.SGD(runner.module.parameters(), lr=0.1)
    opt.zero_grad()
    for step in range(STEPS):
        x, y = (t.chunk(2)[half] for t in seeded_batch(step))
        runner.step(x if first else None, y if last else None)
        opt.step()
        opt.zero_grad()
    return runner.state_dict(full=True)


def copies_fail_together(kind: str):
    """Each stage on two data-parallel copies (``kind``: ``fsdp`` — each block a unit, then
    the stage — or ``ddp``): what each rank raised in each bad step, then the whole model
    after ``STEPS`` clean steps (each copy its half of the batch)."""
    # a short timeout: before, the waiting copies failed only when it ran out
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"), timeout=20)
    me, half = mesh.get_coordinate()
    stage = split_sequential(make_model(), 2)[me]
    if kind == "fsdp":
        for block in stage:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(stage, mesh=mesh["dp"])
    else:
        replicate(stage, mesh=mesh["dp"])
    errors = []
    try:  # the micro-batch count from each copy's own data (8 rows or 4)
        PipelineRunner({me: stage}, mesh, build_schedule("1f1b", 2, 4 if half == 0 else 2),
                       F.cross_entropy)
    except PipelineError as exc:
        errors.append(str(exc))
    runner = PipelineRunner({me: stage}, mesh, build_schedule("1f1b", 2, MICRO),
                            F.cross_entropy)
    x, y = (t.chunk(2)[half] for t in seeded_batch(0))
    first, last = me == 0, me == 1
    bad_steps = [
        # the first stage's second copy (rank 1) got a batch of 6 rows
        lambda: runner.step((x[:6] if half else x) if first else None, y if last else None),
        # the last stage's first copy (rank 2) runs under no_grad
        lambda: runner.step(x if first else None, y if last else None),
        # validation: the first stage's second copy has no inputs
        lambda: runner.evaluate(x if first and not half else None, y if last else None),
        # a class out of range in the second copy's targets (rank 3's loss fails)
        lambda: runner.step(x if first else None, (y + 4 * half) if last else None),
    ]
    for i, bad_step in enumerate(bad_steps):
        off = i == 1 and (me, half) == (1, 0)
        try:
            with torch.no_grad() if off else contextlib.nullcontext():
                bad_step()
            errors.append(None)
        except PipelineError as exc:
            errors.append(str(exc))
    return errors, trained_after(runner, half, first, last)


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_a_copy_that_cannot_start_the_step_fails_it_on_every_rank(mesh_pool, kind):
    expected = train_alone(make_model(), STEPS)
    results = mesh_pool.run(copies_fail_together, 4, kind)
    for rank, (errors, trained) in enumerate(results):
        schedules, divide, no_grad, no_inputs, out_of_range = errors
        assert "the ranks hold different schedules (ranks [0, 2]: 1f1b: 2 stages on 2 ranks, " \
               "4 micro-batches; ranks [1, 3]: 1f1b: 2 stages on 2 ranks, 2 micro-batches" \
               in schedules, schedules
        # every rank names the culprit and what it lacked, the same words on all four
        assert f"[rank {rank}] pipeline step failed — rank 1: 4 micro-batches do not divide " \
               "the batch of 6 inputs" in divide, divide
        assert "pipeline step failed — rank 2: step() computes gradients, but gradients " \
               "are off here" in no_grad, no_grad
        assert "pipeline step failed — rank 1: the first stage's rank needs the inputs" \
               in no_inputs, no_inputs
        assert "pipeline step failed — rank 3: stage 1, forward of micro-batch 0 on an input " \
               "of (2, 16) torch.float32: IndexError: Target 6 is out of bounds." \
               in out_of_range, out_of_range
        for error, rank_0s in zip(errors[1:], results[0][0][1:]):
            assert error.count("[rank") == 1 and "timed out" not in error, error
            assert error.split("] ", 1)[1] == rank_0s.split("] ", 1)[1]
        assert trained.keys() == expected.keys()
        for name, value in expected.items():  # the failed steps left nothing behind
            torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6,
                                       msg=f"rank {rank}: {name}")


def loss_fails_on_one_copy(name: str, kind: str):
    """A class out of range in the second copy's targets under schedule ``name`` (split
    backwards, stages in a V, two stages a rank), the stages under ``kind`` (devmesh's
    ``fsdp`` or ``ddp``, or torch's FSDP2): the error each rank raised, then the whole model
    after ``STEPS`` clean steps."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"), timeout=20)
    me, half = mesh.get_coordinate()
    virtual = 1 if name == "zero-bubble" else 2
    schedule = build_schedule(name, 2, MICRO, virtual)
    parts = split_sequential(make_model(), 2 * virtual)
    stages = {s: parts[s] for s in range(2 * virtual) if schedule.rank_of(s) == me}
    for stage in stages.values():
        if kind == "ddp":
            replicate(stage, mesh=mesh["dp"])
            continue
        shard = torch_fully_shard if kind == "torch-fsdp" else fully_shard
        for block in stage:
            shard(block, mesh=mesh["dp"])
        shard(stage, mesh=mesh["dp"])
    runner = PipelineRunner(stages, mesh, schedule, F.cross_entropy)
    first, last = 0 in stages, 2 * virtual - 1 in stages
    x, y = (t.chunk(2)[half] for t in seeded_batch(0))
    try:
        runner.step(x if first else None, (y + 4 * half) if last else None)
        error = None
    except PipelineError as exc:
        error = str(exc)
    return error, trained_after(runner, half, first, last)


@pytest.mark.parametrize("name, kind", [("zero-bubble", "fsdp"), ("zbv-zero-bubble", "ddp"),
                                        ("dualpipe-v", "fsdp"),
                                        ("interleaved-1f1b", "torch-fsdp")])
def test_a_loss_failing_on_one_copy_fails_the_step_under_every_schedule(mesh_pool, name, kind):
    """The zero loss goes through split backwards (zero-bubble's I and W), a V's last stage
    on the first rank, and torch's FSDP2, whose reduce-scatter runs in the zero loss's
    backward as in any other."""
    expected = train_alone(make_model(), STEPS)
    results = mesh_pool.run(loss_fails_on_one_copy, 4, name, kind)
    culprit = "rank 3: stage 1" if name == "zero-bubble" else (
        "rank 3: stage 3" if name == "interleaved-1f1b" else "rank 1: stage 3")
    for rank, (error, trained) in enumerate(results):
        assert error is not None and f"pipeline step failed — {culprit}, forward of " \
            "micro-batch 0" in error and "Target 6 is out of bounds" in error, error
        for key, value in expected.items():
            torch.testing.assert_close(trained[key], value, rtol=1e-5, atol=1e-6,
                                       msg=f"rank {rank}: {key}")


class Gate(nn.Module):
    """The identity, whose backward raises once ``fail`` is set: a gradient one copy
    refuses (a NaN check, say) in the middle of its stage."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def refuse(grad: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("the gradient is not finite")

        if self.fail and x.requires_grad:
            x.register_hook(refuse)
        return x


def copy_stops_mid_step(kind: str, where: str):
    """Stage 0 (an embedding, two blocks) and stage 1 (a block, a gate, a block, a head) on
    two data-parallel copies each (``kind``: ``fsdp``, each block a unit, or ``ddp``). Every
    stage-0 copy meets a token out of range: the step fails everywhere, and the next trains;
    then one copy fails in the middle of its stage (``where``: its embedding's ``forward``
    on rank 1, its gate's ``backward`` on rank 3) and the other is in the stage's
    collectives. Returns each step's error (``None``: it trained) and the refusal after."""
    # a long timeout: before, the waiting copy raised only when it ran out
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"), timeout=60)
    me, half = mesh.get_coordinate()
    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))  # noqa: E731
    gate = Gate()
    stage = (nn.Sequential(nn.Embedding(10, 16), block(), block()) if me == 0
             else nn.Sequential(block(), gate, block(), nn.Linear(16, 4)))
    if kind == "fsdp":
        for child in stage:
            if any(True for _ in child.parameters()):
                fully_shard(child, mesh=mesh["dp"])
        fully_shard(stage, mesh=mesh["dp"])
    else:
        replicate(stage, mesh=mesh["dp"])
    runner = PipelineRunner({me: stage}, mesh, build_schedule("1f1b", 2, MICRO),
                            F.cross_entropy)
    gen = torch.Generator().manual_seed(half)
    x, y = torch.randint(0, 10, (8,), generator=gen), torch.randint(0, 4, (8,), generator=gen)
    outcomes = []

    def step(tokens: torch.Tensor) -> None:
        try:
            runner.step(tokens if me == 0 else None, y if me == 1 else None)
            outcomes.append(None)
        except PipelineError as exc:
            outcomes.append(str(exc))

    step(torch.where(torch.arange(8) == 5, 10, x))  # every copy: the same token out of range
    step(x)
    if where == "forward":
        step(torch.where(torch.arange(8) == 5, 10 * half, x))  # rank 1's token 10 only
    else:
        gate.fail = half == 1  # rank 3
        step(x)
    try:  # the world is broken now: refused, not a hang or a wrong pairing
        runner.step(x if me == 0 else None, y if me == 1 else None)
    except MeshBrokenError as exc:
        outcomes.append(str(exc))
    return outcomes


@pytest.mark.parametrize("kind, where", [("fsdp", "forward"), ("ddp", "backward"),
                                         ("fsdp", "backward")])
def test_a_copy_that_stops_mid_step_fails_it_on_every_rank_at_once(mesh_pool, kind, where):
    """Before, the copy left in the stage's collectives waited for the one that stopped until
    the mesh's timeout (30 minutes by default; 60 s here): now it gives up within a second
    (the stopped copy says so through the store), every rank raises the same error naming
    both, and devmesh refuses the next step — the collective given up on stays posted."""
    results = mesh_pool.run(copy_stops_mid_step, 4, kind, where)
    stopped, waiting = (1, 0) if where == "forward" else (3, 2)
    for rank, (every_copy, trained, one_copy, refused) in enumerate(results):
        assert every_copy.count("IndexError: index out of range in self") == 2, every_copy
        assert "out of step" not in every_copy, every_copy
        assert trained is None
        if where == "forward":
            assert f"rank {stopped}: stage 0, forward of micro-batch 2 on an input of (2,) " \
                   "torch.int64: IndexError: index out of range in self" in one_copy, one_copy
        else:
            assert f"rank {stopped}: stage 1, backward of micro-batch " in one_copy \
                and "RuntimeError: the gradient is not finite" in one_copy, one_copy
        assert f"rank {waiting}: stage " in one_copy and "gave up waiting in " in one_copy \
            and "over dp (collective #" in one_copy \
            and f"for rank {stopped}, which stopped first" in one_copy, one_copy
        assert "this world's collectives are out of step: restart the job" in one_copy
        assert one_copy.split("] ", 1)[1] == results[0][2].split("] ", 1)[1]
        assert refused.startswith(f"[rank {rank}] this world's collectives are out of step "
                                  f"(rank {waiting} gave up on "), refused
