"""devmesh names torch's private parts in one module (devmesh._torch_compat), checked against the
running torch: a scan of src/ for private names anywhere else, and a torch lacking one of them
(simulated by deleting or replacing it before devmesh is imported) stopped with a clear error."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from devmesh import _torch_compat
from devmesh.errors import TorchVersionError

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "devmesh"
COMPAT = SRC / "_torch_compat.py"


def _private(parts: list[str]) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in parts)


def _private_uses(path: Path) -> list[str]:
    """Where ``path`` imports a private torch module or name, or reads a private attribute
    through a name bound to torch (``torch._C.x``, ``dist.distributed_c10d._y``), or sets
    one of torch's DeviceMesh attributes on anything."""
    tree = ast.parse(path.read_text())
    torch_names: dict[str, list[str]] = {}  # local name -> the torch path it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "torch":
                    torch_names[alias.asname or "torch"] = parts if alias.asname else ["torch"]
                    if _private(parts):
                        found.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                parts = node.module.split(".") + [alias.name]
                torch_names[alias.asname or alias.name] = parts
                if _private(parts):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in torch_names:
                parts = torch_names[inner.id] + chain[::-1]
                if _private(parts):
                    found.append(f"line {node.lineno}: {'.'.join(parts)}")
            # (a module without torch holds no torch mesh: the pure layout's own ``_hash``)
            if (torch_names and isinstance(node.ctx, ast.Store)
                    and node.attr in _torch_compat.TORCH_MESH_ATTRIBUTES):
                found.append(f"line {node.lineno}: sets torch's DeviceMesh.{node.attr}")
    return found


def test_only_the_compatibility_module_names_torchs_private_parts():
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        if path != COMPAT:
            uses = _private_uses(path)
            if uses:
                offenders[str(path.relative_to(SRC))] = uses
    assert not offenders, (
        "torch's private names belong in devmesh/_torch_compat.py, which checks them against "
        f"the running torch: {offenders}")


def test_the_scan_finds_each_kind_of_private_use(tmp_path):
    """The scan itself (else the test above would pass for a scan that finds nothing)."""
    sample = tmp_path / "sample.py"
    sample.write_text(textwrap.dedent("""
        import torch
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        from torch.distributed.device_mesh import _mesh_resources
        from torch.utils import _pytree
        from torch.distributed import tensor

        dist.distributed_c10d._get_default_store()
        torch._C._current_graph_task_id()
        tensor.placement_types.Shard  # public: not reported
        mesh._layout = None
    """))
    uses = sorted(_private_uses(sample))
    assert uses == sorted([
        "line 4: import torch.distributed._functional_collectives",
        "line 5: from torch.distributed.device_mesh import _mesh_resources",
        "line 6: from torch.utils import _pytree",
        "line 9: torch.distributed.distributed_c10d._get_default_store",
        "line 10: torch._C._current_graph_task_id", "line 10: torch._C",
        "line 12: sets torch's DeviceMesh._layout",
    ]), uses


def test_the_supported_releases_are_the_package_requirement():
    requirement = re.search(r'"torch([^"]*)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert requirement == _torch_compat.SUPPORTED_TORCH


def _import_devmesh_after(patch: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(patch) + "\nimport devmesh.mesh\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("patch, named", [
    ("import torch.distributed.distributed_c10d as c10d\ndel c10d._get_default_store",
     "torch.distributed.distributed_c10d._get_default_store (missing)"),
    ("import torch.distributed.device_mesh as dm\ndel dm.DeviceMesh._concatenate",
     "torch.distributed.device_mesh.DeviceMesh._concatenate (missing)"),
    ("import torch._C\ndel torch._C._current_graph_task_id",
     "torch._C._current_graph_task_id (missing)"),
    # a changed signature, not only a missing name
    ("import torch.distributed._mesh_layout as ml\n"
     "class _FlatLayout:\n    def __init__(self, shape, strides=None): pass\n"
     "ml._FlatLayout = _FlatLayout",
     "torch.distributed._mesh_layout._FlatLayout (its parameters ['stride'] are gone)"),
], ids=["store", "concatenate", "graph-task", "signature"])
def test_a_torch_without_a_private_name_is_refused_at_import_naming_it(patch, named):
    result = _import_devmesh_after(patch)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("devmesh.errors.TorchVersionError: devmesh needs torch's "
                           + named), result.stderr
    assert f"torch {torch.__version__} does not have" in last
    assert f"pip install 'torch{_torch_compat.SUPPORTED_TORCH}'" in last


def test_a_subsystem_is_checked_on_first_use(monkeypatch):
    """Pipelining's private stage classes are looked up when a schedule first needs them: a
    torch without them is refused there, by name."""
    import torch.distributed.pipelining.stage as stage

    monkeypatch.delattr(stage, "_PipelineStage")
    _torch_compat.pipeline_stage_types.cache_clear()
    try:
        with pytest.raises(TorchVersionError,
                           match=r"torch.distributed.pipelining.stage._PipelineStage \(missing\)"):
            _torch_compat.pipeline_stage_types()
    finally:
        monkeypatch.undo()
        _torch_compat.pipeline_stage_types.cache_clear()
    base, traced = _torch_compat.pipeline_stage_types()
    assert issubclass(traced, base)
