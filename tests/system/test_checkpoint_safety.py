"""Checkpoints that refuse to run code, never follow a planted file, never leave a half-written
or temporary file, and load all or nothing (issue 9, items 1, 4, 5, 6, 7). Single process: a
mesh of size 1 runs the same code paths as a larger one."""

from __future__ import annotations

import json
import math
import os
import pickle
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from devmesh.errors import (CheckpointChecksumError, CheckpointError, CheckpointNotFoundError,
                            StateDictError)
from devmesh.parallel import load_checkpoint, load_state_dict, save_checkpoint


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.norm(self.lin(x))


def _trained():
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(6, 4)).sum().backward()
    opt.step()
    return model, opt


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_an_old_single_file_checkpoint_whose_pickle_runs_code_is_refused(tmp_path,
                                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.pt"
    torch.save({"format": "devmesh-checkpoint/1", "model": {}, "extra": _RunsCode()}, path)
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="refused without running anything"):
        load_checkpoint(str(path), model)
    assert not (tmp_path / "PWNED").exists()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_an_old_single_file_checkpoint_still_loads(tmp_path):
    model, _ = _trained()
    path = tmp_path / "old.pt"
    torch.save({"format": "devmesh-checkpoint/1", "model": model.state_dict(),
                "extra": {"step": 3}}, path)
    fresh = Net()
    assert load_checkpoint(str(path), fresh) == {"step": 3}
    assert _same(model, fresh)


def test_extra_must_be_plain_data():
    model, opt = _trained()
    with pytest.raises(CheckpointError, match="extra\\['obj'\\] is a _RunsCode"):
        save_checkpoint("/nonexistent/never-written", model, opt, extra={"obj": _RunsCode()})


def test_round_trip_with_optimizer_buffers_and_extra(tmp_path):
    model, opt = _trained()
    path = str(tmp_path / "ckpt")
    rng = torch.get_rng_state()
    save_checkpoint(path, model, opt, extra={"step": 7, "rng": rng, "betas": (0.9, 0.99),
                                             3: [None, True, "x", torch.float16]})
    fresh = Net()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    extra = load_checkpoint(path, fresh, fresh_opt)
    assert _same(model, fresh)  # BatchNorm's running statistics included
    assert extra["step"] == 7 and torch.equal(extra["rng"], rng)
    assert extra["betas"] == (0.9, 0.99) and extra[3] == [None, True, "x", torch.float16]
    assert fresh_opt.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key])
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert all(not name.endswith(".devmesh-tmp") for name in os.listdir(path))


def test_tied_weights_are_stored_once_and_stay_tied(tmp_path):
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    save_checkpoint(str(tmp_path / "ckpt"), model)
    meta = json.load(open(tmp_path / "ckpt" / "metadata.json"))
    assert meta["aliases"] == {"model.1.weight": "model.0.weight"}
    assert sum(meta["files"].values()) == 10 * 4 * 4
    fresh = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    fresh[1].weight = fresh[0].weight
    load_checkpoint(str(tmp_path / "ckpt"), fresh)
    assert fresh[1].weight is fresh[0].weight and torch.equal(fresh[0].weight, model[0].weight)


def test_a_planted_symlink_is_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    path = tmp_path / "ckpt"
    path.mkdir()
    os.symlink(victim, path / "metadata.json")  # the predictable names
    os.symlink(victim, path / "metadata.json.tmp")
    model, opt = _trained()
    save_checkpoint(str(path), model, opt)
    assert victim.read_text() == "precious"
    assert not os.path.islink(path / "metadata.json")
    load_checkpoint(str(path), Net())


@pytest.mark.parametrize("content, words", [
    (b"", "is empty"),
    (b"not a zip file at all", "truncated or corrupted"),
])
def test_empty_and_garbage_files(tmp_path, content, words):
    path = tmp_path / "bad.pt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=words) as info:
        load_checkpoint(str(path), Net())
    assert str(path) in str(info.value)


def _saved(tmp_path):
    model, opt = _trained()
    path = tmp_path / "ckpt"
    save_checkpoint(str(path), model, opt)
    meta = json.loads((path / "metadata.json").read_text())
    return path, meta


def _damage(path, meta, change):
    change(meta)
    (path / "metadata.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("case, words", [
    ("garbage metadata", "not valid JSON"),
    ("no metadata", "holds no metadata.json"),
    ("missing data file", "is missing"),
    ("short data file", "truncated or overwritten"),
    ("path in a file name", "damaged or not written by devmesh"),
    ("block past the end", "ends past the end"),
    ("block outside the tensor", "lies outside the tensor"),
    ("blocks do not cover", "cover"),
    ("overlapping blocks", "overlap, leaving part of it unwritten"),
    ("data file linked elsewhere", "is a link or not a plain file"),
    ("unknown dtype", "unknown dtype"),
    ("foreign format", "expected 'devmesh-sharded-checkpoint/1'"),
    ("object in extra", "unknown tag"),
    ("a flipped byte", "does not match the checksum written with it"),
    ("checksums of another block", "xxh3 is not a list"),
    ("checksums out of range", "holds values that are not xxh3 sums"),
])
def test_damaged_or_hostile_checkpoints_are_refused_before_anything_changes(tmp_path, case,
                                                                               words):
    path, meta = _saved(tmp_path)
    data = next(iter(meta["files"]))
    first = next(iter(meta["tensors"]))
    if case == "garbage metadata":
        (path / "metadata.json").write_text('{"format": "devmesh-sharded-checkpoint/1", "fi')
    elif case == "no metadata":
        (path / "metadata.json").unlink()
    elif case == "missing data file":
        (path / data).unlink()
    elif case == "short data file":
        (path / data).write_bytes((path / data).read_bytes()[:-4])
    elif case == "path in a file name":
        _damage(path, meta, lambda m: m["files"].update({"../../etc/passwd": 10}))
    elif case == "block past the end":
        _damage(path, meta, lambda m: m["tensors"][first]["blocks"][0].update(
            offset=meta["files"][data]))
    elif case == "block outside the tensor":
        _damage(path, meta, lambda m: m["tensors"][first]["blocks"][0].update(start=[5, 5]))
    elif case == "blocks do not cover":
        _damage(path, meta, lambda m: m["tensors"][first].update(shape=[9, 4]))
    elif case == "overlapping blocks":  # as many elements as the tensor, half of them twice
        _damage(path, meta, lambda m: m["tensors"]["model.lin.weight"].update(blocks=[
            dict(m["tensors"]["model.lin.weight"]["blocks"][0], size=[4, 4]),
            dict(m["tensors"]["model.lin.weight"]["blocks"][0], size=[4, 4])]))
    elif case == "data file linked elsewhere":  # a secret of the same size, read as weights
        secret = tmp_path / "secret"
        secret.write_bytes((path / data).read_bytes())
        (path / data).unlink()
        (path / data).symlink_to(secret)
    elif case == "unknown dtype":
        _damage(path, meta, lambda m: m["tensors"][first].update(dtype="object"))
    elif case == "foreign format":
        _damage(path, meta, lambda m: m.update(format="torch-dcp"))
    elif case == "object in extra":
        _damage(path, meta, lambda m: m.update(extra={"pickle": "cos\nsystem\n"}))
    elif case == "a flipped byte":  # one byte of the middle of the data: loaded silently before
        raw = bytearray((path / data).read_bytes())
        raw[len(raw) // 2] ^= 0x40
        (path / data).write_bytes(bytes(raw))
    elif case == "checksums of another block":
        _damage(path, meta, lambda m: m["tensors"][first]["blocks"][0].update(xxh3=[1, 2, 3]))
    elif case == "checksums out of range":
        _damage(path, meta, lambda m: m["tensors"][first]["blocks"][0].update(
            xxh3=[1 << 63] * len(m["tensors"][first]["blocks"][0]["xxh3"])))
    target = Net()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError, match=words) as info:
        load_checkpoint(str(path), target, torch.optim.Adam(target.parameters()))
    assert str(path) in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def _as_written_with_crc32(path, meta) -> None:
    """Rewrite a checkpoint's checksums as checkpoints written before XXH3 carry them: a
    CRC-32 per chunk of rows, under ``crc32`` and ``crc_rows``."""
    import zlib

    for tensor in meta["tensors"].values():
        itemsize = torch.empty((), dtype=getattr(torch, tensor["dtype"])).element_size()
        for block in tensor["blocks"]:
            data = (path / block["file"]).read_bytes()
            size = block["size"]
            row = math.prod(size[1:]) * itemsize if size else itemsize
            step = block["chunk_rows"] * row
            nbytes = math.prod(size) * itemsize
            chunk_starts = range(block["offset"], block["offset"] + nbytes, step)
            block["crc32"] = [zlib.crc32(data[at:min(at + step, block["offset"] + nbytes)])
                              for at in chunk_starts]
            block["crc_rows"] = block.pop("chunk_rows")
            del block["xxh3"]
    _damage(path, meta, lambda m: None)


def test_a_checkpoint_written_with_crc32_checksums_still_loads_and_is_still_checked(tmp_path):
    """Checkpoints written before XXH3 carry a CRC-32 per chunk: they load as before, every
    byte checked, and a flipped byte is refused naming the block."""
    model, _ = _trained()
    path, meta = _saved(tmp_path)
    _as_written_with_crc32(path, meta)
    assert "crc32" in json.loads((path / "metadata.json").read_text())["tensors"][
        "model.lin.weight"]["blocks"][0]
    loaded = Net()
    loaded.lin.weight.data.zero_()
    load_checkpoint(str(path), loaded, torch.optim.Adam(loaded.parameters()))
    assert _same(loaded, model)
    block = meta["tensors"]["model.lin.weight"]["blocks"][0]
    raw = bytearray((path / block["file"]).read_bytes())
    raw[block["offset"] + 5] ^= 1
    (path / block["file"]).write_bytes(bytes(raw))
    with pytest.raises(CheckpointChecksumError, match="does not match the checksum written"):
        load_checkpoint(str(path), Net())


def test_missing_and_plain_files(tmp_path):
    model, _ = _trained()
    with pytest.raises(CheckpointNotFoundError) as info:
        load_checkpoint(str(tmp_path / "missing"), Net())
    assert isinstance(info.value, FileNotFoundError)
    plain = tmp_path / "plain.pt"
    torch.save(model.state_dict(), plain)
    with pytest.raises(CheckpointError, match="plain torch.save\\(model.state_dict\\(\\)\\)"):
        load_checkpoint(str(plain), Net())


def test_a_model_that_does_not_match_is_refused(tmp_path):
    path, _ = _saved(tmp_path)
    wider = Net()
    wider.lin = nn.Linear(4, 9)
    with pytest.raises(StateDictError, match="size mismatch for model.lin.weight"):
        load_checkpoint(str(path), wider)
    renamed = nn.Sequential(nn.Linear(4, 8))
    with pytest.raises(StateDictError, match="Missing key\\(s\\): '0.weight'"):
        load_checkpoint(str(path), renamed)


def test_another_dtype_is_cast_as_torch_dcp_casts_it(tmp_path):
    """A float32 checkpoint loads into a float16 model converted, as ``torch.distributed.
    checkpoint.load`` loads a float32 one into the same model."""
    import torch.distributed.checkpoint as dcp

    model, opt = _trained()
    save_checkpoint(str(tmp_path / "ckpt"), model, opt)
    half = Net().to(torch.float16)
    load_checkpoint(str(tmp_path / "ckpt"), half)
    torch_half = Net().to(torch.float16)
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    state = torch_half.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    for key, value in half.state_dict().items():
        assert value.dtype == state[key].dtype and torch.equal(value, state[key]), key
    assert torch.equal(half.lin.weight, model.lin.weight.to(torch.float16))


def test_loads_are_all_or_nothing_and_shapes_exact():
    model = Net()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    target = Net()
    with torch.no_grad():
        for p in target.parameters():
            p.add_(1.0)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    bad_cases = {
        "reshaped": {**state, "lin.weight": state["lin.weight"].reshape(4, 8)},  # same numel
        "broadcast buffer": {**state, "norm.running_mean": torch.zeros(1)},
        "short buffer": {**state, "norm.running_var": torch.ones(3)},
        "missing buffer": {k: v for k, v in state.items() if k != "norm.running_mean"},
    }
    for case, bad in bad_cases.items():
        with pytest.raises(StateDictError) as info:
            load_state_dict(target, bad)
        assert isinstance(info.value, RuntimeError), case
        after = target.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), case
    assert "size mismatch for lin.weight" in _message(load_state_dict, target,
                                                      bad_cases["reshaped"])
    assert "Missing key(s) in state_dict: 'norm.running_mean'" in _message(
        load_state_dict, target, bad_cases["missing buffer"])
    result = load_state_dict(target, {**bad_cases["missing buffer"], "extra.key": torch.ones(1)},
                             strict=False)
    assert result.missing_keys == ["norm.running_mean"]
    assert result.unexpected_keys == ["extra.key"]
    assert torch.equal(target.lin.weight, model.lin.weight)


def _message(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    return ""


def test_optimizer_mismatch_changes_nothing(tmp_path):
    model, opt = _trained()
    path = str(tmp_path / "ckpt")
    save_checkpoint(path, model, opt)
    target = Net()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    only_lin = torch.optim.Adam(target.lin.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="parameter groups differ"):
        load_checkpoint(path, target, only_lin)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


@pytest.mark.parametrize("stage", ["data-", "metadata.json"])
def test_a_killed_writer_leaves_the_old_checkpoint_loadable(tmp_path, stage):
    """SIGKILL while writing the data files, or the metadata: the previous checkpoint still
    loads, and the next save removes what the killed writer left."""
    path = tmp_path / "ckpt"
    model, opt = _trained()
    save_checkpoint(str(path), model, opt, extra={"generation": 1})
    script = textwrap.dedent(f"""
        import contextlib, os, signal
        import devmesh.parallel.checkpoint.save as save
        real = save.atomic_file
        @contextlib.contextmanager
        def dying(target, mode="wb", **options):
            with real(target, mode, **options) as f:
                if {stage!r} in os.path.basename(target):
                    f.write(b"partial" if "b" in mode else "partial")
                    f.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                yield f
        save.atomic_file = dying
        from torch import nn
        save.save_checkpoint({str(path)!r}, nn.Linear(4, 8), extra={{"generation": 99}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = set(os.listdir(path))
    assert any(n.endswith(".devmesh-tmp") for n in left)
    fresh = Net()
    assert load_checkpoint(str(path), fresh)["generation"] == 1
    assert _same(model, fresh)
    save_checkpoint(str(path), model, opt, extra={"generation": 2})
    meta = json.loads((path / "metadata.json").read_text())
    assert sorted(os.listdir(path)) == sorted(["metadata.json", *meta["files"]])


def test_nothing_is_unpickled_when_loading_sharded_checkpoints():
    root = os.path.join(os.path.dirname(__file__), "..", "..", "src", "devmesh", "parallel",
                        "checkpoint")
    for name in ("format.py", "load.py", "encoding.py", "offline.py"):
        source = open(os.path.join(root, name)).read()
        assert "import pickle" not in source and "torch.load(" not in source, name
    assert pickle  # imported for the malicious file above


def test_a_changed_byte_is_named_by_ckpt_info_verify(tmp_path):
    path, meta = _saved(tmp_path)
    data = next(iter(meta["files"]))
    devmesh = [sys.executable, "-m", "devmesh", "ckpt", "info", "--verify", str(path)]
    clean = subprocess.run(devmesh, capture_output=True, text=True, timeout=120)
    assert clean.returncode == 0, clean.stderr
    assert "every checksum matches" in clean.stdout
    block = meta["tensors"]["model.lin.weight"]["blocks"][0]
    raw = bytearray((path / data).read_bytes())
    raw[block["offset"] + 5] ^= 1  # one bit of lin.weight
    (path / data).write_bytes(bytes(raw))
    damaged = subprocess.run(devmesh, capture_output=True, text=True, timeout=120)
    assert damaged.returncode == 1
    assert f"{data} does not match the checksum written with it" in damaged.stderr
    assert "the block of 'model.lin.weight' starting at [0, 0], size [8, 4]" in damaged.stderr
    # the listing alone reads no data: it still works
    assert subprocess.run(devmesh[:-2] + [str(path)], capture_output=True,
                          timeout=120).returncode == 0


_DIGEST_MEMORY = """
import resource, torch
from devmesh.parallel.checkpoint import save
save._digest(torch.ones(1 << 20))  # a first call's own buffers
block = torch.arange(16 << 20, dtype=torch.float32)  # 64 MiB, touched
strided = torch.arange(32 << 20, dtype=torch.float32).reshape(-1, 2)[:, 0]  # 128 MiB, half read
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(save._digest(block), save._digest(strided),
      (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_checking_replicas_digests_a_block_without_copying_it():
    """save_checkpoint digests every replicated block to check its replicas agree: summed as
    64-bit words at once, a 64 MiB block cost 128 MiB more (2x the block, measured). On the
    host the digest is XXH3 of the block's bytes in row-major order, read in place, or slab
    by slab from a strided view: nothing measurable beyond the block either way."""
    import xxhash

    done = subprocess.run([sys.executable, "-c", _DIGEST_MEMORY], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    whole, strided, growth_mb = map(int, done.stdout.split())
    assert growth_mb < 8, growth_mb
    def digest(t):
        return xxhash.xxh3_64_intdigest(t.numpy()) >> 1

    assert whole == digest(torch.arange(16 << 20, dtype=torch.float32))
    assert strided == digest(torch.arange(0, 32 << 20, 2, dtype=torch.float32))


def test_writers_of_one_file_at_once_keep_their_own_temporary_files(tmp_path):
    """Every rank drawing the same picture (visualize_sharding(w, to_file=...) on each rank)
    writes one file from several processes at once: a writer used to delete the others'
    temporary files as if their writers had been killed, and their rename failed."""
    from devmesh._files import atomic_file

    target = tmp_path / "w.png"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alive = tmp_path / f".w.png.{sleeper.pid}.abc.devmesh-tmp"
        alive.write_bytes(b"half")
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout.strip()
        left = tmp_path / f".w.png.{dead}.def.devmesh-tmp"
        left.write_bytes(b"half")
        with atomic_file(str(target)) as f:
            f.write(b"picture")
        assert alive.exists() and not left.exists() and target.read_bytes() == b"picture"
    finally:
        sleeper.kill()
        sleeper.wait()
