"""The layer order of docs/design/index.md, checked on the source: a module never imports a higher layer
(lazy imports inside functions included)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "devmesh"

LAYERS = {  # low to high; one entry per folder (a top-level module counts as its own)
    "errors": 0, "_files": 0, "_exit": 0, "_log": 0, "_progress": 0,
    "_torch_compat": 0,  # the one module naming torch's private parts
    "layout": 1,  # pure: no torch (see test_layout_imports_no_torch)
    "launching": 2, "testing": 2,
    "distributed": 3,
    "mesh": 4, "hybrid": 4,
    "tensor": 5,
    "parallel": 6, "fault": 6,
    "integrations": 7,  # other libraries' models under the parallelisms
    "pictures": 7,
    "tools": 8, "__main__": 8,
}
# Pictures are drawn on demand: a method that draws (DeviceMesh.visualize) or a name kept
# for compatibility (devmesh.parallel.describe, devmesh.parallel.parallelize) may import
# devmesh.pictures or devmesh.integrations inside a function.
LAZY_ALLOWED = {"pictures", "integrations"}


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
    tree = ast.parse(path.read_text())
    type_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                 and getattr(block.test, "id", None) == "TYPE_CHECKING"
                 for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in type_only:  # annotations only: never imported at run time
            continue
        targets = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("devmesh"):
            targets = [node.module]
            if node.module == "devmesh":
                targets = [f"devmesh.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name.startswith("devmesh")]
        for target in targets:
            if target.split(".")[1] in LAYERS:
                if target.split(".")[1] in LAZY_ALLOWED and node.col_offset > 0:
                    continue
                assert _layer(target) <= own, f"{name} (layer {own}) imports {target}"


def test_layout_imports_no_torch():
    """The pure core stays pure: importing it (and devmesh itself) loads no torch."""
    code = ("import sys, devmesh, devmesh.layout, devmesh.layout.plan, devmesh.layout.topology, "
            "devmesh.pictures.render; assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_rank_that_uses_no_dtensor_does_not_import_it():
    """``import devmesh.parallel`` (every rank of a devmesh script) leaves torch's DTensor,
    and the sympy it pulls in, unimported (~0.6 s of CPU per process): it is imported where a
    DTensor is first made or met, and ``loss_parallel`` (torch's) when first asked for."""
    code = ("import sys, devmesh.parallel, devmesh.parallel.tensor_parallel; "
            "assert 'torch.distributed.tensor' not in sys.modules, 'DTensor was imported'; "
            "assert 'sympy' not in sys.modules, 'sympy was imported'; "
            "from devmesh.parallel import loss_parallel; "
            "from torch.distributed.tensor.parallel import loss_parallel as torchs; "
            "assert loss_parallel is torchs")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """The devmesh modules ``name`` imports, at run time (lazy imports inside functions
    included, ``TYPE_CHECKING`` blocks not): ``from a.b import c`` names ``a.b.c`` where that is
    a module, else the package ``a.b``."""
    tree = ast.parse(path.read_text())
    type_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                 and getattr(block.test, "id", None) == "TYPE_CHECKING"
                 for stmt in block.body for n in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("devmesh"):
            assert node.level == 0, f"{name}: relative import"
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                      else node.module for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("devmesh")}
    return (found & modules) - {name}


def test_no_module_imports_itself_through_others():
    """No import cycle anywhere in devmesh, lazy imports included: a cycle hidden inside a
    function is still two modules that cannot be understood (or moved) one without the other."""
    paths = dict(_modules())
    graph = {name: _imports(name, path, set(paths)) for name, path in paths.items()}
    cycles = []
    for start in graph:  # a path from start back to itself
        stack, seen = [(start, (start,))], set()
        while stack:
            node, route = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(" -> ".join(route + (start,)))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, route + (nxt,)))
    assert not cycles, "import cycles:\n" + "\n".join(sorted(set(cycles)))


def test_subpackages_are_reached_from_the_package_as_torch_users_expect():
    """``import devmesh`` then ``devmesh.parallel.fully_shard`` (as ``torch.distributed``
    after ``import torch``), each subpackage imported on first use: ``import devmesh`` alone
    still loads no torch."""
    code = ("import sys, devmesh; assert 'torch' not in sys.modules; "
            "assert devmesh.parallel.load_checkpoint and devmesh.errors.DevmeshError "
            "and devmesh.tensor.Shard and devmesh.layout.MeshLayout")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# calls whose result is a value that never changes (a constant, a compiled pattern, a logger)
_IMMUTABLE_CALLS = {"frozenset", "tuple", "object", "TypeVar", "get_logger", "getLogger",
                    "compile", "MappingProxyType", "namedtuple", "field", "dataclass"}


def _module_level_state(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level to something that can change: a list, dict or
    set display, or an object made by a call (an instance of a class of its own)."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        mutable = isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp,
                                     ast.SetComp))
        if isinstance(value, ast.Call):
            called = value.func.attr if isinstance(value.func, ast.Attribute) else \
                getattr(value.func, "id", "")
            mutable = called not in _IMMUTABLE_CALLS and not called.isupper()
        if mutable:
            names |= {t.id for t in targets if isinstance(t, ast.Name) and t.id != "__all__"}
    return names


def test_no_module_level_state_coordinates_the_parallel_layer_between_files():
    """State that several files of ``devmesh.parallel`` read and write (the forward in
    progress, gathers kept for a pipeline's weight gradients) lives in one file, private,
    behind functions that say what they do: no other module imports or reaches into it."""
    modules = {name: path for name, path in _modules() if name.startswith("devmesh.parallel")}
    state = {}
    for name, path in modules.items():
        for held in _module_level_state(ast.parse(path.read_text())):
            assert held.startswith("_"), (
                f"{name}.{held} is module-level state with a public name: make it private "
                "and give the files that need it functions")
            state[held] = name
    for name, path in _modules():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                shared = {a.name for a in node.names} & {k for k, v in state.items()
                                                          if v == node.module}
                assert not shared, f"{name} imports {sorted(shared)} from {node.module}"
            if isinstance(node, ast.Attribute) and node.attr in state and \
                    state[node.attr] != name and isinstance(node.value, ast.Name):
                raise AssertionError(f"{name} reaches into {state[node.attr]}.{node.attr}")


def test_a_modules_parameter_slots_are_written_in_one_place():
    """``module._parameters[name] = ...`` (a swap bypassing ``nn.Module``'s checks and hooks)
    appears only in devmesh.parallel.swap; everything else calls ``swap_parameter``."""
    writers = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else
                       node.targets if isinstance(node, ast.Delete) else [])
            for target in targets:
                if (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute)
                        and target.value.attr == "_parameters"):
                    writers.append(f"{path.relative_to(SRC)}:{node.lineno}")
        for node in ast.walk(ast.parse(path.read_text())):  # ._parameters.update(...) etc.
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("update", "pop", "setdefault", "clear",
                                           "__setitem__")
                    and isinstance(node.func.value, ast.Attribute)
                    and node.func.value.attr == "_parameters"):
                writers.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert writers == ["parallel/swap.py:22"], writers


def test_an_objects_private_fields_are_written_by_its_own_class():
    """In ``devmesh.parallel`` state is changed by the object that holds it: a private field
    is assigned only through ``self`` (or ``new``, the copy a ``__deepcopy__`` makes), never
    by another file reaching in (an FSDP unit's gathers are started and dropped by asking the
    unit). devmesh's own markers on torch modules (``_devmesh_*``) are the exception."""
    writers = []
    for name, path in _modules():
        if not name.startswith("devmesh.parallel"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                for each in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if (isinstance(each, ast.Attribute) and each.attr.startswith("_")
                            and not each.attr.startswith("_devmesh_")
                            and not each.attr.endswith("__")  # __class__: not a field
                            and not (isinstance(each.value, ast.Name)
                                     and each.value.id in ("self", "cls", "new"))):
                        writers.append(f"{name}:{node.lineno} writes .{each.attr}")
    assert not writers, writers


def test_no_test_module_imports_another():
    """What several test modules share lives in the helper modules beside them (tests/*.py
    without the test_ prefix), so each test module can move or run alone."""
    tests = SRC.parents[1] / "tests"
    offenders = []
    for path in tests.rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(tests)} imports {n}" for n in names
                          if n.split(".")[0].startswith("test_")]
    assert not offenders, offenders
