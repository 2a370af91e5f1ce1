"""Tensor parallelism as torch users apply it (issue 8, items 1, 3, 6, 13, 14): torch's
placements, use_local_output, keyword inputs, deepcopy of parallelized modules, styles
applied twice, replicas that differ."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard

from devmesh import init_device_mesh
from helpers import caught
from devmesh.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
    replicate,
    state_dict,
)



def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).double()


def sequence_parallel_input_gradient():
    """PrepareModuleInput(Shard(1) -> Replicate) in front of column-parallel layers: the
    input gradient equals single-process (it was multiplied by the TP degree)."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.wq, self.wk = nn.Linear(8, 8).double(), nn.Linear(8, 8).double()
            self.wo = nn.Linear(8, 8).double()

        def forward(self, x):
            return self.wo(F.relu(self.wq(x)) * self.wk(x))

    x = torch.randn(2, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref, model = Block(), Block()
    xr = x.clone().requires_grad_()
    ref(xr).pow(2).sum().backward()
    model = parallelize_module(model, mesh, PrepareModuleInput(
        input_layouts=TorchShard(1), desired_input_layouts=TorchReplicate()))
    parallelize_module(model, mesh, {"wq": ColwiseParallel(), "wk": ColwiseParallel(),
                                     "wo": RowwiseParallel(output_layouts=TorchShard(1))})
    r = mesh.get_local_rank()
    xs = x[:, 2 * r: 2 * r + 2].clone().requires_grad_()
    model(xs).pow(2).sum().backward()
    return torch.allclose(xs.grad, xr.grad[:, 2 * r: 2 * r + 2], atol=1e-12)


def test_sequence_parallel_input_gradient_is_counted_once(mesh_pool):
    assert all(mesh_pool.run(sequence_parallel_input_gradient, 2))


def local_output_and_kwargs():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = _mlp()
    parallelize_module(model, mesh, {"0": ColwiseParallel(use_local_output=False),
                                     "2": RowwiseParallel(output_layouts=TorchReplicate(),
                                                          use_local_output=False)})
    x = torch.randn(3, 8, dtype=torch.float64)
    hidden = model[0](x)
    out = model(x)

    class Takes(nn.Module):
        def forward(self, x, *, scale):
            return x, scale

    taker = parallelize_module(Takes(), mesh, PrepareModuleInput(
        input_kwarg_layouts={"scale": TorchShard(0)},
        desired_input_kwarg_layouts={"scale": TorchReplicate()}, use_local_output=True))
    _, scale = taker(x, scale=torch.full((2,), float(dist.get_rank())))
    return (type(hidden).__name__, str(hidden.placements), type(out).__name__,
            str(out.placements), scale.tolist())


def test_use_local_output_false_gives_dtensors_and_kwargs_are_prepared(mesh_pool):
    for hidden, hp, out, op, scale in mesh_pool.run(local_output_and_kwargs, 2):
        assert (hidden, out) == ("DTensor", "DTensor")
        assert "Shard(dim=-1)" in hp or "Shard(dim=1)" in hp
        assert "Replicate" in op
        assert scale == [0.0, 0.0, 1.0, 1.0]


class _TorchStyleOfMyOwn(__import__("torch.distributed.tensor.parallel",
                                    fromlist=["x"]).ParallelStyle):
    """A style written for torch's parallelize_module (torchtitan's expert styles are)."""

    def _apply(self, module, device_mesh):
        return module


def deepcopy_and_refusals():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = _mlp()
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(3, 8, dtype=torch.float64)
    before = model(x)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone[2].weight.zero_()
        clone[2].bias.fill_(1.0)
    out = {
        "original_unchanged": torch.equal(model(x), before),
        "copy_uses_its_weights": torch.equal(clone(x), torch.ones(3, 8, dtype=torch.float64)),
        "copy_keeps_layout": tuple(state_dict(clone)["0.weight"].shape) == (16, 8),
        "twice": caught(lambda: parallelize_module(model, mesh, {"0": ColwiseParallel()})),
        "bad_placement": caught(lambda: RowwiseParallel(output_layouts="Replicate")),
        "torch_style": caught(lambda: parallelize_module(
            _mlp(), mesh, {"0": __import__("torch.distributed.tensor.parallel",
                                           fromlist=["x"]).ColwiseParallel()})),
        "own_torch_style": caught(lambda: parallelize_module(_mlp(), mesh,
                                                             {"0": _TorchStyleOfMyOwn()})),
    }
    return out


def test_deepcopy_styles_twice_and_bad_arguments(mesh_pool):
    for r in mesh_pool.run(deepcopy_and_refusals, 2):
        assert r["original_unchanged"] and r["copy_uses_its_weights"] and r["copy_keeps_layout"]
        assert r["twice"][0] == "ParallelizeError" and "already applied" in r["twice"][1]
        assert r["bad_placement"][0] == "ParallelizeError"
        assert "torch's style" in r["torch_style"][1]
        assert "_TorchStyleOfMyOwn" in r["own_torch_style"][1]
        assert "torch's parallelize_module on the devmesh mesh" in r["own_torch_style"][1]


def replicas_that_differ(case: str):
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    rank = dist.get_rank()
    if case == "shape":
        model = nn.Linear(8, 4 if rank != 3 else 5)
    else:
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(2 if rank else 3)])
    return caught(lambda: replicate(model, mesh=mesh))


@pytest.mark.parametrize("case, words", [("shape", "(5, 8)"), ("count", "6 parameters")])
def test_replicate_refuses_replicas_that_differ_on_every_rank(mesh_pool, case, words):
    for name, message in mesh_pool.run(replicas_that_differ, 4, case, timeout=60):
        assert name == "MeshMismatchError" and words in message


def prepare_input_and_output(library: str, keyed: bool = False):
    """One module whose input arrives split by rows and whose output leaves split by rows,
    computing on the whole batch in between: torch's PrepareModuleInputOutput or devmesh's
    (``keyed``: given as ``{"": style}``, torch's plan key for the module itself)."""
    if library == "devmesh":
        from devmesh.parallel import PrepareModuleInputOutput
    else:
        from torch.distributed.tensor.parallel import PrepareModuleInputOutput
        from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))

    class WholeBatch(nn.Module):
        def forward(self, x):
            full = x.to_local() if hasattr(x, "to_local") else x  # Replicate: the whole batch
            return full - full.mean(0)

    style = PrepareModuleInputOutput(input_layouts=TorchShard(0),
                                     desired_input_layouts=TorchReplicate(),
                                     use_local_input=True, output_layouts=TorchReplicate(),
                                     desired_output_layouts=TorchShard(0))
    apply = parallelize_module if library == "devmesh" else torch_parallelize
    module = apply(WholeBatch(), mesh, {"": style} if keyed else style)
    rows = torch.arange(8.0, dtype=torch.float64).reshape(4, 2) ** 2
    mine = rows.chunk(2)[dist.get_rank()].clone().requires_grad_()
    out = module(mine)
    out.pow(2).sum().backward()
    return out.detach(), mine.grad


@pytest.mark.parametrize("keyed", [False, True])
def test_prepare_module_input_output_as_torch(mesh_pool, keyed):
    ours = mesh_pool.run(prepare_input_and_output, 2, "devmesh", keyed)
    theirs = mesh_pool.run(prepare_input_and_output, 2, "torch")
    rows = torch.arange(8.0, dtype=torch.float64).reshape(4, 2) ** 2
    for rank, ((out, grad), (t_out, t_grad)) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(out, (rows - rows.mean(0)).chunk(2)[rank])
        torch.testing.assert_close(out, t_out)
        torch.testing.assert_close(grad, t_grad)


def vocab_parallel_loss():
    """The output head column-parallel with a sharded, non-local output (a torch DTensor),
    under loss_parallel (torch's own, re-exported): the cross-entropy never gathers the
    logits, and the loss and every gradient equal single-process training."""
    import torch.nn.functional as F

    from devmesh.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ref, model = _mlp(), _mlp()
    parallelize_module(model, mesh, {"2": ColwiseParallel(output_layouts=TorchShard(-1),
                                                           use_local_output=False)})
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([1, 3, 7, 0])
    logits = model(x)
    with loss_parallel():
        loss = F.cross_entropy(logits, y)
        loss.backward()
    expected = F.cross_entropy(ref(x), y)
    expected.backward()
    mine = slice(4 * dist.get_rank(), 4 * dist.get_rank() + 4)  # this rank's 4 of 8 classes
    return (tuple(logits.to_local().shape), float(loss.full_tensor()), float(expected),
            torch.allclose(model[2].weight.grad, ref[2].weight.grad[mine], atol=1e-14),
            torch.allclose(model[0].weight.grad, ref[0].weight.grad, atol=1e-14))


def test_loss_parallel_with_devmesh_tensor_parallelism(mesh_pool):
    for local_shape, loss, expected, head_grad, trunk_grad in mesh_pool.run(vocab_parallel_loss, 2):
        assert local_shape == (4, 4)  # the logits stay split by class
        assert loss == pytest.approx(expected, rel=1e-14) and head_grad and trunk_grad


class _Uneven(nn.Module):
    """Feature counts the TP degree 4 does not divide: torch.chunk gives 7 -> 2, 2, 2, 1,
    6 -> 2, 2, 2, 0 and 5 -> 2, 2, 1, 0 (a rank with an empty block)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)     # columns 6 -> Replicate output
        self.up = nn.Linear(6, 7)          # columns -> Replicate output
        self.mid = nn.Linear(7, 5)         # rows, from a Replicate input
        self.gate = nn.Linear(5, 7)        # columns, handed on as a DTensor ...
        self.down = nn.Linear(7, 6)        # ... to rows
        self.head = nn.Linear(6, 7)        # columns, class-sharded logits for loss_parallel

    def forward(self, ids):
        h = torch.tanh(self.up(self.emb(ids)))
        h = torch.tanh(self.mid(h))
        h = self.down(torch.tanh(self.gate(h)))
        return self.head(h)


def _uneven_plan(lib):
    return {"emb": lib.ColwiseParallel(output_layouts=TorchReplicate()),
            "up": lib.ColwiseParallel(output_layouts=TorchReplicate()),
            "mid": lib.RowwiseParallel(input_layouts=TorchReplicate()),
            "gate": lib.ColwiseParallel(use_local_output=False),
            "down": lib.RowwiseParallel(),
            "head": lib.ColwiseParallel(output_layouts=TorchShard(-1), use_local_output=False)}


def uneven_feature_splits():
    """The model above trained by devmesh's styles, by torch's on the same ranks, and alone:
    each step's loss and every final parameter."""
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    import devmesh.parallel as ours
    import torch.distributed.tensor.parallel as theirs

    meshes = {"devmesh": init_device_mesh("cpu", (4,)), "torch": torch_mesh("cpu", (4,))}
    results = {}
    for lib in ("alone", "devmesh", "torch"):
        torch.manual_seed(0)
        model = _Uneven().double()
        if lib != "alone":
            (ours if lib == "devmesh" else theirs).parallelize_module(
                model, meshes[lib], _uneven_plan(ours if lib == "devmesh" else theirs))
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        losses = []
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 11, (4, 3), generator=g)
            labels = torch.randint(0, 7, (12,), generator=g)
            logits = model(ids).flatten(0, 1)
            if lib == "alone":
                loss = F.cross_entropy(logits, labels)
            else:
                with loss_parallel():
                    loss = F.cross_entropy(logits, labels)
                    loss.backward()
            if lib == "alone":
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float((loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()))
        params = state_dict(model, full=True) if lib == "devmesh" else {
            k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
        results[lib] = losses, params
    alone = results["alone"]
    return {lib: (max(abs(a - b) for a, b in zip(losses, alone[0])),
                  max(float((params[k] - alone[1][k]).abs().max()) for k in alone[1]))
            for lib, (losses, params) in results.items() if lib != "alone"}


def test_uneven_feature_splits_train_as_torch_and_as_one_process(mesh_pool):
    """A column-sharded output gathered to Replicate, a Replicate input split for row-sharded
    weights, a column-sharded output handed on as a DTensor and class-sharded logits under
    loss_parallel, all with features 4 ranks split unevenly. Before, the gathers of uneven
    blocks aborted every rank in gloo, the split was refused and the DTensors had the global
    shape of an even split; torch's styles take all of these."""
    for errors in mesh_pool.run(uneven_feature_splits, 4):
        for lib, (loss_error, param_error) in errors.items():
            assert loss_error < 1e-12 and param_error < 1e-12, (lib, loss_error, param_error)


def split_embeddings(vocab: int, scale_grad_by_freq: bool):
    """A row-split (vocab) and a column-split embedding trained two steps by devmesh's styles
    and by torch's on the same 4 ranks; each one's largest difference from one process.
    torch's only where the vocabulary gives every rank rows: with 3 on 4, its optimizer step
    fails ("in-place operations that require placement changes are not supported")."""
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor import DTensor

    import devmesh.parallel as ours
    import torch.distributed.tensor.parallel as theirs

    meshes = {"devmesh": init_device_mesh("cpu", (4,)), "torch": torch_mesh("cpu", (4,))}
    ids = torch.tensor([[0, 0, 0, 5], [5, 3, 7, 1], [2, 2, 9, 0]]) % vocab
    results = {}
    for lib in ("alone", "devmesh", "torch") if vocab >= 4 else ("alone", "devmesh"):
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Embedding(vocab, 6, scale_grad_by_freq=scale_grad_by_freq)
                                for _ in range(2))).double()
        if lib != "alone":
            styles = ours if lib == "devmesh" else theirs
            styles.parallelize_module(model, meshes[lib], {
                "0": styles.RowwiseParallel(input_layouts=TorchReplicate()),
                "1": styles.ColwiseParallel(output_layouts=TorchReplicate())})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            weights = torch.arange(ids.numel() * 6, dtype=torch.float64).reshape(*ids.shape, 6)
            out = model[0](ids) * model[1](ids)
            (out * weights).sum().backward()
            opt.step()
            opt.zero_grad()
        results[lib] = state_dict(model, full=True) if lib == "devmesh" else {
            k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    alone = results.pop("alone")
    return {lib: max(float((params[k] - alone[k]).abs().max()) for k in alone)
            for lib, params in results.items()}


@pytest.mark.parametrize("vocab,scale_grad_by_freq", [(11, True), (3, False), (3, True)])
def test_split_embeddings_as_torch_with_frequency_scaling_and_empty_blocks(
        mesh_pool, vocab, scale_grad_by_freq):
    """``scale_grad_by_freq``: the row-split embedding looked other ranks' ids up in row 0,
    which counted them toward row 0's frequency (its gradient was off by 20). A vocabulary
    smaller than the degree (3 on 4 ranks) leaves a rank no rows: its lookup indexed an empty
    block and failed on that rank alone while the others waited in the all-reduce."""
    for errors in mesh_pool.run(split_embeddings, 4, vocab, scale_grad_by_freq):
        assert all(error < 1e-12 for error in errors.values()), errors


def _local(t):
    """This rank's block of a style's output or gradient, torch's or devmesh's."""
    if isinstance(t, torch.distributed.tensor.DTensor):
        t = t.to_local()
    return (t * 1).detach()  # * 1: waits for torch's AsyncCollectiveTensor


def linear_styles_every_layout():
    """ColwiseParallel and RowwiseParallel on one nn.Linear with every input and output layout
    torch takes, local or DTensor outputs, features the 2 ranks split evenly (8) and unevenly
    (7): this rank's output, input gradient and weight and bias gradient blocks, by devmesh's
    styles and by torch's (where torch cannot run the case — an uneven Shard(-1) input, which
    it takes for an even split's block — one process's output instead)."""
    import itertools

    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    import devmesh.parallel as ours
    import torch.distributed.tensor.parallel as theirs

    meshes = {ours: init_device_mesh("cpu", (2,)), theirs: torch_mesh("cpu", (2,))}
    rank = dist.get_rank()
    cases = [("col", i, o, local, f) for i, o, local, f in itertools.product(
                 [TorchReplicate(), TorchShard(0)], [TorchShard(-1), TorchReplicate(), TorchShard(0)],
                 [True, False], [8, 7])]
    cases += [("row", i, o, local, f) for i, o, local, f in itertools.product(
                  [TorchShard(-1), TorchReplicate()], [TorchReplicate(), TorchShard(0)],
                  [True, False], [8, 7])]
    results = []
    for kind, inputs, outputs, local, features in cases:
        found = []
        for lib in (ours, theirs):
            torch.manual_seed(0)
            layer = (nn.Linear(6, features) if kind == "col" else nn.Linear(features, 5)).double()
            style = lib.ColwiseParallel if kind == "col" else lib.RowwiseParallel
            lib.parallelize_module(layer, meshes[lib], style(
                input_layouts=inputs, output_layouts=outputs, use_local_output=local))
            x = torch.randn(4, layer.in_features, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(1))
            if isinstance(inputs, TorchShard):
                x = x.tensor_split(2, inputs.dim)[rank]
            x = x.clone().requires_grad_()
            try:
                y = layer(x)
            except RuntimeError:  # torch takes the uneven block for an even split's
                if lib is ours:
                    raise
                torch.manual_seed(0)
                alone = nn.Linear(features, 5).double()
                whole = alone(torch.randn(4, features, dtype=torch.float64,
                                          generator=torch.Generator().manual_seed(1)))
                found.append(("alone", whole if isinstance(outputs, TorchReplicate)
                              else whole.tensor_split(2, 0)[rank]))
                continue
            (y.to_local() if isinstance(y, torch.distributed.tensor.DTensor) else y
             ).pow(2).sum().backward()
            found.append([_local(t) for t in (y, x.grad, *(p.grad for p in layer.parameters()))])
        results.append(((kind, str(inputs), str(outputs), local, features), *found))
    return results


def test_linear_styles_in_every_layout_as_torch(mesh_pool):
    """Each rank's blocks equal torch's for every layout torch runs; devmesh also runs the
    uneven Shard(-1) inputs torch cannot, giving one process's output."""
    for results in mesh_pool.run(linear_styles_every_layout, 2):
        assert len(results) == 40
        for case, ours, theirs in results:
            if theirs[0] == "alone":  # torch cannot; devmesh's output is one process's
                assert case[0] == "row" and case[1] == "S(-1)" and case[4] == 7, case
                torch.testing.assert_close(ours[0], theirs[1].detach(), atol=1e-13, rtol=1e-13)
                continue
            for mine, torchs in zip(ours, theirs):
                torch.testing.assert_close(mine, torchs, atol=1e-13, rtol=1e-13,
                                           msg=lambda m: f"{case}: {m}")


def torch_transformer_with_an_uneven_vocabulary(sequence_parallel: bool):
    """torch's test Transformer with 15 tokens on 2 ranks (8 + 7), parallelized by its own
    plan with devmesh's styles: its output head gathers uneven logits to Replicate. Returns
    the largest loss and parameter differences from one process over 3 Adam steps."""
    from unittest import mock

    from torch.testing._internal.distributed._tensor import common_dtensor
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    import devmesh.parallel as ours

    vocab = 15

    def build():
        torch.manual_seed(0)
        return Transformer(ModelArgs(n_layers=2, vocab_size=vocab, max_seq_len=8, dim=16,
                                     n_heads=4, dropout_p=0.0)).double()

    def train(model):
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        losses = []
        for step in range(3):
            tokens = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(step))
            loss = F.cross_entropy(model(tokens).reshape(-1, vocab),
                                   torch.roll(tokens, -1, 1).reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    alone = build()
    ref_losses, model = train(alone), build()
    styles = {name: getattr(ours, name) for name in (
        "parallelize_module", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
        "PrepareModuleInput")}
    with mock.patch.multiple(common_dtensor, **styles):
        model.parallelize(model, init_device_mesh("cpu", (2,)),
                          use_seq_parallel=sequence_parallel, local_output_for_attn=True)
    losses, full = train(model), state_dict(model, full=True)
    return (max(abs(a - b) for a, b in zip(losses, ref_losses)),
            max(float((full[k] - v).abs().max()) for k, v in alone.state_dict().items()))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_torch_transformer_with_a_vocabulary_the_degree_does_not_divide(mesh_pool,
                                                                         sequence_parallel):
    for loss_error, param_error in mesh_pool.run(torch_transformer_with_an_uneven_vocabulary,
                                                 2, sequence_parallel):
        assert loss_error < 1e-12 and param_error < 1e-12
