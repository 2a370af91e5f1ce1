"""DeviceMesh on real gloo processes (the shared worker pool): the torch API, groups, slicing,
flattening, group sharing, partial meshes and interop."""

from __future__ import annotations

import datetime
import pickle

import torch
import torch.distributed as dist

from devmesh import DeviceMesh, init_device_mesh
from devmesh.distributed import groups as dm_groups
from helpers import reported, stay_away_until_reported


def _sum_of_ranks(group) -> int:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=group)
    return int(t.item())


def seed_2d_hsdp():
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    replicate = mesh.get_group(mesh_dim="replicate")
    shard = mesh.get_group(mesh_dim="shard")
    return {
        "replicate": dist.get_process_group_ranks(replicate),
        "shard": dist.get_process_group_ranks(shard),
        "sums": (_sum_of_ranks(replicate), _sum_of_ranks(shard)),
        "local": (mesh.get_local_rank("replicate"), mesh.get_local_rank(1)),
        "coordinate": mesh.get_coordinate(),
        "size": (mesh.size(), mesh.size(0), mesh.size("shard"), mesh.ndim, mesh.shape),
        "mesh": mesh.mesh.tolist(),
    }


def test_seed_2d_hsdp_groups(mesh_pool):
    results = mesh_pool.run(seed_2d_hsdp, 8)
    for rank, r in enumerate(results):
        row, col = divmod(rank, 4)
        assert r["shard"] == list(range(4 * row, 4 * row + 4))
        assert r["replicate"] == [col, col + 4]
        assert r["sums"] == (2 * col + 4, sum(range(4 * row, 4 * row + 4)))
        assert r["local"] == (row, col) and r["coordinate"] == (row, col)
        assert r["size"] == (8, 2, 4, 2, (2, 4))
        assert r["mesh"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def seed_004_printing(shape):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=["dp", "tp"])
    return f"Rank: {dist.get_rank()}, {mesh['tp']}"


def test_seed_004_prints_ranks_of_each_submesh(mesh_pool):
    assert mesh_pool.run(seed_004_printing, 6, (2, 3)) == [
        f"Rank: {r}, DeviceMesh({[0, 1, 2] if r < 3 else [3, 4, 5]}, mesh_dim_names=('tp',))"
        for r in range(6)
    ]
    assert mesh_pool.run(seed_004_printing, 6, (3, 2))[5] == (
        "Rank: 5, DeviceMesh([4, 5], mesh_dim_names=('tp',))"
    )


def slicing_3d_shares_groups():
    mesh_3d = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    created_after_init = dm_groups.created_count()
    hsdp_mesh = mesh_3d["replicate", "shard"]
    tp_mesh = mesh_3d["tp"]
    replicate_group = hsdp_mesh["replicate"].get_group()
    shard_group = hsdp_mesh["shard"].get_group()
    tp_group = tp_mesh.get_group()
    same_objects = (
        replicate_group is mesh_3d.get_group("replicate")
        and shard_group is mesh_3d.get_group("shard")
        and tp_group is mesh_3d.get_group("tp")
    )
    reversed_mesh = mesh_3d["tp", "replicate"]
    for _ in range(5):
        mesh_3d["shard", "tp"]["tp"].get_group()
    return {
        "created_after_init": created_after_init,
        "created_after_slicing": dm_groups.created_count(),
        "same_objects": same_objects,
        "hsdp": hsdp_mesh.mesh.tolist(),
        "tp": tp_mesh.mesh.tolist(),
        "reversed": reversed_mesh.mesh.tolist(),
        "reversed_names": reversed_mesh.mesh_dim_names,
        "sums": [_sum_of_ranks(g) for g in (replicate_group, shard_group, tp_group)],
    }


def test_3d_slicing_creates_no_group(mesh_pool):
    results = mesh_pool.run(slicing_3d_shares_groups, 8)
    for rank, r in enumerate(results):
        a, b, c = rank // 4, (rank // 2) % 2, rank % 2
        assert r["created_after_init"] == 3  # one group per dim, none for slicing
        assert r["created_after_slicing"] == 3
        assert r["same_objects"]
        assert r["hsdp"] == [[c, 2 + c], [4 + c, 6 + c]]
        assert r["tp"] == [rank - c, rank - c + 1]
        assert r["reversed"] == [[b * 2, 4 + b * 2], [b * 2 + 1, 5 + b * 2]]
        assert r["reversed_names"] == ("tp", "replicate")
        assert r["sums"] == [2 * rank - 4 * a + 4 if a == 0 else 2 * rank - 4,
                             sum({rank - 2 * b, rank - 2 * b + 2}),
                             2 * (rank - c) + 1]


def flatten_and_unflatten():
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    before = dm_groups.created_count()
    dp_cp = mesh["dp", "cp"]._flatten()
    after_flatten = dm_groups.created_count()
    again = mesh["dp_cp"]
    mixed = mesh["dp_cp", "tp"]
    after_slicing = dm_groups.created_count()
    world = DeviceMesh("cpu", list(range(8)), mesh_dim_names=("world",))
    un = world._unflatten(0, (2, 2, 2), ("a", "b", "c"))
    return {
        "flat": dp_cp.mesh.tolist(),
        "flat_names": dp_cp.mesh_dim_names,
        "again_equal": again == dp_cp,
        "same_group": again.get_group() is dp_cp.get_group(),
        "mixed": mixed.mesh.tolist(),
        "mixed_groups": [dist.get_process_group_ranks(g) for g in mixed.get_all_groups()],
        "counts": (before, after_flatten, after_slicing),
        "flat_sum": _sum_of_ranks(dp_cp.get_group()),
        "un": un.mesh.tolist(),
        "un_groups": [dist.get_process_group_ranks(un.get_group(n)) for n in ("a", "b", "c")],
        "public_alias": mesh["cp", "tp"].flatten("cp_tp").mesh.tolist(),
        # torch: the root answers get_group / get_local_rank for a flattened name
        "group_by_flat_name": mesh.get_group("dp_cp") is dp_cp.get_group(),
        "local_by_flat_name": mesh.get_local_rank("dp_cp"),
        "torch_get_group": torch_mesh_get_group(mesh, "dp_cp") is dp_cp.get_group(),
    }


def torch_mesh_get_group(mesh, name):
    """torch's own DeviceMesh.get_group, run on the devmesh mesh (it is a torch mesh)."""
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

    return TorchDeviceMesh.get_group(mesh, name)


def test_flatten_unflatten(mesh_pool):
    results = mesh_pool.run(flatten_and_unflatten, 8)
    for rank, r in enumerate(results):
        c = rank % 2
        assert r["flat"] == [c, 2 + c, 4 + c, 6 + c] and r["flat_names"] == ("dp_cp",)
        assert r["again_equal"] and r["same_group"]
        assert r["mixed"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert r["mixed_groups"][0] == [c, 2 + c, 4 + c, 6 + c]
        assert r["counts"] == (3, 4, 4)
        assert r["flat_sum"] == 4 * c + 12
        assert r["un"] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
        a, b = rank // 4, (rank // 2) % 2
        assert r["un_groups"] == [[rank - 4 * a, rank - 4 * a + 4],
                                  [rank - 2 * b, rank - 2 * b + 2], [rank - c, rank - c + 1]]
        cp_tp_start = 4 * (rank // 4)
        assert r["public_alias"] == list(range(cp_tp_start, cp_tp_start + 4))
        assert r["group_by_flat_name"] and r["torch_get_group"]
        assert r["local_by_flat_name"] == rank // 2


def partial_world_mesh():
    mesh = DeviceMesh("cpu", [[3, 1]], mesh_dim_names=("a", "b"))
    out = {"coordinate": mesh.get_coordinate(), "repr": repr(mesh)}
    if mesh.get_coordinate() is not None:
        out["sum"] = _sum_of_ranks(mesh.get_group("b"))
        out["local"] = mesh.get_local_rank("b")
    else:
        try:
            mesh.get_group("b")
        except Exception as exc:  # noqa: BLE001
            out["error"] = (type(exc).__name__, str(exc), isinstance(exc, ValueError))
    return out


def test_partial_world_mesh(mesh_pool):
    results = mesh_pool.run(partial_world_mesh, 4)
    assert results[3]["coordinate"] == (0, 0) and results[1]["coordinate"] == (0, 1)
    assert results[3]["sum"] == results[1]["sum"] == 4
    assert results[3]["local"] == 0 and results[1]["local"] == 1  # mesh order, not sorted
    for rank in (0, 2):
        assert results[rank]["coordinate"] is None
        name, message, is_value_error = results[rank]["error"]
        assert name == "MeshRankError" and is_value_error
        assert f"rank {rank} is not part of" in message
    assert results[0]["repr"] == "DeviceMesh([[3, 1]], mesh_dim_names=('a', 'b'))"


def interop_with_torch():
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch_mesh = mesh.to_torch()
    same_groups = all(
        torch_mesh.get_group(d) is mesh.get_group(d) for d in ("dp", "tp")
    )
    tensor = torch.arange(16.0).reshape(4, 4)
    dt = distribute_tensor(tensor, torch_mesh["tp"], [Shard(0)])
    full_ok = torch.equal(dt.full_tensor(), tensor)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    fully_shard(model, mesh=mesh["tp"].to_torch())
    loss = model(torch.ones(3, 4)).sum()
    loss.backward()
    back = DeviceMesh.from_torch(torch_mesh)
    before = dm_groups.created_count()
    from_group = DeviceMesh.from_group(mesh.get_group("tp"), "cpu", mesh_dim_names=("tp",))
    return {
        "same_groups": same_groups,
        "full_ok": full_ok,
        "grad_shape": tuple(model[0].weight.grad.to_local().shape),
        "back_equal": back == mesh,
        "back_same_group": back.get_group("tp") is mesh.get_group("tp"),
        "from_group": from_group.mesh.tolist(),
        "no_new_groups": dm_groups.created_count() == before,
    }


def test_interop_with_torch_fully_shard_and_dtensor(mesh_pool):
    for rank, r in enumerate(mesh_pool.run(interop_with_torch, 4)):
        assert r["same_groups"] and r["full_ok"] and r["back_equal"] and r["back_same_group"]
        assert r["grad_shape"] == (2, 4)
        assert r["from_group"] == [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert r["no_new_groups"]


def compare_with_torch(shapes):
    """Every group, slice and flatten of devmesh against torch's DeviceMesh, same world."""
    import itertools

    from torch.distributed.device_mesh import init_device_mesh as torch_init

    mismatches = []
    for shape in shapes:
        names = tuple(f"n{i}" for i in range(len(shape)))
        ours = init_device_mesh("cpu", shape, mesh_dim_names=names)
        theirs = torch_init("cpu", shape, mesh_dim_names=names)
        if ours.mesh.tolist() != theirs.mesh.tolist():
            mismatches.append((shape, "mesh"))
        for d in range(len(shape)):
            a = dist.get_process_group_ranks(ours.get_group(d))
            b = dist.get_process_group_ranks(theirs.get_group(d))
            if a != b or ours.get_local_rank(d) != theirs.get_local_rank(d):
                mismatches.append((shape, "group", d, a, b))
        for k in range(1, len(shape) + 1):
            for combo in itertools.combinations(names, k):
                if combo == names:
                    continue
                a, b = ours[combo], theirs[combo]
                if a.mesh.tolist() != b.mesh.tolist() or a.get_coordinate() != tuple(
                    b.get_coordinate()
                ):
                    mismatches.append((shape, "slice", combo))
                if k > 1:
                    fa, fb = a._flatten(), b._flatten()
                    ga = dist.get_process_group_ranks(fa.get_group())
                    gb = dist.get_process_group_ranks(fb.get_group())
                    if fa.mesh.tolist() != fb.mesh.tolist() or ga != gb:
                        mismatches.append((shape, "flatten", combo))
    return mismatches


def test_same_rank_lists_as_torch_for_a_sweep_of_shapes(mesh_pool):
    import warnings

    warnings.filterwarnings("ignore")
    sweep = {
        8: [(8,), (2, 4), (4, 2), (1, 8), (2, 2, 2), (2, 1, 4), (2, 2, 1, 2)],
        6: [(6,), (2, 3), (3, 2), (3, 1, 2)],
        4: [(4,), (2, 2), (1, 2, 2)],
        2: [(2,), (1, 2), (2, 1)],
        1: [(1,), (1, 1)],
    }
    for world, shapes in sweep.items():
        assert mesh_pool.run(compare_with_torch, world, shapes) == [[]] * world


def eq_hash_and_timeout():
    import datetime

    a = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    b = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("x", "y"), timeout=30)
    return {
        "eq": a == b and hash(a) == hash(b),
        "neq": a != DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("x", "y")),
        "timeout": b.timeout == datetime.timedelta(seconds=30),
        "distinct_group_for_timeout": b.get_group("y") is not a.get_group("y"),
    }


def test_equality_hash_and_timeout_groups(mesh_pool):
    for r in mesh_pool.run(eq_hash_and_timeout, 4):
        assert all(r.values()), r


def collective_timeout(folder: str):
    import time

    mesh = init_device_mesh("cpu", (2,), timeout=2)
    if dist.get_rank() == 1:  # never joins the all_reduce
        stay_away_until_reported(folder, (0,))
        return None
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=mesh.get_group())
    except RuntimeError as exc:
        return ("raised", time.monotonic() - start, str(exc)[:200])
    finally:
        reported(folder, 0)
    return ("returned", time.monotonic() - start, "")


def test_mesh_timeout_bounds_collectives(mesh_pool, tmp_path):
    outcome, elapsed, message = mesh_pool.run(collective_timeout, 2, str(tmp_path), timeout=60)[0]
    assert outcome == "raised", message
    assert elapsed < 7.5, elapsed  # bounded by the 2 s mesh timeout, not gloo's 30 min default


def coordinates_of_other_ranks():
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
    flat = mesh["a", "b"]._flatten("ab")
    out = {}
    for name, sub in (("ac", mesh["a", "c"]), ("ca", mesh["c", "a"]), ("ab", flat)):
        out[name] = [sub.coordinate_of(r) for r in range(8)]
    out["root"] = [mesh.coordinate_of(r) for r in range(8)]
    out["missing"] = mesh.coordinate_of(42)
    return out


def test_coordinate_of_other_ranks_in_their_own_submesh(mesh_pool):
    out = mesh_pool.run(coordinates_of_other_ranks, 8)[0]
    # rank r = 4a + 2b + c; in its own ("a", "c") slice it sits at (a, c)
    assert out["ac"] == [(r // 4, r % 2) for r in range(8)]
    assert out["ca"] == [(r % 2, r // 4) for r in range(8)]
    assert out["ab"] == [(r // 2,) for r in range(8)]
    assert out["root"] == [(r // 4, (r // 2) % 2, r % 2) for r in range(8)]
    assert out["missing"] is None


def return_a_mesh():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return mesh["tp"]


def test_a_mesh_can_be_returned_from_launch_for_inspection(mesh_pool):
    import pytest

    from devmesh.errors import MeshUsageError

    meshes = mesh_pool.run(return_a_mesh, 4)
    assert [repr(m) for m in meshes] == [
        "DeviceMesh([0, 1], mesh_dim_names=('tp',))", "DeviceMesh([0, 1], mesh_dim_names=('tp',))",
        "DeviceMesh([2, 3], mesh_dim_names=('tp',))", "DeviceMesh([2, 3], mesh_dim_names=('tp',))"]
    assert meshes[3].get_coordinate() == (1,) and meshes[3].layout.groups("tp") == [(2, 3)]
    with pytest.raises(MeshUsageError, match="unpickled"):
        meshes[0].get_group()


def backend_override_like_torch():
    """torch's ``backend_override`` on the same (2, 2) mesh: devmesh's dims use their own
    backend's groups (collectives included) with the same ranks as torch's."""
    from torch.distributed.device_mesh import init_device_mesh as torch_init

    from devmesh.distributed import comm
    from devmesh.errors import MeshDimNameError, MeshShapeError

    override = {"tp": "gloo", 0: (None, None)}
    ours = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), backend_override=override)
    theirs = torch_init("cpu", (2, 2), mesh_dim_names=("dp", "tp"), backend_override=override)
    same = all(dist.get_process_group_ranks(ours.get_group(d))
               == dist.get_process_group_ranks(theirs.get_group(d)) for d in ("dp", "tp"))
    default_tp = dm_groups.get_group(ours.layout.group_of(dist.get_rank(), (1,)),
                                     timeout=ours.timeout)
    t = torch.tensor([float(dist.get_rank())])
    comm.all_reduce(t, ours, (1,), "sum")
    errors = []
    for bad in ({"ep": "gloo"}, {"tp": 3}, {"tp": "nosuch"}, {"tp": "gloo", 1: "gloo"}):
        try:
            init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), backend_override=bad)
        except (MeshDimNameError, MeshShapeError) as exc:
            errors.append((str(exc), isinstance(exc, RuntimeError)))
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=77)
    with_options = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"),
                                    backend_override={"tp": ("gloo", options)})
    t2 = torch.tensor([float(dist.get_rank())])
    comm.all_reduce(t2, with_options, (1,), "sum")
    return {"same": same, "backends": (ours.backend_of("dp"), ours.backend_of("tp"),
                                       ours["tp"].backend_of(0)),
            "own_group": ours.get_group("tp") is not default_tp
            and ours["tp"].get_group() is ours.get_group("tp"),
            "sum": t.item(), "errors": errors,
            "options": (with_options.get_group("tp") is not ours.get_group("tp"),
                        with_options.has_own_group("tp"), not with_options.has_own_group("dp"),
                        t2.item()),
            # returned from a launch, a mesh is pickled: torch cannot pickle the options
            "pickled": repr(pickle.loads(pickle.dumps(with_options))) == repr(with_options)}


def test_backend_override_as_torch(mesh_pool):
    for rank, r in enumerate(mesh_pool.run(backend_override_like_torch, 4)):
        assert r["same"] and r["backends"] == (None, "gloo", "gloo") and r["own_group"]
        assert r["sum"] == (1.0 if rank < 2 else 5.0)
        messages = [m for m, _ in r["errors"]]
        assert len(messages) == 4, messages
        # torch's phrases (RuntimeError) for keys naming no dim or one dim twice
        assert "Found invalid keys in backend_override: got ['ep']" in messages[0]
        assert "give a backend name ('gloo'), its options" in messages[1]
        assert "not a backend this torch build has" in messages[2]
        assert "Found redundant dim index 1 and name tp in backend_override" in messages[3]
        assert [runtime for _, runtime in r["errors"]] == [True, False, False, True]
        # (name, options): a group of its own, collectives on it
        assert r["options"] == (True, True, True, 1.0 if rank < 2 else 5.0)
        assert r["pickled"]


def _mesh_under_meta_device():
    with torch.device("meta"):  # where large models are built; torch's mesh works here too
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        device, ranks = mesh.mesh.device.type, mesh.mesh.tolist()
    return device, ranks, _sum_of_ranks(mesh.get_group("tp"))


def test_a_mesh_is_made_inside_a_meta_device_context(mesh_pool):
    for rank, (device, ranks, tp_sum) in enumerate(mesh_pool.run(_mesh_under_meta_device, 4)):
        assert device == "cpu" and ranks == [[0, 1], [2, 3]]
        assert tp_sum == (1 if rank < 2 else 5)
