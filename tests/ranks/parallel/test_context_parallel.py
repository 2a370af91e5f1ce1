"""Context parallelism (docs/tutorials/context-parallel.md): attention over a sequence split across a
``cp`` mesh dim equals ``scaled_dot_product_attention`` on the whole sequence, forward and
backward, and a transformer block trained under it equals one process."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from devmesh import init_device_mesh
from devmesh.distributed.comm import comm_stats
from devmesh.parallel import (
    context_parallel,
    gather_sequence,
    ring_attention,
    sequence_positions,
    shard_sequence,
)
from helpers import caught


def _cp_mesh():
    return init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("cp",))


def _inputs(heads: int = 4, kv_heads: int = 4, length: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, length, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, kv_heads, length, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(2, kv_heads, length, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(2, heads, length, 8, generator=gen, dtype=torch.float64)
    padding = torch.rand(2, length, generator=gen) > 0.3
    padding[:, 0] = True  # every query keeps a key (the first token) under causality too
    return q, k, v, weight, padding


def _reference(q, k, v, weight, causal, padding):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    mask = None
    if padding is not None:
        mask = padding[:, None, None, :]
        if causal:
            mask = mask & torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                         is_causal=causal and padding is None,
                                         enable_gqa=k.shape[1] != q.shape[1])
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


CASES = [  # (causal, padding, load_balance, method, gqa): every pair of values appears
    (causal, padding, balance, method, gqa)
    for causal, padding, balance, method, gqa in itertools.product(
        (True, False), (False, True), (True, False), ("ring", "allgather"), (False, True))
]


def attention_cases(cases):
    """Each case on this rank: the whole sequence's output and gradients, gathered."""
    mesh = _cp_mesh()
    results = []
    for causal, padding, balance, method, gqa in cases:
        q, k, v, weight, mask = _inputs(kv_heads=2 if gqa else 4)
        local = [shard_sequence(t, mesh, 2, load_balance=balance).requires_grad_()
                 for t in (q, k, v)]
        local_mask = shard_sequence(mask, mesh, 1, load_balance=balance) if padding else None
        with comm_stats() as stats:
            out = ring_attention(*local, mesh, is_causal=causal, load_balance=balance,
                                 key_padding_mask=local_mask, method=method)
            (out * shard_sequence(weight, mesh, 2, load_balance=balance)).sum().backward()
        whole = [gather_sequence(t, mesh, 2, load_balance=balance).detach()
                 for t in (out, *(x.grad for x in local))]
        results.append((whole, stats.by_collective()))
    return results


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_attention_over_the_split_sequence_equals_attention_over_the_whole(mesh_pool, cp):
    """Causal and not, with and without a padding mask, load-balanced and contiguous, ring
    and all-gather, grouped-query heads: output and the gradients of q, k and v equal torch's
    scaled_dot_product_attention on the whole sequence (1e-10, float64)."""
    for rank_results in mesh_pool.run(attention_cases, cp, CASES):
        for case, (whole, stats) in zip(CASES, rank_results, strict=True):
            causal, padding, _, method, gqa = case
            q, k, v, weight, mask = _inputs(kv_heads=2 if gqa else 4)
            expected = _reference(q, k, v, weight, causal, mask if padding else None)
            for ours, theirs in zip(whole, expected, strict=True):
                torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10, msg=str(case))
            messages = 3 if padding else 2  # k, v (and the mask) per ring step
            if method == "ring":
                # forward: cp - 1 steps; backward: cp - 1 steps of the blocks, and cp of
                # their gradients (dk, dv), the last one home to the owner
                sends = 2 * (cp - 1) * messages + cp * 2 if cp > 1 else 0
                assert stats.get("send", (0,))[0] == stats.get("recv", (0,))[0] == sends, (
                    case, stats)
            else:
                gathers = stats.get("all_gather", (0,))[0]
                assert "send" not in stats and gathers >= 2 * (cp > 1), (case, stats)


# (sliding window, chunk size, load balance, method): windows narrower than a chunk of a
# rank, as wide, wider than a rank's share, wider than the sequence; chunks across ranks
BANDS = [(1, None, True, "ring"), (3, None, True, "ring"), (4, None, False, "ring"),
         (5, None, True, "allgather"), (9, None, True, "ring"), (20, None, False, "allgather"),
         (None, 3, True, "ring"), (None, 8, False, "ring"), (None, 6, True, "allgather"),
         (5, 8, True, "ring")]


def band_cases(cases):
    """Each windowed case on this rank: the whole sequence's output and gradients."""
    mesh = _cp_mesh()
    results = []
    for window, chunk, balance, method in cases:
        q, k, v, weight, _ = _inputs(kv_heads=2)
        local = [shard_sequence(t, mesh, 2, load_balance=balance).requires_grad_()
                 for t in (q, k, v)]
        out = ring_attention(*local, mesh, is_causal=True, load_balance=balance,
                             method=method, sliding_window=window, chunk_size=chunk)
        (out * shard_sequence(weight, mesh, 2, load_balance=balance)).sum().backward()
        results.append([gather_sequence(t, mesh, 2, load_balance=balance).detach()
                        for t in (out, *(x.grad for x in local))])
    return results


def _band_reference(q, k, v, weight, window, chunk):
    """torch's attention on the whole sequence with the band's mask, as transformers builds
    a sliding layer's (a query sees keys at distances below the window) or a chunked one's."""
    position = torch.arange(q.shape[-2])
    mask = position[:, None] >= position[None, :]
    if window is not None:
        mask &= position[:, None] - position[None, :] < window
    if chunk is not None:
        mask &= position[:, None] // chunk == position[None, :] // chunk
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("cp", [2, 4])
def test_windowed_attention_over_the_split_sequence_equals_it_over_the_whole(mesh_pool, cp):
    """A sliding window or aligned chunks (transformers' sliding and chunked layers) by the
    tokens' positions in the whole sequence, however the window falls across the ranks'
    chunks: output and gradients equal torch's attention with the band's mask (1e-10)."""
    for rank_results in mesh_pool.run(band_cases, cp, BANDS):
        for case, whole in zip(BANDS, rank_results, strict=True):
            q, k, v, weight, _ = _inputs(kv_heads=2)
            expected = _band_reference(q, k, v, weight, case[0], case[1])
            for ours, theirs in zip(whole, expected, strict=True):
                torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10, msg=str(case))


def sharding_round_trip():
    mesh = _cp_mesh()
    x = torch.arange(2 * 16).reshape(2, 16, 1)
    local = shard_sequence(x, mesh, 1)
    positions = sequence_positions(16, mesh)
    errors = [caught(lambda: shard_sequence(torch.zeros(2, 12, 1), mesh, 1)),
              caught(lambda: shard_sequence(torch.zeros(2, 10, 1), mesh, 1, load_balance=False))]
    return (local[0, :, 0].tolist(), positions.tolist(),
            gather_sequence(local, mesh, 1).equal(x), errors)


def test_each_rank_holds_a_head_and_a_tail_chunk_and_bad_lengths_are_refused(mesh_pool):
    results = mesh_pool.run(sharding_round_trip, 4)
    chunks = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    for rank, (tokens, positions, round_trip, errors) in enumerate(results):
        assert tokens == positions == chunks[rank] + chunks[7 - rank]
        assert round_trip
        assert errors[0] == ("ParallelizeError",
                             f"[rank {rank}] shard_sequence: a sequence of 12 tokens does not "
                             "split into 8 equal chunks over cp = 4: pad it to a multiple of 8 "
                             "(2 x cp, a head and a tail chunk per rank), or pass "
                             "load_balance=False")
        assert errors[1][1].endswith("a sequence of 10 tokens does not split into 4 equal "
                                     "chunks over cp = 4: pad it to a multiple of 4")


class Block(nn.Module):
    """A pre-norm transformer block on scaled_dot_product_attention (causal by default)."""

    def __init__(self, dim: int = 16, heads: int = 4, causal: bool = True) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=self.causal)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, vocab: int = 32, length: int = 16, dim: int = 16,
                 causal: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(length, dim)
        self.blocks = nn.Sequential(Block(dim, causal=causal), Block(dim, causal=causal))
        self.head = nn.Linear(dim, vocab)
        self.double()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens) + self.pos(positions)))


def _batches(steps: int = 3, length: int = 16):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 32, (2, length + 1), generator=gen) for _ in range(steps)]


def train_one_process(causal: bool = True):
    model = Model(causal=causal)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in _batches():
        tokens, targets = batch[:, :-1], batch[:, 1:]
        logits = model(tokens, torch.arange(16))
        loss = F.cross_entropy(logits.reshape(-1, 32), targets.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def train_context_parallel(method: str, causal: bool = True):
    """Each rank runs the model on its tokens; the loss is the sum of its tokens' losses over
    all tokens, and gradients are summed over cp (what FSDP over (dp, cp) does)."""
    mesh = _cp_mesh()
    model = context_parallel(Model(causal=causal), mesh, method=method)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    positions = sequence_positions(16, mesh)
    losses = []
    for batch in _batches():
        tokens, targets = (shard_sequence(t, mesh, 1) for t in (batch[:, :-1], batch[:, 1:]))
        logits = model(tokens, positions)
        loss = F.cross_entropy(logits.reshape(-1, 32), targets.reshape(-1),
                               reduction="sum") / targets.new_tensor(batch[:, 1:].numel())
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        opt.step()
        losses.append(whole.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("cp, method, causal", [
    (2, "ring", True), (4, "ring", True), (2, "allgather", True), (2, "ring", False),
    (4, "ring", False)])
def test_a_transformer_trains_under_context_parallelism_as_in_one_process(mesh_pool, cp,
                                                                          method, causal):
    losses, params = train_one_process(causal)
    for ours, mine in mesh_pool.run(train_context_parallel, cp, method, causal):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(losses), rtol=1e-10,
                                   atol=1e-10)
        for name, value in params.items():
            torch.testing.assert_close(mine[name], value, rtol=1e-10, atol=1e-10, msg=name)


def refused_inputs():
    mesh = _cp_mesh()
    q = torch.zeros(1, 2, 4, 8)
    return [
        caught(lambda: ring_attention(q, q, q, mesh, method="flash")),
        caught(lambda: ring_attention(q, torch.zeros(1, 3, 4, 8), torch.zeros(1, 3, 4, 8),
                                      mesh)),
        caught(lambda: context_parallel(nn.Linear(2, 2), init_device_mesh(
            "cpu", (1, int(os.environ["WORLD_SIZE"]))))),
        caught(lambda: context_parallel(Model(), mesh)(torch.zeros(1, 5, dtype=torch.long),
                                                       torch.arange(5))),
        caught(lambda: ring_attention(q, q, q, mesh, sliding_window=2)),  # not causal
        caught(lambda: ring_attention(q, q, q, mesh, is_causal=True, chunk_size=0)),
        caught(lambda: context_parallel(nn.Linear(2, 2), mesh, sliding_window=2.5)),
    ]


def test_bad_inputs_are_refused_on_every_rank_naming_the_fix(mesh_pool):
    for rank, errors in enumerate(mesh_pool.run(refused_inputs, 2)):
        assert errors[0] == ("ParallelizeError", f"[rank {rank}] context parallelism's method "
                             "must be one of ('ring', 'allgather'), got 'flash'")
        assert "a head count dividing its heads" in errors[1][1]
        assert "takes the 1-D mesh of the context-parallel dim, e.g. mesh['cp']" in errors[2][1]
        # 5 local tokens on each of 2 ranks: 10 do not split into a head and a tail chunk each
        assert errors[3][1].endswith("ring_attention: a sequence of 10 tokens does not split "
                                     "into 4 equal "
                                     "chunks over cp = 2: pad it to a multiple of 4 (2 x cp, "
                                     "a head and a tail chunk per rank), or pass "
                                     "load_balance=False")
        assert "attends within a sliding window or a chunk causally only: pass " \
            "is_causal=True" in errors[4][1]
        assert "ring_attention chunk_size=0: give a number of tokens, 1 or more" in errors[5][1]
        assert "context_parallel sliding_window=2.5: give a number of tokens" in errors[6][1]


class HeadsBlock(nn.Module):
    """Attention with separate q, k and v projections (tensor parallelism splits their
    heads), head dim fixed, so a rank's heads follow from its projection's width."""

    def __init__(self, dim: int = 16, head_dim: int = 4) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(a.transpose(1, 2).reshape(b, s, -1))


class HeadsModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.pos = nn.Embedding(32, 16), nn.Embedding(16, 16)
        self.blocks = nn.Sequential(HeadsBlock(), HeadsBlock())
        self.head = nn.Linear(16, 32)
        self.double()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens) + self.pos(positions)))


def _token_batches(rows: int, steps: int = 3):
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, 32, (rows, 17), generator=gen) for _ in range(steps)]


def train_heads_one_process(rows: int):
    model = HeadsModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in _token_batches(rows):
        loss = F.cross_entropy(model(batch[:, :-1], torch.arange(16)).reshape(-1, 32),
                               batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def train_cp_with(other: str):
    """CP 2 with FSDP over the flattened (dp, cp) dims (dp 2), or with TP 2 on the heads."""
    from devmesh.parallel import (ColwiseParallel, RowwiseParallel, fully_shard,
                                  parallelize_module)

    names = ("dp", "cp") if other == "fsdp" else ("cp", "tp")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    cp = mesh["cp"]
    model = HeadsModel()
    if other == "fsdp":
        shard_over = mesh["dp", "cp"]._flatten("dp_cp")
        for block in model.blocks:
            fully_shard(block, mesh=shard_over)
        fully_shard(model, mesh=shard_over)
    else:
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"q": ColwiseParallel(), "k": ColwiseParallel(),
                                                   "v": ColwiseParallel(),
                                                   "out": RowwiseParallel()})
    context_parallel(model, cp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp = mesh.get_local_rank("dp") if other == "fsdp" else 0
    rows = 2 if other == "fsdp" else 4
    losses = []
    with comm_stats() as stats:
        for batch in _token_batches(4):
            batch = batch[dp * rows:(dp + 1) * rows]
            tokens, targets = (shard_sequence(t, cp, 1) for t in (batch[:, :-1], batch[:, 1:]))
            logits = model(tokens, sequence_positions(16, cp))
            # each rank's mean over its tokens: FSDP averages over dp x cp ranks of equal
            # token counts; without FSDP the cp ranks' gradients are summed, halved
            loss = F.cross_entropy(logits.reshape(-1, 32), targets.reshape(-1))
            opt.zero_grad()
            loss.backward()
            if other == "tp":
                for p in model.parameters():
                    dist.all_reduce(p.grad, group=cp.get_group())
                    p.grad /= 2
            whole = loss.detach().clone()
            dist.all_reduce(whole)
            opt.step()
            losses.append(whole.item() / 4)  # the mean of the 4 ranks' (equal-sized) means
    full = {}
    for name, value in model.state_dict().items():
        full[name] = value.full_tensor() if hasattr(value, "full_tensor") else value
    return losses, full, stats.by_collective()


@pytest.mark.parametrize("other", ["fsdp", "tp"])
def test_context_parallelism_composes_with_fsdp_and_tensor_parallelism(mesh_pool, other):
    """CP x FSDP (FSDP over the flattened (dp, cp) dims, dp 2) and CP x TP (TP 2 on heads),
    on 4 ranks, train equal to one process on the whole batch."""
    losses, params = train_heads_one_process(4)
    for ours, mine, stats in mesh_pool.run(train_cp_with, 4, other):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(losses), rtol=1e-10,
                                   atol=1e-10)
        for name, value in params.items():
            torch.testing.assert_close(mine[name], value, rtol=1e-10, atol=1e-10, msg=name)
        assert stats["send"][0] > 0  # the ring ran


class Embed(nn.Module):
    """Token and position embeddings; ``positions``: this rank's tokens' places."""

    def __init__(self, positions: torch.Tensor) -> None:
        super().__init__()
        self.tokens, self.places = nn.Embedding(32, 16), nn.Embedding(16, 16)
        self.register_buffer("positions", positions, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tokens(tokens) + self.places(self.positions)


def _pipeline_model(positions: torch.Tensor) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Embed(positions), Block(), Block(), nn.Linear(16, 32)).double()


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, 32), targets.reshape(-1))


def pipeline_one_process():
    model = _pipeline_model(torch.arange(16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in _token_batches(4):
        opt.zero_grad()
        _token_loss(model(batch[:, :-1]), batch[:, 1:]).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def train_cp_pipeline():
    """PP 2 (1F1B, 2 micro-batches) x CP 2: each stage's attention runs over cp."""
    from devmesh.parallel.pipeline import PipelineRunner, build_schedule, split_sequential

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "cp"))
    cp = mesh["cp"]
    model = _pipeline_model(sequence_positions(16, cp))
    schedule = build_schedule("1f1b", ranks=2, microbatches=2)
    parts = split_sequential(model, schedule.stages)
    me = mesh.get_local_rank("pp")
    stages = {s: context_parallel(parts[s], cp) for s in range(schedule.stages)
              if schedule.rank_of(s) == me}
    runner = PipelineRunner(stages, mesh, schedule, _token_loss)
    opt = torch.optim.AdamW(runner.module.parameters(), lr=1e-2)
    with comm_stats() as stats:
        for batch in _token_batches(4):
            tokens, targets = (shard_sequence(t, cp, 1) for t in (batch[:, :-1], batch[:, 1:]))
            opt.zero_grad()
            runner.step(tokens if 0 in stages else None, targets if 1 in stages else None)
            for p in runner.module.parameters():  # each cp rank's mean over its tokens
                dist.all_reduce(p.grad, group=cp.get_group())
                p.grad /= 2
            opt.step()
    return runner.state_dict(full=True), stats.by_collective()


def test_context_parallel_stages_in_a_pipeline_train_as_one_process(mesh_pool):
    expected = pipeline_one_process()
    for full, stats in mesh_pool.run(train_cp_pipeline, 4):
        for name, value in expected.items():
            torch.testing.assert_close(full[name], value, rtol=1e-10, atol=1e-10, msg=name)
        assert stats["send"][0] > 0
