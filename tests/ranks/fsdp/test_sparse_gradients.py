"""Sparse embeddings (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``) — the
usual recommendation for large vocabularies with ``torch.optim.SparseAdam`` — train under
``replicate`` as single-process training does, with gradients that stay sparse, as under
torch's DDP; ``fully_shard`` refuses them by name (its reduce-scatter cannot shard a sparse
gradient), and keeping one out of the unit and replicating it works."""

from __future__ import annotations

import torch
from torch import nn

from devmesh import init_device_mesh
from devmesh.parallel import fully_shard, replicate, state_dict
from helpers import caught

WORLD, STEPS, PER_RANK = 2, 3, 3


class Tagger(nn.Module):
    """Word and tag embeddings (sparse), a dense head; the tag bag is used only where
    ``use_tags`` is set (see :func:`_uses_tags`: on some steps one rank, on one none)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embeddings = nn.ModuleDict({"words": nn.Embedding(30, 6, sparse=True),
                                         "tags": nn.EmbeddingBag(10, 6, mode="sum",
                                                                 sparse=True)})
        self.head = nn.Linear(6, 2)
        self.use_tags = True

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        h = self.embeddings["words"](words).mean(dim=1)
        if self.use_tags:
            h = h + self.embeddings["tags"](words % 10)
        return self.head(torch.tanh(h))


def _batch(step: int, rank: int):
    gen = torch.Generator().manual_seed(100 * step + rank)
    words = torch.randint(0, 30, (PER_RANK, 4), generator=gen)
    return words, torch.randn(PER_RANK, 2, generator=gen)


def _uses_tags(step: int, rank: int) -> bool:
    return (step + rank) % 3 == 0  # step 0: rank 0, step 1: neither, step 2: rank 1


def _optimizers(model: Tagger):
    sparse = list(model.embeddings.parameters())
    return [torch.optim.SparseAdam(sparse, lr=0.05),
            torch.optim.Adam(model.head.parameters(), lr=0.05)]


def _step(model: Tagger, optimizers, batches, step: int) -> list[bool]:
    for rank, (words, target) in batches:  # several batches: accumulated
        model.use_tags = _uses_tags(step, rank)
        (((model(words) - target) ** 2).mean() / len(batches)).backward()
    sparse = [p.grad is None or p.grad.is_sparse for p in model.embeddings.parameters()]
    for opt in optimizers:
        opt.step()
        opt.zero_grad()
    return sparse


def _single() -> dict[str, torch.Tensor]:
    model = Tagger()
    optimizers = _optimizers(model)
    for step in range(STEPS):
        # the mean over the ranks' batches is the mean over the global batch
        _step(model, optimizers, [(r, _batch(step, r)) for r in range(WORLD)], step)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _parallel(how: str, accumulate: bool):
    import torch.distributed as dist

    mesh = init_device_mesh("cpu", (WORLD,))
    rank = dist.get_rank()
    model = Tagger()
    if how == "replicate":
        replicate(model, mesh=mesh)
    else:  # the embeddings out of the FSDP unit, replicated; the rest sharded
        replicate(model.embeddings, mesh=mesh)
        fully_shard(model, mesh=mesh, ignored_params=set(model.embeddings.parameters()))
    optimizers = _optimizers(model)
    stayed_sparse = []
    for step in range(STEPS):
        words, target = _batch(step, rank)
        model.use_tags = _uses_tags(step, rank)
        if accumulate:  # the same batch in two micro-batches, the first without sync
            model.set_requires_gradient_sync(False)
            model(words[:1]).sub(target[:1]).pow(2).sum().div(target.numel()).backward()
            model.set_requires_gradient_sync(True)
            model(words[1:]).sub(target[1:]).pow(2).sum().div(target.numel()).backward()
            sparse = [p.grad is None or p.grad.is_sparse for p in model.embeddings.parameters()]
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
            stayed_sparse.append(all(sparse))
        else:
            stayed_sparse.append(all(_step(model, optimizers, [(rank, (words, target))], step)))
    full = state_dict(model, full=True)
    return {k: v.detach().clone() for k, v in full.items()}, stayed_sparse


def test_sparse_embeddings_under_replicate_train_as_single_process(mesh_pool):
    expected = _single()
    for accumulate in (False, True):
        for full, stayed_sparse in mesh_pool.run(_parallel, WORLD, "replicate", accumulate):
            assert all(stayed_sparse)
            assert full.keys() == expected.keys()
            for name, value in expected.items():
                torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6,
                                           msg=f"{name} (accumulate={accumulate})")


def test_fully_shard_refuses_a_sparse_embedding_and_takes_it_replicated_beside(mesh_pool):
    def refused():
        mesh = init_device_mesh("cpu", (WORLD,))
        return caught(lambda: fully_shard(Tagger(), mesh=mesh))

    for kind, message in mesh_pool.run(refused, WORLD):
        assert kind == "ParallelizeError"
        assert "embeddings.words" in message and "sparse=True" in message and "ignored_params" in message

    expected = _single()
    for full, stayed_sparse in mesh_pool.run(_parallel, WORLD, "fsdp+replicate", False):
        assert all(stayed_sparse)
        for name, value in expected.items():
            torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=name)
