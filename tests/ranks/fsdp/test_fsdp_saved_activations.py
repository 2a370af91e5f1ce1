"""Activations a ``fully_shard`` unit's forward saves for backward behave as without devmesh.

A unit that reshards after forward swaps the gathered parameters autograd saves for handles
(a saved-tensor hook), and every other saved tensor goes through that hook too. Kept as they
were, two of autograd's guarantees were lost:

- an operation's own saved output (tanh, sigmoid, exp, softmax) held its graph node and the
  node held it, a cycle through C++ the garbage collector cannot see: every graph not freed by
  a backward — a forward without backward, ``retain_graph=True``, zero-bubble's input-gradient
  pass — stayed alive for good with its activations, units and process groups (2 tensors per
  step leaked by the small model here; a pool worker kept a pipeline's gloo threads);
- a saved tensor changed in place before backward was used as changed (wrong gradients)
  where autograd refuses it.

And only one pair of hooks applies at a time, the innermost: a unit's own replaced any
around it, so activation checkpointing around a unit recomputed nothing (and kept every
activation) and ``save_on_cpu`` or a user's hooks saw 2 of the 11 tensors saved. Compared
here with torch's FSDP2 on the same mesh.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from devmesh import init_device_mesh
from devmesh.parallel import fully_shard
from helpers import TorchRuns, full_params, shard_blocks_and_root


class _Block(nn.Module):
    """Linear, tanh (saves its output), Linear; remembers its last activation weakly."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.activation: weakref.ref | None = None
        self.change_in_place = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        self.activation = weakref.ref(h)
        out = self.b(h)
        if self.change_in_place:
            h.mul_(2)  # after b saved it for its weight gradient
        return out


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Block(), nn.Linear(8, 4))


def _shard(model: nn.Sequential) -> nn.Sequential:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    fully_shard(model[0], mesh=mesh)  # not the root: reshards after forward (the hook)
    fully_shard(model, mesh=mesh)
    return model


def _drop_unused_graphs() -> dict[str, bool]:
    """For each way of leaving a graph unfreed by backward: is the activation gone once the
    loss is dropped and garbage collected?"""
    model = _shard(_model())
    x = torch.randn(4, 8, requires_grad=True)
    gone = {}
    for case in ("forward only", "retain_graph", "input gradient only"):
        loss = F.cross_entropy(model(x), torch.zeros(4, dtype=torch.long))
        if case == "retain_graph":
            loss.backward(retain_graph=True)
        elif case == "input gradient only":
            torch.autograd.grad(loss, x, retain_graph=True)
        del loss
        gc.collect()
        gone[case] = model[0].activation() is None
    return gone


def test_a_graph_no_backward_freed_is_collected(mesh_pool):
    for gone in mesh_pool.run(_drop_unused_graphs, 2):
        assert gone == {"forward only": True, "retain_graph": True,
                        "input gradient only": True}


def _backward_after_change(sharded: bool) -> str:
    model = _model()
    if sharded:
        _shard(model)
    model[0].change_in_place = True
    loss = model(torch.randn(4, 8)).sum()
    try:
        loss.backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_saved_activation_changed_in_place_is_refused_as_autograd_does(mesh_pool):
    plain = _backward_after_change(sharded=False)
    assert "modified by an inplace operation" in plain  # autograd's own check
    for message in mesh_pool.run(_backward_after_change, 2, True):
        assert "modified by an inplace operation" in message, message
        assert "[torch.FloatTensor [4, 8]], which is output 0 of TanhBackward0" in message
        assert "is at version 1; expected version 0" in message


def _train(model: nn.Module, x: torch.Tensor, steps: int = 3) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(steps):
        y = model(x)
        # a double backward through the saved activations: they unpack with their graph
        grad, = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
        (y.sum() + grad.pow(2).sum()).backward()
        opt.step()
        opt.zero_grad()


def _train_sharded() -> dict[str, torch.Tensor]:
    from devmesh.parallel import state_dict

    model = _shard(_model())
    _train(model, torch.randn(4, 8, generator=torch.Generator().manual_seed(1),
                              requires_grad=True))
    return {k: v.clone() for k, v in state_dict(model, full=True).items()}


def test_saved_activations_give_the_gradients_of_one_process(mesh_pool):
    model = _model()
    _train(model, torch.randn(4, 8, generator=torch.Generator().manual_seed(1),
                              requires_grad=True))
    expected = model.state_dict()
    for trained in mesh_pool.run(_train_sharded, 2):
        for key, value in expected.items():
            torch.testing.assert_close(trained[key], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{key}: {m}")


def _pipeline_leaves_nothing(name: str) -> tuple[int, bool]:
    """This run's units still alive, and whether its last activation is, once a pipeline of
    sharded stages is dropped."""
    from devmesh.parallel.pipeline import PipelineRunner, build_schedule, split_sequential

    def run() -> tuple[list[weakref.ref], weakref.ref]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        me = mesh.get_coordinate()[0]
        torch.manual_seed(0)
        model = nn.Sequential(_Block(), _Block(), _Block(), nn.Linear(8, 4))
        stage = split_sequential(model, 2)[me]
        for block in stage:
            if isinstance(block, _Block):
                fully_shard(block, mesh=mesh["dp"])
        fully_shard(stage, mesh=mesh["dp"])
        runner = PipelineRunner({me: stage}, mesh, build_schedule(name, 2, 4), F.cross_entropy)
        x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        for _ in range(2):
            runner.step(x if me == 0 else None, y if me == 1 else None)
        units = [weakref.ref(m._devmesh_fsdp) for m in stage.modules()
                 if getattr(m, "_devmesh_fsdp", None)]
        return units, stage[0].activation

    units, activation = run()
    gc.collect()
    return sum(unit() is not None for unit in units), activation() is not None


@pytest.mark.parametrize("name", ["zero-bubble", "1f1b"])
def test_a_pipeline_of_sharded_stages_leaves_nothing_behind(mesh_pool, name):
    # zero-bubble's input-gradient pass keeps the graph for the weight-gradient pass; the
    # part no pass frees (the input path) was kept alive by the cycle: its units, their
    # meshes and process groups (a pool worker's gloo threads) with it
    assert mesh_pool.run(_pipeline_leaves_nothing, 4, name) == [(0, False)] * 4


class _Counted(nn.Module):
    """A block that counts its forwards (a recomputation runs it again)."""

    calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Counted.calls += 1
        return self.l2(torch.tanh(self.l1(x)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([_Counted(), _Counted()])
        self.head = nn.Linear(8, 2)
        self.checkpointed = True

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.checkpointed else block(h)
        return self.head(h)


def _hooks_around_units(kind: str) -> dict[str, object]:
    """Block forwards with a checkpoint around each unit, the shapes a user's hooks around
    the whole forward are given, and the parameters after a step on both backwards."""
    model = shard_blocks_and_root(_Net(), kind)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    _Counted.calls = 0
    model(x).sum().backward()
    forwards = _Counted.calls
    model.checkpointed = False
    packed = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(tuple(t.shape))
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).sum()
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()  # both backwards' gradients
    return {"block forwards": forwards, "packed": sorted(packed),
            "params": full_params(model, kind)}


@pytest.fixture(scope="module")
def torch_runs() -> TorchRuns:
    """torch's FSDP2 side (fresh processes: its groups outlive a pool task)."""
    return TorchRuns({2: [(_hooks_around_units, ("torch",))]})


def test_hooks_around_a_unit_apply_inside_it_as_under_torchs_fsdp(mesh_pool, torch_runs):
    expected = _hooks_around_units("one process")
    assert expected["block forwards"] == 4  # 2 forwards, 2 recomputations
    assert len(expected["packed"]) == 11
    for kind, results in (("torch", torch_runs(2, _hooks_around_units, "torch")),
                          ("devmesh", mesh_pool.run(_hooks_around_units, 2, "devmesh"))):
        for result in results:
            assert result["block forwards"] == 4, kind
            assert result["packed"] == expected["packed"], kind
            for key, value in expected["params"].items():
                torch.testing.assert_close(result["params"][key], value, rtol=1e-5,
                                           atol=1e-6, msg=lambda m: f"{kind} {key}: {m}")
