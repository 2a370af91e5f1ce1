"""devmesh's DeviceMesh against torch's on the same world, call by call: the corners torch
2.13's own DeviceMesh tests exercise (backend overrides and their options, flattening into
a taken name, ``_concatenate``, ``from_group`` with a mesh that does not fit, a mesh built
without process groups). Each case runs with both libraries in the same task, and their
outcomes must agree: the same values, or an exception of (a subclass of) torch's type whose
message keeps torch's phrase. Differences devmesh makes on purpose (slicing in any order,
a mesh smaller than the world refused by ``init_device_mesh``) are in docs/reference/differences.md and not
repeated here."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from devmesh.distributed import env


def _libraries():
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh
    from torch.distributed.device_mesh import init_device_mesh as torch_init

    from devmesh import DeviceMesh, init_device_mesh

    return {"torch": (TorchMesh, torch_init), "devmesh": (DeviceMesh, init_device_mesh)}


def _outcome(call):
    """What a call did, in a form both libraries can be compared by."""
    try:
        return ("returned", call())
    except Exception as error:  # noqa: BLE001 - the comparison is the test
        builtins = [t.__name__ for t in (RuntimeError, ValueError, KeyError) if isinstance(error, t)]
        return ("raised", builtins, str(error))


def _groups_of(mesh, dims):
    return [dist.get_process_group_ranks(mesh.get_group(d)) for d in dims]


# -- the cases: each takes (DeviceMesh, init_device_mesh) and returns plain data ----------
def _override_same_dim_twice(DeviceMesh, init):
    return init("cpu", (2, 4), mesh_dim_names=("dp", "tp"), backend_override={"dp": "gloo", 0: "gloo"})


def _override_unknown_name(DeviceMesh, init):
    return init("cpu", (2, 4), mesh_dim_names=("dp", "tp"), backend_override={"cp": "gloo"})


def _override_index_out_of_range(DeviceMesh, init):
    return init("cpu", (2, 4), mesh_dim_names=("dp", "tp"), backend_override={42: "gloo"})


def _override_with_options(DeviceMesh, init):
    """A backend by index, another by name with options, a flattened view with options."""
    from torch.testing._internal.distributed.fake_pg import FakeProcessGroup

    options = FakeProcessGroup.Options()
    options.fake_option = 7
    mesh = init("cpu", (2, 2, 2), mesh_dim_names=("dp", "tp", "cp"),
                backend_override={0: "fake", "cp": ("fake", options)})
    flat = mesh["dp", "tp"]._flatten("dp_tp", backend_override=("fake", options))
    own = mesh["tp", "cp"]._flatten("tp_cp")
    return {
        "backends": [mesh.get_group(d)._get_backend_name() for d in range(3)],
        "cp option": mesh.get_group(2)._get_backend(torch.device("cpu")).options.fake_option,
        "flattened": (flat.get_group()._get_backend_name(),
                      flat.get_group()._get_backend(torch.device("cpu")).options.fake_option),
        "default flattened": own.get_group()._get_backend_name(),
        "sliced": mesh["cp"].get_group()._get_backend_name(),
        "tp groups": _groups_of(mesh, [1]),
    }


def _unflatten_with_a_fake_dim(DeviceMesh, init):
    """torchtitan gives a disabled (size-1) dim torch's ``fake`` backend when it unflattens."""
    world = init("cpu", (8,), mesh_dim_names=("world",))
    mesh = world._unflatten(0, (1, 2, 4), ("pp", "dp", "tp"), backend_override={"pp": "fake"})
    t = torch.ones(1) * dist.get_rank()
    dist.all_reduce(t, group=mesh.get_group("tp"))
    return {
        "names": list(mesh.mesh_dim_names),
        "backends": [mesh.get_group(d)._get_backend_name() for d in range(3)],
        "groups": _groups_of(mesh, [1, 2]),
        "tp sum": t.item(),
    }


def _flatten_into_a_dim_name(DeviceMesh, init):
    mesh = init("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    return mesh["cp", "tp"]._flatten("dp")


def _flatten_into_a_taken_flattened_name(DeviceMesh, init):
    mesh = init("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    mesh["dp", "tp"]._flatten()
    return mesh["cp", "tp"]._flatten("dp_tp")


def _flatten_again(DeviceMesh, init):
    mesh = init("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    first = mesh["dp", "cp"]._flatten()
    count = dist.distributed_c10d._world.group_count
    second = mesh["dp", "cp"]._flatten()
    return {"equal": first == second, "new groups": dist.distributed_c10d._world.group_count - count,
            "ranks": first.mesh.tolist(), "name": first.mesh_dim_names,
            "by name": mesh["dp_cp", "tp"].mesh.tolist()}


def _concatenate(DeviceMesh, init):
    mesh = init("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    joined = DeviceMesh._concatenate([mesh["dp"], mesh["tp"]])
    whole = DeviceMesh._concatenate([mesh["pp", "dp"], mesh["tp"]])
    return {
        "ranks": joined.mesh.tolist(), "names": joined.mesh_dim_names,
        "same groups": joined.get_group("dp") == mesh["dp", "tp"].get_group("dp")
        and joined.get_group("tp") == mesh.get_group("tp"),
        "is the sliced mesh": joined == mesh["dp", "tp"],
        "is the whole mesh": whole == mesh,
    }


def _concatenate_overlapping(DeviceMesh, init):
    mesh = init("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    return DeviceMesh._concatenate([mesh["dp", "tp"], mesh["tp"]])


def _from_group_2d_mesh_for_one_group(DeviceMesh, init):
    world = dist.distributed_c10d._get_default_group()
    return DeviceMesh.from_group(world, "cpu", [[0, 1], [2, 3]], mesh_dim_names=("a", "b"))


def _from_groups_1d_mesh_for_two_groups(DeviceMesh, init):
    mesh = init("cpu", (2, 2))
    return DeviceMesh.from_group(mesh.get_all_groups(), "cpu", (0, 1, 2, 3),
                                 mesh_dim_names=("a", "b"))


def _from_group_of_a_3d_mesh(DeviceMesh, init):
    """The HSDP mesh of a (replicate, shard, tp) mesh rebuilt from its groups."""
    mesh = init("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    hsdp = DeviceMesh.from_group(
        [mesh["replicate"].get_group(), mesh["shard"].get_group()], "cpu",
        mesh=mesh.mesh[:, :, mesh.get_local_rank("tp")], mesh_dim_names=("replicate", "shard"))
    return {"ranks": hsdp.mesh.tolist(), "groups": _groups_of(hsdp, [0, 1]),
            "replicate": hsdp["replicate"].mesh.tolist(),
            "coordinate": list(hsdp.get_coordinate())}


def _without_process_groups(DeviceMesh, init):
    """torch's ``_init_backend=False, _rank=``: coordinates without groups."""
    mesh = DeviceMesh("cpu", torch.arange(10).reshape(2, 5), _init_backend=False, _rank=7)
    groups = _outcome(mesh.get_group)
    return {"coordinate": list(mesh.get_coordinate()), "groups": groups[:2]}


CASES_4 = {
    "from_group_2d_mesh_for_one_group": (_from_group_2d_mesh_for_one_group,
                                         r"Invalid mesh \[\[0, 1\], \[2, 3\]\] for ProcessGroup with ranks \[0, 1, 2, 3\]"),
    "from_groups_1d_mesh_for_two_groups": (_from_groups_1d_mesh_for_two_groups,
                                           r"Expects mesh with ndim equal to number of ProcessGroups but got mesh \[0, 1, 2, 3\] and 2 ProcessGroups"),
    "from_group_of_a_3d_mesh": (_from_group_of_a_3d_mesh, None),
    "without_process_groups": (_without_process_groups, None),
}
CASES_8 = {
    "override_same_dim_twice": (_override_same_dim_twice,
                                "Found redundant dim index 0 and name dp in backend_override"),
    "override_unknown_name": (_override_unknown_name,
                              r"Found invalid keys in backend_override: got \['cp'\]"),
    "override_index_out_of_range": (_override_index_out_of_range,
                                    r"Found invalid keys in backend_override: got \[42\]"),
    "override_with_options": (_override_with_options, None),
    "unflatten_with_a_fake_dim": (_unflatten_with_a_fake_dim, None),
    "flatten_into_a_dim_name": (_flatten_into_a_dim_name,
                                "dp already exists for submesh of the DeviceMesh"),
    "flatten_into_a_taken_flattened_name": (_flatten_into_a_taken_flattened_name,
                                            "Flatten mesh with mesh_dim_name dp_tp has been created before"),
    "flatten_again": (_flatten_again, None),
    "concatenate": (_concatenate, None),
    "concatenate_overlapping": (_concatenate_overlapping, "Cannot concatenate overlapping meshes"),
}


def both_libraries(case_name: str):
    case = {**CASES_4, **CASES_8}[case_name][0]
    env.ensure_default_group("cpu")  # torch's from_group needs the world up
    return {name: _outcome(lambda api=api: case(*api)) for name, api in _libraries().items()}


@pytest.mark.parametrize("world_size,case_name",
                         [(4, n) for n in CASES_4] + [(8, n) for n in CASES_8])
def test_devmesh_does_what_torch_does(mesh_pool, world_size, case_name):
    phrase = (CASES_4 if world_size == 4 else CASES_8)[case_name][1]
    for rank, result in enumerate(mesh_pool.run(both_libraries, world_size, case_name)):
        torch_did, devmesh_did = result["torch"], result["devmesh"]
        if phrase is None:  # a case that works: the same values
            assert torch_did[0] == "returned", (rank, torch_did)
            assert devmesh_did == torch_did, (rank, devmesh_did, torch_did)
        else:  # a mistake: torch's exception type and phrase, in devmesh's longer message
            assert torch_did[0] == "raised" and re.search(phrase, torch_did[2]), (rank, torch_did)
            assert devmesh_did[0] == "raised", (rank, devmesh_did)
            assert set(torch_did[1]) <= set(devmesh_did[1]), (rank, devmesh_did, torch_did)
            assert re.search(phrase, devmesh_did[2]), (rank, devmesh_did[2])
            assert devmesh_did[2].startswith(f"[rank {rank}] "), devmesh_did[2]


_FAKE_WORLD = r"""
import json, sys
import torch, torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

library, rank = sys.argv[1], int(sys.argv[2])
if library == "torch":
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
else:
    from devmesh import init_device_mesh
    from devmesh.parallel import (ColwiseParallel, RowwiseParallel, fully_shard,
                                  parallelize_module)
dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=16)
mesh = init_device_mesh("cpu", (2, 2, 4), mesh_dim_names=("pp", "dp", "tp"))
flat = mesh["pp", "dp"]._flatten()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
fully_shard(model, mesh=mesh["dp"])
local = {k: list(getattr(p, "_local_tensor", p).shape) for k, p in model.named_parameters()}
model(torch.randn(4, 8)).sum().backward()
print(json.dumps({"coordinate": list(mesh.get_coordinate()), "tp": mesh["tp"].mesh.tolist(),
                  "flat": flat.mesh.tolist(), "local": local,
                  "grads": all(p.grad is not None for p in model.parameters())}))
"""


def test_a_fake_world_plans_as_torchs():
    """torchtitan's dry run: one process in torch's ``fake`` world of 16 ranks builds the
    (pp, dp, tp) mesh and shards the model as rank 13 would, with nothing launched.
    devmesh's mesh and shards there are torch's (each library in its own process)."""
    import json
    import subprocess
    import sys

    rank = 13

    seen = {}
    for library in ("torch", "devmesh"):
        done = subprocess.run([sys.executable, "-c", _FAKE_WORLD, library, str(rank)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        seen[library] = json.loads(done.stdout.splitlines()[-1])
    assert seen["devmesh"] == seen["torch"]
    assert seen["devmesh"]["coordinate"] == [rank // 8, rank // 4 % 2, rank % 4]
    assert seen["devmesh"]["grads"]


_FAKE_CUDA_WORLD = r"""
import json, sys
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

library = sys.argv[1]
if library == "torch":
    from torch.distributed.device_mesh import init_device_mesh
else:
    from devmesh import init_device_mesh
dist.init_process_group("fake", store=FakeStore(), rank=13, world_size=16)
mesh = init_device_mesh("cuda", (2, 2, 4), mesh_dim_names=("pp", "dp", "tp"))
flat = mesh["dp", "tp"]._flatten()
print(json.dumps({"device": mesh.device_type, "coordinate": list(mesh.get_coordinate()),
                  "tp": mesh["tp"].mesh.tolist(), "flat": flat.mesh.tolist(),
                  "group": dist.get_process_group_ranks(mesh["dp"].get_group())}))
"""


def test_a_fake_world_takes_a_cuda_mesh_on_a_machine_without_a_gpu():
    """Large jobs are dry-run on a laptop as torch's ``fake`` world with the job's own
    ``init_device_mesh("cuda", ...)``: torch takes it without a GPU, and so does devmesh."""
    import json
    import subprocess
    import sys

    seen = {}
    for library in ("torch", "devmesh"):
        done = subprocess.run([sys.executable, "-c", _FAKE_CUDA_WORLD, library],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        seen[library] = json.loads(done.stdout.splitlines()[-1])
    assert seen["devmesh"] == seen["torch"]
    assert seen["devmesh"]["device"] == "cuda" and seen["devmesh"]["group"] == [9, 13]
