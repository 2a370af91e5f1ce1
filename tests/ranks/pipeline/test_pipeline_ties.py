"""A weight tied across pipeline stages (input embedding = output head) stays one tensor: the
stages on different ranks sum their gradients, and a pipelined model trains and clips its
gradients like the unsplit model in one process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from devmesh import comm_stats, init_device_mesh
from devmesh.layout.schedule import IN_A_V, build_schedule
from devmesh.parallel.pipeline import PipelineError, PipelineRunner, split_sequential
from devmesh.parallel.pipeline.tied import find_ties, record_ties

VOCAB, WIDTH = 12, 8


class Head(nn.Module):
    """The output projection, sharing the embedding's weight."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


def tied_model() -> nn.Sequential:
    torch.manual_seed(0)
    embedding = nn.Embedding(VOCAB, WIDTH)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(6)]
    return nn.Sequential(embedding, *blocks, Head(embedding))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return (torch.randint(0, VOCAB, (16,), generator=gen),
            torch.randint(0, VOCAB, (16,), generator=gen))


def reference(steps: int, max_norm: float, norm_type: float = 2.0
              ) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = tied_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    norms = []
    for step in range(steps):
        x, y = batch(step)
        F.cross_entropy(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm,
                                                          norm_type)))
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.state_dict().items()}, norms


def train_tied(name: str, ranks: int, steps: int, max_norm: float, perturb: bool,
               dp: int = 1, norm_type: float = 2.0):
    """``dp > 1``: each stage is also sharded (``fully_shard``) over a ``dp`` dim; a rank's
    two stages (interleaved, or in a V) as one unit of both (torch's ``fully_shard([a, b])``:
    in a V, one weight tied between them), whose zero-bubble ``W`` must hand autograd the
    other stage's accumulated gradients too."""
    from devmesh.parallel import fully_shard, state_dict

    mesh = init_device_mesh("cpu", (ranks, dp), mesh_dim_names=("pp", "dp"))
    schedule = build_schedule(name, ranks, 4)
    parts = split_sequential(tied_model(), schedule.stages)
    me = mesh.get_coordinate()[0]
    stages = {s: parts[s] for s in range(schedule.stages) if schedule.rank_of(s) == me}
    if perturb and schedule.stages - 1 in stages:  # the last stage's copy starts elsewhere
        with torch.no_grad():
            stages[schedule.stages - 1][-1].weight.add_(1.0)
    if dp > 1 and len(stages) > 1:
        fully_shard(list(stages.values()), mesh=mesh["dp"])
    elif dp > 1:
        for stage in stages.values():
            fully_shard(stage, mesh=mesh["dp"])
    runner = PipelineRunner(stages, mesh, schedule, F.cross_entropy)
    opt = torch.optim.Adam(runner.module.parameters(), lr=0.05)
    norms, reductions = [], []
    index = mesh["dp"].get_local_rank()
    for step in range(steps):
        x, y = (t.chunk(dp)[index] for t in batch(step))
        with comm_stats() as stats:
            runner.step(x if 0 in stages else None,
                        y if schedule.stages - 1 in stages else None)
        reductions.append(stats.by_collective().get("reduce_scatter", (0, 0))[0])
        norms.append(float(runner.clip_grad_norm_(max_norm, norm_type)))
        opt.step()
        opt.zero_grad()
    return state_dict(runner.module, full=True), norms, reductions


@pytest.mark.parametrize("name,ranks,dp,norm_type", [
    ("1f1b", 4, 1, 2.0), ("zero-bubble", 4, 1, 2.0), ("interleaved-1f1b", 2, 1, 2.0),
    ("1f1b", 2, 2, 2.0), ("1f1b", 4, 1, math.inf), ("zbv-zero-bubble", 2, 1, 2.0),
    ("dualpipe-v", 2, 1, 2.0), ("dualpipe-v", 2, 2, 2.0), ("zbv-zero-bubble", 2, 2, 2.0),
    ("interleaved-zero-bubble", 2, 2, 2.0)])
def test_a_tied_weight_trains_like_the_unsplit_model(mesh_pool, name, ranks, dp, norm_type):
    # the embedding (stage 0) and the head (last stage) are on different ranks — or, in
    # a V's placement (zero-bubble V, DualPipeV), both on rank 0 (sharded over dp as one
    # fully_shard unit of the rank's two stages); the last stage's copy even starts
    # different: the runner gives it stage 0's value
    max_norm = 0.5 if norm_type == 2.0 else 0.05
    ref, ref_norms = reference(3, max_norm, norm_type)
    merged = {}
    # (in a V both stages on rank 0 hold the one Parameter object, as one process does, so
    # changing "the last stage's copy" would change the model itself)
    perturb = name not in IN_A_V
    for state, norms, reductions in mesh_pool.run(train_tied, ranks * dp, name, ranks, 3,
                                                  max_norm, perturb, dp, norm_type):
        assert norms == pytest.approx(ref_norms, rel=1e-5)  # clipping really happened
        # one reduce-scatter a step per fully_shard unit, also for the unit of a rank's two
        # stages (it reduces at the later of their final backwards only)
        assert reductions == [1 if dp > 1 else 0] * 3
        for key, value in state.items():
            if key in merged:  # a tied weight on two ranks: bitwise the same copy
                assert torch.equal(merged[key], value), key
            merged[key] = value
    assert merged.keys() == ref.keys()
    for key, value in ref.items():
        torch.testing.assert_close(merged[key], value, rtol=1e-5, atol=1e-6)
    assert all(n > max_norm for n in ref_norms)  # every step was clipped


def test_ties_are_found_between_stages_only():
    parts = split_sequential(tied_model(), 4)
    ties = find_ties(parts)
    assert [t.holders for t in ties] == [((0, "0.weight"), (3, "7.weight"))]
    assert parts[1].pipeline_ties == ties
    assert find_ties(split_sequential(tied_model(), 1)) == ()  # one stage: nothing to keep


def runner_error(change_rank_1: str) -> str:
    """Build 1F1B over the tied model split in two, after ``change_rank_1`` altered what
    rank 1 holds; the ``PipelineError`` the runner raised, or "built"."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    parts = split_sequential(tied_model(), 2)
    me = mesh.get_coordinate()[0]
    if me == 1 and change_rank_1 == "reshape the head":  # no longer the embedding's shape
        parts[1][-1].weight = nn.Parameter(torch.zeros(VOCAB, WIDTH + 1))
    if me == 1 and change_rank_1 == "record no tie":  # as when the ranks' models were
        record_ties(parts, ())                      # built or traced differently
    try:
        PipelineRunner({me: parts[me]}, mesh, build_schedule("1f1b", 2, 2), F.cross_entropy)
    except PipelineError as exc:
        return str(exc)
    return "built"


def test_tied_copies_of_different_shapes_are_refused_on_every_rank(mesh_pool):
    for error in mesh_pool.run(runner_error, 2, "reshape the head"):
        assert "tied parameters differ" in error and "(12, 8)" in error \
               and "(12, 9)" in error, error


def test_ranks_that_found_different_ties_are_refused_on_every_rank_not_hung(mesh_pool):
    """Each rank would exchange its copies of the ties it found with the other holders:
    with different lists, rank 0 waited for rank 1's copy forever (seen with torch's tracer,
    whose copies differ from process to process). One tiny agreement first, then the same
    error on every rank."""
    for error in mesh_pool.run(runner_error, 2, "record no tie"):
        assert "the pipeline ranks found different tied parameters" in error, error
        assert "ranks [0]: [(0, 1)]; ranks [1]: []" in error, error


def test_the_inf_norm_is_the_largest_gradient_entry():
    from devmesh.parallel import clip_grad_norm_

    model = tied_model()
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, norm_type=math.inf)
    assert float(clip_grad_norm_(model, 1e9, norm_type=math.inf)) == pytest.approx(
        float(expected))
