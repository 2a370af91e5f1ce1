"""torch's traced pipelines (``pipeline``, ``SplitPoint``, ``pipe.build_stage``) on devmesh's
schedules: torch's tutorial code with its imports switched trains torch's test Transformer as
torch's own run does and as one process does; a split graph whose values skip stages (a
residual over several stages, a model input used by the last stage) is routed stage to
stage."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

from devmesh import init_device_mesh
from devmesh.layout.schedule import IN_A_V, LOOPED
from devmesh.parallel.pipeline import PipelineError

VOCAB, SEQ, BATCH, MICRO = 32, 8, 8, 4
CLASSES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B",
           "interleaved-zero-bubble": "InterleavedZeroBubble", "looped-bfs": "LoopedBFS",
           "zbv-zero-bubble": "ZBVZeroBubble", "dualpipe-v": "DualPipeV"}


def transformer(tied: bool = False) -> nn.Module:
    """torch's test Transformer; ``tied``: its embedding and output head one weight."""
    torch.manual_seed(0)
    return Transformer(ModelArgs(n_layers=4, vocab_size=VOCAB, max_seq_len=SEQ, dim=16,
                                 n_heads=2, dropout_p=0.0, weight_tying=tied))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tokens(step: int, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return (torch.randint(0, VOCAB, (batch, SEQ), generator=gen),
            torch.randint(0, VOCAB, (batch, SEQ), generator=gen))


def optimizer(params) -> torch.optim.Optimizer:
    """SGD with momentum: a state of its own to checkpoint."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def one_process(steps: int = 2, tied: bool = False, batch: int = BATCH
                ) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = transformer(tied)
    opt = optimizer(model.parameters())
    losses = []
    for step in range(steps):
        x, y = tokens(step, batch)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {k: v.detach() for k, v in model.named_parameters(remove_duplicate=False)}, losses


def train_traced(library: str, name: str, build: str = "pipe", steps: int = 2,
                 tied: bool = False, save_to: str | None = None):
    """torch's tutorial way: trace the whole model on every rank, split it at layer names,
    build this rank's stages, train with the schedule ``name`` on 2 ranks — with torch's
    imports, or (``library="devmesh"``) the same code with devmesh's. ``build="function"``:
    ``build_stage(pipe.get_stage_module(s), s, pipe.info(), ...)`` instead of the method;
    ``save_to``: devmesh's ``save_checkpoint`` of this rank's stage and optimizer at the end
    (one stage per rank)."""
    if library == "torch":
        from torch.distributed.pipelining import SplitPoint, build_stage, pipeline
        from torch.distributed.pipelining.schedules import (
            PipelineScheduleMulti,
            get_schedule_class,
        )
    else:
        from devmesh.parallel.pipeline import (
            PipelineScheduleMulti,
            SplitPoint,
            build_stage,
            get_schedule_class,
            pipeline,
        )

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    group, me = mesh.get_group("pp"), mesh.get_coordinate()[0]
    count = 4 if name in LOOPED or name in IN_A_V else 2
    model = transformer(tied)
    with warnings.catch_warnings():  # torch.export's deprecation notes
        warnings.simplefilter("ignore")
        pipe = pipeline(model, mb_args=(tokens(0)[0][:BATCH // MICRO],),
                        split_spec={f"layers.{k * 4 // count}": SplitPoint.BEGINNING
                                    for k in range(1, count)})
    mine = [me, count - 1 - me] if name in IN_A_V else list(range(me, count, 2))
    cpu = torch.device("cpu")
    stages = [pipe.build_stage(s, cpu, group) if build == "pipe" else
              build_stage(pipe.get_stage_module(s), s, pipe.info(), cpu, group) for s in mine]
    kind = get_schedule_class(CLASSES[name])
    schedule = kind(stages if issubclass(kind, PipelineScheduleMulti) else stages[0],
                    n_microbatches=MICRO, loss_fn=lm_loss)
    opt = optimizer([p for s in stages for p in s.submod.parameters()])
    losses = []
    for step in range(steps):
        x, y = tokens(step)
        step_losses: list[torch.Tensor] = []  # this step's, one per micro-batch
        if 0 in mine and count - 1 in mine:
            schedule.step(x, target=y, losses=step_losses)
        elif 0 in mine:
            schedule.step(x)
        elif count - 1 in mine:
            schedule.step(target=y, losses=step_losses)
        else:
            schedule.step()
        losses += [loss.item() for loss in step_losses]
        opt.step()
        opt.zero_grad()
    if save_to is not None:
        from devmesh.parallel import save_checkpoint

        save_checkpoint(save_to, stages[0].submod, opt, extra={"step": steps})
    return ({k: p.detach().clone() for s in stages
             for k, p in s.submod.named_parameters(remove_duplicate=False)}, losses)


def _check_equal(ours: dict, theirs: dict) -> None:
    for key, value in ours.items():
        torch.testing.assert_close(value, theirs[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs",
                                  "interleaved-zero-bubble"])
def test_torchs_traced_pipeline_code_runs_on_devmesh_with_its_imports_switched(mesh_pool,
                                                                                name):
    """The same parameters (by torch's names) and micro-batch losses as torch's own run of
    the same code, and as one process training the unsplit model."""
    theirs = mesh_pool.run(train_traced, 2, "torch", name)
    ours = mesh_pool.run(train_traced, 2, "devmesh", name)
    single, single_losses = one_process()
    assert set().union(*(p.keys() for p, _ in ours)) == set(single)
    for (params, losses), (t_params, t_losses) in zip(ours, theirs):
        assert params.keys() == t_params.keys()
        _check_equal(params, t_params)
        _check_equal(params, single)
        assert losses == pytest.approx(t_losses, rel=1e-5)
    _check_losses(ours[1][1], single_losses)


def _check_losses(losses: list[float], single: list[float]) -> None:
    assert len(losses) == 2 * MICRO
    for step in range(2):  # a step's micro-batch losses average to the batch's loss
        mean = sum(losses[step * MICRO:(step + 1) * MICRO]) / MICRO
        assert mean == pytest.approx(single[step], rel=1e-5)


@pytest.mark.parametrize("name", ["zbv-zero-bubble", "dualpipe-v"])
def test_a_traced_pipeline_in_a_v_trains_like_one_process(mesh_pool, name):
    """Rank r holds stages r and 3 - r; the stage-to-stage hand-over on one rank is in
    memory. (torch's own traced stages fail here on gloo: their first step sends stage 1's
    output to stage 2 on the same rank over the network, "Pair is not connected".)"""
    single, single_losses = one_process()
    results = mesh_pool.run(train_traced, 2, "devmesh", name)
    assert set().union(*(p.keys() for p, _ in results)) == set(single)
    for params, _ in results:
        _check_equal(params, single)
    _check_losses(results[0][1], single_losses)


def test_devmesh_build_stage_from_the_stage_module(mesh_pool):
    """torch's function form, ``build_stage(pipe.get_stage_module(s), s, pipe.info(), ...)``,
    gives devmesh's stage: trains as one process."""
    single, _ = one_process()
    for params, _ in mesh_pool.run(train_traced, 2, "devmesh", "1f1b", "function"):
        _check_equal(params, single)


@pytest.mark.parametrize("name", ["1f1b", "zbv-zero-bubble"])
def test_a_tied_embedding_and_head_stay_one_weight_as_in_one_process(mesh_pool, name):
    """torch's tracer copies a tied weight into each stage that uses it (the first stage's
    embedding, the last stage's head, and a third copy the first stage keeps unused), so
    torch's own traced stages train the copies apart; devmesh's ``pipeline`` remembers the
    tie and every copy — on each rank, by both names — ends equal to the one weight of
    single-process training. 1F1B: the ends on ranks 0 and 1; a V: both on rank 0."""
    single, single_losses = one_process(tied=True)
    results = mesh_pool.run(train_traced, 2, "devmesh", name, "pipe", 2, True)
    for params, _ in results:
        _check_equal(params, single)
    assert "output.weight" in results[1 if name == "1f1b" else 0][0]
    _check_losses(results[0 if name in IN_A_V else 1][1], single_losses)
    if name == "1f1b":  # the evidence for the above: torch's own run of the same code
        theirs = mesh_pool.run(train_traced, 2, "torch", name, "pipe", 2, True)
        off = (theirs[0][0]["tok_embeddings.weight"] - single["tok_embeddings.weight"]).abs()
        assert off.max() > 1e-3


def train_traced_under_fsdp(name: str, steps: int = 2, tied: bool = False,
                            data_parallel: str = "fsdp"):
    """A traced pipeline on the ``pp`` dim of a (pp, dp) = (2, 2) mesh, each stage's blocks
    and the stage itself under ``fully_shard`` on ``dp`` (``data_parallel="ddp"``: the
    stage under ``replicate``), each replica its half of the batch: the stage's full
    parameters after ``steps``."""
    from devmesh.parallel import fully_shard, replicate, state_dict
    from devmesh.parallel.pipeline import SplitPoint, get_schedule_class, pipeline

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    me, replica = mesh.get_coordinate()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = pipeline(transformer(tied), mb_args=(tokens(0)[0][:BATCH // MICRO],),
                        split_spec={"layers.2": SplitPoint.BEGINNING})
    stage = pipe.build_stage(me, torch.device("cpu"), mesh.get_group("pp"))
    if data_parallel == "ddp":
        replicate(stage.submod, mesh=mesh["dp"])
    else:
        for layer in range(4):
            if f"layers.{layer}" in dict(stage.submod.named_modules()):
                fully_shard(stage.submod.get_submodule(f"layers.{layer}"), mesh=mesh["dp"])
        fully_shard(stage.submod, mesh=mesh["dp"])
    schedule = get_schedule_class(name)(stage, MICRO, loss_fn=lm_loss)
    opt = optimizer(stage.submod.parameters())
    for step in range(steps):
        x, y = (half.chunk(2)[replica] for half in tokens(step, 2 * BATCH))
        schedule.step(x) if me == 0 else schedule.step(target=y)
        opt.step()
        opt.zero_grad()
    return state_dict(stage.submod, full=True)


@pytest.mark.parametrize("name, tied, data_parallel", [
    ("1F1B", False, "fsdp"), ("GPipe", False, "fsdp"), ("1F1B", True, "fsdp"),
    ("1F1B", True, "ddp")])
def test_a_traced_pipeline_composes_with_fully_shard(mesh_pool, name, tied, data_parallel):
    """PP x FSDP (and PP x DDP) on 4 ranks with traced stages: every parameter equal to one
    process training on the whole batch; tied: the embedding's and the head's copies,
    sharded or replicated on both pipeline ranks, stay one weight."""
    single, _ = one_process(batch=2 * BATCH, tied=tied)
    full: dict[str, torch.Tensor] = {}
    for state in mesh_pool.run(train_traced_under_fsdp, 4, name, 2, tied, data_parallel):
        for key, value in state.items():
            if key in full:  # a tied weight's copies on two pipeline ranks: the same
                torch.testing.assert_close(value, full[key], rtol=0, atol=0, msg=key)
            full[key] = value
    assert full.keys() == single.keys()
    _check_equal(full, single)


@pytest.mark.parametrize("tied", [False, True])
def test_a_traced_pipelines_checkpoint_resumes_in_one_process(mesh_pool, tmp_path, tied):
    """Each rank saves its traced stage (torch's parameter names) and its optimizer's
    momentum; one process loads the whole model and its optimizer and trains on exactly as
    the single process that never stopped (the tied weight's copies saved once)."""
    from devmesh.parallel import load_checkpoint

    path = str(tmp_path / "ckpt")
    mesh_pool.run(train_traced, 2, "devmesh", "1f1b", "pipe", 2, tied, path)

    model, resumed = transformer(tied), transformer(tied)
    opt, resumed_opt = optimizer(model.parameters()), optimizer(resumed.parameters())
    for step in range(3):  # the run that never stopped, and the one resumed at step 2
        if step == 2:
            assert load_checkpoint(path, resumed, resumed_opt) == {"step": 2}
            for key, value in model.state_dict().items():
                torch.testing.assert_close(resumed.state_dict()[key], value, msg=key)
        for net, net_opt in ((model, opt),) if step < 2 else ((model, opt),
                                                              (resumed, resumed_opt)):
            x, y = tokens(step)
            lm_loss(net(x), y).backward()
            net_opt.step()
            net_opt.zero_grad()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value, msg=key)


class SkipOverStages(nn.Module):
    """A model whose split graph sends values past the next stage: the embedding is added
    back at the top (stage 0 to stage 2) and the keyword input ``scale`` is first used by
    the last stage."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCAB, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = skip = self.embedding(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h * scale + skip)


def _trace_skip_model(model: nn.Module):
    from devmesh.parallel.pipeline import SplitPoint, pipeline

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pipeline(model, (tokens(0)[0][:2],), {"scale": torch.ones(2, SEQ, 16)},
                        split_spec={"layers.1": SplitPoint.BEGINNING,
                                    "layers.3": SplitPoint.BEGINNING})


def test_values_skipping_stages_are_carried_by_the_stages_between():
    """One process, the three rewritten stages called one after the other: each takes what
    the one before hands on, and the chain computes the model's output and gradients."""
    from devmesh.parallel.pipeline.traced import route_stage, stage_routes

    model = SkipOverStages()
    reference = copy.deepcopy(model)
    pipe = _trace_skip_model(model)
    routes = stage_routes(pipe.split_gm.graph)
    names = [([v.name for v in r.takes], r.gives and [v.name for v in r.gives]) for r in routes]
    # stage 0 takes the model's inputs; scale and the embedding ride along to stage 2
    assert names[0][0] == ["x", "scale"] and len(names[0][1]) == 3
    assert "scale" in names[1][0] and "scale" in names[1][1] and names[2][1] is None
    stages = [pipe.get_stage_module(i) for i in range(3)]
    for stage, route in zip(stages, routes):
        route_stage(stage, route)
    x, y = (t[:BATCH // MICRO] for t in tokens(0))  # one micro-batch, as traced
    scale = torch.rand(BATCH // MICRO, SEQ, 16)
    out = stages[0](x, scale=scale)
    out = stages[2](*stages[1](*out))
    expected = reference(x, scale)
    torch.testing.assert_close(out, expected)
    lm_loss(out, y).backward()
    lm_loss(expected, y).backward()
    grads = {k: p.grad for s in stages for k, p in s.named_parameters()}
    assert grads.keys() == dict(reference.named_parameters()).keys()
    for key, param in reference.named_parameters():
        torch.testing.assert_close(grads[key], param.grad, msg=key)
    route_stage(stages[1], routes[1])  # again: left as it is
    with pytest.raises(PipelineError, match="already built as stage 1 .* cannot also be "
                                            "stage 2"):
        route_stage(stages[1], routes[2])


def train_skip_model(schedule_name: str, steps: int = 2):
    from devmesh.parallel.pipeline import get_schedule_class

    mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("pp",))
    me = mesh.get_coordinate()[0]
    pipe = _trace_skip_model(SkipOverStages())
    stage = pipe.build_stage(me, torch.device("cpu"), mesh.get_group("pp"))
    schedule = get_schedule_class(schedule_name)(stage, MICRO, loss_fn=lm_loss)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=0.1)
    for step in range(steps):
        x, y = tokens(step)
        scale = torch.linspace(0.5, 1.5, 16).expand(BATCH, SEQ, 16)
        if me == 0:
            schedule.step(x, scale=scale)
        else:
            schedule.step(target=y) if me == 2 else schedule.step()
        opt.step()
        opt.zero_grad()
    return {k: p.detach().clone() for k, p in stage.submod.named_parameters()}


@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
def test_a_traced_model_with_values_skipping_stages_trains_like_one_process(mesh_pool, name):
    model = SkipOverStages()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x, y = tokens(step)
        lm_loss(model(x, torch.linspace(0.5, 1.5, 16).expand(BATCH, SEQ, 16)), y).backward()
        opt.step()
        opt.zero_grad()
    single = {k: v.detach() for k, v in model.named_parameters()}
    results = mesh_pool.run(train_skip_model, 3, name)
    assert set().union(*results) == set(single)
    for params in results:
        _check_equal(params, single)


def test_traced_stage_errors_name_the_fix():
    from devmesh.parallel.pipeline import Schedule1F1B, build_stage

    with pytest.raises(PipelineError, match="a schedule takes PipelineStage objects .devmesh's "
                                            "or torch's., not Linear: wrap the module"):
        Schedule1F1B(nn.Linear(2, 2), 2)
    from devmesh.parallel.pipeline import PipelineStage, ScheduleInterleaved1F1B

    stages = (PipelineStage(nn.Linear(2, 2), s, 4, "cpu") for s in (0, 2))  # any iterable
    assert len(ScheduleInterleaved1F1B(stages, 4)._stages) == 2

    pipe = _trace_skip_model(SkipOverStages())
    with pytest.raises(PipelineError, match="stage_index 3 is not one of the traced "
                                            "pipeline's 3 stages"):
        build_stage(pipe.get_stage_module(0), 3, pipe.info(), "cpu")
    with pytest.raises(PipelineError, match="not Linear; for a module of your own, use "
                                            "PipelineStage"):
        build_stage(nn.Linear(2, 2), 0, pipe.info(), "cpu")


def train_other_micro_batch_size():
    """Micro-batches of 4 rows on a pipeline traced with micro-batches of 2."""
    from devmesh.parallel.pipeline import Schedule1F1B

    mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("pp",))
    me = mesh.get_coordinate()[0]
    pipe = _trace_skip_model(SkipOverStages())  # traced: x (2, 8), scale (2, 8, 16)
    stage = pipe.build_stage(me, torch.device("cpu"), mesh.get_group("pp"))
    schedule = Schedule1F1B(stage, 2, loss_fn=lm_loss)
    x, y = tokens(0)
    if me == 0:
        schedule.step(x, scale=torch.ones(BATCH, SEQ, 16))
    else:
        schedule.step(target=y) if me == 2 else schedule.step()


def test_a_micro_batch_of_another_shape_than_traced_is_refused_on_every_rank(mesh_pool):
    from devmesh.errors import RankFailedError

    with pytest.raises(RankFailedError, match=r"input 'x' has shape \(4, 8\) in this "
                                              r"micro-batch, but was traced with \(2, 8\)") as info:
        mesh_pool.run(train_other_micro_batch_size, 3)
    assert "ranks [1, 2] failed too" in str(info.value)


class MarkedInForward(nn.Module):
    """Split by ``pipe_split()`` calls in its forward, torch's other way to mark stages."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCAB, 16)
        self.middle, self.head = nn.Linear(16, 16), nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from devmesh.parallel.pipeline import pipe_split

        h = self.embedding(x)
        pipe_split()
        h = torch.relu(self.middle(h))
        pipe_split()
        return self.head(h)


def train_marked_in_forward(steps: int = 2):
    from devmesh.parallel.pipeline import ScheduleGPipe, pipeline

    mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("pp",))
    me = mesh.get_coordinate()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = pipeline(MarkedInForward(), (tokens(0)[0][:BATCH // MICRO],))
    stage = pipe.build_stage(me, torch.device("cpu"), mesh.get_group("pp"))
    schedule = ScheduleGPipe(stage, MICRO, loss_fn=lm_loss)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=0.1)
    for step in range(steps):
        x, y = tokens(step)
        schedule.step(x) if me == 0 else schedule.step(target=y) if me == 2 else schedule.step()
        opt.step()
        opt.zero_grad()
    return pipe.num_stages, {k: p.detach().clone() for k, p in stage.submod.named_parameters()}


def test_stages_marked_by_pipe_split_in_the_forward_train_like_one_process(mesh_pool):
    model = MarkedInForward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x, y = tokens(step)
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    results = mesh_pool.run(train_marked_in_forward, 3)
    assert [stages for stages, _ in results] == [3, 3, 3]
    params = [p for _, p in results]
    assert [sorted(p) for p in params] == [["embedding.weight"], ["middle.bias", "middle.weight"],
                                           ["head.bias", "head.weight"]]
    for part in params:
        _check_equal(part, {k: v.detach() for k, v in model.named_parameters()})


class ConstantAcross(nn.Module):
    """A value that needs no gradient crosses the boundary (a buffer's copy, made before the
    split), next to the activation; the second input has a default."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(16, 16) / 4)
        self.register_buffer("offset", torch.randn(16))
        self.first, self.second = nn.Linear(16, 16), nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor, shift: float = 0.5) -> torch.Tensor:
        from devmesh.parallel.pipeline import pipe_split

        h = self.first(torch.relu(x @ self.weight + shift))
        constant = self.offset.clone()
        pipe_split()
        return self.second(torch.relu(h) + constant)


class AliasedOnBothSides(nn.Module):
    """One parameter under two names and one Linear under two names, each used on both
    sides of the split: in one process, one tensor each."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.left = self.right = nn.Parameter(torch.randn(16, 16) / 4)
        self.before = self.after = nn.Linear(16, 16)
        self.out = nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from devmesh.parallel.pipeline import pipe_split

        h = torch.relu(self.before(x @ self.left))
        pipe_split()
        return self.out(torch.relu(self.after(h @ self.right)))


def _features(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 16, generator=gen), torch.randint(0, VOCAB, (BATCH,), generator=gen)


def train_two_stage(make, steps: int = 2):
    from devmesh.parallel.pipeline import Schedule1F1B, pipeline

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    me = mesh.get_coordinate()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = pipeline(make(), (_features(0)[0][:BATCH // MICRO],))
    stage = pipe.build_stage(me, torch.device("cpu"), mesh.get_group("pp"))
    schedule = Schedule1F1B(stage, MICRO, loss_fn=F.cross_entropy)
    opt = optimizer(stage.submod.parameters())
    for step in range(steps):
        x, y = _features(step)
        schedule.step(x) if me == 0 else schedule.step(target=y)
        opt.step()
        opt.zero_grad()
    return {k: p.detach().clone() for k, p in stage.submod.named_parameters(
        remove_duplicate=False)}


@pytest.mark.parametrize("make", [ConstantAcross, AliasedOnBothSides])
def test_shapes_of_torchs_own_pipelining_test_models_train_like_one_process(mesh_pool, make):
    """Models shaped as those torch tests its tracer with: a constant crossing the boundary
    beside the activation, an input with a default, parameters and a module aliased under
    two names and used on both sides (torch's tracer copies them per stage; devmesh keeps
    each one tensor)."""
    model = make()
    opt = optimizer(model.parameters())
    for step in range(2):
        x, y = _features(step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    single = {k: v.detach() for k, v in model.named_parameters(remove_duplicate=False)}
    results = mesh_pool.run(train_two_stage, 2, make)
    for params in results:
        _check_equal(params, single)
    held = set().union(*results)  # the stages may hold an aliased tensor under one name
    names_of: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), set()).add(name)
    assert held <= set(single) and all(names & held for names in names_of.values())


def tensor_parallel_inside_a_traced_stage():
    from devmesh.parallel import ColwiseParallel, parallelize_module
    from devmesh.parallel.pipeline import SplitPoint, pipeline

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    me = mesh.get_coordinate()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = pipeline(transformer(), mb_args=(tokens(0)[0][:BATCH // MICRO],),
                        split_spec={"layers.2": SplitPoint.BEGINNING})
    stage = pipe.build_stage(me, torch.device("cpu"), mesh.get_group("pp"))
    block = stage.submod.get_submodule(f"layers.{2 * me}")
    parallelize_module(block, mesh["tp"], {"attention.wq": ColwiseParallel()})


def test_tensor_parallel_inside_a_traced_stage_is_refused_by_name(mesh_pool):
    """torch.export turns the stage's layers into InterpreterModules (torch's styles refuse
    them as well): a clear error on every rank, not a reshape error or wrong numbers."""
    from devmesh.errors import RankFailedError

    with pytest.raises(RankFailedError, match="ColwiseParallel applies to nn.Linear, "
                                              "nn.Embedding and transformers' Conv1D, but "
                                              "'attention.wq' is a InterpreterModule") as info:
        mesh_pool.run(tensor_parallel_inside_a_traced_stage, 4)
    assert "ranks [1, 2, 3] failed too" in str(info.value)
