"""Every parallelism and composition trains exactly like single-process training.

Each rank also trains an unparallelized copy of the same model on the *global* batch; after
every step the parallel loss (averaged over data-parallel ranks) must equal the reference loss,
and at the end every full parameter (``state_dict(full=True)``) must equal the reference's.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from devmesh import comm_stats, init_device_mesh
from devmesh.parallel import (
    ColwiseParallel,
    MixedPrecisionPolicy,
    RowwiseParallel,
    clip_grad_norm_,
    describe,
    fully_shard,
    parallelize_module,
    state_dict,
)
from strategies import apply_strategy, make_model

STRATEGIES = {
    # name: (world, mesh shape, mesh names)
    "ddp": (4, (4,), ("dp",)),
    "ddp_2d": (4, (2, 2), ("a", "b")),
    "fsdp": (4, (4,), ("dp",)),
    "fsdp_uneven": (3, (3,), ("dp",)),
    "fsdp_no_reshard": (2, (2,), ("dp",)),
    "hsdp": (8, (2, 4), ("replicate", "shard")),
    "tp": (4, (4,), ("tp",)),
    "ddp+tp": (4, (2, 2), ("dp", "tp")),
    "fsdp+tp": (8, (2, 4), ("dp", "tp")),
    "hsdp+tp": (8, (2, 2, 2), ("replicate", "shard", "tp")),
}


def fsdp_model(mesh, **options):
    """make_model() with every Linear and then the root fully sharded over ``mesh``."""
    model = make_model()
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def train_and_compare(name, optimizer_name, steps=4, global_batch=24):
    import torch.distributed as dist

    world, shape, names = STRATEGIES[name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = make_model()
    reference = copy.deepcopy(model)
    dp_mesh = apply_strategy(name, model, mesh)
    if dp_mesh is None:
        dp_index, dp_size = 0, 1
    else:
        coord = dp_mesh.get_coordinate()
        dp_size = dp_mesh.size()
        dp_index = 0
        for c, s in zip(coord, dp_mesh.shape):
            dp_index = dp_index * s + c
    make_opt = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    }[optimizer_name]
    opt, ref_opt = make_opt(model.parameters()), make_opt(reference.parameters())
    losses, ref_losses = [], []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.randn(global_batch, 12, generator=gen)
        y = torch.randint(0, 5, (global_batch,), generator=gen)
        per = global_batch // dp_size
        xl, yl = x[dp_index * per:(dp_index + 1) * per], y[dp_index * per:(dp_index + 1) * per]
        loss = F.cross_entropy(model(xl), yl)
        loss.backward()
        opt.step()
        opt.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / dist.get_world_size())
        ref_loss = F.cross_entropy(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    full = state_dict(model, full=True)
    ref_state = reference.state_dict()
    max_diff = max((full[k] - ref_state[k]).abs().max().item() for k in ref_state)
    same_keys = set(full) == set(ref_state)
    local_numel = {k: p.numel() for k, p in model.named_parameters()}
    return losses, ref_losses, max_diff, same_keys, local_numel


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_matches_single_process_training(mesh_pool, strategy, optimizer):
    world = STRATEGIES[strategy][0]
    results = mesh_pool.run(train_and_compare, world, strategy, optimizer)
    for losses, ref_losses, max_diff, same_keys, _ in results:
        assert same_keys
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        assert max_diff < 1e-5, max_diff
    if strategy == "fsdp_uneven":  # rows split 7+7+6 / 5+5+4 / 2+2+1 like torch.chunk
        numels = [r[4] for r in results]
        assert [n["0.weight"] for n in numels] == [7 * 12, 7 * 12, 6 * 12]
        assert [n["4.weight"] for n in numels] == [2 * 14, 2 * 14, 1 * 14]
    if strategy == "fsdp+tp":  # weight 0 (20x12): TP rows 5 each, FSDP halves: 3 + 2
        numels = [r[4] for r in results]
        assert numels[0]["0.weight"] == 3 * 12 and numels[4]["0.weight"] == 2 * 12


def collectives_per_step(name, reshard=True):
    world, shape, names = STRATEGIES[name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = make_model()
    if name.startswith("fsdp") or name == "hsdp":
        for i in (0, 2, 4):
            fully_shard(model[i], mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    else:
        apply_strategy(name, model, mesh)
    x = torch.randn(8, 12)
    with comm_stats() as stats:
        model(x).sum().backward()
    return stats.by_collective()


def test_collective_counts_per_step(mesh_pool):
    # FSDP, 3 units with parameters: gather in forward; gather again in backward
    # (reshard_after_forward) only where backward needs the weight: not for the first layer,
    # whose input needs no gradient; one reduce-scatter per unit
    fsdp = mesh_pool.run(collectives_per_step, 4, "fsdp")[0]
    assert fsdp["all_gather"][0] == 5 and fsdp["reduce_scatter"][0] == 3
    assert "all_reduce" not in fsdp
    kept = mesh_pool.run(collectives_per_step, 2, "fsdp_no_reshard", False)[0]
    assert kept["all_gather"][0] == 3 and kept["reduce_scatter"][0] == 3
    hsdp = mesh_pool.run(collectives_per_step, 8, "hsdp")[0]
    assert hsdp["reduce_scatter"][0] == 3 and hsdp["all_reduce"][0] == 3
    ddp = mesh_pool.run(collectives_per_step, 4, "ddp")[0]
    # every gradient, and one "used" flag per parameter (unused ones keep no gradient)
    params = list(make_model().parameters())
    assert ddp == {"all_reduce": (1, 4 * (sum(p.numel() for p in params) + len(params)))}
    tp = mesh_pool.run(collectives_per_step, 4, "tp")[0]
    # one all-reduce in forward (rowwise output: batch 8 x 14 features, fp32); none in backward:
    # the input needs no gradient, so colwise's input all-reduce never runs
    assert tp == {"all_reduce": (1, 8 * 14 * 4)}


def fsdp_memory_and_helpers(tmp):
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    full_bytes = sum(p.numel() * 4 for p in make_model().parameters())
    model = fsdp_model(mesh)
    local_bytes = sum(p.numel() * 4 for p in model.parameters())
    F.cross_entropy(model(torch.randn(8, 12)), torch.zeros(8, dtype=torch.long)).backward()
    norm = clip_grad_norm_(model.parameters(), max_norm=1e-3)
    local_sq = sum((p.grad ** 2).sum() for p in model.parameters())
    text = describe(model, to_file=f"{tmp}/describe{torch.distributed.get_rank()}.png")
    return full_bytes, local_bytes, float(norm), float(local_sq), text


def clip_with_torchs_arguments(poison: str | None):
    """FSDP on 4 ranks, clipped with torch's full signature; ``poison`` puts a nan or inf
    into one gradient entry on rank 2 only."""
    from devmesh.parallel import state_dict

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    model = fsdp_model(mesh)
    F.cross_entropy(model(torch.randn(8, 12, generator=torch.Generator().manual_seed(1))),
                    torch.zeros(8, dtype=torch.long)).backward()
    if poison and torch.distributed.get_rank() == 2:
        with torch.no_grad():
            next(iter(model.parameters())).grad.reshape(-1)[0] = float(poison)
    try:
        norm = clip_grad_norm_(model.parameters(), 0.1, norm_type="inf",
                               error_if_nonfinite=poison is not None, foreach=True)
    except RuntimeError as exc:
        return "error", str(exc)
    grads = {n: p.grad for n, p in model.named_parameters()}
    norm2 = clip_grad_norm_(model.parameters(), 0.1, 2.0, False)  # as torch: nan spreads
    return float(norm), float(norm2), state_dict(model), grads


def test_clip_grad_norm_refuses_what_is_no_norm_and_matches_torch_on_the_rest():
    """torch's ``norm_type=0`` counts the tensors with a nonzero gradient and ``-inf`` takes
    the smallest magnitude; devmesh raised ``ZeroDivisionError`` on 0. Refused by name
    (before any collective, so on every rank alike); the norms it takes equal torch's on
    plain parameters, clipped gradients included."""
    from devmesh.parallel import ParallelizeError

    model = make_model()
    F.cross_entropy(model(torch.randn(4, 12, generator=torch.Generator().manual_seed(0))),
                    torch.zeros(4, dtype=torch.long)).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for norm_type in (0, -1.0, float("-inf")):
        with pytest.raises(ParallelizeError, match="takes a positive norm_type"):
            clip_grad_norm_(model.parameters(), 1e-3, norm_type=norm_type)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    for norm_type in (1, 3.0, "inf"):
        ours = clip_grad_norm_(model.parameters(), 1e-3, norm_type=norm_type)
        clipped = [p.grad.clone() for p in model.parameters()]
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        theirs = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3, norm_type=norm_type)
        torch.testing.assert_close(ours, theirs)
        for p, mine, g in zip(model.parameters(), clipped, grads):
            torch.testing.assert_close(mine, p.grad)
            p.grad = g.clone()


def test_clip_grad_norm_takes_torchs_arguments(mesh_pool):
    reference = make_model()
    F.cross_entropy(reference(torch.randn(8, 12, generator=torch.Generator().manual_seed(1))),
                    torch.zeros(8, dtype=torch.long)).backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1, norm_type="inf",
                                              error_if_nonfinite=True, foreach=True)
    norm, _, _, _ = mesh_pool.run(clip_with_torchs_arguments, 4, None)[0]
    assert norm == pytest.approx(float(expected), rel=1e-6)
    # a non-finite entry on one rank makes the global norm non-finite: every rank raises
    # torch's error (none waits for a rank that raised alone)
    for poison in ("nan", "inf"):
        for result in mesh_pool.run(clip_with_torchs_arguments, 4, poison):
            assert result[0] == "error" and "is non-finite, so it cannot be clipped" in result[1]
    torch_grads = make_model()
    for p in torch_grads.parameters():
        p.grad = torch.ones_like(p)
    next(iter(torch_grads.parameters())).grad[0, 0] = float("nan")
    torch.nn.utils.clip_grad_norm_(torch_grads.parameters(), 0.1)
    assert all(p.grad.isnan().all() for p in torch_grads.parameters())  # torch's behaviour


def total_norms_of_a_deep_copy():
    """torch's get_total_norm on the gradients of an FSDP model and of its deep copy (the
    copy's parameters carry the layout too), in norms 2 and inf, with a plain tensor among
    the gradients; and devmesh's clip_grad_norm_'s norm of the same gradients."""
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    model = copy.deepcopy(fsdp_model(mesh))
    return _total_norms(model), float(clip_grad_norm_(model.parameters(), 1e9))


def _total_norms(model: torch.nn.Module) -> list[float]:
    """torch's get_total_norm, norms 2 and inf, of ``model``'s gradients on a fixed batch
    and a plain tensor beside them."""
    F.cross_entropy(model(torch.randn(8, 12, generator=torch.Generator().manual_seed(1))),
                    torch.zeros(8, dtype=torch.long)).backward()
    grads = [p.grad for p in model.parameters()] + [torch.full((3,), 0.5)]
    return [float(torch.nn.utils.get_total_norm(grads, norm_type=n)) for n in (2.0, "inf")]


def test_torchs_get_total_norm_counts_a_sharded_gradient_whole_and_a_plain_tensor_as_it_is(
        mesh_pool):
    reference = make_model()
    want = _total_norms(reference)
    whole = float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))
    for totals, clipped in mesh_pool.run(total_norms_of_a_deep_copy, 4):
        assert totals == pytest.approx(want, rel=1e-6)
        assert clipped == pytest.approx(whole, rel=1e-6)


def nan_gradient_without_error():
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    model = fsdp_model(mesh)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    if torch.distributed.get_rank() == 2:
        next(iter(model.parameters())).grad.reshape(-1)[0] = float("nan")
    norm = clip_grad_norm_(model.parameters(), 0.1)
    return float(norm), all(bool(p.grad.isnan().all()) for p in model.parameters())


def test_a_nan_norm_spreads_to_every_gradient_as_in_torch(mesh_pool):
    for norm, all_nan in mesh_pool.run(nan_gradient_without_error, 4):
        assert norm != norm and all_nan


def test_fsdp_memory_clip_and_describe(mesh_pool, tmp_path):
    results = mesh_pool.run(fsdp_memory_and_helpers, 4, str(tmp_path))
    from devmesh.layout.spec import chunk_bounds

    for rank, (full_bytes, local, _, _, _) in enumerate(results):
        # per-rank parameter memory = every parameter's torch.chunk rows on this rank
        expected = sum(chunk_bounds(p.shape[0], 4, rank)[1] * (p.numel() // p.shape[0]) * 4
                       for p in make_model().parameters())
        assert local == expected
        assert sum(r[1] for r in results) == full_bytes  # shards partition the model
    total_sq = sum(r[3] for r in results)  # after clipping: norm of the clipped grads
    assert total_sq ** 0.5 == pytest.approx(1e-3, rel=1e-3)
    assert len({round(r[2], 6) for r in results}) == 1  # every rank agrees on the norm
    text = results[0][4]
    assert "0.weight" in text and "dim 0 split by (dp)" in text
    # every rank's block, from the spec: 5 bias rows split 2, 2, 1, 0 like torch.chunk
    assert "(2,) on ranks 0-1; (1,) on rank 2; (0,) on rank 3" in text
    # rank 0's describe predicts the bytes every rank really holds (measured on each rank)
    measured = [r[1] for r in results]
    assert measured[0] == measured[1] > measured[2] > measured[3]
    assert (f"bytes per rank: {measured[0]:,} on ranks 0-1; {measured[2]:,} on rank 2; "
            f"{measured[3]:,} on rank 3 (the full model: {results[0][0]:,})") in text
    assert (tmp_path / "describe0.png").read_bytes()[:4] == b"\x89PNG"


def mixed_precision_steps(library: str):
    """Three AdamW steps with bf16 compute and fp32 reduction, by devmesh or torch's FSDP2 on
    the same mesh: losses, output dtype, and the dtypes of the master weights and grads."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    if library == "devmesh":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = fsdp_model(mesh, mp_policy=policy)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        policy = TorchPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = make_model()
        for layer in model:
            if isinstance(layer, nn.Linear):
                torch_fully_shard(layer, mesh=mesh, mp_policy=policy)
        torch_fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(dist.get_rank() if dist.is_initialized() else 0)
    losses = []
    for _ in range(3):
        out = model(torch.randn(4, 12, generator=gen))
        loss = out.float().pow(2).mean()
        loss.backward()
        dtypes = [(p.dtype, p.grad.dtype) for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return out.dtype, dtypes, losses


def test_mixed_precision_equals_torch_fsdp2_bit_for_bit(mesh_pool):
    """bf16 compute, fp32 master weights and reductions — and the same losses as torch's
    FSDP2 with the same policy, exactly (a dtype check alone could not catch a wrong cast)."""
    ours = mesh_pool.run(mixed_precision_steps, 2, "devmesh")
    theirs = mesh_pool.run(mixed_precision_steps, 2, "torch")
    for (dtype, params, losses), (_, _, ref_losses) in zip(ours, theirs):
        assert dtype == torch.bfloat16
        assert all(p == torch.float32 and g == torch.float32 for p, g in params)
        assert losses == ref_losses


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, ids):
        h = self.norm(self.emb(ids))
        return self.head(self.down(F.relu(self.up(h))))


def sequence_parallel_matches(plan_name, with_fsdp=False, accumulate=1):
    from devmesh.parallel import SequenceParallel
    from devmesh.tensor import Replicate, Shard

    if with_fsdp:
        root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        mesh = root["tp"]
    else:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    plans = {
        "sequence_parallel": {
            "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1)),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
        "colwise_embedding": {
            "emb": ColwiseParallel(output_layouts=Replicate()),
            "up": ColwiseParallel(),
            "down": RowwiseParallel(),
        },
    }
    model, reference = TinyLM(), TinyLM()
    parallelize_module(model, mesh, plans[plan_name])
    if with_fsdp:  # every rank of a dp group sees the same batch here: FSDP averages equal grads
        for name in ("emb", "norm", "up", "down", "head"):
            fully_shard(getattr(model, name), mesh=root["dp"])
        fully_shard(model, mesh=root["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    losses = []
    for step in range(3):
        for m, o in ((model, opt), (reference, ref_opt)):
            total = 0.0
            for micro in range(accumulate):  # gradient accumulation: sum of micro-batch grads
                gen = torch.Generator().manual_seed(10 * step + micro)
                ids = torch.randint(0, 16, (3, 8), generator=gen)
                target = torch.randint(0, 16, (3, 8), generator=gen)
                loss = F.cross_entropy(m(ids).reshape(-1, 16), target.reshape(-1))
                loss.backward()
                total += loss.item()
            o.step()
            o.zero_grad()
            losses.append(total)
    full = state_dict(model)
    ref = reference.state_dict()
    return losses[0::2], losses[1::2], max((full[k] - ref[k]).abs().max().item() for k in ref)


@pytest.mark.parametrize("plan, with_fsdp, accumulate", [
    ("sequence_parallel", False, 1), ("colwise_embedding", False, 1),
    ("sequence_parallel", True, 1), ("sequence_parallel", False, 2),
])
def test_sequence_parallel_and_embeddings_match_single_process(mesh_pool, plan, with_fsdp,
                                                                accumulate):
    results = mesh_pool.run(sequence_parallel_matches, 4, plan, with_fsdp, accumulate)
    for losses, ref_losses, max_diff in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert max_diff < 1e-5


def bad_plans():
    from devmesh.parallel import ParallelizeError

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    errors = []
    for fn in (
        lambda: parallelize_module(make_model(), mesh, {"0": ColwiseParallel()}),
        lambda: parallelize_module(make_model(), mesh["tp"], {"9": ColwiseParallel()}),
        lambda: parallelize_module(make_model(), mesh["tp"], {"1": ColwiseParallel()}),
        lambda: fully_shard(fully_shard(make_model(), mesh=mesh["dp"]), mesh=mesh["dp"]),
    ):
        try:
            fn()
            errors.append(None)
        except ParallelizeError as exc:
            errors.append(str(exc))
    return errors


def test_bad_plans_are_named(mesh_pool):
    errors = mesh_pool.run(bad_plans, 4)[0]
    assert "needs a 1-D tensor-parallel mesh" in errors[0] and "mesh['tp']" in errors[0]
    assert "matches no submodule" in errors[1] and "0, 1, 2, 3, 4" in errors[1]
    assert "applies to nn.Linear, nn.Embedding and transformers' Conv1D, but '1' is a ReLU" in errors[2]
    assert "already applied" in errors[3]


def prefetch_observed():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = fsdp_model(mesh)
    seen = []
    model[0].register_forward_hook(
        lambda m, a, y: seen.append(model[2]._devmesh_fsdp._prefetched is not None))
    for _ in range(3):
        with comm_stats() as stats:
            model(torch.randn(4, 12)).sum().backward()
    leftover = [model[i]._devmesh_fsdp._prefetched for i in (0, 2, 4)]
    return seen, stats.by_collective()["all_gather"][0], leftover


def test_fsdp_prefetches_the_next_unit_after_the_first_step(mesh_pool):
    seen, gathers, leftover = mesh_pool.run(prefetch_observed, 2)[0]
    # step 1 records the order; from step 2 on, layer 2's all-gather is already in flight
    # while layer 0 runs
    assert seen == [False, True, True]
    assert gathers == 5 and leftover == [None, None, None]  # prefetching adds no collective


def state_dict_round_trip(name):
    from devmesh.parallel import load_state_dict

    world, shape, names = STRATEGIES[name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    trained = make_model()
    with torch.no_grad():
        for p in trained.parameters():
            p.mul_(-2.0).add_(0.5)  # differs from make_model()'s initialization
    plain_state = trained.state_dict()
    fresh = make_model()
    apply_strategy(name, fresh, mesh)
    load_state_dict(fresh, plain_state)
    back = state_dict(fresh)
    x = torch.randn(6, 12, generator=torch.Generator().manual_seed(3))
    errors = []
    for bad in ({**plain_state, "0.weight": torch.zeros(3, 3)},
                {k: v for k, v in plain_state.items() if k != "2.bias"}):
        before = state_dict(fresh)
        try:
            load_state_dict(fresh, bad)
        except ValueError as exc:
            errors.append(type(exc).__name__)
        after = state_dict(fresh)
        errors.append(all(torch.equal(before[k], after[k]) for k in before))
    return (all(torch.equal(back[k], plain_state[k]) for k in plain_state),
            torch.allclose(fresh(x), trained(x), atol=1e-6), errors)


@pytest.mark.parametrize("strategy", ["fsdp_uneven", "fsdp+tp", "hsdp+tp", "tp"])
def test_load_state_dict_puts_every_block_back(mesh_pool, strategy):
    for equal, same_output, errors in mesh_pool.run(state_dict_round_trip,
                                                    STRATEGIES[strategy][0], strategy):
        assert equal and same_output
        assert errors == ["StateDictError", True, "StateDictError", True]  # nothing changed


def backward_prefetch_observed():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = fsdp_model(mesh)
    seen = []
    unit2 = model[2]._devmesh_fsdp
    # runs in backward right after layer 4's weights were re-gathered (its grad_input hook)
    model[4].register_full_backward_hook(
        lambda m, gi, go: seen.append(unit2._regather_pending is not None or unit2._full is not None))
    counts = []
    for _ in range(3):
        with comm_stats() as stats:
            model(torch.randn(4, 12, requires_grad=False)).sum().backward()
        counts.append(stats.by_collective()["all_gather"][0])
    return seen, counts, unit2._regather_pending


def test_fsdp_prefetches_backward_regathers(mesh_pool):
    seen, counts, leftover = mesh_pool.run(backward_prefetch_observed, 2)[0]
    assert seen == [False, True, True]
    assert counts == [5, 5, 5] and leftover is None  # layer 0's weights are never re-gathered


def checkpoint_resume(name, path, break_save=False):
    from devmesh.parallel import load_checkpoint, save_checkpoint

    world, shape, names = STRATEGIES[name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)

    def fresh():
        model = make_model()
        apply_strategy(name, model, mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)

    def step(model, opt, i):
        gen = torch.Generator().manual_seed(100 + i)
        x, y = torch.randn(24, 12, generator=gen), torch.randint(0, 5, (24,), generator=gen)
        loss = F.cross_entropy(model(x), y)  # every rank the same batch: fine for any layout
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    model, opt = fresh()
    for i in range(2):
        step(model, opt, i)
    save_checkpoint(path, model, opt, extra={"step": 2})
    continued = [step(model, opt, i) for i in (2, 3)]
    failure = None
    if break_save:  # a failed save (a real one: the target's parent is a file) raises on
        # every rank and leaves the old checkpoint intact
        try:
            save_checkpoint(os.path.join(path, "metadata.json", "inside-a-file"), model, opt)
        except Exception as exc:  # noqa: BLE001
            failure = str(exc)
    model2, opt2 = fresh()
    extra = load_checkpoint(path, model2, opt2)
    resumed = [step(model2, opt2, i) for i in (2, 3)]
    return continued, resumed, extra, failure


@pytest.mark.parametrize("strategy", ["fsdp+tp", "hsdp", "ddp"])
def test_checkpoint_resumes_training_exactly(mesh_pool, tmp_path, strategy):
    path = str(tmp_path / "ckpt")
    break_save = strategy == "hsdp"
    results = mesh_pool.run(checkpoint_resume, STRATEGIES[strategy][0], strategy, path,
                            break_save)
    for continued, resumed, extra, failure in results:
        assert resumed == pytest.approx(continued, rel=1e-6)
        assert extra == {"step": 2}
        if break_save:
            assert "could not write" in failure and "NotADirectoryError" in failure
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert not any(n.endswith(".devmesh-tmp") for n in os.listdir(path))  # no temporary left


def fsdp_recovers_after_a_failed_forward_and_keeps_models_apart():
    """A forward that raises inside a unit leaves every unit resharded and the order record
    usable; two FSDP models used in turn each keep their own order (issue 12, item 3)."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    models = []
    for _ in range(2):
        model = make_model()
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        models.append(model)
    reference = make_model()
    try:
        models[0](torch.randn(3, 5))  # wrong width: the first unit raises
    except RuntimeError:
        pass
    resharded = all(p.shape[0] <= -(-q.shape[0] // 2)
                    for p, q in zip(models[0].parameters(), reference.parameters()))
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(0))
    outs = []
    for _ in range(3):  # interleaved forwards of the two models
        outs.append([m(x).detach() for m in models])
    orders = [m._devmesh_fsdp.root_order for m in models]
    return (resharded, all(torch.allclose(a, reference(x), atol=1e-6)
                           for pair in outs for a in pair),
            orders[0] is not orders[1] and all(len(o.order) == 3 for o in orders))


def test_fsdp_recovers_after_a_failed_forward(mesh_pool):
    for resharded, equal, separate in mesh_pool.run(
            fsdp_recovers_after_a_failed_forward_and_keeps_models_apart, 2):
        assert resharded and equal and separate


def flattened_dim_fsdp_with_tp(path: str, flattened: str):
    """``flattened="dp_shard_cp"``: torchtitan's mesh, ("dp_shard", "cp", "tp") with dp_shard
    and cp flattened into "dp_shard_cp", fully_shard over that flattened dim on top of tensor
    parallelism over "tp"; rows split over the 4 flattened ranks as torch.chunk gives them
    (5 -> 2, 2, 1, 0). ``flattened="tp"``: the other way round, ("dp_shard_cp", "a", "b")
    with a and b flattened into a 4-way "tp". Returns the gradient norms, the largest
    difference from one process of the trained model, of its DTensor state dict and of its
    checkpoint loaded into a plain (dp, tp) mesh of the same sizes."""
    from torch.distributed.tensor import DTensor

    from devmesh.parallel import load_checkpoint, save_checkpoint

    if flattened == "dp_shard_cp":
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_shard", "cp", "tp"))
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    else:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_shard_cp", "a", "b"))
        mesh["a", "b"]._flatten("tp")
    dp = mesh["dp_shard_cp"].size()

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Linear(5, 3)).double()

    def train(model, rows, clip):
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        norms = []
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(8, 6, dtype=torch.float64, generator=gen)
            y = torch.randint(0, 3, (8,), generator=gen)
            F.cross_entropy(model(x[rows]), y[rows]).backward()
            norms.append(float(clip(model.parameters(), 0.5)))
            opt.step()
            opt.zero_grad()
        return opt, norms

    alone = build()
    _, ref_norms = train(alone, slice(None), torch.nn.utils.clip_grad_norm_)
    ref = alone.state_dict()
    model = build()
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    parallelize_module(model, mesh["tp"], plan)
    fully_shard(model[0], mesh=mesh["dp_shard_cp"])
    fully_shard(model, mesh=mesh["dp_shard_cp"])
    i = mesh["dp_shard_cp"].get_local_rank()
    rows = 8 // dp
    opt, norms = train(model, slice(rows * i, rows * (i + 1)), clip_grad_norm_)

    def error(state):
        return max(float(((v.full_tensor() if isinstance(v, DTensor) else v) - ref[k]).abs().max())
                   for k, v in state.items())

    save_checkpoint(path, model, opt)
    plain_mesh = init_device_mesh("cpu", (dp, 8 // dp), mesh_dim_names=("dp", "tp"))
    other = build()
    parallelize_module(other, plain_mesh["tp"], plan)
    fully_shard(other, mesh=plain_mesh["dp"])
    load_checkpoint(path, other, torch.optim.AdamW(other.parameters()))
    return (norms, ref_norms, error(state_dict(model, full=True)), error(model.state_dict()),
            error(state_dict(other, full=True)))


@pytest.mark.parametrize("flattened", ["dp_shard_cp", "tp"])
def test_fsdp_over_a_flattened_dim_with_tp_as_torchtitan_builds_it(mesh_pool, tmp_path,
                                                                   flattened):
    """Before, fully_shard raised KeyError: 'dp_shard_cp' (or 'tp') on every rank (the
    flattened name is no dim of the root); splitting over its parts instead would nest 5 rows
    as 2, 1, 1, 1 where torch.chunk over the flattened dim gives 2, 2, 1, 0."""
    for norms, ref_norms, trained, as_dtensors, reloaded in mesh_pool.run(
            flattened_dim_fsdp_with_tp, 8, str(tmp_path / "ckpt"), flattened):
        assert norms == pytest.approx(ref_norms, rel=1e-12)
        assert max(trained, as_dtensors, reloaded) < 1e-12
