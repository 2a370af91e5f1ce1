"""Zero-bubble's split backward over a stage whose graph the forward cut at its layers'
outputs (``layer_cuts``): the same gradients and the same matrix work as one backward, on
stages built the ways users build them (torch's own transformer layers, skip connections
across layers, tuples with masks, a module called twice, a weight shared by two layers,
frozen layers), and each autograd call of W walks one piece, not the stage below it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from devmesh.parallel.pipeline.layer_cuts import LayerCuts
from devmesh.parallel.pipeline.backward_graph import consumers_of
from devmesh.parallel.pipeline.split_backward import SplitBackward
from pipeline_cases import ChunkKeepingTheOtherHalf as _KeepsHalf
from pipeline_cases import MatmulWork


def _mlp(depth: int = 12) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(depth)])


class _Skips(nn.Module):
    """A custom stage whose forward reuses an early layer's output later (a long skip)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.layers[0](x)
        h = first
        for layer in self.layers[1:]:
            h = torch.tanh(layer(h))
        return h + first


class _WithMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, mask=None):
        h = x[0] if isinstance(x, tuple) else x
        out = torch.tanh(self.fc(h))
        return out, (out[:, :1] > 0)


class _Unmask(nn.Module):
    def forward(self, pair):
        h, mask = pair
        return h * mask


class _TiedUse(nn.Module):
    """Uses another layer's weight directly (not through that layer's forward)."""

    def __init__(self, source: nn.Linear) -> None:
        super().__init__()
        self.source = [source]  # not a child: the weight belongs to the earlier layer
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(F.linear(x, self.source[0].weight)))


class _MatmulUse(nn.Module):
    """Multiplies by another layer's weight directly (``x @ W``: its backward node feeds
    the weight's accumulator itself, where ``F.linear`` goes through a transpose)."""

    def __init__(self, source: nn.Linear) -> None:
        super().__init__()
        self.source = [source]
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.source[0].weight) * self.scale


class _DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return {"h": self.fc(x)}


class _FromDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, d):
        return self.fc(d["h"])


class _ReadsKept(nn.Module):
    """Reads the half an earlier layer kept: a piece's graph reaching into an earlier
    piece's (not through the cut)."""

    def __init__(self, keeper: _KeepsHalf) -> None:
        super().__init__()
        self.keeper = [keeper]
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.keeper[0].other


def _stage(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return _mlp()
    if kind == "torch-transformer":  # torch's own layer class, four of them
        return nn.Sequential(*[nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0,
                                                          batch_first=True)
                               for _ in range(4)])
    if kind == "skips":
        return _Skips()
    if kind == "tuples":
        return nn.Sequential(_WithMask(), _WithMask(), _Unmask(), nn.Linear(16, 16))
    if kind == "called-twice":
        shared = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        return nn.Sequential(shared, _mlp(2), shared, nn.Linear(16, 16))
    if kind == "shared-weight":
        first = nn.Linear(16, 16)
        return nn.Sequential(first, *_mlp(4), _TiedUse(first))
    if kind == "matmul-shared-weight":
        first = nn.Linear(16, 16)
        return nn.Sequential(first, nn.Tanh(), _MatmulUse(first), *_mlp(4), _MatmulUse(first))
    if kind == "frozen":
        model = _mlp(6)
        for p in model[2].parameters():
            p.requires_grad_(False)
        return nn.Sequential(nn.Tanh(), *model)  # the first layer has no parameters
    if kind == "keeps-state":
        keeper = _KeepsHalf()
        return nn.Sequential(nn.Linear(16, 16), keeper, *_mlp(3), _ReadsKept(keeper))
    if kind == "in-place-relu":  # ResNet's stem: no cut before the in-place ReLU
        return nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(inplace=True),
                             *_mlp(4), nn.LayerNorm(16), nn.ReLU(inplace=True))
    if kind == "dict":
        return nn.Sequential(nn.Linear(16, 16), _DictOut(), _FromDict(), nn.Linear(16, 16))
    raise ValueError(kind)


KINDS = ["mlp", "torch-transformer", "skips", "tuples", "called-twice", "shared-weight",
         "frozen", "dict", "keeps-state", "in-place-relu", "matmul-shared-weight"]


def _input(kind: str) -> torch.Tensor:
    shape = (2, 4, 16) if kind == "torch-transformer" else (8, 16)
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("min_params", [1, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_a_cut_stage_splits_into_one_backwards_gradients_and_work(kind, min_params):
    """I then W over the cut graph: the input gradient and every parameter's gradient of one
    plain backward, with the same matrix work (nothing computed twice); ``min_params=1``
    cuts after every layer with parameters."""
    stage = _stage(kind)
    reference = copy.deepcopy(stage)
    x = _input(kind)
    x_ref = x.clone().requires_grad_()
    out_ref = reference(x_ref)
    grad = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(2))
    with MatmulWork() as whole:
        out_ref.backward(grad)

    cuts = LayerCuts(stage, min_params)
    x_split = x.clone().requires_grad_()
    with cuts.recording() as made:
        out = stage(x_split)
    assert made, "the forward made no cut"
    params = [p for p in stage.parameters() if p.requires_grad]
    split = SplitBackward(out, grad, x_split, params, made)
    assert len(split._pieces) == len(made) + 1
    with MatmulWork() as input_part:
        input_grad = split.input_grad()
    assert all(p.grad is None for p in params)  # I touches no parameter
    with MatmulWork() as weight_part:
        split.weight_grads()
    torch.testing.assert_close(input_grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    for (name, ours), theirs in zip(stage.named_parameters(), reference.parameters()):
        if theirs.grad is None:
            assert ours.grad is None, name
        else:
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6,
                                       msg=name)
    # keeps-state: the top piece reaches the keeper's Linear past the cut, so I runs its
    # input gradient for each piece's share (8 x 32 x 16 multiply-adds once more)
    extra = 8 * 32 * 16 if kind == "keeps-state" else 0
    assert input_part.flops + weight_part.flops == whole.flops + extra


def test_each_piece_is_one_layers_graph_however_deep_the_stage():
    """The reason for the cuts: W's autograd calls start inside a piece, and autograd walks
    everything reachable from where a call starts. Uncut, a 48-layer stage's first piece was
    the whole stage; cut, the biggest piece of a 48-layer stage is no bigger than that of a
    12-layer one."""
    def biggest_piece(depth: int, min_params: int) -> int:
        stage = _mlp(depth)
        cuts = LayerCuts(stage, min_params)
        x = torch.randn(4, 16, requires_grad=True)
        with cuts.recording() as made:
            out = stage(x)
        split = SplitBackward(out, torch.ones_like(out), x, list(stage.parameters()), made)
        return max(len(consumers_of(piece.roots)) for piece in split._pieces)

    assert biggest_piece(48, 8) == biggest_piece(12, 8) <= 5 * 4  # 4 layers: 5 nodes each
    assert biggest_piece(48, 10**9) > 4 * biggest_piece(12, 10**9)  # uncut: grows


class _Direct(nn.Module):
    """``x @ W`` with a weight the stage holds (not a layer's own)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = [weight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight[0]


@pytest.mark.parametrize("min_params", range(1, 9))
def test_a_weight_used_directly_in_two_pieces_is_counted_once(min_params):
    """Two layers multiplying by one weight directly (both backward nodes feed its
    accumulator), in pieces cut every ``min_params`` parameter tensors: W asking both in
    one call counted one's gradient twice, through its piece's input path (6: 0.55 off)."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(16, 16) / 4)
    layers = []
    for kind in "lldlldl":
        layers += [_Direct(weight) if kind == "d" else nn.Linear(16, 16), nn.Tanh()]
    stage = nn.Sequential(*layers)
    stage.weight = weight
    reference = copy.deepcopy(stage)
    x, grad = torch.randn(4, 16), torch.randn(4, 16)
    reference(x).backward(grad)
    cuts = LayerCuts(stage, min_params)
    x_split = x.clone().requires_grad_()
    with cuts.recording() as made:
        out = stage(x_split)
    split = SplitBackward(out, grad, x_split, list(stage.parameters()), made)
    split.input_grad()
    split.weight_grads()
    for ours, theirs in zip(stage.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6)


class _FlatLinears(nn.Module):
    """``depth`` Linear layers whose weights are slices of one flat parameter (as under a
    sharding wrapper's gather): the layers' weight sides meet, so W takes its second way
    (weight gradients asked for, then one backward into the parameter)."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.flat = nn.Parameter(torch.randn(depth, 16, 16) / 4)
        self.layers = nn.ModuleList(_Slice(self, i) for i in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _Slice(nn.Module):
    def __init__(self, owner: _FlatLinears, index: int) -> None:
        super().__init__()
        self.owner, self.index = [owner], index
        self.bias = nn.Parameter(torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.linear(x, self.owner[0].flat[self.index], self.bias))


@pytest.mark.parametrize("build", [_mlp, _FlatLinears], ids=["apart", "meeting"])
def test_w_makes_as_many_autograd_calls_however_deep_the_stage(build, monkeypatch):
    """The pieces are separate graphs, so W starts the j-th boundary of every piece in one
    autograd call: as many calls at depth 48 as at 12 (one per layer cost ~50 us of engine
    and Python each, 1.3-1.5x a whole backward on small layers), with one backward's
    gradients."""
    def calls_and_check(depth: int) -> int:
        torch.manual_seed(0)
        stage = build(depth)
        reference = copy.deepcopy(stage)
        x = torch.randn(4, 16)
        grad = torch.randn(4, 16)
        reference(x).backward(grad)
        cuts = LayerCuts(stage, 8)
        x_split = x.clone().requires_grad_()
        with cuts.recording() as made:
            out = stage(x_split)
        split = SplitBackward(out, grad, x_split, list(stage.parameters()), made)
        split.input_grad()
        counted = []
        for name in ("backward", "grad"):
            original = getattr(torch.autograd, name)
            monkeypatch.setattr(torch.autograd, name,
                                lambda *a, _f=original, **k: counted.append(1) or _f(*a, **k))
        split.weight_grads()
        monkeypatch.undo()
        for ours, theirs in zip(stage.parameters(), reference.parameters()):
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6)
        return len(counted)

    assert calls_and_check(48) == calls_and_check(12) <= 9


def test_cuts_only_where_the_runner_records_and_grad_is_on():
    """Outside :meth:`LayerCuts.recording` (the user's own forward, validation) and under
    ``no_grad`` or activation checkpointing nothing is cut: the graph is torch's own."""
    from torch.utils.checkpoint import checkpoint

    stage = _mlp(4)
    cuts = LayerCuts(stage, 1)
    x = torch.randn(4, 16, requires_grad=True)
    out = stage(x)
    assert len(consumers_of([out.grad_fn])) > 4 * 4  # one graph down to x
    with cuts.recording() as made, torch.no_grad():
        stage(x)
    assert made == []
    with cuts.recording() as made:
        out = checkpoint(stage, x, use_reentrant=False)
    assert made == []
    out.sum().backward()  # the recomputation matches the forward
    assert x.grad is not None


class _AddsInPlace(nn.Module):
    """Changes its input in place (``x += 1``): a cut before it cannot be a leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x += 1
        return self.fc(x)


def _in_place_after_a_cut():
    from devmesh import init_device_mesh
    from devmesh.layout.schedule import build_schedule
    from devmesh.parallel.pipeline import PipelineError, PipelineRunner

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    me = mesh.get_coordinate()[0]
    torch.manual_seed(0)
    stage = (nn.Sequential(nn.Linear(16, 16), _AddsInPlace()) if me == 0
             else nn.Linear(16, 4))
    runner = PipelineRunner({me: stage}, mesh, build_schedule("zero-bubble", 2, 2),
                            F.cross_entropy)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    try:
        runner.step(x if me == 0 else None, y if me == 1 else None)
    except PipelineError as exc:
        return str(exc)
    return None


def test_a_layer_changing_its_input_in_place_after_a_cut_is_told_the_fix(mesh_pool):
    """torch's own message ("a leaf Variable ... in-place operation") names neither the cut
    nor the fix; the runner's does, on every rank (no hang)."""
    for error in mesh_pool.run(_in_place_after_a_cut, 2):
        assert error is not None and "rank 0:" in error, error
        assert "cuts the stage's graph at its layers' outputs" in error, error
        assert "make that operation out of place (x = x + y, not x += y" in error, error


def test_a_copy_or_a_saved_stage_carries_no_live_cuts():
    """The hooks stay on the user's modules: a deep copy (an EMA, a teacher) runs its own
    forwards uncut even while the runner records the original's, and ``torch.save`` of the
    whole module still pickles (the runner's earlier closure hook could not be pickled)."""
    import io

    stage = _mlp(4)
    cuts = LayerCuts(stage, 1)
    twin = copy.deepcopy(stage)
    x = torch.randn(4, 16, requires_grad=True)
    with cuts.recording() as made:
        stage(x)
        out = twin(x)
    assert len(made) == 4  # the original's layers only
    assert len(consumers_of([out.grad_fn])) > 4 * 4  # the copy's graph is one piece
    buffer = io.BytesIO()
    torch.save(stage, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded(x), stage(x))
