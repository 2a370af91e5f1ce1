"""The whole pipelined model (issue 11, item 4): checkpoints, full state dicts and
descriptions of a model whose stages live on different ranks, checked against plain
single-process training — saved pipelined, resumed plain and the other way round."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from devmesh.errors import CheckpointError
from devmesh.parallel.checkpoint.blocks import Block
from devmesh.parallel.checkpoint.union import Listed, Merged, listed_json, merge_listings

from helpers import caught


def block_model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)) for _ in range(4)]
    return nn.Sequential(*blocks, nn.Linear(16, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)


def momentum_sgd(params) -> torch.optim.Optimizer:
    """An optimizer with state (momentum buffers) that must round-trip; Adam would divide
    away the last-bit differences between a pipeline's and a plain model's gradients."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def pipelined(layout: str):
    """This rank's runner over a fresh ``block_model``: ``"pp2-fsdp-tp"`` is interleaved 1F1B
    (4 stages, 2 per rank) x FSDP x TP on (pp, dp, tp) = (2, 2, 2); ``"pp4"`` is 1F1B on 4
    plain pipeline ranks; ``"pp2-v"`` zero-bubble V on 2 (stages 0 and 3 on rank 0)."""
    from devmesh import init_device_mesh
    from devmesh.layout.schedule import build_schedule
    from devmesh.parallel import ColwiseParallel, RowwiseParallel, fully_shard, parallelize_module
    from devmesh.parallel.pipeline import PipelineRunner, split_sequential

    if layout == "pp2-fsdp-tp":
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        schedule = build_schedule("interleaved-1f1b", 2, 4)
    elif layout == "pp2-v":
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
        schedule = build_schedule("zbv-zero-bubble", 2, 4)
    else:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("pp",))
        schedule = build_schedule("1f1b", 4, 4)
    parts = split_sequential(block_model(), schedule.stages)
    me = mesh.get_coordinate()[0]
    stages = {s: parts[s] for s in range(schedule.stages) if schedule.rank_of(s) == me}
    if layout == "pp2-fsdp-tp":
        for stage in stages.values():
            for block in stage:
                if isinstance(block, nn.Sequential):
                    parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(),
                                                           "2": RowwiseParallel()})
                    fully_shard(block, mesh=mesh["dp"])
            fully_shard(stage, mesh=mesh["dp"])
    return PipelineRunner(stages, mesh, schedule, F.cross_entropy)


def train_steps(runner, opt, steps: range) -> None:
    data_parallel = "dp" in (runner.mesh.mesh_dim_names or ())
    for step in steps:
        x, y = batch(step)
        if data_parallel:
            dp = runner.mesh["dp"]
            x, y = x.chunk(dp.size())[dp.get_local_rank()], y.chunk(dp.size())[dp.get_local_rank()]
        runner.step(x if 0 in runner.stages else None,
                    y if runner.schedule.stages - 1 in runner.stages else None)
        opt.step()
        opt.zero_grad()


def train_plain(model: nn.Module, opt, steps: range) -> None:
    for step in steps:
        x, y = batch(step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def save_pipelined_then_continue(path: str):
    """Train 2 steps pipelined, save, train a third; the whole model after 2 and 3 steps."""
    from devmesh.parallel import save_checkpoint

    runner = pipelined("pp2-fsdp-tp")
    opt = momentum_sgd(runner.module.parameters())
    train_steps(runner, opt, range(2))
    save_checkpoint(path, runner.module, opt, extra={"step": 2})
    at_save = runner.state_dict(full=True)
    train_steps(runner, opt, range(2, 3))
    return at_save, runner.state_dict(full=True)


def load_into_other_pipeline(path: str, layout: str = "pp4"):
    """Resume the checkpoint in another pipeline (4 plain ranks, or a V on 2) for the third
    step."""
    from devmesh.parallel import load_checkpoint

    runner = pipelined(layout)
    opt = momentum_sgd(runner.module.parameters())
    extra = load_checkpoint(path, runner.module, opt)
    train_steps(runner, opt, range(2, 3))
    return extra, runner.state_dict(full=True)


def test_a_pipelined_checkpoint_resumes_plain_and_in_another_pipeline(mesh_pool, tmp_path):
    from devmesh.parallel import load_checkpoint

    path = str(tmp_path / "ckpt")
    results = mesh_pool.run(save_pipelined_then_continue, 8, path)
    at_save, after = results[0]
    for other_save, other_after in results[1:]:  # every rank got the whole model
        assert other_save.keys() == at_save.keys()
        for k in at_save:
            assert torch.equal(other_save[k], at_save[k]) and torch.equal(other_after[k], after[k])
    reference = block_model()
    ref_opt = momentum_sgd(reference.parameters())
    train_plain(reference, ref_opt, range(2))
    assert at_save.keys() == reference.state_dict().keys()
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(at_save[k], v, rtol=1e-5, atol=1e-6)

    # the pipelined checkpoint into one plain process: model and AdamW state resume exactly
    plain = nn.Sequential(*[nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))
                            for _ in range(4)], nn.Linear(16, 4))
    plain_opt = momentum_sgd(plain.parameters())
    assert load_checkpoint(path, plain, plain_opt) == {"step": 2}
    train_plain(plain, plain_opt, range(2, 3))
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(after[k], v, rtol=1e-5, atol=1e-6)

    # ... and into other pipelines: 4 stages one per rank, no FSDP/TP; zero-bubble V on 2
    # ranks (the first and last stages on rank 0)
    for ranks, layout in ((4, "pp4"), (2, "pp2-v")):
        for extra, state in mesh_pool.run(load_into_other_pipeline, ranks, path, layout):
            assert extra == {"step": 2}
            for k, v in plain.state_dict().items():
                torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=layout)


def state_dict_round_trip(state: dict[str, torch.Tensor]):
    """Load a plain model's state dict into the stages, read the whole model back; then a
    state dict with a name no stage has is refused on every rank."""
    from devmesh.parallel import describe

    runner = pipelined("pp2-fsdp-tp")
    incompatible = runner.load_state_dict(state)
    back = runner.state_dict(full=True)
    bad = dict(state) | {"head.weight": torch.zeros(1)}
    refused = caught(lambda: runner.load_state_dict(bad))
    return incompatible, back, refused, describe(runner)


def test_whole_model_state_dict_and_describe_of_a_pipeline(mesh_pool):
    model = block_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    state = model.state_dict()
    for incompatible, back, refused, text in mesh_pool.run(state_dict_round_trip, 8, state):
        assert incompatible.missing_keys == [] and incompatible.unexpected_keys == []
        assert back.keys() == state.keys()
        for k, v in state.items():
            assert torch.equal(back[k], v), k
        assert refused[0] == "StateDictError" and "'head.weight'" in refused[1]
        # every stage with the ranks holding it, every local shape on those ranks only
        assert "stage 0 (pipeline index 0 of 2, ranks 0-3)" in text
        assert "stage 3 (pipeline index 1 of 2, ranks 4-7)" in text
        stage0 = text.split("stage 1 (")[0]
        assert "0.0.weight" in stage0 and "1.0.weight" not in stage0
        assert "4-7" not in stage0 and "(8, 16) on ranks 0-3" in stage0  # (32, 16) / (dp x tp)
        assert "bytes per rank: 1,088 on ranks 0-3" in stage0


def _listed(key: str, holders: tuple[int, ...], shape=(4,), slice_of=None) -> Listed:
    return Listed(key, "float32", shape, 4, "whole", None,
                  (Block((0,) * len(shape), shape, holders),), slice_of)


def test_merging_listings_keeps_the_union_and_refuses_what_differs():
    stage0 = Merged([_listed("model.0.w", (0, 1, 2, 3))], ["0.w"], {}, None)
    stage1 = Merged([_listed("model.1.w", (0, 1, 2, 3))], ["1.w"], {}, None)
    merged = merge_listings([(listed_json(stage0), [0, 1]), (listed_json(stage1), [2, 3])])
    assert merged.model_keys == ["0.w", "1.w"]
    assert [t.blocks[0].holders for t in merged.tensors] == [(0, 1), (2, 3)]
    other = Merged([_listed("model.0.w", (0, 1, 2, 3), shape=(5,))], ["0.w"], {}, None)
    with pytest.raises(CheckpointError, match=r"model.0.w differs between ranks 0-1 .* and "
                                              r"ranks 2-3"):
        merge_listings([(listed_json(stage0), [0, 1]), (listed_json(other), [2, 3])])
    # laid out on a 4-rank mesh, but rank 3 does not list it: the ranks' models differ
    sliced = {"ranks": [0, 1, 2, 3], "root_shape": [4], "dims": [[0]]}
    sharded = Merged([_listed("model.0.w", (0, 1, 2, 3), slice_of=sliced)], ["0.w"], {}, None)
    empty = Merged([], [], {}, None)
    with pytest.raises(CheckpointError, match="ranks 3 do not list it"):
        merge_listings([(listed_json(sharded), [0, 1, 2]), (listed_json(empty), [3])])


def test_optimizer_groups_merge_by_name_and_must_share_settings():
    from devmesh.parallel.checkpoint.encoding import encode

    def listing(params, lr):
        groups = encode([{"lr": lr, "params": params}], None)
        return Merged([], params, {}, {"state": {p: {} for p in params}, "param_groups": groups})
    merged = merge_listings([(listed_json(listing(["a"], 0.1)), [0]),
                             (listed_json(listing(["b"], 0.1)), [1])])
    assert merged.optimizer["param_groups"] == encode([{"lr": 0.1, "params": ["a", "b"]}], None)
    with pytest.raises(CheckpointError, match="parameter group 0 has other settings"):
        merge_listings([(listed_json(listing(["a"], 0.1)), [0]),
                        (listed_json(listing(["b"], 0.2)), [1])])


def built_on_meta_then_dcp(start: dict[str, torch.Tensor], path: str):
    """torchtitan's flow for a pipelined model: build the stages on the meta device,
    ``runner.module.to_empty``, load the whole model's weights, train; then torch DCP of
    ``runner.module.state_dict()`` into a fresh pipeline of the same layout."""
    import torch.distributed.checkpoint as dcp

    with torch.device("meta"):  # the mesh too, as torch's init_device_mesh allows
        runner = pipelined("pp2-fsdp-tp")
    runner.module.to_empty(device="cpu")  # two stages per rank: the joined module
    runner.load_state_dict(start)
    opt = momentum_sgd(runner.module.parameters())
    train_steps(runner, opt, range(3))
    trained = runner.state_dict(full=True)
    saved = runner.module.state_dict()
    dcp.save(saved, checkpoint_id=path)
    fresh = pipelined("pp2-fsdp-tp")
    loaded = fresh.module.state_dict()
    dcp.load(loaded, checkpoint_id=path)
    fresh.module.load_state_dict(loaded)
    kinds = {type(v).__name__ for v in saved.values()}
    return kinds, trained, fresh.state_dict(full=True)


def test_a_pipeline_built_on_meta_trains_and_round_trips_through_torch_dcp(mesh_pool, tmp_path):
    reference = block_model()
    start = {k: v.clone() for k, v in reference.state_dict().items()}
    train_plain(reference, momentum_sgd(reference.parameters()), range(3))
    for kinds, trained, reloaded in mesh_pool.run(built_on_meta_then_dcp, 8, start,
                                                  str(tmp_path / "dcp")):
        assert kinds == {"DTensor"}  # every stage's parameters by their global layout
        for k, v in reference.state_dict().items():
            torch.testing.assert_close(trained[k], v, rtol=1e-5, atol=1e-6)
            assert torch.equal(reloaded[k], trained[k]), k


def normed_model() -> nn.Sequential:
    """Parameters and buffers whose byte sizes leave the next one unaligned: a 3-wide layer's
    float32 bias (12 bytes) before BatchNorm's statistics and its int64 batch count, and a
    bfloat16 layer (odd element count) before float32 ones."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 3), nn.Tanh(),
                          nn.Linear(3, 5), nn.Linear(5, 2))
    model[2].to(torch.bfloat16)
    return model


def normed_full_state_dict():
    from devmesh import init_device_mesh
    from devmesh.layout.schedule import build_schedule
    from devmesh.parallel.pipeline import PipelineRunner, split_sequential

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    parts = split_sequential(normed_model(), 2)
    me = mesh.get_coordinate()[0]
    runner = PipelineRunner({me: parts[me]}, mesh, build_schedule("1f1b", 2, 2), F.mse_loss)
    return runner.state_dict(full=True)


def test_a_full_state_dict_of_mixed_dtypes_and_integer_buffers(mesh_pool):
    """Each pipeline index broadcasts its tensors as one byte string; before, a tensor that
    started unaligned in it (BatchNorm's int64 count after 108 bytes of float32) could not
    be viewed as its dtype, and ``state_dict(full=True)`` failed on every rank."""
    expected = normed_model().state_dict()
    for full in mesh_pool.run(normed_full_state_dict, 2):
        assert full.keys() == expected.keys()
        for key, value in expected.items():
            assert full[key].dtype == value.dtype and torch.equal(full[key], value), key


def runner_checkpoint_round_trip(path: str):
    """A user's first try: the runner itself given to the functions that take a model."""
    from devmesh import init_device_mesh
    from devmesh.layout.schedule import build_schedule
    from devmesh.parallel import load_checkpoint, load_state_dict, save_checkpoint, state_dict
    from devmesh.parallel.pipeline import PipelineRunner, split_sequential

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    me = mesh.get_coordinate()[0]

    def runner_and_optimizer(seed_shift: float):
        parts = split_sequential(normed_model().float(), 2)
        with torch.no_grad():
            for p in parts[me].parameters():
                p.add_(seed_shift)
        runner = PipelineRunner({me: parts[me]}, mesh, build_schedule("1f1b", 2, 2),
                                F.mse_loss)
        return runner, momentum_sgd(runner.module.parameters())

    runner, opt = runner_and_optimizer(0.0)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    runner.step(x, y)
    opt.step()
    save_checkpoint(path, runner, opt)
    other, other_opt = runner_and_optimizer(1.0)
    load_checkpoint(path, other, other_opt)
    same = [torch.equal(a, b) for a, b in zip(runner.module.parameters(),
                                              other.module.parameters())]
    momentum = [torch.equal(opt.state[a]["momentum_buffer"], other_opt.state[b]["momentum_buffer"])
                for a, b in zip(runner.module.parameters(), other.module.parameters())]
    whole = state_dict(runner, full=True)
    fresh, _ = runner_and_optimizer(2.0)
    load_state_dict(fresh, whole)
    reloaded = fresh.state_dict(full=True)
    refused = caught(lambda: save_checkpoint(path, {"not": "a model"}))
    return same, momentum, whole, reloaded, refused


def test_a_runner_is_taken_where_a_model_is(mesh_pool, tmp_path):
    """``save_checkpoint(path, runner, opt)``, ``load_checkpoint``, ``state_dict(runner)`` and
    ``load_state_dict(runner, ...)`` work on the runner as on its ``module`` (before: an
    ``AttributeError`` on 'named_parameters' on every rank); a value that is neither is
    refused by name."""
    path = str(tmp_path / "ckpt")
    for same, momentum, whole, reloaded, refused in mesh_pool.run(
            runner_checkpoint_round_trip, 2, path):
        assert same and all(same) and momentum and all(momentum)
        assert whole.keys() == normed_model().state_dict().keys()
        for key, value in whole.items():
            assert torch.equal(reloaded[key], value), key
        assert refused[0] == "ParallelizeError", refused
        assert refused[1].endswith("save_checkpoint takes the model (an nn.Module, or a "
                                   "pipeline runner), got dict"), refused


def describe_where_rank_0_alone_calls_it():
    """``if rank == 0: print(describe(runner))``, the way torch code prints; then on every
    rank, twice (each call its own exchange)."""
    from devmesh.errors import MeshUsageError
    from devmesh.pictures import describe as describing

    import torch.distributed as dist

    describing.PIPELINE_SECONDS = 3.0  # the test's patience; 60 s by default
    runner = pipelined("pp2-v")
    store = dist.distributed_c10d._get_default_store()
    refused = None
    if runner.mesh.get_rank() == 0:
        try:
            describing.describe(runner)
        except MeshUsageError as exc:
            refused = str(exc)
        from devmesh.layout import format_ranks

        # the refused exchange left nothing: the next call (same name) reads fresh texts only
        assert not store.check([f"devmesh/posted/describe {format_ranks([0, 1])} #0/0"])
        store.set("test: rank 0 printed", "1")
    else:  # a script's rank 1 goes on to its own work meanwhile
        store.wait(["test: rank 0 printed"])
    return refused, describing.describe(runner), describing.describe(runner)


def test_describe_of_a_pipeline_called_on_one_rank_names_the_others(mesh_pool):
    """Before, rank 0 waited in the pipeline's all-gather until the process group's timeout
    (30 minutes by default)."""
    (refused, first, again), (nothing, *texts) = mesh_pool.run(
        describe_where_rank_0_alone_calls_it, 2)
    assert refused == ("[rank 0] describe(runner) shows every stage, and each rank holds only "
                       "its own: the pipeline's ranks call it together, and rank 1 did not "
                       "within 3 s. Call it on every rank and print on one: text = "
                       "describe(runner); if rank == 0: print(text)"), refused
    assert nothing is None
    assert first == again == texts[0] == texts[1]
    assert [line.split(" (")[0] for line in first.splitlines() if line.startswith("stage ")] \
        == ["stage 0", "stage 1", "stage 2", "stage 3"], first
