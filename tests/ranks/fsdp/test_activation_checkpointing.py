"""Activation checkpointing (``torch.utils.checkpoint``) with ``fully_shard`` units and under
``replicate``: training must equal single-process training, and the checkpoint must
recompute (not silently keep every activation).

Both orders: a checkpoint around a unit (its recomputation runs the unit's hooks again), and
torchtitan's, a unit around a checkpoint (``checkpoint_wrapper`` first, ``fully_shard`` on
the wrapper): its recomputation runs the wrapped block alone, in backward, where devmesh's
parameters were the shards — ``CheckpointError`` (metadata differ) or a shape mismatch
(reentrant) until the block's modules were given the gathered parameters there, as torch's
FSDP2 has them unsharded for a unit's whole backward."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from devmesh import comm_stats, init_device_mesh
from devmesh.parallel import fully_shard, replicate, state_dict
from helpers import TorchRuns, full_params, shard_blocks_and_root


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.l2(torch.relu(self.l1(x)))


class Net(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        # a layer before the blocks: reentrant checkpointing backpropagates through a block
        # only if an input of it requires grad (else no block would train, here or in the
        # reference, and the comparison would say nothing about them)
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(8, 3)
        self.checkpoint_blocks = True  # off: the blocks checkpoint themselves (wrapped)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = (checkpoint(block, x, use_reentrant=self.reentrant) if self.checkpoint_blocks
                 else block(x))
        return self.head(x)


def _batch(step: int):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=gen), torch.randint(0, 3, (16,), generator=gen)


def train(strategy: str, reentrant: bool):
    import torch.distributed as dist

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    model = Net(reentrant)
    if strategy == "fsdp":
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        replicate(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    rank = dist.get_rank()
    for step in range(3):
        x, y = _batch(step)
        F.cross_entropy(model(x[4 * rank: 4 * rank + 4]), y[4 * rank: 4 * rank + 4]).backward()
        opt.step()
        opt.zero_grad()
    return state_dict(model, full=True)


def reference(reentrant: bool):
    model = Net(reentrant)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(3):
        x, y = _batch(step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("strategy", ["fsdp", "replicate"])
def test_activation_checkpointing_matches_single_process(mesh_pool, strategy, reentrant):
    expected = reference(reentrant)
    for params in mesh_pool.run(train, 4, strategy, reentrant):
        for key, value in expected.items():
            torch.testing.assert_close(params[key], value, rtol=1e-5, atol=1e-6, msg=key)


def _wrapped_net(mode: str) -> nn.Module:
    """torchtitan's order: each block in torch's ``checkpoint_wrapper``, to be sharded;
    ``mode`` "reentrant", "non-reentrant" or "selective" (torch's selective checkpointing,
    the matrix products saved: torchtitan's "op" mode)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    net = Net(mode == "reentrant")
    kwargs = {"checkpoint_impl": CheckpointImpl.REENTRANT if mode == "reentrant"
              else CheckpointImpl.NO_REENTRANT}
    if mode == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        kwargs["context_fn"] = functools.partial(
            create_selective_checkpoint_contexts, [torch.ops.aten.addmm.default])
    net.blocks = nn.ModuleList([checkpoint_wrapper(b, **kwargs) for b in net.blocks])
    net.checkpoint_blocks = False
    return net


def _train_wrapped(kind: str, mode: str):
    """Three Adam steps; the blocks' forwards counted (a recomputation runs each again)."""
    import torch.distributed as dist

    model = shard_blocks_and_root(_wrapped_net(mode), kind)
    rank, world = (0, 1) if kind == "one process" else (dist.get_rank(), dist.get_world_size())
    calls = [0]
    for block in model.blocks:
        block._checkpoint_wrapped_module.l1.register_forward_hook(
            lambda *_: calls.__setitem__(0, calls[0] + 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    counts = []
    for step in range(3):
        x, y = _batch(step)
        per = 16 // world
        rows = slice(rank * per, (rank + 1) * per)
        with comm_stats() as stats:
            F.cross_entropy(model(x[rows]), y[rows]).backward()
        counts.append(stats.by_collective().get("all_gather", (0,))[0])
        opt.step()
        opt.zero_grad()
    return {"params": full_params(model, kind), "forwards": calls[0], "all_gathers": counts}


@pytest.fixture(scope="module")
def torch_runs() -> TorchRuns:
    """torch's FSDP2 side (fresh processes: its groups outlive a pool task)."""
    return TorchRuns({2: [(_train_wrapped, ("torch", mode)) for mode in _MODES]})


_MODES = ("non-reentrant", "reentrant", "selective")


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("mode", _MODES)
def test_a_unit_around_a_checkpoint_recomputes_and_trains_as_one_process(mesh_pool, torch_runs,
                                                                        mode):
    """Selective checkpointing replays the forward's operations one for one: the gather for
    the recomputation runs outside its dispatch mode (inside, it failed: "aten.empty
    encountered during backward but not found in storage")."""
    expected = _train_wrapped("one process", mode)
    assert expected["forwards"] == 3 * 3 * 2  # 3 steps x 3 blocks x (forward + recompute)
    for kind, results in (("torch", torch_runs(2, _train_wrapped, "torch", mode)),
                          ("devmesh", mesh_pool.run(_train_wrapped, 2, "devmesh", mode))):
        for result in results:
            assert result["forwards"] == expected["forwards"], kind
            for key, value in expected["params"].items():
                torch.testing.assert_close(result["params"][key], value, rtol=1e-5,
                                           atol=1e-6, msg=lambda m: f"{kind} {key}: {m}")
            if kind == "devmesh":  # per step: the root's and each block's forward gather,
                # and each block's one re-gather for its recomputation and backward
                assert result["all_gathers"] == [1 + 3 * 2] * 3


def _wrapped_and_compiled(wrapped: bool) -> nn.Module:
    """Net with its blocks in torch's checkpoint wrapper and compiled (``_orig_mod``), or not."""
    net = _wrapped_net("non-reentrant") if wrapped else Net(reentrant=False)
    if wrapped:
        for i, block in enumerate(net.blocks):
            net.blocks[i] = torch.compile(block, backend="eager")
    return net


def _move_checkpoint(path: str, wrapped_first: bool):
    """Train a step, save a checkpoint; load it into the other kind of model (wrapped and
    compiled, or plain), train again; return the names and the loaded model's parameters."""
    from devmesh.parallel import load_checkpoint, save_checkpoint

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    models = []
    for wrapped in (wrapped_first, not wrapped_first):
        model = _wrapped_and_compiled(wrapped)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        models.append(model)
    first, second = models
    opt = torch.optim.AdamW(first.parameters(), lr=0.05)
    x, y = _batch(0)
    F.cross_entropy(first(x), y).backward()
    opt.step()
    opt.zero_grad()
    save_checkpoint(path, first, opt)
    opt2 = torch.optim.AdamW(second.parameters(), lr=0.05)
    load_checkpoint(path, second, opt2)
    for model, optimizer in ((first, opt), (second, opt2)):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {"names": [list(state_dict(m, full=True)) for m in models],
            "params": [state_dict(m, full=True) for m in models]}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("wrapped_first", [True, False], ids=["wrapped-to-plain",
                                                              "plain-to-wrapped"])
def test_a_checkpoint_moves_between_wrapped_and_plain_models(mesh_pool, tmp_path,
                                                             wrapped_first):
    """State-dict names leave out what wrappers insert (``_checkpoint_wrapped_module``, as
    ``nn.Module.state_dict()`` does; ``_orig_mod``, as torch's DCP does): a checkpoint saved
    with activation checkpointing and compiled blocks loads into the plain model, and back
    (before: every key missing)."""
    plain = Net(reentrant=False)
    wrapped = _wrapped_and_compiled(True)
    assert list(wrapped.state_dict()) != list(plain.state_dict())  # _orig_mod is in torch's
    path = str(tmp_path / "ckpt")
    for result in mesh_pool.run(_move_checkpoint, 2, path, wrapped_first):
        assert result["names"] == [list(plain.state_dict())] * 2
        first, second = result["params"]  # one more step on the same state: the same values
        for key, value in first.items():
            torch.testing.assert_close(second[key], value, rtol=1e-6, atol=1e-7, msg=key)


def _load_a_compiled_models_state(state: dict):
    from devmesh.parallel import load_state_dict

    model = shard_blocks_and_root(Net(reentrant=False), "devmesh")
    load_state_dict(model, state)
    return state_dict(model, full=True)


def test_a_compiled_models_torch_state_dict_loads(mesh_pool):
    """torch's ``state_dict()`` of a compiled model (keys with ``_orig_mod.``) loads into the
    sharded plain model: keys are read without wrapper parts."""
    source = _wrapped_and_compiled(True)
    # other values than the target's (both start from Net's seed)
    state = {k: v.detach() * 2 + 1 for k, v in source.state_dict().items()}
    assert any("_orig_mod" in k for k in state)
    for loaded in mesh_pool.run(_load_a_compiled_models_state, 2, state):
        assert list(loaded) == list(Net(reentrant=False).state_dict())
        for key, value in state.items():
            name = key.replace("._orig_mod", "")
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)


def _copy_and_train():
    """A deep copy of a checkpointed, sharded model (an EMA or a teacher): each recomputes
    with its own units' parameters, and its gradients land in its own parameters."""
    import copy

    model = shard_blocks_and_root(_wrapped_net("non-reentrant"), "devmesh")
    twin = copy.deepcopy(model)
    x, y = _batch(0)
    grads = []
    for m in (model, twin):
        F.cross_entropy(m(x[:8]), y[:8]).backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    units = {id(m._devmesh_fsdp) for m in (*model.blocks, *twin.blocks)}
    return grads, len(units)


def test_a_copy_of_a_checkpointed_sharded_model_recomputes_with_its_own_units(mesh_pool):
    for grads, units in mesh_pool.run(_copy_and_train, 2):
        assert units == 6
        mine, copied = grads
        for name, grad in mine.items():
            assert grad is not None and copied[name] is not None, name
            torch.testing.assert_close(copied[name], grad, rtol=0, atol=0, msg=name)


def _compiled_blocks(mode: str | None):
    """torchtitan's order — checkpointing (``mode``), ``block.compile()``, ``fully_shard``
    on each block and the root — over 2 ranks, 3 Adam steps; and how often dynamo broke the
    blocks' graphs."""
    import torch.distributed as dist

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _wrapped_net(mode) if mode else Net(False)
    for block in model.blocks:
        block.compile(backend="aot_eager")
    model = shard_blocks_and_root(model, "devmesh")
    rank = dist.get_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(3):
        x, y = _batch(step)
        F.cross_entropy(model(x[8 * rank:8 * rank + 8]), y[8 * rank:8 * rank + 8]).backward()
        opt.step()
        opt.zero_grad()
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    return {"params": full_params(model, "devmesh"), "graph_breaks": breaks}


@pytest.mark.parametrize("mode", [None, "non-reentrant"], ids=["plain", "checkpointed"])
def test_compiled_blocks_under_fully_shard_are_not_split(mesh_pool, mode):
    """Each block compiles to whole graphs: the hooks devmesh puts on the modules inside a
    unit (for recomputation in backward) return at once in a compiled region. Before, their
    untraceable read of autograd's task id broke every module's graph (and the saved-tensor
    hooks after it): 18 frames compiled for 2 blocks of 3 modules instead of 2."""
    expected = _train_wrapped("one process", "non-reentrant")["params"]  # the same model
    for result in mesh_pool.run(_compiled_blocks, 2, mode):
        assert result["graph_breaks"] == 0
        for key, value in expected.items():
            torch.testing.assert_close(result["params"][key], value, rtol=1e-5, atol=1e-6,
                                       msg=key)
