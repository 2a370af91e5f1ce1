"""DESIGN.md's layer order, checked on the source: a module never imports a higher layer
(lazy imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "devmesh"

LAYERS = {  # low to high
    "errors": 0, "_files": 0,
    "layout": 1, "topology": 1, "render": 1, "render_png": 1,  # pure: need only the layout
    "launcher": 2, "_worker": 2, "_auth": 2, "testing": 2,
    "env": 3, "groups": 3,
    "mesh": 4,
    "comm": 5,
    "tensor": 6,
    "viz": 7, "parallel": 7,
    "apps": 8, "cluster_plan": 8, "doctor": 8, "commbench": 8,
    "demo": 9, "cli": 9,
}


def _layer(module: str) -> int:
    parts = module.split(".")
    assert parts[0] == "devmesh"
    return LAYERS[parts[1]]


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        name = ".".join(rel.parts)
        if name.endswith("__init__"):
            name = name.rsplit(".", 1)[0]
        if name != "devmesh":
            yield name, path


@pytest.mark.parametrize("name, path", list(_modules()), ids=lambda v: str(v))
def test_module_imports_only_lower_layers(name, path):
    own = _layer(name)
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("devmesh"):
            targets = [node.module]
            if node.module == "devmesh":
                targets = [f"devmesh.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name.startswith("devmesh")]
        for target in targets:
            if target.split(".")[1] in LAYERS:
                assert _layer(target) <= own, f"{name} (layer {own}) imports {target}"
