"""Expert parallelism (docs/tutorials/expert-parallel.md): a mixture-of-experts transformer whose
experts are split over an ``ep`` dim, tokens dispatched with all-to-all, trains equal to one
process on the whole batch (float64, 1e-10) — alone, with FSDP, with tensor parallelism, with
uneven routing and with a capacity."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from devmesh import init_device_mesh
from devmesh.distributed.comm import comm_stats
from devmesh.parallel import fully_shard
from devmesh.parallel.expert_parallel import MoE, expert_parallel, expert_parameters
from helpers import caught

STEPS, ROWS, LENGTH, AUX = 3, 4, 8, 0.01


class MoEModel(nn.Module):
    """Embedding, causal attention (q, k, v, out projections), a 4-expert top-2 MoE, head."""

    def __init__(self, uneven: bool = False, capacity_factor: float | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 16)
        self.q, self.k, self.v, self.out = (nn.Linear(16, 16) for _ in range(4))
        self.moe = MoE(16, 32, experts=4, top_k=2, capacity_factor=capacity_factor)
        self.head = nn.Linear(16, 32)
        if uneven:  # every token's first feature is 3, and expert 0 reads it: it gets them all
            with torch.no_grad():
                self.embed.weight[:, 0] = 3.0
                self.moe.router.weight[0, 0] = 5.0
        self.double()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, -1))
        return self.head(x + self.moe(x))


def _batches():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 32, (ROWS, LENGTH + 1), generator=gen) for _ in range(STEPS)]


def _loss(model: MoEModel, batch: torch.Tensor, aux: float) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, 32), batch[:, 1:].reshape(-1)) + (
        aux * model.moe.aux_loss)


def one_process(uneven: bool = False, capacity_factor: float | None = None, slices: int = 1):
    """The whole batch in one process; with a capacity, as ``slices`` micro-batches (each
    rank's), since a capacity is per the tokens one forward sees."""
    model = MoEModel(uneven, capacity_factor)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    aux = 0.0 if capacity_factor else AUX
    losses, dropped, counts = [], [], []
    for batch in _batches():
        opt.zero_grad()
        total = 0.0
        for part in batch.chunk(slices):
            loss = _loss(model, part, aux) / slices
            loss.backward()
            total += loss.item()
            dropped.append(model.moe.dropped)
        opt.step()
        losses.append(total)
    with torch.no_grad():
        probs = torch.softmax(model.moe.router(model.embed(_batches()[0][:, :-1])), -1)
        counts = torch.bincount(probs.topk(2, -1).indices.reshape(-1), minlength=4).tolist()
    return losses, {k: v.detach() for k, v in model.state_dict().items()}, dropped, counts


def _full(state: dict) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach()
            for k, v in state.items()}


def train(kind: str, uneven: bool = False, capacity_factor: float | None = None):
    """``kind``: "ep" (EP over every rank), "ep-fsdp" (dp 2 x ep 2: experts split over ep and
    FSDP over dp, the rest FSDP over both), "ep-tp" (ep 2 x tp 2: attention TP on heads)."""
    from devmesh.parallel import (ColwiseParallel, RowwiseParallel, fully_shard,
                                  parallelize_module)

    world = int(os.environ["WORLD_SIZE"])
    model = MoEModel(uneven, capacity_factor)
    if kind == "ep":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        expert_parallel(model.moe, mesh)
        data, data_rank, data_size = mesh, mesh.get_local_rank(), world
    elif kind == "ep-fsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        expert_parallel(model.moe, mesh["ep"], data_mesh=mesh)
        fully_shard(model.moe.experts, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp", "ep"]._flatten("dp_ep"))
        data, data_rank, data_size = mesh, dist.get_rank(), world
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
        expert_parallel(model.moe, mesh["ep"])
        parallelize_module(model, mesh["tp"], {"q": ColwiseParallel(), "k": ColwiseParallel(),
                                               "v": ColwiseParallel(),
                                               "out": RowwiseParallel()})
        data, data_rank, data_size = mesh["ep"], mesh.get_local_rank("ep"), 2
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    experts = {id(p) for p in expert_parameters(model)}
    aux = 0.0 if capacity_factor else AUX
    losses, dropped = [], []
    rows = ROWS // data_size
    with comm_stats() as stats:
        for batch in _batches():
            mine = batch[data_rank * rows:(data_rank + 1) * rows]
            loss = _loss(model, mine, aux)
            opt.zero_grad()
            loss.backward()
            dropped.append(model.moe.dropped)
            if kind != "ep-fsdp":  # data parallelism by hand: the others' gradients averaged
                for p in model.parameters():
                    if id(p) not in experts:
                        dist.all_reduce(p.grad, group=data.get_group())
                        p.grad /= data_size
            whole = loss.detach().clone()
            dist.all_reduce(whole, group=None if data.ndim > 1 else data.get_group())
            opt.step()
            losses.append(whole.item() / data_size)
    return losses, _full(model.state_dict()), dropped, stats.by_collective()


def _check(results, expected, steps=STEPS):
    losses, params = expected[0], expected[1]
    for ours, mine, _, stats in results:
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(losses), rtol=1e-10,
                                   atol=1e-10)
        for name, value in params.items():
            torch.testing.assert_close(mine[name], value, rtol=1e-10, atol=1e-10, msg=name)
        # per step: the counts' all-to-all, the tokens' there and back, their gradients'
        # there and back; one all-reduce of the 4 assignment counts (the aux loss)
        assert stats["all_to_all"][0] == 5 * steps, stats


@pytest.mark.parametrize("ep", [2, 4])
def test_a_moe_transformer_trains_under_expert_parallelism_as_in_one_process(mesh_pool, ep):
    expected = one_process()
    _check(mesh_pool.run(train, ep, "ep"), expected)


@pytest.mark.parametrize("kind", ["ep-fsdp", "ep-tp"])
def test_expert_parallelism_composes_with_fsdp_and_tensor_parallelism(mesh_pool, kind):
    _check(mesh_pool.run(train, 4, kind), one_process())


def test_uneven_routing_sends_uneven_token_counts(mesh_pool):
    expected = one_process(uneven=True)
    assert expected[3][0] == ROWS * LENGTH and sum(expected[3][1:]) == ROWS * LENGTH, expected[3]
    _check(mesh_pool.run(train, 2, "ep", True), expected)


def test_a_capacity_drops_and_counts_the_same_assignments_as_one_process(mesh_pool):
    expected = one_process(uneven=True, capacity_factor=1.0, slices=2)
    results = mesh_pool.run(train, 2, "ep", True, 1.0)
    _check(results, expected)
    for rank, (_, _, dropped, _) in enumerate(results):
        assert dropped == expected[2][rank::2] and min(dropped) > 0, (dropped, expected[2])


def refused():
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("ep",))
    split = expert_parallel(MoE(8, 16, experts=2), mesh)
    sharded = MoE(8, 16, experts=2)
    fully_shard(sharded.experts, mesh=mesh)
    return [caught(lambda: expert_parallel(MoE(8, 16, experts=3), mesh)),
            caught(lambda: expert_parallel(nn.Linear(2, 2), mesh)),
            caught(lambda: MoE(8, 16, experts=2, top_k=3)),
            caught(lambda: expert_parallel(split, mesh)),
            caught(lambda: expert_parallel(sharded, mesh))]


def test_bad_inputs_are_refused_on_every_rank_naming_the_fix(mesh_pool):
    for rank, errors in enumerate(mesh_pool.run(refused, 2)):
        assert errors[0] == ("ParallelizeError", f"[rank {rank}] expert_parallel: 3 experts do "
                             "not split evenly over ep = 2: use a number of experts divisible "
                             "by 2, or an ep size dividing 3")
        assert errors[1][1].startswith(f"[rank {rank}] expert_parallel takes a devmesh MoE "
                                       "layer or an experts module") and \
            errors[1][1].endswith("got Linear")
        assert errors[2][1].endswith("MoE: top_k = 3 must be between 1 and the number of "
                                     "experts, 2")
        assert errors[3] == ("ParallelizeError", f"[rank {rank}] expert_parallel: this MoE is "
                             "already split over an ep mesh of 2 ranks; call expert_parallel "
                             "once per MoE layer")
        assert errors[4][1].endswith("is already distributed along its experts "
                                     "(expert_parallel, fully_shard or torch's tensor "
                                     "parallelism ran on it first); apply expert_parallel "
                                     "once, after devmesh's tensor parallelism if any, before "
                                     "FSDP")


class _Residual(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


def _pipeline_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 16), nn.GELU(),
                         _Residual(MoE(16, 32, experts=4, top_k=2)), nn.Linear(16, 32)).double()


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, 32), targets.reshape(-1))


def pipeline_one_process():
    model = _pipeline_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in _batches():
        opt.zero_grad()
        _token_loss(model(batch[:, :-1]), batch[:, 1:]).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def train_ep_pipeline():
    """PP 2 (1F1B, 2 micro-batches) x EP 2: the MoE's stage splits its experts over ep."""
    from devmesh.parallel.pipeline import PipelineRunner, build_schedule, split_sequential

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    ep = mesh["ep"]
    model = _pipeline_model()
    expert_parallel(model[3].inner, ep)
    schedule = build_schedule("1f1b", ranks=2, microbatches=2)
    parts = split_sequential(model, schedule.stages)
    me = mesh.get_local_rank("pp")
    stages = {s: parts[s] for s in range(schedule.stages) if schedule.rank_of(s) == me}
    runner = PipelineRunner(stages, mesh, schedule, _token_loss)
    opt = torch.optim.AdamW(runner.module.parameters(), lr=1e-2)
    experts = {id(p) for p in expert_parameters(runner.module)}
    e = ep.get_local_rank()
    with comm_stats() as stats:
        for batch in _batches():
            mine = batch[e * 2:(e + 1) * 2]
            opt.zero_grad()
            runner.step(mine[:, :-1] if 0 in stages else None,
                        mine[:, 1:] if 1 in stages else None)
            for p in runner.module.parameters():
                if id(p) not in experts:
                    dist.all_reduce(p.grad, group=ep.get_group())
                    p.grad /= 2
            opt.step()
    return runner.state_dict(full=True), stats.by_collective()


def test_an_expert_parallel_stage_in_a_pipeline_trains_as_one_process(mesh_pool):
    expected = pipeline_one_process()
    for rank, (full, stats) in enumerate(mesh_pool.run(train_ep_pipeline, 4)):
        for name, value in expected.items():
            torch.testing.assert_close(full[name], value, rtol=1e-10, atol=1e-10, msg=name)
        if rank >= 2:  # the MoE's stage: 5 all-to-alls per micro-batch, 2 of them per step
            assert stats["all_to_all"][0] == 5 * 2 * STEPS, stats
