"""Sharded checkpoints (issue 10): every rank writes only its blocks, each block once, and a
checkpoint loads into any layout of the same model — another mesh, another world size, one
plain process — with the optimizer's state resharded alongside its parameter."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from devmesh import comm_stats, init_device_mesh
from devmesh.parallel import (
    as_sharded,
    fully_shard,
    get_layout,
    load_checkpoint,
    save_checkpoint,
    state_dict,
)
from strategies import apply_strategy, make_model

# name: (world, mesh shape, mesh dim names, strategy of test_parallel.apply_strategy)
LAYOUTS = {
    "plain": (1, None, None, None),
    "ddp4": (4, (4,), ("dp",), "ddp"),
    "fsdp3": (3, (3,), ("dp",), "fsdp_uneven"),
    "tp2": (2, (2,), ("tp",), "tp"),
    "hsdp4": (4, (2, 2), ("replicate", "shard"), "hsdp"),
    "fsdp+tp8": (8, (2, 4), ("dp", "tp"), "fsdp+tp"),
    "hsdp+tp8": (8, (2, 2, 2), ("replicate", "shard", "tp"), "hsdp+tp"),
}


def build(layout: str, dtype: torch.dtype):
    world, shape, names, strategy = LAYOUTS[layout]
    model = make_model().to(dtype)
    if strategy is not None:
        apply_strategy(strategy, model, init_device_mesh("cpu", shape, mesh_dim_names=names))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def train_step(model, opt, i: int) -> float:
    gen = torch.Generator().manual_seed(100 + i)
    dtype = next(model.parameters()).dtype
    x, y = torch.randn(24, 12, generator=gen).to(dtype), torch.randint(0, 5, (24,), generator=gen)
    loss = F.cross_entropy(model(x).float(), y)  # every rank the same batch: any layout
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def full_state(model, opt) -> dict[str, torch.Tensor]:
    """Parameters, buffers and Adam's moments and step, as full tensors, by name."""
    out = dict(state_dict(model, full=True))
    for name, p in model.named_parameters():
        for key, value in opt.state[p].items():
            if value.ndim and get_layout(p) is not None:
                sharded = as_sharded(p)
                value = type(sharded)(value, sharded.device_mesh, sharded.spec).full_tensor()
            out[f"{name}.{key}"] = value.reshape(-1) if value.ndim else value
    return out


def save_trained(layout: str, dtype: torch.dtype, path: str):
    model, opt = build(layout, dtype)
    for i in range(2):
        train_step(model, opt, i)
    with comm_stats() as stats:
        save_checkpoint(path, model, opt, extra={"step": 2})
    return full_state(model, opt), stats.calls


def load_into(layout: str, dtype: torch.dtype, path: str):
    model, opt = build(layout, dtype)
    extra = load_checkpoint(path, model, opt)
    return full_state(model, opt), extra


def run(mesh_pool, layout: str, fn, *args):
    world = LAYOUTS[layout][0]
    return mesh_pool.run(fn, world, layout, *args) if world > 1 else [fn(layout, *args)]


PAIRS = [
    ("fsdp+tp8", "ddp4", torch.float32),
    ("ddp4", "plain", torch.float32),
    ("fsdp+tp8", "hsdp4", torch.bfloat16),
    ("hsdp4", "tp2", torch.float32),
    ("tp2", "fsdp3", torch.bfloat16),
    ("fsdp3", "hsdp+tp8", torch.float32),
    ("plain", "fsdp+tp8", torch.bfloat16),
]


@pytest.mark.parametrize("saved, loaded, dtype", PAIRS, ids=[f"{a}->{b}-{str(d)[6:]}"
                                                            for a, b, d in PAIRS])
def test_a_checkpoint_reshards_into_another_layout(mesh_pool, tmp_path, saved, loaded, dtype):
    path = str(tmp_path / "ckpt")
    before = run(mesh_pool, saved, save_trained, dtype, path)
    expected, collectives = before[0]
    assert all(calls == 0 for _, calls in before)  # no rank gathered anything to save
    for state, extra in run(mesh_pool, loaded, load_into, dtype, path):
        assert extra == {"step": 2}
        assert state.keys() == expected.keys()
        for key, value in expected.items():
            assert state[key].dtype == value.dtype, key
            assert torch.equal(state[key], value), key
    # every block written once: the data files hold exactly the model's and optimizer's bytes
    meta = json.load(open(os.path.join(path, "metadata.json")))
    stored = sum(torch.Size(t["shape"]).numel() * getattr(torch, t["dtype"]).itemsize
                 for t in meta["tensors"].values())
    assert sum(meta["files"].values()) == stored
    on_disk = sorted(n for n in os.listdir(path) if n.endswith(".bin"))
    assert on_disk == sorted(meta["files"]) and len(on_disk) == min(LAYOUTS[saved][0], 8)


def test_a_checkpoint_loads_into_a_model_of_another_dtype_as_torch_dcp_casts(mesh_pool,
                                                                             tmp_path):
    """Train in float32, load into a bfloat16 model on another layout (for inference or
    low-precision fine-tuning): every parameter, buffer and optimizer moment arrives cast to
    the model's dtype, as torch's DCP and ``load_state_dict`` cast (before, devmesh refused)."""
    path = str(tmp_path / "ckpt")
    expected, _ = run(mesh_pool, "fsdp+tp8", save_trained, torch.float32, path)[0]
    for state, extra in run(mesh_pool, "hsdp4", load_into, torch.bfloat16, path):
        assert extra == {"step": 2} and state.keys() == expected.keys()
        for key, value in expected.items():
            # Adam's step count keeps its dtype: torch's optimizer never casts it
            want = value if key.endswith(".step") else value.to(torch.bfloat16)
            assert state[key].dtype == want.dtype and torch.equal(state[key], want), key


def async_save_then_keep_training(layout: str, path: str):
    model, opt = build(layout, torch.float32)
    train_step(model, opt, 0)
    snapshot = full_state(model, opt)
    handle = save_checkpoint(path, model, opt, async_=True)
    losses = [train_step(model, opt, i) for i in (1, 2)]  # changes parameters while writing
    handle.wait()
    fresh, fresh_opt = build(layout, torch.float32)
    load_checkpoint(path, fresh, fresh_opt)
    loaded = full_state(fresh, fresh_opt)
    resumed = [train_step(fresh, fresh_opt, i) for i in (1, 2)]
    return snapshot, loaded, losses, resumed


def test_async_save_writes_the_state_of_the_moment_it_was_called(mesh_pool, tmp_path):
    path = str(tmp_path / "ckpt")
    for snapshot, loaded, losses, resumed in mesh_pool.run(async_save_then_keep_training, 4,
                                                           "hsdp4", path):
        assert all(torch.equal(snapshot[k], loaded[k]) for k in snapshot)
        assert resumed == losses  # bit for bit: the checkpoint holds the state before step 1


def save_twice_second_fails(layout: str, path: str):
    """A save that fails on one rank only (its data file cannot be created) raises on every
    rank, and the previous checkpoint stays loadable."""
    import torch.distributed as dist

    model, opt = build(layout, torch.float32)
    save_checkpoint(path, model, opt, extra={"generation": 1})
    train_step(model, opt, 0)
    error = None
    real_open = os.fdopen
    if dist.get_rank() == 2:
        def broken(*args, **kwargs):
            raise OSError(28, "No space left on device")
        os.fdopen = broken
    try:
        save_checkpoint(path, model, opt, extra={"generation": 2})
    except Exception as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {exc}"
    finally:
        os.fdopen = real_open
    fresh, fresh_opt = build(layout, torch.float32)
    extra = load_checkpoint(path, fresh, fresh_opt)
    return error, extra


def test_a_save_failing_on_one_rank_raises_everywhere_and_keeps_the_old(mesh_pool, tmp_path):
    path = str(tmp_path / "ckpt")
    for error, extra in mesh_pool.run(save_twice_second_fails, 4, "ddp4", path):
        assert error is not None and "rank 2" in error and "No space left" in error, error
        assert extra == {"generation": 1}
    assert not any(n.endswith(".devmesh-tmp") for n in os.listdir(path))


def test_ckpt_info_and_consolidate_without_launching(mesh_pool, tmp_path):
    import subprocess
    import sys

    from safetensors.torch import load_file

    path = str(tmp_path / "ckpt")
    expected = run(mesh_pool, "hsdp+tp8", save_trained, torch.float32, path)[0][0]
    shown = subprocess.run([sys.executable, "-m", "devmesh", "ckpt", "info", path],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "saved by 8 rank(s)" in shown.stdout
    line = next(l for l in shown.stdout.splitlines() if l.startswith("model.0.weight "))
    assert "[20, 12]" in line and "dim 0 split by (tp, shard)" in line and "960 B" in line
    out = str(tmp_path / "model.safetensors")
    merged = subprocess.run([sys.executable, "-m", "devmesh", "ckpt", "consolidate", path, out,
                             "--buffer-mb", "0.0001"], capture_output=True, text=True,
                            timeout=120)  # a few rows at a time
    assert merged.returncode == 0, merged.stderr
    assert f"load them with safetensors.torch.load_file({out!r})" in merged.stdout
    tensors = load_file(out)  # the real safetensors library reads it
    model = make_model()
    assert tensors.keys() == model.state_dict().keys()
    model.load_state_dict(tensors)
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    bad = subprocess.run([sys.executable, "-m", "devmesh", "ckpt", "info", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "holds no metadata.json" in bad.stderr


def torch_fsdp_tp_model():
    """make_model() under torch's own TP (colwise, rowwise) and FSDP2 on a torch mesh: the
    first Linear's weight is split FSDP-over-TP (nested, torch's _StridedShard)."""
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    mesh = torch_init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    model = make_model()
    torch_parallelize(model, mesh["tp"], {"0": TorchColwise(), "2": TorchRowwise()})
    for i in (0, 2, 4):
        torch_fully_shard(model[i], mesh=mesh["dp"])
    torch_fully_shard(model, mesh=mesh["dp"])
    return model


def dcp_both_ways(devmesh_path: str, torch_path: str):
    """devmesh FSDP+TP checkpoint -> torch FSDP2+TP via dcp.load; torch FSDP2+TP dcp.save ->
    devmesh FSDP+TP via load_torch_dcp. Returns full states to compare."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from devmesh.parallel.checkpoint.torch_dcp import DevmeshReader, load_torch_dcp

    full = StateDictOptions(full_state_dict=True)
    saved, _ = save_trained("fsdp+tp8", torch.float32, devmesh_path)
    theirs = torch_fsdp_tp_model()
    state = {"model": get_model_state_dict(theirs)}
    dcp.load(state, storage_reader=DevmeshReader(devmesh_path))
    set_model_state_dict(theirs, state["model"])
    torch_loaded = {k: v.clone() for k, v in get_model_state_dict(theirs, options=full).items()}

    with torch.no_grad():  # something other than the initial weights, saved by torch
        for p in theirs.parameters():
            p.mul_(-2.0).add_(0.25)
    torch_saved = {k: v.clone() for k, v in get_model_state_dict(theirs, options=full).items()}
    dcp.save({"model": get_model_state_dict(theirs)}, checkpoint_id=torch_path)
    ours, _ = build("fsdp+tp8", torch.float32)
    load_torch_dcp(torch_path, ours)
    return saved, torch_loaded, torch_saved, dict(state_dict(ours, full=True))


def load_torch_dcp_into(layout: str, path: str):
    from devmesh.parallel.checkpoint.torch_dcp import load_torch_dcp

    model, _ = build(layout, torch.float32)
    load_torch_dcp(path, model)
    return dict(state_dict(model, full=True))


def test_torch_dcp_interop_both_ways(mesh_pool, tmp_path):
    ours_path, torch_path = str(tmp_path / "devmesh"), str(tmp_path / "torch")
    for saved, torch_loaded, torch_saved, ours in mesh_pool.run(dcp_both_ways, 8, ours_path,
                                                                torch_path):
        assert torch_loaded.keys() == ours.keys() == torch_saved.keys()
        for name in torch_loaded:
            assert torch.equal(torch_loaded[name], saved[name]), name  # devmesh -> torch
            assert torch.equal(ours[name], torch_saved[name]), name  # torch -> devmesh
    for state in mesh_pool.run(load_torch_dcp_into, 4, "hsdp4", torch_path):
        assert all(torch.equal(state[k], torch_saved[k]) for k in torch_saved)
    plain = make_model()
    from devmesh.parallel.checkpoint.torch_dcp import load_torch_dcp

    load_torch_dcp(torch_path, plain)  # one plain process, no process group
    assert all(torch.equal(v, torch_saved[k]) for k, v in plain.state_dict().items())


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_torch_dcp_metadata_pickle_that_runs_code_is_refused(tmp_path, monkeypatch):
    import pickle

    from devmesh.errors import CheckpointError
    from devmesh.parallel.checkpoint.torch_dcp import load_torch_dcp

    monkeypatch.chdir(tmp_path)
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(CheckpointError, match="refused without running anything"):
        load_torch_dcp(str(tmp_path / "evil"), make_model())
    assert not (tmp_path / "PWNED").exists()


def load_torch_dcp_missing_on_rank_1(path: str):
    import torch.distributed as dist

    from devmesh.errors import CheckpointError
    from devmesh.parallel.checkpoint.torch_dcp import load_torch_dcp

    model, _ = build("tp2", torch.float32)
    mine = path if dist.get_rank() == 0 else path + "-not-here"
    try:
        load_torch_dcp(mine, model)
    except CheckpointError as exc:
        return str(exc)
    return None


def test_load_torch_dcp_failing_on_one_rank_raises_on_every_rank(mesh_pool, tmp_path):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "dcp")
    dcp.save({"model": make_model().state_dict()}, checkpoint_id=path)  # one plain process
    first, second = mesh_pool.run(load_torch_dcp_missing_on_rank_1, 2, path)
    assert second is not None and "holds no DCP .metadata" in second
    assert first is not None and "failed on other ranks — rank 1" in first


class _Tempered(torch.nn.Sequential):
    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
        self.temperature = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) / self.temperature


def scalar_model(layout: str):
    """A model with a 0-d parameter (a temperature), trained 2 steps under ``layout``:
    fully_shard holds such a parameter as one element on the shard dim's first rank."""
    model = _Tempered()
    if layout == "fsdp2":
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    elif layout == "hsdp4":
        fully_shard(model, mesh=init_device_mesh("cpu", (2, 2)))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    return model, opt


def scalar_save(layout: str, path: str):
    model, opt = scalar_model(layout)
    for i in range(2):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(i))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    save_checkpoint(path, model, opt)
    return full_state(model, opt)


def scalar_load(layout: str, path: str):
    model, opt = scalar_model(layout)
    load_checkpoint(path, model, opt)
    return full_state(model, opt)


@pytest.mark.parametrize("saved, loaded", [("fsdp2", "plain"), ("fsdp2", "hsdp4"),
                                           ("plain", "fsdp2")])
def test_a_0d_parameter_keeps_its_shape_through_checkpoints(mesh_pool, tmp_path, saved, loaded):
    """Before, fully_shard's one-element form was saved as shape (1,): no plain model could
    load it ("size mismatch for model.temperature")."""
    from safetensors.torch import load_file

    from devmesh.parallel.checkpoint.offline import consolidate

    path = str(tmp_path / "ckpt")
    worlds = {"plain": 1, "fsdp2": 2, "hsdp4": 4}

    def on(layout, fn):
        return mesh_pool.run(fn, worlds[layout], layout, path) if worlds[layout] > 1 \
            else [fn(layout, path)]

    expected = on(saved, scalar_save)[0]
    assert expected["temperature"].shape == ()
    for state in on(loaded, scalar_load):
        assert state.keys() == expected.keys()
        assert state["temperature"].shape == ()
        for key, value in expected.items():  # (optimizer moments: flattened by full_state)
            assert torch.equal(state[key].reshape(-1), value.reshape(-1)), key
    out = str(tmp_path / "model.safetensors")
    consolidate(path, out)
    assert load_file(out)["temperature"].shape == ()


def scalar_dcp_both_ways(devmesh_path: str, torch_path: str):
    """A 0-d parameter between devmesh's fully_shard and torch DCP: torch's FSDP2 refuses
    0-d parameters, so the torch side is a plain model, saved and loaded by DCP."""
    from devmesh.parallel.checkpoint.torch_dcp import load_torch_dcp

    scalar_save("fsdp2", devmesh_path)  # devmesh -> torch: the plain model is read below
    ours, _ = scalar_model("fsdp2")
    load_torch_dcp(torch_path, ours)  # torch -> devmesh
    return dict(state_dict(ours, full=True))


def test_a_0d_parameter_between_fully_shard_and_torch_dcp(mesh_pool, tmp_path):
    import torch.distributed.checkpoint as dcp

    from devmesh.parallel.checkpoint.torch_dcp import DevmeshReader

    devmesh_path, torch_path = str(tmp_path / "devmesh"), str(tmp_path / "torch")
    theirs = _Tempered()
    with torch.no_grad():
        for p in theirs.parameters():
            p.mul_(-2.0).add_(0.25)
    torch_saved = {k: v.clone() for k, v in theirs.state_dict().items()}
    dcp.save({"model": theirs.state_dict()}, checkpoint_id=torch_path)  # one plain process
    for ours in mesh_pool.run(scalar_dcp_both_ways, 2, devmesh_path, torch_path):
        assert ours["temperature"].shape == ()
        assert all(torch.equal(ours[k], v) for k, v in torch_saved.items())
    expected = mesh_pool.run(scalar_save, 2, "fsdp2", str(tmp_path / "again"))[0]
    plain = _Tempered()
    state = {"model": plain.state_dict()}
    dcp.load(state, storage_reader=DevmeshReader(str(tmp_path / "again")))
    plain.load_state_dict(state["model"])
    assert all(torch.equal(v, expected[k]) for k, v in plain.state_dict().items())


def _save_what_ranks_hold_differently(path: str, case: str):
    """A checkpoint keeps one copy of a block several ranks hold; here those copies differ.
    ``"stages"``: each rank of a 2-stage pipeline saves its own stage, an ``nn.Sequential``
    numbered from 0 (both list ``0.weight``, different layers); ``"diverged"``: a replicated
    model whose weight rank 1 changed alone (saved with ``check_replicas=False``); ``"buffers"``: only BatchNorm's statistics
    differ (each rank's own data, as under DDP) — saved, one rank's copy as torch's DCP
    keeps. Then the stages saved under the whole model's names: one checkpoint of both."""
    import torch.distributed as dist
    from torch import nn

    from devmesh.parallel import replicate
    from devmesh.parallel.pipeline import PipelineStage, Schedule1F1B
    from helpers import caught

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)]
    if case == "stages":
        stage = layers[rank]
        schedule = Schedule1F1B(PipelineStage(stage, rank, 2, "cpu", group=mesh.get_group()),
                                2, loss_fn=F.mse_loss)
        schedule.step(torch.ones(4, 4)) if rank == 0 else schedule.step(target=torch.ones(4, 4))
        refusal = caught(lambda: save_checkpoint(path, stage))
        # the whole model's names in each stage (torchtitan's way): saved, and loads whole
        named = nn.Module()
        named.add_module(str(rank), stage)  # "1.0.weight" on stage 1's rank
        save_checkpoint(f"{path}-named", named)
        loaded = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)])
        load_checkpoint(f"{path}-named", loaded)
        same = all(torch.equal(a, b) for a, b in zip(loaded[rank].state_dict().values(),
                                                      stage.state_dict().values()))
        return refusal, os.path.exists(path), same
    model = nn.Sequential(layers[0], nn.BatchNorm1d(4))
    replicate(model, mesh=mesh)
    model(torch.randn(8, 4) + rank)  # each rank's own statistics
    if case == "diverged" and rank == 1:
        with torch.no_grad():
            model[0][0].weight[0, 0] += 1e-3
    refusal = caught(lambda: save_checkpoint(path, model))
    written = os.path.exists(path)
    if case == "diverged":  # unchecked, one holder's copy of each block is kept, as DCP does
        save_checkpoint(path, model, check_replicas=False)
        return refusal, written, os.path.exists(f"{path}/metadata.json")
    return refusal, written, None


@pytest.mark.parametrize("case", ["stages", "diverged", "buffers"])
def test_blocks_ranks_hold_differently_are_refused_not_mixed(mesh_pool, tmp_path, case):
    """Before, the stages' checkpoint was written, silently a mix of both stages: ``0.weight``
    from one stage's rank, ``0.bias`` from the other's (the same with torch's tensor
    parallelism inside each stage, and for diverged replicas)."""
    path = str(tmp_path / "ckpt")
    for refusal, written, own_path in mesh_pool.run(_save_what_ranks_hold_differently, 2,
                                                    path, case):
        if case == "buffers":
            assert refusal is None and written
            continue
        assert refusal[0] == "CheckpointError" and not written, refusal
        names = "0.weight, 0.bias" if case == "stages" else "0.0.weight"
        assert f"parameter(s) {names} differ between the ranks that hold them" in refusal[1]
        assert "Nothing was written" in refusal[1]
        # stages: the whole model's names load whole; diverged: check_replicas=False saves
        assert own_path is True


def _digest_fails_on_rank_zero(path: str):
    import torch.distributed as dist
    from torch import nn

    import devmesh.parallel.checkpoint.save as save
    from devmesh.parallel import replicate

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",), timeout=30)
    model = replicate(nn.Linear(4, 4), mesh=mesh)
    if dist.get_rank() == 0:
        def broken(block):
            raise RuntimeError("cannot read this parameter")
        save._digest, kept = broken, save._digest
    try:
        save_checkpoint(path, model)
        return None, os.path.exists(path)
    except Exception as exc:  # noqa: BLE001 - the test reads which error each rank raised
        return (type(exc).__name__, str(exc)), os.path.exists(path)
    finally:
        if dist.get_rank() == 0:
            save._digest = kept


def test_a_rank_failing_to_read_its_blocks_fails_the_save_everywhere(mesh_pool, tmp_path):
    """The check of replicated blocks is a collective: a rank that fails inside it (before,
    a meta parameter's digest) tells the others in that same collective instead of leaving
    them waiting in it."""
    (mine, written0), (other, written1) = mesh_pool.run(
        _digest_fails_on_rank_zero, 2, str(tmp_path / "ckpt"), timeout=60)
    assert mine[0] == "RuntimeError" and "cannot read this parameter" in mine[1], mine
    assert other[0] == "CheckpointError" and "failed on another rank" in other[1], other
    assert not written0 and not written1


def _save_recording_fsyncs_and_renames(path: str):
    """Save a replicated model, recording this rank's fsyncs and renames (what each touched,
    when: CLOCK_MONOTONIC is one clock for every process of a host)."""
    import time

    from torch import nn

    from devmesh.parallel import replicate

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",), timeout=30)
    model = replicate(nn.Linear(64, 64), mesh=mesh)
    events: list[tuple[int, str, str]] = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        events.append((time.monotonic_ns(), "fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def recording_replace(src, dst):
        replace(src, dst)
        events.append((time.monotonic_ns(), "rename", os.path.abspath(dst)))

    os.fsync, os.replace = recording_fsync, recording_replace
    try:
        save_checkpoint(path, model)
    finally:
        os.fsync, os.replace = fsync, replace
    return events


def test_the_data_files_are_durable_before_the_metadata_that_names_them(mesh_pool, tmp_path):
    """A checkpoint exists once its metadata is renamed into place, so every rank's data
    file must be durable first: its bytes fsynced before its rename, and the renames
    themselves (directory entries) fsynced before the metadata's. One fsync of the directory,
    after the last data file's rename, makes them all durable: the ranks do not each fsync
    it (eight concurrent directory fsyncs were a tenth of a replicated save)."""
    from devmesh.parallel.checkpoint.format import DATA_FILE, METADATA

    directory = os.path.realpath(tmp_path / "ckpt")
    events = sorted(e for rank in mesh_pool.run(_save_recording_fsyncs_and_renames, 4,
                                                directory, timeout=60) for e in rank)
    renames = {os.path.basename(target): at for at, kind, target in events if kind == "rename"}
    data = [name for name in renames if DATA_FILE.fullmatch(name)]
    assert len(data) >= 2 and METADATA in renames  # a replicated block: one writer
    for name in data:  # its bytes, under the temporary name it was written as, before it
        assert any(kind == "fsync" and os.path.basename(target).startswith(f".{name}.")
                   and at < renames[name] for at, kind, target in events), name
    first, last = min(renames[n] for n in data), max(renames[n] for n in data)
    directory_syncs = [at for at, kind, target in events
                       if kind == "fsync" and target == directory
                       and first < at < renames[METADATA]]
    assert len(directory_syncs) == 1 and directory_syncs[0] > last, events


def _paths_per_rank(base: str):
    """Each rank builds its own path (from its rank, as a script might from the host or the
    time): the save is refused on every rank before anything is written, and a load of two
    existing checkpoints, one per rank, before anything changes."""
    import torch.distributed as dist

    from devmesh.errors import CheckpointError

    model, opt = build("ddp4", torch.float32)
    rank = dist.get_rank()
    before = full_state(model, opt)
    out = {}
    for what, call in (("save", lambda: save_checkpoint(f"{base}/own-{rank}", model, opt)),
                       ("load", lambda: load_checkpoint(f"{base}/step-{rank % 2}", model, opt))):
        try:
            call()
            out[what] = None
        except CheckpointError as exc:
            out[what] = str(exc)
    after = full_state(model, opt)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    return out, unchanged, sorted(n for n in os.listdir(base) if n.startswith("own-"))


def test_paths_that_differ_between_ranks_are_refused_on_every_rank(mesh_pool, tmp_path):
    """Before, ranks saving to paths of their own each wrote a part: rank 0's metadata listed
    the other ranks' data files in directories it never looked in (the save "succeeded", the
    checkpoint could not load), and ranks loading checkpoints of their own went on as
    replicas that differ."""
    for step in range(2):  # two checkpoints, of different trained states
        model, opt = build("plain", torch.float32)
        for i in range(step + 1):
            train_step(model, opt, i)
        save_checkpoint(tmp_path / f"step-{step}", model, opt)
    for out, unchanged, written in mesh_pool.run(_paths_per_rank, 4, str(tmp_path)):
        assert out["save"] is not None and "save_checkpoint: the ranks passed different " \
            f"paths (ranks 0: {tmp_path}/own-0; ranks 1: {tmp_path}/own-1" in out["save"]
        assert "pass every rank the same directory" in out["save"]
        assert out["load"] is not None and "load_checkpoint: the ranks read different " \
            "checkpoints (ranks 0, 2:" in out["load"] and "ranks 1, 3:" in out["load"]
        assert unchanged and written == [], (unchanged, written)


def flipped_byte_in_rows_one_rank_reads(path: str, damaged_row: int, target: str = "fsdp"):
    """A replicated 16x16 weight saved whole (one block, one chunk a row), one byte of row
    ``damaged_row`` flipped, then loaded into ``target``: ``fsdp`` over
    every rank (each reads, and checks, only its rows) or ``ddp`` (every rank reads every
    row, and the ranks split the checking). What each rank raised, and whether its
    parameters stayed as they were."""
    from devmesh.parallel.checkpoint import checksums

    chunk_bytes = checksums.CHUNK_BYTES
    checksums.CHUNK_BYTES = 64  # one 16-float row a chunk: reads of a few rows are checked
    try:
        return _flip_and_load(path, damaged_row, target)
    finally:  # this worker serves other tests next
        checksums.CHUNK_BYTES = chunk_bytes


def _flip_and_load(path: str, damaged_row: int, target_kind: str):
    import torch.distributed as dist

    from devmesh.errors import CheckpointError
    from devmesh.parallel import replicate
    world = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    saved = torch.nn.Linear(16, 16, bias=False)
    replicate(saved, mesh=mesh)
    save_checkpoint(path, saved)
    meta = json.load(open(os.path.join(path, "metadata.json")))
    block = meta["tensors"]["model.weight"]["blocks"][0]
    dist.barrier()
    if dist.get_rank() == 0:
        assert len(block["xxh3"]) == 16
        name = os.path.join(path, block["file"])
        raw = bytearray(open(name, "rb").read())
        raw[block["offset"] + damaged_row * 64 + 3] ^= 0x10
        open(name, "wb").write(bytes(raw))
    dist.barrier()
    torch.manual_seed(1)
    target = torch.nn.Linear(16, 16, bias=False)
    (fully_shard if target_kind == "fsdp" else replicate)(target, mesh=mesh)
    before = target.weight.detach().clone()
    try:
        load_checkpoint(path, target)
        outcome = "loaded"
    except CheckpointError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    return outcome, torch.equal(before, target.weight.detach()), damaged_row


def test_a_flipped_byte_is_found_by_the_rank_that_reads_it_and_refused_everywhere(mesh_pool,
                                                                                  tmp_path):
    (r0, same0, _), (r1, same1, _) = mesh_pool.run(flipped_byte_in_rows_one_rank_reads, 2,
                                                   str(tmp_path / "c"), 12)
    assert r1.startswith("CheckpointChecksumError") and "rows 12..12" in r1, r1
    assert "the block of 'model.weight' starting at [0, 0], size [16, 16]" in r1
    assert r0 != "loaded" and "rank 1" in r0, r0  # the rank whose rows were clean refuses too
    assert same0 and same1  # nothing was loaded anywhere


def test_replicas_on_one_host_split_the_checking_and_still_refuse_a_flipped_byte(mesh_pool,
                                                                                 tmp_path):
    """Every rank of a replicated model reads every row from the host's page cache, and
    checks only its share: the flipped row is found by one rank (every rank used to check,
    and find, it), and every rank refuses, nothing loaded."""
    results = mesh_pool.run(flipped_byte_in_rows_one_rank_reads, 4, str(tmp_path / "c"), 5,
                            "ddp")
    found = [i for i, (outcome, _, _) in enumerate(results)
             if outcome.startswith("CheckpointChecksumError")]
    assert len(found) == 1, [outcome for outcome, _, _ in results]
    assert "rows 5..5" in results[found[0]][0]
    for rank, (outcome, unchanged, _) in enumerate(results):
        assert unchanged, rank
        if rank != found[0]:
            assert outcome.startswith("CheckpointError") and f"rank {found[0]}" in outcome, \
                outcome


def halves_read_by_different_ranks(path: str):
    """Two replicated 16x16 weights saved over 4 ranks, then loaded by models holding one
    each (ranks 0, 1 the first, ranks 2, 3 the second: as a pipeline's stages hold their
    layers), after a byte is flipped in the one whose chunks the host's split of the checking
    gives to a rank that does not read it. What each rank raised, whether its weight stayed
    as it was, and which weight was damaged."""
    import torch.distributed as dist

    from devmesh.errors import CheckpointError
    from devmesh.parallel import replicate
    from devmesh.parallel.checkpoint import checksums
    from devmesh.parallel.checkpoint.format import CheckShare

    chunk_bytes, checksums.CHUNK_BYTES = checksums.CHUNK_BYTES, 64  # a chunk a row
    try:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        torch.manual_seed(0)
        saved = torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False),
                                    torch.nn.Linear(16, 16, bias=False))
        replicate(saved, mesh=mesh)
        save_checkpoint(path, saved)
        meta = json.load(open(os.path.join(path, "metadata.json")))
        readers = {"0": (0, 1), "1": (2, 3)}
        damaged = [name for name, ranks in readers.items()
                   if CheckShare(0, 4).owner(meta["tensors"][f"model.{name}.weight"]["blocks"][0]
                                             ["file"], 0) not in ranks]
        assert damaged, "every weight's checking falls to one of its readers"
        block = meta["tensors"][f"model.{damaged[0]}.weight"]["blocks"][0]
        dist.barrier()
        if dist.get_rank() == 0:
            name = os.path.join(path, block["file"])
            raw = bytearray(open(name, "rb").read())
            raw[block["offset"] + 7 * 64 + 3] ^= 0x10  # row 7
            open(name, "wb").write(bytes(raw))
        dist.barrier()
        mine = "0" if dist.get_rank() < 2 else "1"
        target = torch.nn.Sequential()
        target.add_module(mine, torch.nn.Linear(16, 16, bias=False))  # named as in `saved`
        before = target.get_submodule(mine).weight.detach().clone()
        try:
            load_checkpoint(path, target)
            outcome = "loaded"
        except CheckpointError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        return outcome, torch.equal(before, target.get_submodule(mine).weight), damaged[0]
    finally:  # this worker serves other tests next
        checksums.CHUNK_BYTES = chunk_bytes


def test_a_replicated_row_left_to_a_rank_that_does_not_read_it_is_checked_by_its_readers(
        mesh_pool, tmp_path):
    """Ranks that hold different layers read different replicated tensors, so a chunk the
    host's split of the checking gives to one rank may be read only by others: the digest
    that confirms the checkpoint shows the reads differ, and each rank checks what it left
    to others (without that, this flip loaded silently)."""
    results = mesh_pool.run(halves_read_by_different_ranks, 4, str(tmp_path / "c"))
    damaged = results[0][2]
    readers = (0, 1) if damaged == "0" else (2, 3)
    for rank, (outcome, unchanged, _) in enumerate(results):
        assert unchanged and outcome != "loaded", (rank, outcome)
        if rank in readers:
            assert outcome.startswith("CheckpointChecksumError") and "rows 7..7" in outcome, \
                outcome
            assert f"the block of 'model.{damaged}.weight'" in outcome


def test_consolidate_names_the_extra_that_reads_its_file_where_it_is_missing(
        tmp_path, monkeypatch, capsys):
    """``devmesh ckpt consolidate`` writes safetensors without the library; where the library
    is missing, its message says how to get the reader."""
    from devmesh.parallel import save_checkpoint
    from devmesh.tools import cli
    from devmesh.tools.cli import ckpt

    save_checkpoint(str(tmp_path / "ckpt"), torch.nn.Linear(2, 2)).wait()
    out = str(tmp_path / "m.safetensors")
    monkeypatch.setattr(ckpt, "_installed", lambda package: False)
    assert cli.main(["ckpt", "consolidate", str(tmp_path / "ckpt"), out]) == 0
    told = capsys.readouterr().out
    assert f"wrote 2 tensors to {out}: load them with safetensors.torch.load_file" in told
    assert "pip install 'devmesh[safetensors]'" in told


class Calibrated(torch.nn.Module):
    """A module keeping state beyond its tensors (``get_extra_state``), as quantized and fp8
    modules do: a scale and a history."""

    def __init__(self, plain_state: bool = True) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale, self.history = 1.0, torch.zeros(3)
        self.plain_state = plain_state

    def get_extra_state(self):
        return {"scale": self.scale, "history": self.history} if self.plain_state else object()

    def set_extra_state(self, state) -> None:
        self.scale, self.history = state["scale"], state["history"]

    def forward(self, x):
        return self.lin(x) * self.scale


class Uncalibrated(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)


def extra_state_through_a_checkpoint(path: str):
    from devmesh.errors import CheckpointError, StateDictError

    mesh = init_device_mesh("cpu", (2,))

    def sharded(first):
        model = torch.nn.Sequential(first, torch.nn.Linear(4, 2))
        fully_shard(model, mesh=mesh)
        return model

    model = sharded(Calibrated())
    model[0].scale, model[0].history = 2.5, torch.arange(3.0)
    save_checkpoint(path, model)
    fresh = sharded(Calibrated())
    load_checkpoint(path, fresh)
    restored = (fresh[0].scale, fresh[0].history.tolist())
    errors = []
    for call in (lambda: load_checkpoint(path, sharded(Uncalibrated())),
                 lambda: save_checkpoint(path + "-object", sharded(Calibrated(False)))):
        try:
            call()
            errors.append(None)
        except (CheckpointError, StateDictError) as exc:
            errors.append(str(exc))
    return restored, errors


def test_a_modules_extra_state_goes_through_a_checkpoint(mesh_pool, tmp_path):
    """``get_extra_state`` (``nn.Module.state_dict``'s ``_extra_state`` keys) is saved and set
    back on load, as torch's state dicts and DCP keep it; a checkpoint holding one loads
    into a model without it as an unexpected key, and an extra state a checkpoint cannot
    hold as plain data is refused on every rank, naming it."""
    path = str(tmp_path / "ckpt")
    for restored, (unexpected, refused) in mesh_pool.run(extra_state_through_a_checkpoint, 2,
                                                         path):
        assert restored == (2.5, [0.0, 1.0, 2.0])
        assert unexpected is not None and "Unexpected key(s): '0._extra_state'" in unexpected
        assert refused is not None and "model.0._extra_state" in refused, refused
        assert "Calibrated.get_extra_state() returned it" in refused
