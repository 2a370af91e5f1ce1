"""A ``fully_shard`` unit's parameter slots as one state with checked transitions
(docs/design/fsdp.md, "A unit's state")."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from devmesh.parallel.fsdp import unit as unit_module
from devmesh.parallel.fsdp.state import TRANSITIONS, FSDPStateError, Slots, check_transition


def test_every_move_outside_the_table_raises_naming_both_states():
    for old in Slots:
        for new in Slots:
            if new in TRANSITIONS[old]:
                check_transition("[Linear]", old, new)
                continue
            with pytest.raises(FSDPStateError, match=f"hold {old.name} and cannot move to "
                                                     f"{new.name}"):
                check_transition("[Linear]", old, new)
    # the one move no sequence of forward, backward, unshard() and reshard() makes
    assert Slots.UNSHARDED not in TRANSITIONS[Slots.FORWARD]


def test_only_place_writes_a_units_slots_outside_recomputation():
    """Every ``swap_parameter`` call in the unit's module sits in ``_place`` (the unit's
    state) or in the per-module swaps of a recomputation inside backward."""
    tree = ast.parse(inspect.getsource(unit_module))
    writers = set()
    for func in ast.walk(tree):
        if isinstance(func, ast.FunctionDef):
            for node in ast.walk(func):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id == "swap_parameter"):
                    writers.add(func.name)
    assert writers == {"_place", "_before_recompute", "_after_recompute"}


def _record_transitions():
    """Train two steps (with ``unshard()`` before the second, and a group of two modules)
    and record every move of each unit's slots."""
    from devmesh import init_device_mesh
    from devmesh.parallel import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 4))
    fully_shard([model[2], model[3]], mesh=mesh)
    fully_shard(model, mesh=mesh)
    moves: list[tuple[str, str, str]] = []
    units = {"group": model[2]._devmesh_fsdp, "root": model._devmesh_fsdp}
    for name, unit in units.items():
        place = unit._place

        def spy(slots, fulls=None, _name=name, _unit=unit, _place=place):
            moves.append((_name, _unit.slots.name, slots.name))
            _place(slots, fulls)

        unit._place = spy
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    for step in range(2):
        if step == 1:
            model[2].unshard()
            assert model[2].weight.shape == (8, 8)  # full, between steps
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    bad, group = None, units["group"]
    group.slots = Slots.FORWARD  # as in the group's forward
    try:  # a forward's gather is never turned into unshard()'s
        type(group)._place(group, Slots.UNSHARDED, [p.sharded for p in group.params])
    except FSDPStateError as e:
        bad = str(e)
    finally:
        group.slots = Slots.SHARDS
    return moves, model[2].weight.shape[0], bad


def test_a_training_step_moves_the_slots_as_the_state_table_says(mesh_pool):
    moves, rows, bad = mesh_pool.run(_record_transitions, 2)[0]
    group = [(old, new) for name, old, new in moves if name == "group"]
    # step 1: gathered by the group's first module, kept for the second, back to shards;
    # step 2: unshard() first, the forward takes its gather without another, then shards
    assert group[:2] == [("SHARDS", "FORWARD"), ("FORWARD", "SHARDS")]
    assert ("SHARDS", "UNSHARDED") in group[2:]
    assert group[group.index(("SHARDS", "UNSHARDED")) + 1] == ("UNSHARDED", "FORWARD")
    assert group[-1] == ("FORWARD", "SHARDS")
    assert rows == 4  # this rank's rows after the step
    assert bad is not None and "[FSDPLinear, FSDPLinear]" in bad and "FORWARD" in bad
