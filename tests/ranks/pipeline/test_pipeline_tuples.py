"""Stages that pass several tensors to the next (a tuple: hidden states, a mask, token ids),
as torch's ``torch.distributed.pipelining`` allows: every schedule trains as one process does,
only the floating-point tensors get gradients back, and a first stage may take several
inputs, positional or keyword."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from devmesh import comm_stats, init_device_mesh
from devmesh.layout.schedule import build_schedule
from devmesh.parallel.pipeline import PipelineRunner
from tuple_stages import TWO_PER_RANK, pipelining_stage, through_parts, tuple_batch, tuple_parts, tuple_pipeline


# zero-bubble V and DualPipeV place stages 0 and 3 on rank 0, 1 and 2 on rank 1: the tuple
# from stage 1 to stage 2 (hidden states, a bool mask, a skip connection) is handed over in
# memory


def _train_pipelined(name: str):
    stages, runner, opt = tuple_pipeline(name)
    losses = []
    for step in range(2):
        x, scale, y = tuple_batch(step)
        with comm_stats() as stats:
            loss = runner.step((x, scale) if 0 in stages else None, y if 3 in stages else None)
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else loss.item())
    return losses, {s: part.state_dict() for s, part in stages.items()}, stats.by_collective()


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble",
                                  "interleaved-zero-bubble", "zbv-zero-bubble", "dualpipe-v"])
def test_stages_passing_tuples_train_as_one_process(mesh_pool, name):
    parts = tuple_parts()
    opt = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=0.1)
    expected = []
    for step in range(2):
        x, scale, y = tuple_batch(step)
        loss = F.cross_entropy(through_parts(parts, x, scale), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    results = mesh_pool.run(_train_pipelined, 4 // (2 if name in TWO_PER_RANK else 1), name)
    losses = [loss for rank_losses, _, _ in results for loss in rank_losses if loss is not None]
    assert losses == pytest.approx(expected, rel=1e-5)
    for _, states, _ in results:
        for s, state in states.items():
            for key, value in state.items():
                torch.testing.assert_close(value, parts[s].state_dict()[key], rtol=1e-5,
                                           atol=1e-6, msg=f"stage {s} {key}")
    if name == "1f1b":  # one message per activation and per gradient, whatever it carries:
        # 3 boundaries x 4 micro-batches each way, plus one header per boundary and step
        sends = sum(stats["send"][0] for _, _, stats in results)
        assert sends == 3 * 4 * 2 + 3


def _wrong_layouts():
    """A stage whose second micro-batch gives a tuple of another length: refused with both
    layouts named, on every rank."""
    from devmesh.parallel.pipeline import PipelineError

    class Flaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.calls = nn.Linear(16, 16), 0

        def forward(self, x: torch.Tensor):
            self.calls += 1
            h = self.fc(x)
            return (h, h) if self.calls == 2 else (h,)

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    me = mesh.get_coordinate()[0]
    stages = {0: Flaky()} if me == 0 else {1: nn.Linear(16, 4)}
    runner = PipelineRunner(stages, mesh, build_schedule("1f1b", 2, 2), F.cross_entropy)
    x, _, y = tuple_batch(0)
    try:
        runner.step(x if me == 0 else None, y if me == 1 else None)
    except PipelineError as exc:
        return str(exc)
    return None


def test_a_tuple_that_changes_within_a_step_is_named_on_every_rank(mesh_pool):
    for error in mesh_pool.run(_wrong_layouts, 2):
        assert error is not None and "stage 0's output for micro-batch 1 is ((8, 16) " \
            "torch.float32, (8, 16) torch.float32), but it was (8, 16) torch.float32" in error


def _torch_pipelining_code(library: str, keyword: bool):
    """torch's pipelining code for the tuple-passing model, run by torch's classes or, with
    its imports switched, devmesh's; the first stage's second input positional or keyword."""
    me, part, stage, classes = pipelining_stage(library)
    schedule = classes.Schedule1F1B(stage, 4, loss_fn=F.cross_entropy)
    opt = torch.optim.SGD(part.parameters(), lr=0.1)
    losses, outputs = [], []
    for step in range(2):
        x, scale, y = tuple_batch(step)
        if me == 0:
            schedule.step(x, scale=scale) if keyword else schedule.step(x, scale)
        elif me == 3:
            outputs.append(schedule.step(target=y, losses=losses))
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
    return part.state_dict(), [float(loss) for loss in losses], outputs


@pytest.mark.parametrize("keyword", [False, True], ids=["positional", "keyword"])
def test_tuples_between_stages_as_torchs_pipelining(mesh_pool, keyword):
    theirs = mesh_pool.run(_torch_pipelining_code, 4, "torch", keyword)
    ours = mesh_pool.run(_torch_pipelining_code, 4, "devmesh", keyword)
    for (state, losses, outputs), (t_state, t_losses, t_outputs) in zip(ours, theirs):
        for key, value in t_state.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)
        assert losses == pytest.approx(t_losses, rel=1e-5)
        for out, t_out in zip(outputs, t_outputs):
            torch.testing.assert_close(out, t_out, rtol=1e-5, atol=1e-6)
    assert len(ours[3][1]) == 4 and len(ours[3][2]) == 2


def _train_sharded_pipeline(style: str):
    """Zero-bubble on (pp, dp) = (4, 2), each stage under ``fully_shard`` or ``replicate``
    over ``dp``, each dp rank on its half of the batch."""
    from devmesh.parallel import fully_shard, replicate, state_dict

    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("pp", "dp"))
    me, dp = mesh.get_coordinate()
    stage = tuple_parts()[me]
    (fully_shard if style == "fsdp" else replicate)(stage, mesh=mesh["dp"])
    runner = PipelineRunner({me: stage}, mesh, build_schedule("zero-bubble", 4, 4),
                            F.cross_entropy)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    for step in range(2):
        x, scale, y = tuple_batch(step)
        half = slice(8 * dp, 8 * dp + 8)
        runner.step((x[half], scale[half]) if me == 0 else None, y[half] if me == 3 else None)
        opt.step()
        opt.zero_grad()
    return me, state_dict(stage, full=True)


@pytest.mark.parametrize("style", ["fsdp", "ddp"])
def test_tuples_between_sharded_stages_train_as_one_process(mesh_pool, style):
    parts = tuple_parts()
    opt = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=0.1)
    for step in range(2):
        x, scale, y = tuple_batch(step)
        F.cross_entropy(through_parts(parts, x, scale), y).backward()
        opt.step()
        opt.zero_grad()
    for stage, state in mesh_pool.run(_train_sharded_pipeline, 8, style):
        for key, value in state.items():
            torch.testing.assert_close(value, parts[stage].state_dict()[key], rtol=1e-5,
                                       atol=1e-6, msg=f"stage {stage} {key}")


class _MaskOnly(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x > 0


class _FromMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(16, 4)

    def forward(self, mask: torch.Tensor) -> torch.Tensor:
        return self.fc(mask.float())


def _boolean_boundary():
    """Stage 0 passes a bool tensor only: nothing differentiable crosses, so no gradient
    message comes back (and stage 0, without parameters, has nothing to compute)."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    me = mesh.get_coordinate()[0]
    stages = {0: _MaskOnly()} if me == 0 else {1: _FromMask()}
    runner = PipelineRunner(stages, mesh, build_schedule("1f1b", 2, 2), F.cross_entropy)
    x, _, y = tuple_batch(0)
    with comm_stats() as stats:
        loss = runner.step(x if me == 0 else None, y if me == 1 else None)
    sends = stats.by_collective().get("send", (0,))[0]
    if me == 0:
        return sends, None, None
    reference = _FromMask()
    F.cross_entropy(reference(x > 0), y).backward()
    return sends, loss.item(), torch.allclose(stages[1].fc.weight.grad, reference.fc.weight.grad,
                                              rtol=1e-5, atol=1e-7)


def test_a_boundary_without_floating_point_tensors_sends_no_gradient(mesh_pool):
    (first_sends, _, _), (last_sends, loss, same_grads) = mesh_pool.run(_boolean_boundary, 2)
    assert first_sends == 2 + 1 and last_sends == 0  # 2 activations and a header; no gradient
    assert loss is not None and same_grads


def _batches_of_several_sizes():
    """Interleaved on 2 ranks, 16, 8, 8, 16 and 4 samples: each step's first packed message
    lands in the receive posted in the previous step's layout, or fills it and follows on a
    tag of its own."""
    stages, runner, opt = tuple_pipeline("interleaved-1f1b")
    losses = []
    for step, size in enumerate(_SIZES):
        x, scale, y = (t[:size] for t in tuple_batch(step))
        loss = runner.step((x, scale) if 0 in stages else None, y if 3 in stages else None)
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else loss.item())
    return losses


_SIZES = (16, 8, 8, 16, 4)


def test_tuples_whose_batch_changes_between_steps(mesh_pool):
    parts = tuple_parts()
    opt = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=0.1)
    expected = []
    for step, size in enumerate(_SIZES):
        x, scale, y = (t[:size] for t in tuple_batch(step))
        loss = F.cross_entropy(through_parts(parts, x, scale), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    last_rank = mesh_pool.run(_batches_of_several_sizes, 2)[1]  # holds stage 3
    assert last_rank == pytest.approx(expected, rel=1e-5)


class _SameTensorTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor):
        h = self.fc(x)
        return h, h


class _Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b = nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return self.a(p) + self.b(q.tanh())


class _NineTensors(nn.Module):
    def forward(self, x: torch.Tensor):
        return (x,) * 9


def _two_stage_run(first: str, name: str):
    """Stage 0 returns the same tensor twice (its two gradients must add) or nine tensors
    (one too many: refused on every rank)."""
    from devmesh.parallel.pipeline import PipelineError

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    me = mesh.get_coordinate()[0]
    stage = (_SameTensorTwice() if first == "twice" else _NineTensors()) if me == 0 else _Join()
    runner = PipelineRunner({me: stage}, mesh, build_schedule(name, 2, 2), F.cross_entropy)
    x, _, y = tuple_batch(0)
    try:
        runner.step(x if me == 0 else None, y if me == 1 else None)
    except PipelineError as exc:
        return str(exc)
    return [p.grad for p in stage.parameters()]


@pytest.mark.parametrize("name", ["1f1b", "zero-bubble"])
def test_the_same_tensor_passed_twice_gets_both_gradients(mesh_pool, name):
    first, last = _SameTensorTwice(), _Join()
    x, _, y = tuple_batch(0)
    F.cross_entropy(last(*first(x)), y).backward()
    ours = mesh_pool.run(_two_stage_run, 2, "twice", name)
    for grads, reference in zip(ours, (first, last)):
        for grad, param in zip(grads, reference.parameters()):
            torch.testing.assert_close(grad, param.grad, rtol=1e-5, atol=1e-6)


def test_more_tensors_than_a_boundary_carries_are_refused_on_every_rank(mesh_pool):
    for error in mesh_pool.run(_two_stage_run, 2, "nine", "1f1b"):
        assert "rank 0: stage 0 returned 9 tensors: a stage passes 1 to 8 tensors" in error


class _TwoWays(nn.Module):
    """Two inputs and two outputs, each output reached from both inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, h: torch.Tensor, skip: torch.Tensor):
        mixed = torch.tanh(self.a(h) + self.b(skip))
        return self.c(mixed), mixed * 0.5 + skip


class _PassesSkipOn(nn.Module):
    """The second input leaves unchanged as the second output (the same tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor, skip: torch.Tensor):
        return torch.tanh(self.fc(h) + skip), skip


class _TableOutput(nn.Module):
    """A second output made from a parameter alone (a learned table), not from the inputs:
    no input-path node leads to its weight side, so W runs the whole backward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.table = nn.Linear(16, 16), nn.Parameter(torch.randn(8, 16))

    def forward(self, h: torch.Tensor, skip: torch.Tensor):
        return self.fc(h) + skip, self.table * 2


@pytest.mark.parametrize("build, fast", [(_TwoWays, True), (_PassesSkipOn, True),
                                         (_TableOutput, False)])
def test_zero_bubbles_split_of_a_tuple_stage_is_one_backward(build, fast):
    """Zero-bubble's I + W on a stage taking and giving two tensors: one backward's
    gradients for one backward's matrix work (the fast split; before, W ran the whole
    backward over the parameters again for tuples, recomputing every input gradient on the
    way to the first layers' weights), or, where the split would not be exact, that whole
    backward in W (here no more work: the table's layer is the stage's last)."""
    import copy

    from devmesh.parallel.pipeline.split_backward import SplitBackward
    from pipeline_cases import MatmulWork

    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    inputs = [torch.randn(8, 16) for _ in range(2)]
    grads = [torch.randn(8, 16) for _ in range(2)]
    ref_inputs = [x.clone().requires_grad_() for x in inputs]
    ref_outputs = reference(*ref_inputs)
    with MatmulWork() as whole:
        torch.autograd.backward(ref_outputs, grads)
    ours = [x.clone().requires_grad_() for x in inputs]
    split = SplitBackward(model(*ours), grads, ours, list(model.parameters()))
    with MatmulWork() as input_part:
        input_grads = split.input_grad()
    assert all(p.grad is None for p in model.parameters())
    with MatmulWork() as weight_part:
        split.weight_grads()
    assert (split._pieces[0].boundaries is not None) == fast
    for got, x in zip(input_grads, ref_inputs):
        torch.testing.assert_close(got, x.grad)
    for got, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, expected.grad)
    assert input_part.flops + weight_part.flops == whole.flops


class _Scaled(nn.Module):
    """A layer every stage holds that takes a keyword input of the batch, as torchtitan's
    layers take their attention masks: each rank gives its stages the keyword."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.tanh(self.fc(x))
        return y if scale is None else y * scale


def _keyword_batch(step: int):
    gen = torch.Generator().manual_seed(step)
    return (torch.randn(8, 8, generator=gen), torch.rand(8, 1, generator=gen) + 0.5,
            torch.randint(0, 8, (8,), generator=gen))


def _keywords_on_every_rank(library: str, schedule_name: str):
    """torch's pipelining code on 2 ranks, every rank passing the keyword to its
    ``schedule.step``: torch's classes, or devmesh's with the imports switched."""
    if library == "torch":
        import torch.distributed.pipelining.schedules as classes
        from torch.distributed.pipelining import PipelineStage
    else:
        import devmesh.parallel.pipeline as classes
        from devmesh.parallel.pipeline import PipelineStage

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    me = mesh.get_coordinate()[0]
    mine = (me,) if schedule_name == "Schedule1F1B" else (me, me + 2)
    stages = len(mine) * 2
    parts = [_Scaled(s) for s in mine]
    built = [PipelineStage(p, s, stages, torch.device("cpu"), group=mesh.get_group("pp"))
             for p, s in zip(parts, mine)]
    schedule = getattr(classes, schedule_name)(built[0] if len(built) == 1 else built, 4,
                                               loss_fn=F.cross_entropy)
    opt = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=0.1)
    losses = []
    for step in range(2):
        x, scale, y = _keyword_batch(step)
        if me == 0:
            schedule.step(x, scale=scale)
        else:
            schedule.step(target=y, losses=losses, scale=scale)
        opt.step()
        opt.zero_grad()
    return {s: part.state_dict() for s, part in zip(mine, parts)}, [float(v) for v in losses]


@pytest.mark.parametrize("schedule_name", ["Schedule1F1B", "ScheduleInterleaved1F1B"])
def test_keyword_inputs_reach_every_stage_as_torchs_pipelining(mesh_pool, schedule_name):
    """torch gives the keyword inputs of a rank's ``step`` to each of its stages (before,
    devmesh gave them to the first stage only: the later stages ran without the scale,
    silently)."""
    theirs = mesh_pool.run(_keywords_on_every_rank, 2, "torch", schedule_name)
    ours = mesh_pool.run(_keywords_on_every_rank, 2, "devmesh", schedule_name)
    stages = 2 if schedule_name == "Schedule1F1B" else 4
    parts = [_Scaled(s) for s in range(stages)]  # one process, every layer scaled alike
    opt = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=0.1)
    alone = []
    for step in range(2):
        x, scale, y = _keyword_batch(step)
        for mb in range(4):
            h = x[2 * mb:2 * mb + 2]
            for part in parts:
                h = part(h, scale=scale[2 * mb:2 * mb + 2])
            loss = F.cross_entropy(h, y[2 * mb:2 * mb + 2])
            (loss / 4).backward()
            alone.append(loss.item())
        opt.step()
        opt.zero_grad()
    for (state, losses), (t_state, t_losses) in zip(ours, theirs):
        assert losses == pytest.approx(t_losses, rel=1e-6)
        for s, values in state.items():
            for key, value in values.items():
                torch.testing.assert_close(value, t_state[s][key], rtol=1e-6, atol=1e-7)
                torch.testing.assert_close(value, parts[s].state_dict()[key], rtol=1e-5,
                                           atol=1e-6)
    assert ours[1][1] == pytest.approx(alone[4:], rel=1e-5)  # the last step's, as torch's
