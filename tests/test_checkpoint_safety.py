"""Checkpoints that refuse to run code, never follow a planted file, never leave a half-written
or temporary file, and load all or nothing (issue 9, items 1, 4, 5, 6, 7). Single process: a
mesh of size 1 runs the same code paths as a larger one."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from devmesh.errors import CheckpointError, CheckpointNotFoundError, StateDictError
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


def test_a_checkpoint_whose_pickle_runs_code_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.pt"
    torch.save({"format": "devmesh-checkpoint/1", "model": {}, "extra": _RunsCode()}, path)
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="refused without running anything"):
        load_checkpoint(str(path), model)
    assert not (tmp_path / "PWNED").exists()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_extra_must_be_plain_data():
    model, opt = _trained()
    with pytest.raises(CheckpointError, match="extra\\['obj'\\] is a _RunsCode"):
        save_checkpoint("/nonexistent/never-written.pt", model, opt, extra={"obj": _RunsCode()})


def test_round_trip_with_optimizer_buffers_and_extra(tmp_path):
    model, opt = _trained()
    path = str(tmp_path / "ckpt.pt")
    rng = torch.get_rng_state()
    save_checkpoint(path, model, opt, extra={"step": 7, "rng": rng, "betas": (0.9, 0.99)})
    fresh = Net()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    extra = load_checkpoint(path, fresh, fresh_opt)
    assert _same(model, fresh)  # BatchNorm's running statistics included
    assert extra["step"] == 7 and torch.equal(extra["rng"], rng)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(opt.state[p]["exp_avg"], fresh_opt.state[q]["exp_avg"])
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]


def test_a_planted_symlink_is_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    path = tmp_path / "ckpt.pt"
    os.symlink(victim, str(path) + ".tmp")  # the old fixed temporary name
    model, opt = _trained()
    save_checkpoint(str(path), model, opt)
    assert victim.read_text() == "precious"
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


def test_truncated_missing_and_plain_files(tmp_path):
    model, opt = _trained()
    good = tmp_path / "good.pt"
    save_checkpoint(str(good), model, opt)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        load_checkpoint(str(cut), Net())
    with pytest.raises(CheckpointNotFoundError) as info:
        load_checkpoint(str(tmp_path / "missing.pt"), Net())
    assert isinstance(info.value, FileNotFoundError)
    plain = tmp_path / "plain.pt"
    torch.save(model.state_dict(), plain)
    with pytest.raises(CheckpointError, match="plain torch.save\\(model.state_dict\\(\\)\\)"):
        load_checkpoint(str(plain), Net())


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
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, model, opt)
    target = Net()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    only_lin = torch.optim.Adam(target.lin.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="parameter groups differ"):
        load_checkpoint(path, target, only_lin)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_a_killed_writer_leaves_the_old_checkpoint_and_no_temporary(tmp_path):
    """SIGKILL in the middle of a save: the previous checkpoint still loads, and the next save
    removes the killed writer's temporary file."""
    path = tmp_path / "ckpt.pt"
    model, opt = _trained()
    save_checkpoint(str(path), model, opt, extra={"generation": 1})
    script = textwrap.dedent(f"""
        import os, signal, torch
        import devmesh._files as files
        real_save = torch.save
        def slow_save(obj, f):
            f.write(b"partial bytes")
            f.flush()
            print("writing", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        torch.save = slow_save
        from devmesh.parallel import save_checkpoint
        from torch import nn
        save_checkpoint({str(path)!r}, nn.Linear(2, 2))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    leftovers = [n for n in os.listdir(tmp_path) if n != "ckpt.pt"]
    assert leftovers and all(n.endswith(".devmesh-tmp") for n in leftovers)
    fresh = Net()
    assert load_checkpoint(str(path), fresh)["generation"] == 1
    assert _same(model, fresh)
    save_checkpoint(str(path), model, opt, extra={"generation": 2})
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]


def test_pickle_module_is_not_used_for_checkpoints():
    assert "pickle.load" not in open(
        os.path.join(os.path.dirname(__file__), "..", "src", "devmesh", "parallel",
                     "checkpoint.py")).read()
    assert pickle  # imported for the malicious file above
