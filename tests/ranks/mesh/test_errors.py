"""Bad input gives devmesh's own exceptions (also torch's types), with rank and fix; no hangs."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch.distributed as dist

from devmesh import DeviceMesh, init_device_mesh
from devmesh.errors import (
    DeviceUnavailableError,
    DevmeshError,
    LaunchEnvironmentError,
    MeshDimNameError,
    MeshMismatchError,
    MeshRankError,
    MeshShapeError,
    MeshTimeoutError,
    WorldSizeMismatchError,
)


def _catch(fn, *args, **kwargs):
    """Return (type name, message, builtin bases) of the error fn raises, or None."""
    try:
        fn(*args, **kwargs)
    except DevmeshError as exc:
        bases = [b.__name__ for b in (KeyError, ValueError, RuntimeError, TimeoutError)
                 if isinstance(exc, b)]
        return type(exc).__name__, str(exc), bases
    return None


def no_launcher():
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        os.environ.pop(name, None)
    error = _catch(init_device_mesh, "cpu", (2, 4))
    single = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    return error, single.get_coordinate(), dist.get_world_size()


def test_without_launcher_error_says_how_to_launch(mesh_pool):
    error, coordinate, world = mesh_pool.run(no_launcher, 1)[0]
    name, message, bases = error
    assert name == "LaunchEnvironmentError" and bases == ["KeyError"]
    assert "RANK" in message and "torchrun --nproc_per_node" in message
    assert "devmesh.launch" in message and "devmesh run" in message
    # a 1-rank mesh needs no launcher at all (torch: KeyError: 'RANK')
    assert coordinate == (0, 0) and world == 1


def wrong_world_size(shape):
    return _catch(init_device_mesh, "cpu", shape), dist.is_initialized()


@pytest.mark.parametrize("shape", [(2, 4), (3,)])
def test_mesh_size_not_world_size(mesh_pool, shape):
    """Refused before any process group is made (every rank reads the same WORLD_SIZE):
    ranks that raised right after connecting closed their sockets while slower peers were
    still connecting, and those got gloo's "Connection closed by peer" instead of this
    error (seen once in a full run of the suite)."""
    results = mesh_pool.run(wrong_world_size, 4, shape)
    assert not any(connected for _, connected in results)
    for rank, ((name, message, bases), _) in enumerate(results):
        assert name == "WorldSizeMismatchError" and bases == ["RuntimeError"]
        assert message.startswith(f"[rank {rank}] ")
        size = 1
        for s in shape:
            size *= s
        assert f"needs {size} ranks but the world has 4" in message
        assert f"--nproc_per_node={size}" in message and "DeviceMesh(device_type, mesh=" in message


def bad_arguments():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    unnamed = init_device_mesh("cpu", (2, 2))
    return {
        "names_count": _catch(init_device_mesh, "cpu", (2, 2), mesh_dim_names=("dp",)),
        "duplicate_names": _catch(init_device_mesh, "cpu", (2, 2), mesh_dim_names=("a", "a")),
        "unknown_name": _catch(lambda: mesh["pp"]),
        "unnamed_slice": _catch(lambda: unnamed["dp"]),
        "zero_size": _catch(init_device_mesh, "cpu", (4, 0)),
        "float_size": _catch(init_device_mesh, "cpu", (2.0, 2)),
        "duplicate_ranks": _catch(DeviceMesh, "cpu", [0, 1, 1]),
        "out_of_range": _catch(DeviceMesh, "cpu", [0, 1, 2, 9]),
        "group_without_dim": _catch(mesh.get_group),
        "cuda": _catch(init_device_mesh, "cuda", (2, 2)),
        "indexed_device": _catch(init_device_mesh, "cpu:0", (2, 2)),
        "overlap": _catch(lambda: mesh["dp", "dp"]),
        "local_rank_without_dim": _catch(mesh.get_local_rank),
        "unknown_group_name": _catch(mesh.get_group, "pp"),
        "from_group_wrong_mesh": _catch(DeviceMesh.from_group, mesh.get_group("tp"), "cpu",
                                        mesh=[7, 8]),
    }


def test_bad_arguments_are_named_with_a_fix(mesh_pool):
    r = mesh_pool.run(bad_arguments, 4)[2]
    expectations = {
        # torch's exception type and its own phrase, inside devmesh's longer message
        "names_count": ("MeshNamesError", "RuntimeError",
                        "mesh_shape and mesh_dim_names should have same length!"),
        "duplicate_names": ("MeshNamesError", "RuntimeError",
                            "Each mesh_dim_name must be unique."),
        "unknown_name": ("MeshDimNameError", "KeyError", "Invalid mesh_dim_names"),
        "unnamed_slice": ("MeshUsageError", "RuntimeError",
                          "Cannot slice a DeviceMesh without mesh_dim_names!"),
        "zero_size": ("MeshShapeError", "ValueError", "positive integer"),
        "float_size": ("MeshShapeError", "ValueError", "positive integer"),
        "duplicate_ranks": ("MeshShapeError", "ValueError", "rank 1 appears more than once"),
        "out_of_range": ("MeshRankError", "ValueError", "contains rank 9 but the world has only 4"),
        "group_without_dim": ("MeshUsageError", "RuntimeError",
                              "Optional kwarg `mesh_dim` needs to be specified"),
        "local_rank_without_dim": ("MeshUsageError", "RuntimeError",
                                   "Optional kwarg `mesh_dim` needs to be specified"),
        "unknown_group_name": ("MeshDimNameError", "KeyError",
                               "Mesh dimension 'pp' does not exist"),
        "from_group_wrong_mesh": ("MeshShapeError", "ValueError", "Invalid mesh [7, 8]"),
        "cuda": ("DeviceUnavailableError", "RuntimeError", "device_type='cpu'"),
        "indexed_device": ("DeviceTypeError", "RuntimeError",
                           "Device type with index is not supported"),
        "overlap": ("MeshNamesError", "KeyError", "repeats 'dp'"),
    }
    for key, (name, base, words) in expectations.items():
        assert r[key] is not None, key
        got_name, message, bases = r[key]
        assert got_name == name, (key, r[key])
        assert base in bases, (key, bases)
        assert words in message, (key, message)
        assert message.startswith("[rank 2] "), (key, message)


def disagreeing_shapes():
    shape = (2, 2) if dist_rank() < 2 else (4,)
    return _catch(init_device_mesh, "cpu", shape, timeout=20)


def disagreeing_names():
    names = ("dp", "tp") if dist_rank() != 3 else ("tp", "dp")
    return _catch(init_device_mesh, "cpu", (2, 2), mesh_dim_names=names, timeout=20)


def dist_rank() -> int:
    return int(os.environ["RANK"])


def test_ranks_passing_different_shapes_all_get_an_error(mesh_pool):
    for rank, (name, message, bases) in enumerate(mesh_pool.run(disagreeing_shapes, 4)):
        assert name == "MeshMismatchError" and "RuntimeError" in bases
        assert "ranks 0-1: device_type='cpu', shape=(2, 2)" in message
        assert "ranks 2-3: device_type='cpu', shape=(4,)" in message


def test_ranks_passing_different_names_all_get_an_error(mesh_pool):
    for name, message, _ in mesh_pool.run(disagreeing_names, 4):
        assert name == "MeshMismatchError"
        assert "ranks 0-2:" in message and "mesh_dim_names=('tp', 'dp')" in message


def one_rank_missing():
    import time

    dist.init_process_group("gloo")  # the world exists ...
    if dist_rank() == 3:
        return None  # ... but rank 3 never creates the mesh
    start = time.monotonic()
    error = _catch(DeviceMesh, "cpu", [0, 1, 2, 3], timeout=3)
    return error, time.monotonic() - start


def test_a_rank_that_never_arrives_is_named_in_bounded_time(mesh_pool):
    results = mesh_pool.run(one_rank_missing, 4, timeout=60)
    for error, elapsed in results[:3]:
        name, message, bases = error
        assert name == "MeshTimeoutError" and "TimeoutError" in bases
        assert "rank(s) 3 did not arrive within 3 s" in message
        assert elapsed < 30


def test_exception_classes_keep_torch_compatible_bases():
    assert issubclass(LaunchEnvironmentError, KeyError)
    assert issubclass(MeshDimNameError, KeyError)
    assert issubclass(WorldSizeMismatchError, RuntimeError)
    assert issubclass(MeshMismatchError, RuntimeError)
    assert issubclass(DeviceUnavailableError, RuntimeError)
    assert issubclass(MeshShapeError, ValueError) and issubclass(MeshRankError, ValueError)
    assert issubclass(MeshTimeoutError, TimeoutError)
    assert str(MeshDimNameError("plain", with_rank=False)) == "plain"


def one_rank_passing_other_arguments():
    """Rank 1 passes its own argument to ``fully_shard``, ``replicate`` or
    ``parallelize_module`` — one devmesh refuses, or one that would gather, cast, bucket or
    split differently. Before, the refusal was raised on rank 1 alone while rank 0 waited in
    the next collective ("never entered it"), and a different mixed precision or bucket size
    aborted the processes in gloo ("Received data size doesn't match expected size"); a
    different plan failed on one rank with a shape error."""
    import torch
    from torch import nn

    from devmesh.parallel import (
        ColwiseParallel,
        MixedPrecisionPolicy,
        fully_shard,
        parallelize_module,
        replicate,
    )
    from devmesh.tensor import Shard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",), timeout=20)
    odd = dist_rank() == 1
    calls = {
        "int reshard": lambda m: fully_shard(m, mesh=mesh,
                                             reshard_after_forward=3 if odd else True),
        "bad split dim": lambda m: fully_shard(
            m, mesh=mesh, shard_placement_fn=(lambda p: Shard(1)) if odd else None),
        "mixed precision": lambda m: fully_shard(m, mesh=mesh, mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if odd else None)),
        "reshard": lambda m: fully_shard(m, mesh=mesh, reshard_after_forward=not odd),
        "bucket": lambda m: replicate(m, mesh=mesh, bucket_cap_mb=1e-6 if odd else 25),
        "DDP option": lambda m: replicate(m, mesh=mesh, device_ids=[0] if odd else None),
        "plan": lambda m: parallelize_module(m, mesh, {"1" if odd else "0": ColwiseParallel()}),
        # the parameters' shapes agree in the plan's one agreement, not one per parameter
        "split shapes": lambda m: parallelize_module(nn.Linear(4, 6 if odd else 4), mesh,
                                                     ColwiseParallel()),
    }
    out = {}
    for case, call in calls.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        out[case] = _catch(lambda: (call(model), model(torch.randn(2, 4)).sum().backward()))
    return out


def test_arguments_one_rank_passes_differently_are_refused_on_every_rank(mesh_pool):
    for rank, out in enumerate(mesh_pool.run(one_rank_passing_other_arguments, 2)):
        for case, words in {
            "int reshard": "If passing reshard_after_forward as an int, it should be a factor "
                           "of 2, not 3",
            "bad split dim": "shard_placement_fn gave Shard(dim=1) for 0.bias",
            "DDP option": "replicate does not take device_ids",
        }.items():
            name, message, _ = out[case]
            assert name == "ParallelizeError" and words in message, (case, out[case])
            if rank == 0:  # the rank that passed good arguments names the one that did not
                assert f"was refused on other ranks — rank 1: {words}" in message, message
        for case, words in {
            "mixed precision": "param_dtype=None",
            "reshard": "reshard_after_forward=True",
            "bucket": "bucket_cap_mb=25",
            "plan": "parallelize_module: every rank must apply the same plan",
            "split shapes": "weight (6, 4) torch.float32",
        }.items():
            name, message, _ = out[case]
            assert name == "MeshMismatchError" and words in message, (case, out[case])
            assert "ranks 0:" in message and "ranks 1:" in message, message


def one_rank_passing_other_arguments_in_a_batch(batched: bool):
    """The ``fully_shard`` cases above, each a model's blocks and root (inside
    ``batched_checks()``, or as written), rank 1's own argument at block 2: the refusal or
    disagreement comes at the end of the block (or at the root's call), on every rank,
    naming the call that differs."""
    import torch
    from torch import nn

    from devmesh.parallel import MixedPrecisionPolicy, batched_checks, fully_shard
    from devmesh.tensor import Shard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",), timeout=20)
    odd = dist_rank() == 1
    odd_kwargs = {
        "int reshard": {"reshard_after_forward": 3 if odd else True},
        "bad split dim": {"shard_placement_fn": (lambda p: Shard(1)) if odd else None},
        "mixed precision": {"mp_policy": MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if odd else None)},
        "reshard": {"reshard_after_forward": not odd},
        "other block": {},
    }
    out = {}
    for case, kwargs in odd_kwargs.items():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4)) for _ in range(4)])
        if case == "other block" and odd:
            model[3] = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))

        def setup(model=model, kwargs=kwargs):
            with batched_checks() if batched else contextlib.nullcontext():
                for i, block in enumerate(model):
                    fully_shard(block, mesh=mesh, **(kwargs if i == 2 else {}))
                fully_shard(model, mesh=mesh)

        out[case] = _catch(setup)
    return out


@pytest.mark.parametrize("batched, refused_on_others", [
    (True, "fully_shard failed on other ranks — rank 1: ParallelizeError: "),
    # as written: the calls' checks are held and agreed at the root's call
    (False, "fully_shard was refused on other ranks — rank 1: "),
])
def test_arguments_one_rank_passes_differently_to_a_models_calls_are_refused_on_every_rank(
        mesh_pool, batched, refused_on_others):
    results = mesh_pool.run(one_rank_passing_other_arguments_in_a_batch, 2, batched)
    for rank, out in enumerate(results):
        for case, words in {
            "int reshard": "If passing reshard_after_forward as an int, it should be a factor "
                           "of 2, not 3",
            "bad split dim": "shard_placement_fn gave Shard(dim=1) for 0.bias",
        }.items():
            name, message, _ = out[case]
            assert name == "ParallelizeError" and words in message, (case, out[case])
            if rank == 0:  # the rank that passed good arguments names the one that did not
                assert refused_on_others + words in message, message
        for case, words in {
            "mixed precision": "param_dtype=None",
            "reshard": "reshard_after_forward=True",
            "other block": "0.weight (6, 4) torch.float32",  # block 3, whose Linear differs
        }.items():
            name, message, _ = out[case]
            assert name == "MeshMismatchError" and words in message, (case, out[case])
            assert "ranks 0:" in message and "ranks 1:" in message, message


def a_refusal_held_back(meshes: int):
    """Rank 1 refused at block 3 of 8; rank 0 shards on, then enters a collective before
    any root call: what each raised. With two meshes (another process group over the same
    ranks), the blocks alternate between them, as a model's experts and dense layers do."""
    import torch
    from torch import nn

    from devmesh.distributed import comm
    from devmesh.parallel import fully_shard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",), timeout=20)
    other = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",), timeout=21)
    assert other.get_group() is not mesh.get_group()
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)])
    refused = dist_rank() == 1

    def setup():
        for i, block in enumerate(model):
            fully_shard(block, mesh=other if meshes == 2 and i % 2 else mesh,
                        reshard_after_forward=3 if refused and i == 3 else True)
        comm.all_reduce(torch.ones(1), mesh, (0,))
    return _catch(setup)


@pytest.mark.parametrize("meshes", [1, 2])
def test_a_refusal_held_back_is_raised_before_the_next_collective(mesh_pool, meshes):
    """Rank 1 is refused at block 3 and leaves; rank 0 goes on sharding and then calls a
    collective rank 1 would never join: the held checks are settled first, and it raises
    naming rank 1's refusal instead of waiting in that collective."""
    on_0, on_1 = mesh_pool.run(a_refusal_held_back, 2, meshes)
    assert on_1[0] == "ParallelizeError" and "not 3" in on_1[1], on_1
    assert on_0[0] == "ParallelizeError" and (
        "fully_shard was refused on other ranks — rank 1:" in on_0[1]), on_0


def communicating_inside_a_batch(what: str):
    """Inside ``batched_checks()``, a collective or a process group made there is refused
    by name on the rank that tries, and the block's end says so on the others — where a
    rank refused earlier in the block would never join it."""
    import torch
    from torch import nn

    from devmesh.distributed import comm
    from devmesh.parallel import batched_checks, fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), timeout=20)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    def setup():
        with batched_checks():
            fully_shard(model[0], mesh=mesh["dp"])
            if what == "collective" and dist_rank() == 1:
                comm.all_reduce(torch.ones(1), mesh["dp"], (0,))
            elif what == "new group":  # a mesh never sliced before: its group is made here
                fully_shard(model[1], mesh=mesh["dp", "tp"]._flatten("dp_tp"))
    return _catch(setup)


@pytest.mark.parametrize("what, says", [
    ("collective", "all_reduce over dp communicates, and the fully_shard calls inside a "
     "batched block must not communicate"),
    ("new group", "making the process group of ranks 0-3 communicates"),
])
def test_communicating_inside_batched_checks_is_refused_by_name(mesh_pool, what, says):
    results = mesh_pool.run(communicating_inside_a_batch, 4, what)
    for rank, (name, message, _) in enumerate(results):
        if what == "new group" or rank == 1:
            assert name == "MeshUsageError" and says in message, (rank, message)
        else:
            assert name == "ParallelizeError" and "fully_shard failed on other ranks" in message
            assert says in message, (rank, message)


def test_every_public_exception_is_importable_from_devmesh_errors():
    """PipelineError lived in devmesh.parallel.pipeline and ScheduleError in the layout: a user
    catching them had to know where each was raised. Every exception and warning class devmesh
    defines is in devmesh.errors."""
    import importlib
    import inspect
    import pkgutil

    import devmesh
    import devmesh.errors as errors

    found = {}
    for info in pkgutil.walk_packages(devmesh.__path__, "devmesh."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, (Exception, Warning))
                    and value.__module__.startswith("devmesh") and not name.startswith("_")):
                found[name] = value
    missing = sorted(n for n, cls in found.items() if getattr(errors, cls.__name__, None) is not cls)
    assert not missing, f"not importable from devmesh.errors: {missing}"
    assert {"PipelineError", "ScheduleError", "CheckpointChecksumError",
            "LaunchCapacityError"} <= set(errors.__all__)
