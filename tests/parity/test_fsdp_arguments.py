"""torch's ``fully_shard`` and ``replicate`` arguments, as FSDP2 code passes them: devmesh
either does what torch does (compared with torch's FSDP2 on the same mesh, same data) or
refuses with a clear error — never ignores an argument silently."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from devmesh import comm_stats, init_device_mesh

from helpers import TorchRuns, caught


@pytest.fixture(scope="module")
def torch_runs() -> TorchRuns:
    """torch's FSDP2 / DDP side of this module's comparisons: one fresh launch per world size."""
    return TorchRuns({
        2: [(keyword_inputs, ("torch",)), (explicit_prefetch, ("torch",)),
            (backward_prefetch_out_of_order, ("torch",)), (grouped_units, ("torch",)),
            (chunked_head, ("torch",)), (forward_method, ("torch",)),
            (unshard_in_place, ("torch",)), (split_along_another_dim, ("torch",)),
            (mixed_precision_replicas, ("torch", "float32")),
            (mixed_precision_replicas, ("torch", None)), (tied_mixed_precision, ("torch",))],
        3: [(ddp_arguments, ("torch", True)), (ddp_arguments, ("torch", False)),
            *((batchnorm_buffers, ("torch", args)) for args in _BUFFER_ARGS)],
        4: [(side_by_side, ("torch",)), (hsdp_accumulation, ("torch", True)),
            (hsdp_by_hook_with_an_unused_layer, ("torch",)), (reshard_to_groups, ("torch",))],
    })


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 14), nn.ReLU(),
                         nn.Linear(14, 5))


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + rank)
    return torch.randn(4, 12, generator=gen), torch.randint(0, 5, (4,), generator=gen)


def _train(model: nn.Module, steps: int = 2, batch: int | None = None) -> list[float]:
    """SGD on this rank's batch (``batch``: another rank's, e.g. its data-parallel index)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        x, y = _batch(dist.get_rank() if batch is None else batch)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters, whoever sharded them (devmesh, torch's DTensor, or nobody)."""
    from devmesh.parallel import state_dict

    if hasattr(model, "_devmesh_fsdp") or hasattr(model, "_devmesh_ddp"):
        return {k: v.clone() for k, v in state_dict(model, full=True).items()}
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _same_training(ours: dict, theirs: dict, where: str = "") -> None:
    """A devmesh run's losses and full parameters equal torch's run's."""
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6, abs=1e-6)
    assert ours["params"].keys() == theirs["params"].keys()
    for key in theirs["params"]:
        torch.testing.assert_close(ours["params"][key], theirs["params"][key], rtol=1e-6,
                                   atol=1e-6, msg=f"{where}{key}")


def side_by_side(library: str):
    """FSDP2 code with torch's arguments: no mesh (the world), the default
    ``reshard_after_forward`` (None), the last layer's weight ignored, torch's own
    ``MixedPrecisionPolicy`` with an ``output_dtype`` and ``OffloadPolicy``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    if library == "devmesh":
        from devmesh.parallel import fully_shard
        world = {}  # no mesh: devmesh builds the world's
    else:
        from torch.distributed.fsdp import fully_shard
        # torch's default mesh, given explicitly: torch's own would stay cached in torch's
        # globals, with its process group, after the pool worker's task
        world = {"mesh": init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))}
    model = make_model()
    ignored = {model[4].weight}
    fully_shard(model[2], ignored_params=ignored, offload_policy=OffloadPolicy(), **world)
    fully_shard(model, ignored_params=ignored,
                mp_policy=MixedPrecisionPolicy(output_dtype=torch.float64), **world)
    # FSDPModule's setters as torchtitan calls them: layer 2's gradients summed over the 4
    # ranks, not averaged (that unit only); the others change no value
    model[2].set_gradient_divide_factor(1.0)
    model[2].set_force_sum_reduction_for_comms(True)  # torch's needs it on gloo
    model.set_reshard_after_forward(True)
    model.set_is_last_backward(True)
    losses = _train(model)
    params = _params(model)
    with torch.no_grad():  # after training: torch's root would otherwise keep its unsharded
        out_dtype = model(_batch(0)[0]).dtype  # parameters from a forward without backward
    return {"losses": losses, "params": params, "out_dtype": out_dtype,
            "ignored_is_plain": type(model[4].weight) is nn.Parameter
                                and tuple(model[4].weight.shape) == (5, 14)}


def test_torchs_fsdp2_arguments_give_torchs_result(mesh_pool, torch_runs):
    ours = mesh_pool.run(side_by_side, 4, "devmesh")
    theirs = torch_runs(4, side_by_side, "torch")
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        assert a["out_dtype"] == b["out_dtype"] == torch.float64  # output_dtype honoured
        assert a["ignored_is_plain"] and b["ignored_is_plain"]
        _same_training(a, b, f"rank {rank} ")
    # the ignored weight trained on each rank's own batch only: the ranks differ there, and
    # agree on every sharded parameter
    assert not torch.equal(ours[0]["params"]["4.weight"], ours[1]["params"]["4.weight"])
    torch.testing.assert_close(ours[0]["params"]["2.weight"], ours[1]["params"]["2.weight"])


def gathers_per_step(reshard):
    from devmesh.parallel import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    model = make_model()
    later = reshard == "set False later"
    fully_shard(model[2], mesh=mesh, reshard_after_forward=True if later else reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=True if later else reshard)
    if later:
        model.set_reshard_after_forward(False)
    x, y = _batch(0)
    with comm_stats() as stats:
        F.cross_entropy(model(x), y).backward()
    return stats.by_collective()["all_gather"][0]


def test_reshard_after_forward_none_keeps_only_the_root(mesh_pool):
    # forward gathers the root (layers 0 and 4) and layer 2; backward re-gathers layer 2,
    # and the root too when it resharded (layer 4's weight gives its input's gradient)
    assert mesh_pool.run(gathers_per_step, 2, True)[0] == 4
    assert mesh_pool.run(gathers_per_step, 2, None)[0] == 3
    assert mesh_pool.run(gathers_per_step, 2, False)[0] == 2
    assert mesh_pool.run(gathers_per_step, 2, "set False later")[0] == 2


def reshard_to_groups(library: str, size: int = 2, hsdp: bool = False):
    """torch's ``reshard_after_forward=int``: after forward the parameters are held by
    groups of ``size`` ranks, and backward gathers within a group. Uneven and empty blocks
    (20, 14 and 5 rows on 4 ranks), three units, 3 SGD steps; ``hsdp``: on 8 ranks, two
    replicas of that (each replica's batch its data-parallel index's)."""
    if library == "devmesh":
        from devmesh.parallel import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    mesh = (init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "dp")) if hsdp
            else init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))
    model = make_model()
    for unit in (model[0], model[2], model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=size)
    with comm_stats() as stats:
        losses = _train(model, steps=3, batch=dist.get_rank() % 4 if hsdp else None)
    gathers = {dims: calls for (op, dims), (calls, _) in stats.records.items()
               if op == "all_gather"}
    return {"losses": losses, "params": _params(model), "gathers": gathers}


def test_reshard_after_forward_to_groups_of_ranks_as_torchs(mesh_pool, torch_runs):
    theirs = torch_runs(4, reshard_to_groups, "torch")
    ours = mesh_pool.run(reshard_to_groups, 4, "devmesh")
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        _same_training(a, b, f"rank {rank} ")
        # a step: each unit gathered over dp in forward, again within its pair in backward
        # (model[0]'s weight needs no re-gather: its input needs no gradient); nothing else
        assert a["gathers"] == {"dp": 9, "dp_within_2": 6}, a["gathers"]
    # 1 is "keep" and 4 (the whole dim) "reshard", as torch reads them: the same training
    for size, gathers in ((1, {"dp": 9}), (4, {"dp": 15})):
        for a, b in zip(mesh_pool.run(reshard_to_groups, 4, "devmesh", size), ours):
            _same_training(a, b)
            assert a["gathers"] == gathers, (size, a["gathers"])
    # HSDP: groups within each replica's shard dim; each replica trains as the 4 ranks did
    for rank, a in enumerate(mesh_pool.run(reshard_to_groups, 8, "devmesh", 2, True)):
        _same_training(a, ours[rank % 4])
        assert a["gathers"] == {"dp": 9, "dp_within_2": 6}, a["gathers"]


def reshard_to_groups_over_tensor_parallelism(reshard, torch_styles: bool):
    """FSDP over ``dp`` of a (dp, tp) = (4, 2) mesh, over tensor parallelism (devmesh's
    styles, or torch's DTensor ones): the blocks a group of ranks holds after forward."""
    import importlib

    from devmesh.parallel import fully_shard

    styles = importlib.import_module("torch.distributed.tensor.parallel" if torch_styles
                                     else "devmesh.parallel")
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    model = make_model()
    styles.parallelize_module(model, mesh["tp"], {"0": styles.ColwiseParallel(),
                                                  "2": styles.RowwiseParallel()})
    for unit in (model[0], model[2], model):
        fully_shard(unit, mesh=mesh["dp"], reshard_after_forward=reshard)
    losses = _train(model, steps=3, batch=mesh.get_local_rank("dp"))
    return {"losses": losses, "params": _params(model)}


@pytest.mark.parametrize("torch_styles", [False, True])
def test_reshard_to_groups_over_tensor_parallelism_trains_as_resharding_all(mesh_pool,
                                                                             torch_styles):
    grouped = mesh_pool.run(reshard_to_groups_over_tensor_parallelism, 8, 2, torch_styles)
    whole = mesh_pool.run(reshard_to_groups_over_tensor_parallelism, 8, True, torch_styles)
    for a, b in zip(grouped, whole):
        assert a["losses"] == b["losses"]
        for key in b["params"]:
            assert torch.equal(a["params"][key], b["params"][key]), key


def pipelined_reshard_to_groups(reshard):
    """A (pp, dp) = (2, 4) pipeline, 1F1B over 4 micro-batches, each stage's blocks under
    ``fully_shard`` over ``dp``: two steps' all-gathers by dims, and the trained stages."""
    from devmesh.layout.schedule import build_schedule
    from devmesh.parallel import fully_shard, state_dict
    from devmesh.parallel.pipeline import PipelineRunner, split_sequential

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
    me = mesh.get_coordinate()[0]
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(4)],
                          nn.Linear(16, 4))
    stage = split_sequential(model, 2)[me]
    for block in stage:
        if isinstance(block, nn.Sequential):
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard)
    fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=reshard)
    runner = PipelineRunner({me: stage}, mesh, build_schedule("1f1b", 2, 4), F.cross_entropy)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    half = mesh["dp"].get_local_rank()
    gathers = []
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(64, 16, generator=gen), torch.randint(0, 4, (64,), generator=gen)
        with comm_stats() as stats:
            runner.step(x.chunk(4)[half] if me == 0 else None,
                        y.chunk(4)[half] if me == 1 else None)
        gathers.append({dims: calls for (op, dims), (calls, _) in stats.records.items()
                        if op == "all_gather"})
        opt.step()
        opt.zero_grad()
    return gathers, state_dict(stage, full=True), me


def test_a_pipelines_micro_batches_gather_within_groups_in_backward(mesh_pool):
    """Each micro-batch's backward gathers within its group of 2 from the rows the
    forwards kept (they stay while the micro-batches accumulate without sync), and the
    stages train bit for bit as resharding to the whole dp dim."""
    grouped = mesh_pool.run(pipelined_reshard_to_groups, 8, 2)
    whole = mesh_pool.run(pipelined_reshard_to_groups, 8, True)
    for (gathers, state, stage), (gathers_whole, state_whole, _) in zip(grouped, whole):
        for key in state_whole:
            assert torch.equal(state[key], state_whole[key]), key
        # stage 0: 2 blocks x 4 micro-batches gathered in forward, block 1 again in each
        # backward (block 0's input needs no gradient); stage 1: 2 blocks and the head,
        # each gathered in forward and in backward
        forward, backward = (8, 4) if stage == 0 else (12, 12)
        for step, whole_step in zip(gathers, gathers_whole):
            assert whole_step == {"dp": forward + backward}, whole_step
            assert step == {"dp": forward, "dp_within_2": backward}, step


def refusals():
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.tensor import Replicate, Shard

    from devmesh.parallel import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    return [
        caught(lambda: fully_shard(make_model(), mesh=mesh, reshard_after_forward=3)),
        caught(lambda: fully_shard(make_model(), mesh=mesh,
                                   shard_placement_fn=lambda p: Shard(p.ndim))),
        caught(lambda: fully_shard(make_model(), mesh=mesh, dp_mesh_dims=object())),
        caught(lambda: fully_shard(make_model(), mesh=mesh, offload_policy=CPUOffloadPolicy(),
                                   shard_placement_fn=lambda p: Shard(0))),
        # torch's list form: the modules of a group apart, each once, all modules
        caught(lambda: fully_shard([nested := make_model(), nested[2]], mesh=mesh)),
        caught(lambda: fully_shard([twice := nn.Linear(2, 2), twice], mesh=mesh)),
        caught(lambda: fully_shard([nn.Linear(2, 2), "head"], mesh=mesh)),
        caught(lambda: fully_shard([], mesh=mesh)),
        caught(lambda: fully_shard(make_model(), mesh=mesh,
                                   shard_placement_fn=lambda p: Replicate())),
    ]


def test_what_devmesh_does_not_do_is_refused_not_ignored(mesh_pool):
    for res in mesh_pool.run(refusals, 2):
        assert res[0][0] == "ParallelizeError" and "If passing reshard_after_forward as an " \
            "int, it should be a factor of 2, not 3" in res[0][1]
        assert "gave Shard(dim=2) for 0.weight, whose shape (20, 12) has no dim 2" in res[1][1]
        assert "dp_mesh_dims" in res[2][1]
        assert res[3] is None  # a CPU mesh is offloaded already; Shard(0) is the default
        assert "item 1 of the list (Linear) is inside item 0: a group's modules must be " \
            "apart" in res[4][1]
        assert "item 1 of the list (Linear) is listed twice" in res[5][1]
        assert "item 1 of the list is a str, not an nn.Module" in res[6][1]
        assert "a module or a non-empty list of modules, got []" in res[7][1]
        assert "gave Replicate() for 0.weight: devmesh's fully_shard takes Shard(dim) or " \
            "None" in res[8][1]


def ddp_arguments(library: str, init_sync: bool = True):
    """torch's replicate passes DDP's options on: the ones a DDP script sets, and
    ``init_sync=False`` with a different start on each rank (each keeps its own)."""
    model = make_model()
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    if not init_sync:
        with torch.no_grad():
            model[0].weight.add_(dist.get_rank())
    if library == "devmesh":
        from devmesh.parallel import replicate
    else:
        from torch.distributed._composable.replicate import replicate
    replicate(model, device_mesh=mesh, ignored_modules=[model[4]], init_sync=init_sync,
              find_unused_parameters=True, gradient_as_bucket_view=True, static_graph=False,
              device_ids=None)
    losses = _train(model)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("init_sync", [True, False])
def test_replicate_takes_torchs_ddp_arguments(mesh_pool, torch_runs, init_sync):
    ours = mesh_pool.run(ddp_arguments, 3, "devmesh", init_sync)
    theirs = torch_runs(3, ddp_arguments, "torch", init_sync)
    if not init_sync:  # each rank kept its own start, and trained on averaged gradients
        assert not torch.equal(ours[0][1]["0.weight"], ours[1][1]["0.weight"])
    for (losses, params), (their_losses, their_params) in zip(ours, theirs):
        assert losses == pytest.approx(their_losses, rel=1e-6, abs=1e-6)
        for key, value in their_params.items():
            torch.testing.assert_close(params[key], value, rtol=1e-6, atol=1e-6)
    assert not torch.equal(ours[0][1]["4.weight"], ours[1][1]["4.weight"])  # not averaged


def mixed_precision_replicas(library: str, reduce: str | None):
    """DDP computing in bfloat16 over float32 parameters: devmesh's replicate with an
    mp_policy against torch's FSDP-based replicate with the same policy; gradients reduced
    in ``reduce`` (None: as the running torch's FSDP2)."""
    model = make_model()
    mesh = init_device_mesh("cpu", (2,))
    kwargs = dict(param_dtype=torch.bfloat16,
                  reduce_dtype=getattr(torch, reduce) if reduce else None)
    if library == "devmesh":
        from devmesh.parallel import MixedPrecisionPolicy, replicate
    else:
        from torch.distributed._composable.replicate_with_fsdp import replicate
        from torch.distributed.fsdp import MixedPrecisionPolicy
    replicate(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(**kwargs))
    losses = _train(model, steps=3)
    dtypes = {str(p.dtype) for p in model.parameters()}
    return {"losses": losses, "params": _params(model), "dtypes": dtypes}


@pytest.mark.parametrize("reduce", ["float32", None])
def test_replicate_computes_in_an_mp_policys_dtype_as_torchs_replicate(mesh_pool, torch_runs,
                                                                         reduce):
    ours = mesh_pool.run(mixed_precision_replicas, 2, "devmesh", reduce)
    theirs = torch_runs(2, mixed_precision_replicas, "torch", reduce)
    for mine, their in zip(ours, theirs):
        assert mine["dtypes"] == their["dtypes"] == {"torch.float32"}  # the master weights
        _same_training(mine, their)
    plain = mesh_pool.run(ddp_plain_losses, 2)  # float32 compute: other losses
    assert plain[0] != pytest.approx(ours[0]["losses"], rel=1e-6)


class TiedLM(nn.Module):
    """An embedding and an output head sharing one weight (tied, as in GPT-2 and Gemma)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.relu(self.mid(self.embed(ids))))


def tied_mixed_precision(library: str):
    """A tied embedding and head computing in bfloat16 over float32 parameters: the tied
    weight is cast by each module using it, its gradient (both uses summed) reaches the one
    float32 parameter."""
    if library == "devmesh":
        from devmesh.parallel import MixedPrecisionPolicy, replicate
    else:
        from torch.distributed._composable.replicate_with_fsdp import replicate
        from torch.distributed.fsdp import MixedPrecisionPolicy
    model = TiedLM()
    replicate(model, mesh=init_device_mesh("cpu", (2,)),
              mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                             reduce_dtype=torch.float32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(3):
        ids = torch.randint(0, 16, (4, 6), generator=gen)
        loss = F.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    tied = model.head.weight is model.embed.weight
    return {"losses": losses, "params": _params(model), "tied": tied}


def test_a_tied_weight_computes_in_an_mp_policys_dtype_as_torchs_replicate(mesh_pool,
                                                                            torch_runs):
    ours = mesh_pool.run(tied_mixed_precision, 2, "devmesh")
    theirs = torch_runs(2, tied_mixed_precision, "torch")
    for mine, their in zip(ours, theirs):
        assert mine["tied"]
        _same_training(mine, their)


def ddp_plain_losses():
    from devmesh.parallel import replicate

    model = make_model()
    replicate(model, mesh=init_device_mesh("cpu", (2,)))
    return _train(model, steps=3)


def ddp_options_refused():
    from devmesh.parallel import replicate

    mesh = init_device_mesh("cpu", (2,))
    return [caught(lambda: replicate(make_model(), mesh=mesh, **{name: value}))
            for name, value in [("process_group", dist.group.WORLD), ("bucket_cap_mb_list", [1]),
                                ("device_ids", [0])]] + [
        caught(lambda: replicate([nn.Linear(2, 2), nn.Linear(2, 2)], mesh=mesh))]


def test_ddp_options_devmesh_does_not_implement_are_refused(mesh_pool):
    for results in mesh_pool.run(ddp_options_refused, 2):
        for (kind, message), name in zip(results, ["process_group", "bucket_cap_mb_list",
                                                   "device_ids"]):
            assert kind == "ParallelizeError" and f"does not take {name}" in message
            assert "pass mesh= or device_mesh=" in message
        assert results[3][0] == "ParallelizeError" and results[3][1].endswith(
            "replicate takes one module, got a list: replicate the module holding them, or "
            "each one (gradients are averaged per parameter either way); fully_shard takes a "
            "list of modules as one unit")


def test_fully_shard_without_a_mesh_outside_a_launcher_says_how_to_launch():
    from devmesh.errors import LaunchEnvironmentError
    from devmesh.parallel import fully_shard, replicate

    for apply in (fully_shard, replicate):
        with pytest.raises(LaunchEnvironmentError, match="not started by a distributed launcher"):
            apply(make_model())


def batchnorm_buffers(library: str, buffer_args: dict):
    """A BatchNorm model data-parallel, by devmesh's ``replicate`` or torch's
    ``DistributedDataParallel`` (the reference for buffers: torch's composable
    ``replicate`` runs DDP over the parameters only and never syncs buffers), each rank on
    its own data: two plain steps around an accumulated one (a ``no_sync`` micro-batch
    first), then two evaluation forwards. Each rank's state (running statistics included)
    and evaluation outputs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 20), nn.BatchNorm1d(20), nn.ReLU(), nn.Linear(20, 5))
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    with torch.no_grad():  # replicas that start apart: the first broadcast matters
        model[1].running_mean.fill_(float(dist.get_rank()))
    if library == "devmesh":
        from devmesh.parallel import replicate

        wrapped = replicate(model, device_mesh=mesh, **buffer_args)
    else:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, process_group=mesh.get_group(), **buffer_args)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def backward(seed: int) -> None:
        gen = torch.Generator().manual_seed(100 * seed + dist.get_rank())
        x, y = torch.randn(6, 12, generator=gen), torch.randint(0, 5, (6,), generator=gen)
        F.cross_entropy(wrapped(x), y).backward()

    backward(0)
    opt.step(), opt.zero_grad()
    with wrapped.no_sync():
        backward(1)
    backward(2)
    opt.step(), opt.zero_grad()
    backward(3)
    opt.step(), opt.zero_grad()
    wrapped.eval()
    with torch.no_grad():
        probe = torch.linspace(-2, 2, 24).reshape(2, 12)
        outputs = [wrapped(probe), wrapped(probe)]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, outputs


_BUFFER_ARGS = [{}, {"forward_sync_buffers": False}, {"broadcast_buffers": False}]


@pytest.mark.parametrize("buffer_args", _BUFFER_ARGS,
                         ids=["default", "forward_sync_buffers=False", "broadcast_buffers=False"])
def test_replicate_syncs_buffers_as_torchs_ddp(mesh_pool, torch_runs, buffer_args):
    ours = mesh_pool.run(batchnorm_buffers, 3, "devmesh", buffer_args)
    theirs = torch_runs(3, batchnorm_buffers, "torch", buffer_args)
    for (state, outputs), (their_state, their_outputs) in zip(ours, theirs):
        assert state.keys() == their_state.keys()
        for key, value in their_state.items():
            torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-6, msg=key)
        for out, their_out in zip(outputs, their_outputs):
            torch.testing.assert_close(out, their_out, rtol=1e-6, atol=1e-6)
    means = [state["1.running_mean"] for state, _ in ours]
    outputs = [outs[0] for _, outs in ours]
    if buffer_args:  # each rank's own statistics: replicas evaluate differently
        assert not torch.equal(means[0], means[1]) and not torch.equal(outputs[0], outputs[1])
    else:  # synced before the evaluation: every replica evaluates alike
        assert all(torch.equal(m, means[0]) for m in means)
        assert all(torch.equal(o, outputs[0]) for o in outputs)


class _KeywordInputs(nn.Module):
    """Takes a tensor positionally, a pair in a tuple and a keyword dict, and fails unless
    every floating-point input arrives in the parameters' dtype."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 4)
        self.b = nn.Linear(6, 4)

    def forward(self, x, pair, *, extra):
        inputs = [x, *pair, extra["scale"]]
        if any(t.dtype != self.a.weight.dtype for t in inputs):
            raise TypeError(f"inputs {[t.dtype for t in inputs]}, weights {self.a.weight.dtype}")
        return (self.a(x) + self.b(pair[0] * pair[1]) * extra["scale"]).sum()


def keyword_inputs(library: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if library == "devmesh":
        from devmesh.parallel import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    model = _KeywordInputs()
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)),
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    gen = torch.Generator().manual_seed(dist.get_rank())
    x, p, q = (torch.randn(3, 6, generator=gen) for _ in range(3))
    loss = model(x, (p, q), extra={"scale": torch.tensor(0.5), "steps": 3})
    loss.backward()
    return loss.item(), [param.grad.clone() for param in model.parameters()]


def test_inputs_in_tuples_and_keywords_are_cast_as_torchs_fsdp2(mesh_pool, torch_runs):
    """``param_dtype`` casts every floating-point input — keyword arguments and tensors
    inside tuples and dicts too — as FSDP2 does (devmesh cast positional tensors only)."""
    for (loss, grads), (torch_loss, torch_grads) in zip(
            mesh_pool.run(keyword_inputs, 2, "devmesh"), torch_runs(2, keyword_inputs, "torch")):
        assert loss == torch_loss
        for ours, theirs in zip(grads, torch_grads):
            torch.testing.assert_close(ours, theirs.to_local() if hasattr(theirs, "to_local")
                                       else theirs)


def hsdp_with_divide_factor(factor):
    from devmesh.parallel import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "shard"))
    model = make_model()
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    if factor is not None:  # each unit's own: the root's and layer 2's
        model.set_gradient_divide_factor(factor)
        model[2].set_gradient_divide_factor(factor)
    _train(model)
    return _params(model)


def test_a_divide_factor_under_hsdp_sums_over_both_dims(mesh_pool):
    """Dividing the sum over all 4 data ranks (reduce-scatter over shard, all-reduce over dp)
    by 4 is the default mean; by 2 it is twice the mean's step."""
    mean = mesh_pool.run(hsdp_with_divide_factor, 4, None)[0]
    by_four = mesh_pool.run(hsdp_with_divide_factor, 4, 4.0)[0]
    by_two = mesh_pool.run(hsdp_with_divide_factor, 4, 2.0)[0]
    for key, value in mean.items():
        torch.testing.assert_close(by_four[key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert any(not torch.allclose(by_two[k], v, atol=1e-4) for k, v in mean.items())


def _three_units(library: str) -> nn.Sequential:
    """``make_model`` with layer 0, layer 2 and the root (layer 4) each a unit, sharded by
    devmesh's or torch's ``fully_shard`` over the world."""
    if library == "devmesh":
        from devmesh.parallel import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    model = make_model()
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    return model


def explicit_prefetch(library: str, explicit: bool = True):
    """The FSDP2 tutorial's explicit prefetching: the root gathered by ``unshard(async_op=
    True)`` before each forward, layer 0's forward starting layer 2's all-gather, layer 2's
    backward starting layer 0's, and ``reshard()`` at the end."""
    model = _three_units(library)
    if explicit:
        model[0].set_modules_to_forward_prefetch([model[2]])
        model[2].set_modules_to_backward_prefetch([model[0]])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = (lambda: model.unshard(async_op=True).wait()) if explicit else (lambda: None)
    losses, gathers = _train_counting_gathers(model, opt, 3, before)
    if explicit:
        model.reshard()
    return {"losses": losses, "params": _params(model), "gathers": gathers}


def _train_counting_gathers(model: nn.Module, opt, steps: int, before_forward
                            ) -> tuple[list[float], list[int]]:
    """Train ``steps`` steps, ``before_forward()`` before each forward: the losses, and the
    all-gathers of each step (``before_forward``'s included)."""
    losses, gathers = [], []
    for step in range(steps):
        x, y = _batch(dist.get_rank() + step)
        with comm_stats() as stats:
            before_forward()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        gathers.append(stats.by_collective().get("all_gather", (0,))[0])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, gathers


def unshard_in_place(library: str):
    """``unshard()`` puts the full parameters in the module (read them, use them outside a
    forward), ``reshard()`` the shards back; then training with ``unshard()`` before each
    forward, on layer 2's unit."""
    from torch.distributed.tensor import DTensor

    model = _three_units(library)
    layer = model[2]
    layer.unshard()
    full = layer.weight.detach().clone()  # torch: a plain tensor now; devmesh: the full one
    direct = torch.ones(3, 20) @ layer.weight.detach().t()  # a use outside forward
    layer.reshard()
    sharded = isinstance(layer.weight, DTensor) or layer.weight.shape[0] < full.shape[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, gathers = _train_counting_gathers(model, opt, 2, layer.unshard)
    return {"losses": losses, "params": _params(model), "full": full, "direct": direct,
            "sharded_after": sharded, "gathers": gathers}


def test_unshard_puts_the_full_parameters_in_place_as_torchs(mesh_pool, torch_runs):
    """torch's ``unshard()`` leaves the module holding its full parameters until the next
    forward or ``reshard()``; devmesh's kept this rank's shards there before (a method
    using them saw a (7, 20) block of a (14, 20) weight)."""
    ours = mesh_pool.run(unshard_in_place, 2, "devmesh")
    theirs = torch_runs(2, unshard_in_place, "torch")
    for a, b in zip(ours, theirs):
        assert tuple(a["full"].shape) == tuple(b["full"].shape) == (14, 20)
        torch.testing.assert_close(a["full"], b["full"])
        torch.testing.assert_close(a["direct"], b["direct"])
        assert a["sharded_after"] and b["sharded_after"]
        _same_training(a, b)
    # unshard()'s own all-gather; the forward's of the root and layer 0, none of layer 2
    # (nor a prefetch of it); layer 2's again in backward (it resharded after forward)
    assert ours[0]["gathers"] == [4, 4]


def test_explicit_prefetching_as_torchs_fsdp2_tutorial(mesh_pool, torch_runs):
    ours = mesh_pool.run(explicit_prefetch, 2, "devmesh")
    theirs = torch_runs(2, explicit_prefetch, "torch")
    for a, b in zip(ours, theirs):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-6)
        for key in b["params"]:
            torch.testing.assert_close(a["params"][key], b["params"][key], rtol=1e-6,
                                       atol=1e-6, msg=key)
    # 3 all-gathers in forward, 1 in backward (layer 2's; layer 0's backward needs no
    # weights, and the root keeps its own); the backward prefetch of layer 0 gathers it in
    # the first step, and not once its backward is known to need none
    plain = mesh_pool.run(explicit_prefetch, 2, "devmesh", False)
    assert plain[0]["gathers"] == [4, 4, 4]
    assert ours[0]["gathers"] == [5, 4, 4]


def backward_prefetch_out_of_order(library: str):
    """Layer 0's backward (which re-gathers: the input requires grad) prefetches layer 2's,
    whose backward already ran: that re-gather goes unused, and must not reach layer 2's
    backward in the next step, after the optimizer changed its parameters."""
    model = _three_units(library)
    model[0].set_modules_to_backward_prefetch([model[2]])
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(3):
        x, y = _batch(dist.get_rank() + step)
        F.cross_entropy(model(x.requires_grad_()), y).backward()
        opt.step()
        opt.zero_grad()
    return _params(model)


def test_an_unused_backward_prefetch_never_reaches_a_later_step(mesh_pool, torch_runs):
    ours = mesh_pool.run(backward_prefetch_out_of_order, 2, "devmesh")[0]
    theirs = torch_runs(2, backward_prefetch_out_of_order, "torch")[0]
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-6, atol=1e-6, msg=key)


def prefetch_misuse():
    from devmesh.parallel import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    model = make_model()
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return caught(lambda: model.set_modules_to_forward_prefetch([model[0]]))


def grouped_units(library: str):
    """torch's list form, as torchtitan's ``fully_shard([model.norm, model.output])``: the
    first and the last Linear one unit (they run at the two ends of the forward), the middle
    one its own, then the root (no parameters left); three steps, and the collectives of
    each."""
    if library == "devmesh":
        from devmesh.parallel import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2,))
    model = make_model()
    grouped = fully_shard([model[0], model[4]], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    if library == "devmesh":  # accepted: nothing to share on devmesh's process groups
        from devmesh.parallel import share_comm_ctx

        share_comm_ctx([model, model[2]])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, collectives = [], []
    for step in range(3):
        x, y = _batch(dist.get_rank() + step)
        with comm_stats() as stats:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        counts = stats.by_collective()
        collectives.append((counts.get("all_gather", (0,))[0],
                            counts.get("reduce_scatter", (0,))[0]))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    units = {id(getattr(m, "_devmesh_fsdp", None)) for m in (model[0], model[4])}
    return {"losses": losses, "params": _params(model), "collectives": collectives,
            "returned": [type(m).__name__ for m in grouped], "one_unit": len(units) == 1}


def test_a_list_of_modules_is_one_unit_as_torchs(mesh_pool, torch_runs):
    """``fully_shard([a, b])``: one unit of both modules, the list returned with each module
    an FSDPModule; the same parameters and losses as torch's FSDP2 with the same groups.
    The group is gathered once for both its modules' forwards and reduced once, as torch's
    (and no prefetch gathers it again while it is in place)."""
    ours = mesh_pool.run(grouped_units, 2, "devmesh")
    theirs = torch_runs(2, grouped_units, "torch")
    for a, b in zip(ours, theirs):
        _same_training(a, b)
        assert a["returned"] == b["returned"] == ["FSDPLinear", "FSDPLinear"]
        assert a["one_unit"]
        # forward: the group at layer 0 (kept in place until layer 4 ran, as torch's), layer
        # 2; backward: the group for layer 4 and layer 2 gather again (layer 0's input needs
        # no gradient, so its weight is not needed); one reduce-scatter per unit
        assert a["collectives"] == [(4, 2)] * 3


class _NormThenHead(nn.Module):
    """A body and a final norm in the forward; the head applied by the caller, chunk by
    chunk (torch's motivating case for ``fully_shard([norm, head])``: a chunked loss)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.norm, self.head = nn.Linear(12, 16), nn.LayerNorm(16), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.body(x)))


def chunked_head(library: str):
    """``fully_shard([model.norm, model.head])`` where the forward runs the norm only and the
    head runs afterwards on two chunks; then a forward alone (the head never runs)."""
    if library == "devmesh":
        from devmesh.parallel import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2,))
    model = _NormThenHead()
    fully_shard(model.body, mesh=mesh)
    fully_shard([model.norm, model.head], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        x, y = _batch(dist.get_rank() + step)
        hidden = model(x)
        loss = sum(F.cross_entropy(model.head(part), target, reduction="sum")
                   for part, target in zip(hidden.chunk(2), y.chunk(2))) / len(y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        model(x)  # the norm runs, the head does not: the group is resharded at the end
    rows = model.head.weight.shape[0] if library == "devmesh" else None  # torch: a DTensor
    return {"losses": losses, "params": _params(model), "head_rows": rows}


def test_a_group_whose_modules_run_apart_or_not_at_all_as_torchs(mesh_pool, torch_runs):
    """torch's chunked-loss case: the norm in the model's forward, the grouped head called
    per chunk after it; the same training as torch's FSDP2, and a forward that never runs
    the head leaves the shards in place (a gather left there would be stale after the next
    optimizer step)."""
    ours = mesh_pool.run(chunked_head, 2, "devmesh")
    theirs = torch_runs(2, chunked_head, "torch")
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        _same_training(a, b)
        assert a["head_rows"] == (3, 2)[rank]  # torch.chunk's rows of 5 on 2 ranks


class _Scorer(nn.Module):
    """A method besides ``forward`` that uses the parameters directly and calls
    ``forward`` too (a ``generate``, a ``score``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.out = nn.Linear(12, 16), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc(x)))

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return self(x) + 0.1 * (x @ self.fc.weight.t()) @ self.out.weight.t()


def forward_method(library: str):
    """torch's ``register_fsdp_forward_method(model, "score")`` on a model that is one
    unit, trained through ``score`` for three steps."""
    if library == "devmesh":
        from devmesh.parallel import fully_shard, register_fsdp_forward_method
    else:
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
    mesh = init_device_mesh("cpu", (2,))
    model = _Scorer()
    fully_shard(model, mesh=mesh)
    register_fsdp_forward_method(model, "score")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        x, y = _batch(dist.get_rank() + step)
        loss = F.cross_entropy(model.score(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": _params(model)}


def test_a_forward_method_registered_gathers_as_forward_does_as_torchs(mesh_pool, torch_runs):
    """A method other than ``forward`` registered with ``register_fsdp_forward_method``
    gathers the unit's parameters (before: it saw the shards, a shape error), and the
    ``forward`` it calls inside finds them gathered: torch's losses and parameters."""
    ours = mesh_pool.run(forward_method, 2, "devmesh")
    theirs = torch_runs(2, forward_method, "torch")
    for a, b in zip(ours, theirs):
        _same_training(a, b)


class _CallsAnother(nn.Module):
    """Calls a module that is not its child (held in a list, so not registered) inside its
    forward: the two grouped in one unit run nested."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.fc, self._head = nn.Linear(12, 14), [head]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._head[0](torch.tanh(self.fc(x)))


def nested_group_calls(shard: bool):
    """``fully_shard([outer, head])`` where outer's forward calls head, resharding after
    forward (saved-tensor hooks on): two steps, the parameters, and whether the hooks were
    all popped."""
    from devmesh.parallel import fully_shard

    torch.manual_seed(0)
    head = nn.Linear(14, 5)
    outer = _CallsAnother(head)
    if shard:
        fully_shard([outer, head], mesh=init_device_mesh("cpu", (2,)),
                    reshard_after_forward=True)
    opt = torch.optim.SGD([*outer.parameters(), *head.parameters()], lr=0.1)
    for step in range(2):
        x, y = _batch(step)  # the same batch on every rank: one process's result
        F.cross_entropy(outer(x), y).backward()
        opt.step()
        opt.zero_grad()
    hooks_left = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return {**_params(outer), **{f"head.{k}": v for k, v in _params(head).items()},
            "hooks left": hooks_left is not None}


def test_a_group_whose_modules_call_each_other_gathers_once_and_trains_right(mesh_pool):
    """A grouped module called inside another's forward finds the parameters gathered
    (no second gather whose reshard would leave the outer one's saved-tensor hooks
    pushed) and the group trains as one process."""
    expected = nested_group_calls(False)
    for got in mesh_pool.run(nested_group_calls, 2, True):
        assert not got.pop("hooks left") and not expected["hooks left"]
        for key, value in got.items():
            torch.testing.assert_close(value, expected[key], rtol=1e-6, atol=1e-6, msg=key)


def test_prefetching_a_module_without_fully_shard_names_the_fix(mesh_pool):
    error = mesh_pool.run(prefetch_misuse, 2)[0]
    assert "Linear is not a module devmesh's fully_shard was applied to" in error[1]


def hsdp_accumulation(library: str, defer_all_reduce: bool):
    """Two micro-batches per step on a (dp, shard) = (2, 2) mesh; with ``defer_all_reduce``
    the first reduce-scatters but leaves the all-reduce to the second."""
    if library == "devmesh":
        from devmesh.parallel import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "shard"))
    model = make_model()
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    early_all_reduces = 0
    for step in range(2):
        for micro in range(2):
            if defer_all_reduce:
                model.set_requires_all_reduce(micro == 1)
            x, y = _batch(4 * step + 2 * dist.get_rank() + micro)
            with comm_stats() as stats:
                F.cross_entropy(model(x), y).backward()
            if micro == 0:
                early_all_reduces += stats.by_collective().get("all_reduce", (0,))[0]
        opt.step()
        opt.zero_grad()
    return _params(model), early_all_reduces


def test_hsdp_accumulation_without_the_all_reduce_as_torchs(mesh_pool, torch_runs):
    deferred, early = mesh_pool.run(hsdp_accumulation, 4, "devmesh", True)[0]
    every_time, early_default = mesh_pool.run(hsdp_accumulation, 4, "devmesh", False)[0]
    theirs = torch_runs(4, hsdp_accumulation, "torch", True)[0][0]
    assert early == 0 and early_default == 4  # 2 units x 2 steps
    for key, value in every_time.items():
        torch.testing.assert_close(deferred[key], value, rtol=1e-6, atol=1e-7, msg=key)
        torch.testing.assert_close(deferred[key], theirs[key], rtol=1e-6, atol=1e-7, msg=key)


def test_torchs_fsdp2_functions_are_devmesh_too():
    """FSDP2 code imports these from ``torch.distributed.fsdp``: devmesh.parallel has each,
    and so does devmesh.parallel.fsdp, the same path with torch's package name (a torch
    release adding one fails this test until it is decided), but FSDP1's API and the
    policy types ``fully_shard`` takes from torch as they are (or refuses)."""
    import torch.distributed.fsdp as torch_fsdp

    import devmesh.parallel as ours
    import devmesh.parallel.fsdp as ours_by_torchs_path
    from devmesh.parallel import ParallelizeError, share_comm_ctx

    fsdp1 = {"FullyShardedDataParallel", "ShardingStrategy", "BackwardPrefetch", "CPUOffload",
             "MixedPrecision", "StateDictType", "StateDictSettings", "StateDictConfig",
             "FullStateDictConfig", "LocalStateDictConfig", "ShardedStateDictConfig",
             "OptimStateDictConfig", "FullOptimStateDictConfig", "LocalOptimStateDictConfig",
             "ShardedOptimStateDictConfig", "OptimStateKeyType"}
    torchs_types = {"OffloadPolicy", "CPUOffloadPolicy", "DataParallelMeshDims"}
    for namespace in (ours, ours_by_torchs_path):
        missing = [n for n in torch_fsdp.__all__ if n not in fsdp1 | torchs_types
                   and not hasattr(namespace, n)]
        assert missing == [], namespace.__name__
    with pytest.raises(ParallelizeError, match="share_comm_ctx: Linear is not a module "
                                               "devmesh's fully_shard was applied to"):
        share_comm_ctx([nn.Linear(2, 2)])


def test_every_method_of_torchs_fsdp_module_is_there_or_named_as_missing():
    # FSDP2 code calls these on its modules: each is devmesh's too, or its docs say it is
    # not (a torch release adding one fails this test until it is decided)
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    from devmesh.parallel.fsdp import FSDPModule

    torchs = {name for name in dir(TorchFSDPModule) if not name.startswith("_")}
    missing = sorted(name for name in torchs if not hasattr(FSDPModule, name))
    documented = FSDPModule.__doc__ or ""
    assert [name for name in missing if name not in documented] == [], missing
    # the two torch added for recovery and for embeddings are devmesh's now
    assert {"reset_iter_state", "set_unshard_in_backward",
            "set_reduce_scatter_divide_factor"} <= set(dir(FSDPModule))


def split_along_another_dim(library: str):
    """torch's ``shard_placement_fn``: every parameter split along its last dim (a weight's
    input features, which torch needs even: 12, 20 and 14 on 2 ranks)."""
    from torch.distributed.tensor import Shard

    if library == "devmesh":
        from devmesh.parallel import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2,))
    model = make_model()
    last = {"shard_placement_fn": lambda p: Shard(-1), "mesh": mesh}
    for layer in (model[0], model[2]):
        fully_shard(layer, **last)
    fully_shard(model, **last)
    saved = {k: (tuple(v.to_local().shape), tuple(v.placements))
             for k, v in model.state_dict().items()}
    return {"losses": _train(model), "params": _params(model), "saved": saved}


def test_shard_placement_fn_splits_another_dim_as_torch(mesh_pool, torch_runs):
    """Before, devmesh refused any dim but 0."""
    ours = mesh_pool.run(split_along_another_dim, 2, "devmesh")
    theirs = torch_runs(2, split_along_another_dim, "torch")
    for a, b in zip(ours, theirs):
        _same_training(a, b)
        assert a["saved"] == b["saved"]  # the same blocks, as DTensors with Shard(1)
    assert ours[0]["saved"]["0.weight"][0] == (20, 6)


def uneven_blocks_along_another_dim(tmp: str):
    """Dims the ranks do not divide (torch refuses these), under FSDP on 3 ranks, and under
    FSDP nested in tensor parallelism on (dp, tp) = (2, 2); then a checkpoint of it."""
    from torch.distributed.tensor import Shard

    from devmesh.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        fully_shard,
        parallelize_module,
        save_checkpoint,
    )

    world = int(os.environ["WORLD_SIZE"])
    model = make_model()
    if world == 3:
        dp = init_device_mesh("cpu", (3,))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        dp = mesh["dp"]
    dims = {"shard_placement_fn": lambda p: Shard(p.ndim - 1), "mesh": dp}
    fully_shard(model[2], **dims)
    fully_shard(model, **dims)
    losses = _train(model, steps=3, batch=dp.get_local_rank())  # a TP group: one batch
    save_checkpoint(tmp, model)
    return {"losses": losses, "params": _params(model),
            "local": {k: tuple(p.shape) for k, p in model.named_parameters()}}


@pytest.mark.parametrize("world", [3, 4], ids=["fsdp3", "fsdp+tp"])
def test_uneven_blocks_along_another_dim_train_as_one_process(mesh_pool, tmp_path, world):
    from devmesh.parallel import load_checkpoint

    results = mesh_pool.run(uneven_blocks_along_another_dim, world, str(tmp_path / "ckpt"))
    alone = make_model()
    opt = torch.optim.SGD(alone.parameters(), lr=0.1)
    replicas = 3 if world == 3 else 2
    for step in range(3):  # the data-parallel ranks' batches: their mean loss
        loss = sum(F.cross_entropy(alone(_batch(r)[0]), _batch(r)[1]) for r in range(replicas))
        (loss / replicas).backward()
        opt.step()
        opt.zero_grad()
    for result in results:
        for key, value in alone.state_dict().items():
            torch.testing.assert_close(result["params"][key], value, rtol=1e-5, atol=1e-6,
                                       msg=key)
    if world == 3:  # 12, 20, 14 features along dim 1 on 3 ranks: 4 4 4, 7 7 6, 5 5 4
        assert [r["local"]["2.weight"] for r in results] == [(14, 7), (14, 7), (14, 6)]
        assert [r["local"]["4.weight"] for r in results] == [(5, 5), (5, 5), (5, 4)]
    plain = make_model()
    load_checkpoint(str(tmp_path / "ckpt"), plain)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(value, results[0]["params"][key], rtol=0, atol=0)


class _WithUnused(nn.Module):
    """make_model's layers and a layer no forward uses (a mixture-of-experts' idle expert)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_model()
        self.idle = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def hsdp_by_hook_with_an_unused_layer(library: str):
    """``set_all_reduce_hook``: FSDP over ``shard`` whose hook averages the reduced shards
    over ``replicate`` — HSDP by hand; ``set_reduce_scatter_unused_params(True)``: the idle
    layer gets zero gradients (AdamW's weight decay then moves it); and torch's
    scheduling switches, which change no value."""
    if library == "devmesh":
        from devmesh.parallel import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    across = mesh["replicate"].get_group()
    seen = []

    def average_across_replicas(reduced: torch.Tensor) -> None:
        seen.append(reduced.numel())
        dist.all_reduce(reduced, group=across)  # gloo has no average: sum, then divide
        reduced.div_(2)

    model = _WithUnused()
    fully_shard(model.body[2], mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    for unit in (model.body[2], model):
        unit.set_all_reduce_hook(average_across_replicas)
    model.set_reduce_scatter_unused_params(True)
    model.set_reduce_scatter_max_input_buffers(2)
    model.set_separate_reduce_scatter_group(False)
    model.set_allocate_memory_from_process_group_for_comm(False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    losses = []
    for _ in range(2):
        x, y = _batch(dist.get_rank())
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        idle_grads = [p.grad is not None and not p.grad.to_local().any()
                      if hasattr(p.grad, "to_local") else p.grad is not None and not p.grad.any()
                      for p in model.idle.parameters()]
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": _params(model), "hook_calls": len(seen),
            "idle_zero_grads": idle_grads}


def test_all_reduce_hook_and_unused_parameters_as_torch(mesh_pool, torch_runs):
    """Before, devmesh had neither method (AttributeError)."""
    ours = mesh_pool.run(hsdp_by_hook_with_an_unused_layer, 4, "devmesh")
    theirs = torch_runs(4, hsdp_by_hook_with_an_unused_layer, "torch")
    for a, b in zip(ours, theirs):
        assert a["idle_zero_grads"] == b["idle_zero_grads"] == [True, True]
        assert a["hook_calls"] == b["hook_calls"] == 4  # 2 units, 2 steps
        _same_training(a, b)
    # the hook made it HSDP: every rank holds the same parameters, though each trained on
    # its own batch, and the idle layer moved (weight decay on a zero gradient)
    for a in ours[1:]:
        for key, value in ours[0]["params"].items():
            torch.testing.assert_close(a["params"][key], value)
    assert not torch.equal(ours[0]["params"]["idle.weight"], _WithUnused().idle.weight)


def test_custom_collectives_are_refused_by_name(mesh_pool):
    for refusals in mesh_pool.run(custom_collectives, 2):
        assert "set_custom_all_gather is not supported by devmesh" in refusals[0][1]
        assert "set_custom_reduce_scatter is not supported by devmesh" in refusals[1][1]


def custom_collectives():
    from devmesh.parallel import fully_shard

    model = fully_shard(make_model(), mesh=init_device_mesh("cpu", (2,)))
    return [caught(lambda: model.set_custom_all_gather(object())),
            caught(lambda: model.set_custom_reduce_scatter(object()))]


def manual_finalization(async_op: bool):
    """torch 2.15's manual backward finalization: two micro-batches per step with sync off,
    then sync on and ``finalize_backward`` reduces what they summed; float64, two SGD steps.
    Returns the full parameters, whether the gradients were held back before finalizing, and
    the misuses' errors."""
    from devmesh.parallel import fully_shard

    torch.set_default_dtype(torch.float64)
    try:
        model = make_model()
    finally:
        torch.set_default_dtype(torch.float32)
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    errors = [caught(model.finalize_backward)]  # before the first forward: nothing to do
    model.set_manual_backward_finalization(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    held_back = []
    for step in range(2):
        model.set_requires_gradient_sync(False)
        for micro in range(2):
            x, y = _batch(4 * step + 2 * dist.get_rank() + micro)
            F.cross_entropy(model(x.double()), y).backward()
        held_back.append(all(p.grad is None for p in model.parameters()))
        model.set_requires_gradient_sync(True)
        handle = model.finalize_backward(async_op=async_op)
        if async_op:
            errors.append(caught(model.finalize_backward))  # the handle not waited on
            handle.wait()
        opt.step()
        opt.zero_grad()
    errors.append(caught(model[2].finalize_backward))  # not the root
    model.set_manual_backward_finalization(False)
    errors.append(caught(model.finalize_backward))  # manual mode off
    return _params(model), held_back, errors


def accumulated_in_one_process():
    torch.set_default_dtype(torch.float64)
    try:
        model = make_model()
    finally:
        torch.set_default_dtype(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        for index in range(4 * step, 4 * step + 4):  # both ranks' micro-batches
            x, y = _batch(index)
            (F.cross_entropy(model(x.double()), y) / 2).backward()  # averaged over 2 ranks
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("async_op", [False, True])
def test_manual_backward_finalization_reduces_held_back_gradients_as_one_process(
        mesh_pool, async_op):
    expected = accumulated_in_one_process()
    for params, held_back, errors in mesh_pool.run(manual_finalization, 2, async_op):
        assert held_back == [True, True]  # nothing reduced before finalize_backward
        for key, value in expected.items():
            torch.testing.assert_close(params[key], value, rtol=1e-12, atol=1e-12, msg=key)
        assert errors[0] is None
        if async_op:
            assert "The previous gradient reduction must be waited on" in errors[1][1]
            errors = [errors[0], *errors[3:]]
        assert "finalize_backward must be called on the root module" in errors[1][1]
        assert ("finalize_backward requires manual backward finalization: call "
                "set_manual_backward_finalization(True) before forward") in errors[2][1]
