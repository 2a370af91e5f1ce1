"""DDP's communication hooks on devmesh's ``replicate``: ``register_comm_hook(state, hook)``
with torch's own hooks (fp16 compression, PowerSGD) trains as torch's DDP-based
``replicate`` with the same hook, and a hook of one's own sees DDP's bucket interface."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from devmesh import comm_stats, init_device_mesh

from helpers import TorchRuns, caught


class Net(nn.Module):
    """Four linear layers; the last one skipped when asked (an unused parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 16), nn.ReLU(),
                                  nn.Linear(16, 5))
        self.last = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor, skip_last: bool = False) -> torch.Tensor:
        out = self.body(x)
        return out if skip_last else self.last(out)


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 12, generator=gen), torch.randint(0, 5, (6,), generator=gen)


def _hook(name: str):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    if name == "fp16":
        return None, default_hooks.fp16_compress_hook
    if name == "allreduce":
        return None, default_hooks.allreduce_hook
    # PowerSGD: plain all-reduce for the first 2 steps, then rank-1 approximations with
    # error feedback (state per bucket, by its index; steps counted by its last bucket)
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                   start_powerSGD_iter=2, min_compression_rate=0.5,
                                   use_error_feedback=True, warm_start=True, random_seed=0)
    return state, powersgd.powerSGD_hook


def _waited(hook):
    """``hook``, returning only once its collectives are done. PowerSGD issues its second
    all-reduce from its first one's callback, on gloo's thread, where torch's DDP may issue
    its own "unused parameters" all-reduce first on one rank and second on the other (gloo
    then aborts the process: 4 runs of 6 here): waited, torch's side is
    deterministic. devmesh's replicate orders a hook's collectives itself."""
    def waited(state, bucket):
        future = hook(state, bucket)
        future.wait()
        return future
    return waited


def trained_with_hook(library: str, hook_name: str, steps: int = 4, unused: bool = True):
    """SGD on each rank's batches with ``hook_name`` reducing the gradients; with ``unused``
    the last layer is skipped on odd steps (DDP's reducer gives an unused parameter no
    gradient)."""
    if library == "devmesh":
        from devmesh.parallel import replicate
    else:
        from torch.distributed._composable.replicate import replicate
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    model = make_model()
    replicate(model, device_mesh=mesh, find_unused_parameters=unused)
    state, hook = _hook(hook_name)
    if library == "torch" and hook_name == "powersgd":
        hook = _waited(hook)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses, unused_grads = [], []
    for step in range(steps):
        x, y = _batch(step, dist.get_rank())
        loss = F.cross_entropy(model(x, skip_last=unused and bool(step % 2)), y)
        loss.backward()
        unused_grads.append(model.last.weight.grad is None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "unused": unused_grads,
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.fixture(scope="module")
def torch_runs() -> TorchRuns:
    return TorchRuns({2: [(trained_with_hook, ("torch", name))
                          for name in ("fp16", "powersgd")]})


@pytest.mark.parametrize("hook_name", ["fp16", "powersgd"])
def test_torchs_hooks_train_as_under_torchs_replicate(mesh_pool, torch_runs, hook_name):
    ours = mesh_pool.run(trained_with_hook, 2, "devmesh", hook_name)
    theirs = torch_runs(2, trained_with_hook, "torch", hook_name)
    for a, b in zip(ours, theirs):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-6, abs=1e-7)
        assert a["unused"] == b["unused"] == [False, True, False, True]
        for key in b["params"]:
            torch.testing.assert_close(a["params"][key], b["params"][key], rtol=1e-6,
                                       atol=1e-7, msg=key)
    # the replicas agree, and the compression changed the result (the hook ran)
    for key in ours[0]["params"]:
        torch.testing.assert_close(ours[0]["params"][key], ours[1]["params"][key])
    plain = mesh_pool.run(trained_with_hook, 2, "devmesh", "allreduce")[0]
    assert any(not torch.equal(plain["params"][k], ours[0]["params"][k])
               for k in plain["params"])


def own_hook():
    """A hook of one's own: what it sees of each bucket, and a sum it divides itself."""
    from devmesh.parallel import replicate

    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    seen = []

    def hook(group, bucket):
        grads = bucket.gradients()
        seen.append((bucket.index(), bucket.is_last(),
                     [tuple(p.shape) for p in bucket.parameters()],
                     all(g.data_ptr() >= bucket.buffer().data_ptr() for g in grads),
                     torch.equal(torch.cat([g.reshape(-1) for g in grads]), bucket.buffer())))
        flat = bucket.buffer().div_(dist.get_world_size(group))
        return dist.all_reduce(flat, group=group, async_op=True).get_future().then(
            lambda fut: fut.value()[0])

    results = {}
    for hooked in (False, True):
        model = make_model()
        replicate(model, mesh=mesh, bucket_cap_mb=(24 * 12 + 24) * 4 / 2**20)
        if hooked:
            model.register_comm_hook(mesh.get_group(), hook)
        x, y = _batch(0, dist.get_rank())
        with comm_stats() as stats:
            F.cross_entropy(model(x), y).backward()
        results[hooked] = ([p.grad.clone() for p in model.parameters()],
                           dict(stats.by_collective()))
    errors = [caught(lambda: model.register_comm_hook(None, hook))]
    other = make_model()
    replicate(other, mesh=mesh)
    other.register_comm_hook(None, lambda state, bucket: bucket.buffer())  # not a future
    errors.append(caught(lambda: F.cross_entropy(other(x), y).backward()))
    return seen, results, errors


def test_a_hook_of_ones_own_gets_ddps_bucket_and_replaces_the_averaging(mesh_pool):
    for seen, results, errors in mesh_pool.run(own_hook, 2):
        # buckets of the cap's size (the first layer's bytes), the last parameters first
        # and in registration order inside a bucket, as DDP's
        assert [(i, last) for i, last, *_ in seen] == [(0, False), (1, True)]
        assert seen[1][2] == [(24, 12), (24,)]
        assert seen[0][2] == [(16, 24), (16,), (5, 16), (5,), (5, 5), (5,)]
        assert all(views and flat for *_, views, flat in seen)
        plain, hooked = results[False], results[True]
        for a, b in zip(plain[0], hooked[0]):
            torch.testing.assert_close(a, b)
        # the hook's 2 all-reduces run on its group (outside devmesh's counts); devmesh
        # adds one for the "used" flags of all buckets, where it ran 2 of its own before
        assert plain[1]["all_reduce"][0] == 2 and hooked[1]["all_reduce"][0] == 1
        assert errors[0][0] == "ParallelizeError" and "can only be called once" in errors[0][1]
        assert errors[1][0] == "ParallelizeError" and "returned a Tensor: a hook returns a " \
            "torch.futures.Future" in errors[1][1]


def hook_state_on_part_of_the_world():
    """A model replicated over ``dp`` of a (dp, tp) mesh: torch's hooks given no group would
    average over all 4 ranks (tp too); devmesh warns, and the dp group gives the right sum."""
    import warnings

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from devmesh.parallel import replicate

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    heard = []
    for state in (None, mesh["dp"].get_group()):
        model = make_model()
        replicate(model, mesh=mesh["dp"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.register_comm_hook(state, default_hooks.allreduce_hook)
        heard.append([str(w.message) for w in caught])
    x, y = _batch(0, mesh.get_local_rank("dp"))
    F.cross_entropy(model(x), y).backward()
    plain = make_model()
    replicate(plain, mesh=mesh["dp"])
    F.cross_entropy(plain(x), y).backward()
    same = all(torch.allclose(a.grad, b.grad) for a, b in zip(model.parameters(),
                                                                plain.parameters()))
    return heard, same


def test_a_hook_without_a_group_on_part_of_the_world_is_warned_of(mesh_pool):
    for (heard_none, heard_group), same in mesh_pool.run(hook_state_on_part_of_the_world, 4):
        assert len(heard_none) == 1 and "the hook's state names no process group" in \
            heard_none[0] and "mesh.get_group()" in heard_none[0]
        assert heard_group == [] and same


def test_every_method_torchs_replicate_adds_to_a_module_is_devmeshs():
    """torch's DDP-based ``replicate`` makes a module's class a subclass of its ``DDP``
    mixin; each of that mixin's public methods is on devmesh's replicated modules too."""
    from torch.distributed._composable.replicate import DDP

    from devmesh.parallel.replicate import ReplicateModule

    theirs = {name for name in vars(DDP) if not name.startswith("_")}
    assert theirs == {"set_requires_gradient_sync", "register_comm_hook"}  # torch 2.13's
    assert all(callable(getattr(ReplicateModule, name, None)) for name in theirs)
