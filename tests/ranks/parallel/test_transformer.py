"""torch's own test Transformer (token + position embeddings, attention with heads, MLP,
LayerNorms, output tied to the embedding), parallelized by torch's own plan
(``Transformer.parallelize``) with only the imports switched to devmesh, trained a few steps
in float64 under TP, TP+SP, FSDP, FSDP+TP and HSDP+TP+SP (FSDP and HSDP+TP+SP also with
torch's grouped units, ``fully_shard([a, b])``). Every case must equal
single-process training (losses and final parameters to 1e-10), and torch's FSDP2/TP on the
same mesh where torch runs the case (issue 8)."""

from __future__ import annotations

from contextlib import nullcontext
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from devmesh import init_device_mesh

VOCAB, SEQ, BATCH, STEPS = 16, 8, 4, 3


def _transformer_class():
    from torch.testing._internal.distributed._tensor.common_dtensor import Transformer

    class Transformer64(Transformer):
        """torch's test Transformer without its final ``.float()`` (float64 end to end)."""

        def forward(self, tokens):
            h = self.tok_embeddings(tokens)
            h = h + self.pos_embeddings(torch.arange(0, tokens.size(1)))
            for layer in self.layers:
                h = layer(h)
            return self.output(self.norm(h))

    return Transformer64


def _model():
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs

    torch.manual_seed(0)
    args = ModelArgs(n_layers=2, vocab_size=VOCAB, max_seq_len=SEQ, dim=16, n_heads=4,
                     dropout_p=0.0, weight_tying=True)
    return _transformer_class()(args).double()


def _batch(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return tokens, torch.roll(tokens, -1, dims=1)


def _devmesh_styles():
    import devmesh.parallel as P

    return dict(parallelize_module=P.parallelize_module, ColwiseParallel=P.ColwiseParallel,
                RowwiseParallel=P.RowwiseParallel, SequenceParallel=P.SequenceParallel,
                PrepareModuleInput=P.PrepareModuleInput)


def _train(model, rows: slice, clip, steps: int = STEPS):
    """Adam on cross-entropy; this rank sees ``rows`` of each global batch (its dp share).
    Returns the losses and the global gradient norm of every step (``clip`` computes it)."""
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses, norms = [], []
    for step in range(steps):
        tokens, target = _batch(step)
        logits = model(tokens[rows])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), target[rows].reshape(-1))
        loss.backward()
        norms.append(float(clip(model.parameters(), 1e9)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def reference():
    model = _model()
    losses, norms = _train(model, slice(None), torch.nn.utils.clip_grad_norm_)
    return losses, norms, {k: v.clone() for k, v in model.state_dict().items()}


def parallel_run(case: str, library: str, compile_backend: str | None = None,
                 checkpointed: str | None = None):
    """Train torch's Transformer under ``case`` with devmesh's (or torch's) parallelisms;
    return this rank's losses, its dp index and the full parameters. ``compile_backend``:
    each block and the whole model compiled with it (``nn.Module.compile``, torchtitan's
    way) after parallelizing. ``checkpointed`` ("reentrant" or "non-reentrant"): each block
    in torch's ``checkpoint_wrapper`` after tensor parallelism and before ``fully_shard``,
    torchtitan's order."""
    from torch.testing._internal.distributed._tensor import common_dtensor

    if library in ("devmesh", "torch styles"):  # the latter: torch's TP, devmesh's FSDP
        from devmesh.parallel import clip_grad_norm_, fully_shard, state_dict
        styles = _devmesh_styles() if library == "devmesh" else {}
    else:
        from torch.distributed.fsdp import fully_shard

        def clip_grad_norm_(params, max_norm):  # torch's refuses a mix of DTensor and Tensor
            return 0.0
        styles = {}

    grouped = case.endswith("_grouped")  # torch's fully_shard([a, b]) groups as well
    case = case.removesuffix("_grouped")
    shapes = {"tp": ((4,), ("tp",)), "tp_sp": ((4,), ("tp",)), "fsdp": ((4,), ("dp",)),
              "fsdp_tp": ((2, 2), ("dp", "tp")), "hsdp_tp_sp": ((2, 2, 2), ("dp", "shard", "tp"))}
    shape, names = shapes[case]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = _model()
    if "tp" in names:
        with mock.patch.multiple(common_dtensor, **styles) if styles else nullcontext():
            # local attention outputs (and n_heads // tp, which the plan sets): on CPU torch
            # has no DTensor rule for scaled_dot_product_attention, for devmesh or torch alike
            model.parallelize(model, mesh["tp"], use_seq_parallel=case.endswith("_sp"),
                              local_output_for_attn=True)
    if checkpointed is not None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            checkpoint_wrapper,
        )

        impl = (CheckpointImpl.REENTRANT if checkpointed == "reentrant"
                else CheckpointImpl.NO_REENTRANT)
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer, checkpoint_impl=impl)
    dp_names = [n for n in names if n != "tp"]
    dp_index, dp_size = 0, 1
    if dp_names:
        dp_mesh = mesh[tuple(dp_names)] if len(dp_names) > 1 else mesh[dp_names[0]]
        if grouped:  # torch's list form: one unit of several modules
            # the tied embedding and head (one weight cannot be in two units), and two
            # modules that run at the start and at the end of the forward, kept gathered
            # after forward as torchtitan keeps its [norm, output] group
            fully_shard([model.tok_embeddings, model.output], mesh=dp_mesh)
            fully_shard([model.pos_embeddings, model.norm], mesh=dp_mesh,
                        reshard_after_forward=False)
        for layer in model.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        dp_size = dp_mesh.size()
        dp_index = 0
        for n in dp_names:
            dp_index = dp_index * mesh.size(n) + mesh.get_local_rank(n)
    if compile_backend is not None:
        for layer in model.layers:
            layer.compile(backend=compile_backend)
        model.compile(backend=compile_backend)
    per = BATCH // dp_size
    losses, norms = _train(model, slice(dp_index * per, (dp_index + 1) * per), clip_grad_norm_)
    if library != "torch":
        full = state_dict(model, full=True)
        tied = model.output.weight is model.tok_embeddings.weight
        count = len(list(model.parameters()))
    else:
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
                for k, v in model.state_dict().items()}
        tied, count = None, None
    return {"losses": losses, "norms": norms, "dp": (dp_index, dp_size), "full": full, "tied": tied,
            "count": count, "rank": dist.get_rank()}


def _mean_losses(results):
    """The global-batch loss per step: the mean over dp shares (equal sizes)."""
    by_dp = {}
    for r in results:
        by_dp.setdefault(r["dp"][0], r["losses"])
    steps = zip(*by_dp.values())
    return [sum(s) / len(by_dp) for s in steps]


_WORLD = {"tp": 4, "tp_sp": 4, "fsdp": 4, "fsdp_grouped": 4, "fsdp_tp": 4, "hsdp_tp_sp": 8,
          "hsdp_tp_sp_grouped": 8}


@pytest.fixture(scope="module")
def single_process():
    return reference()


@pytest.mark.parametrize("case", list(_WORLD))
def test_torch_transformer_matches_single_process(mesh_pool, single_process, case):
    ref_losses, ref_norms, ref_state = single_process
    results = mesh_pool.run(parallel_run, _WORLD[case], case, "devmesh", timeout=300)
    assert _mean_losses(results) == pytest.approx(ref_losses, abs=1e-10, rel=1e-10)
    for r in results:
        # clip_grad_norm_ sees the global-batch gradient: the same norm on every rank
        assert r["norms"] == pytest.approx(ref_norms, abs=1e-10, rel=1e-10)
        assert r["tied"], "output.weight and tok_embeddings.weight must stay one parameter"
        assert r["count"] == len(list(_model().parameters()))
        assert set(r["full"]) == set(ref_state)  # alias keys included, as nn.Module gives
        for key, value in ref_state.items():
            torch.testing.assert_close(r["full"][key], value, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("case", ["fsdp_tp", "hsdp_tp_sp"])
def test_torch_transformer_split_by_torchs_styles_under_devmesh_fsdp(mesh_pool, single_process,
                                                                     case):
    """torch's own plan with torch's own styles (DTensor parameters, the tied embedding and
    head among them), then devmesh's ``fully_shard`` and ``clip_grad_norm_``: equal to one
    process (before, devmesh's fully_shard refused DTensor parameters)."""
    ref_losses, ref_norms, ref_state = single_process
    results = mesh_pool.run(parallel_run, _WORLD[case], case, "torch styles", timeout=300)
    assert _mean_losses(results) == pytest.approx(ref_losses, abs=1e-10, rel=1e-10)
    for r in results:
        assert r["norms"] == pytest.approx(ref_norms, abs=1e-10, rel=1e-10)
        assert r["tied"]
        for key, value in ref_state.items():
            torch.testing.assert_close(r["full"][key], value, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("case,checkpointed", [("fsdp", "reentrant"),
                                               ("hsdp_tp_sp", "non-reentrant")])
def test_torch_transformer_checkpointed_matches_single_process(mesh_pool, single_process, case,
                                                               checkpointed):
    """torchtitan's stack: tensor parallelism, each block in torch's ``checkpoint_wrapper``,
    ``fully_shard`` on the wrappers. Each block recomputes in backward (its TP collectives
    again) with its unit's gathered parameters; the state dict keeps the unwrapped names."""
    ref_losses, ref_norms, ref_state = single_process
    results = mesh_pool.run(parallel_run, _WORLD[case], case, "devmesh", None, checkpointed,
                            timeout=300)
    assert _mean_losses(results) == pytest.approx(ref_losses, abs=1e-10, rel=1e-10)
    for r in results:
        assert r["norms"] == pytest.approx(ref_norms, abs=1e-10, rel=1e-10)
        assert r["tied"]
        assert set(r["full"]) == set(ref_state)
        for key, value in ref_state.items():
            torch.testing.assert_close(r["full"][key], value, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("case", ["hsdp_tp_sp"])  # FSDP's, TP's and SP's hooks all at once
@pytest.mark.parametrize("checkpointed", [None, "non-reentrant"])
def test_torch_transformer_compiled_matches_single_process(mesh_pool, single_process, case,
                                                           checkpointed):
    """Under torch.compile (AOT autograd, as inductor traces it, without its C++ build),
    devmesh's hooks and collectives run eagerly between compiled regions: same training;
    also with each block checkpointed first (torchtitan: TP, AC, compile, FSDP)."""
    ref_losses, ref_norms, ref_state = single_process
    results = mesh_pool.run(parallel_run, _WORLD[case], case, "devmesh", "aot_eager",
                            checkpointed, timeout=300)
    assert _mean_losses(results) == pytest.approx(ref_losses, abs=1e-10, rel=1e-10)
    for r in results:
        assert r["tied"]
        for key, value in ref_state.items():
            torch.testing.assert_close(r["full"][key], value, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("case", ["tp", "tp_sp", "fsdp_tp", "fsdp_grouped"])
def test_torch_transformer_matches_torch_on_the_same_mesh(mesh_pool, case):
    ours = mesh_pool.run(parallel_run, _WORLD[case], case, "devmesh", timeout=300)
    theirs = mesh_pool.run(parallel_run, _WORLD[case], case, "torch", timeout=300)
    for a, b in zip(ours, theirs):
        assert a["losses"] == pytest.approx(b["losses"], abs=1e-10, rel=1e-10)
        assert set(a["full"]) == set(b["full"])
        for key, value in b["full"].items():  # the trained parameters too
            torch.testing.assert_close(a["full"][key], value, atol=1e-10, rtol=1e-10)


# -- torch's Transformer pipelined ----------------------------------------------------------


class _Embed(torch.nn.Module):
    """The Transformer's input end, made of its own modules (token + position embeddings)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.tok_embeddings, self.pos_embeddings = model.tok_embeddings, model.pos_embeddings

    def forward(self, tokens):
        return self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(0, tokens.size(1)))


class _Head(torch.nn.Module):
    """The output end: final norm and the output projection (tied to the token embedding)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.norm, self.output = model.norm, model.output

    def forward(self, h):
        return self.output(self.norm(h))


def _as_sequence(model) -> torch.nn.Sequential:
    """torch's Transformer as the stack a pipeline splits: its own modules, so the head's
    weight is still the embedding's."""
    return torch.nn.Sequential(_Embed(model), *model.layers, _Head(model))


def _torch_name(name: str) -> str:
    """A name in :func:`_as_sequence` -> the same parameter's name in torch's model."""
    index, _, rest = name.partition(".")
    last = len(_model().layers) + 1
    if index in ("0", str(last)):
        return rest
    return f"layers.{int(index) - 1}.{rest}"


def pipelined_run(schedule_name: str, pp: int, dp: int, microbatches: int):
    from devmesh.layout.schedule import build_schedule
    from devmesh.parallel import fully_shard, state_dict
    from devmesh.parallel.pipeline import PipelineRunner, split_sequential

    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    schedule = build_schedule(schedule_name, pp, microbatches)
    sequence = _as_sequence(_model())  # 4 children: embed, 2 blocks, head
    parts = split_sequential(sequence, schedule.stages,
                             starts=["2"] if schedule.stages == 2 else None)
    me = mesh.get_coordinate()[0]
    stages = {s: parts[s] for s in range(schedule.stages) if schedule.rank_of(s) == me}
    if dp > 1:
        for stage in stages.values():
            fully_shard(stage, mesh=mesh["dp"])

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))

    runner = PipelineRunner(stages, mesh, schedule, loss_fn)
    opt = torch.optim.Adam(runner.module.parameters(), lr=0.01)
    per, index = BATCH // dp, mesh["dp"].get_local_rank()
    rows = slice(index * per, (index + 1) * per)
    losses, norms = [], []
    for step in range(STEPS):
        tokens, target = _batch(step)
        loss = runner.step(tokens[rows] if 0 in stages else None,
                           target[rows] if schedule.stages - 1 in stages else None)
        norms.append(float(runner.clip_grad_norm_(1e9)))
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else loss.item())
    return {"losses": losses, "norms": norms, "dp": (index, dp),
            "full": state_dict(runner.module, full=True)}


@pytest.mark.parametrize("schedule_name,pp,dp,microbatches", [
    ("1f1b", 2, 1, 4), ("interleaved-1f1b", 2, 1, 4), ("zero-bubble", 2, 1, 2),
    ("gpipe", 2, 2, 2), ("zero-bubble", 2, 2, 2)])
def test_torch_transformer_pipelined_matches_single_process(mesh_pool, single_process,
                                                            schedule_name, pp, dp, microbatches):
    """torch's Transformer split into stages (embedding | blocks | head): the output head,
    tied to the token embedding, sits on another rank than the embedding (interleaved: 4
    stages, the head on rank 1); with dp, every stage is also fully sharded (zero-bubble:
    one unit over a stage whose graph W's forward cut per block). Losses,
    gradient norms and every parameter equal single-process training over 3 Adam steps."""
    ref_losses, ref_norms, ref_state = single_process
    results = mesh_pool.run(pipelined_run, pp * dp, schedule_name, pp, dp, microbatches,
                            timeout=300)
    last_stage = [r for r in results if r["losses"][0] is not None]
    assert len(last_stage) == dp
    assert _mean_losses(last_stage) == pytest.approx(ref_losses, abs=1e-10, rel=1e-10)
    merged = {}
    for r in results:
        assert r["norms"] == pytest.approx(ref_norms, abs=1e-10, rel=1e-10)
        for key, value in r["full"].items():
            name = _torch_name(key)
            if name in merged:  # the tied weight, held by two stages: one value
                assert torch.equal(merged[name], value), name
            merged[name] = value
    assert set(merged) == set(ref_state)
    for key, value in ref_state.items():
        torch.testing.assert_close(merged[key], value, atol=1e-10, rtol=1e-10)
