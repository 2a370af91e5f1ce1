"""The one module that names torch's private parts.

devmesh's ``DeviceMesh`` is a subclass of torch's and fills in torch's own bookkeeping, so that
torch's FSDP2, DTensor and functional collectives take it; a few runtime paths need hooks torch
offers only privately (the default store, autograd's graph-task id and end-of-backward
callback, the saved-tensor hooks in force). torch changes such names between releases, so they
are named here and nowhere else in ``src/`` (a test scans for it), and each is checked against
the running torch once: the names every devmesh process uses when this module is imported, the
heavier subsystems' (pipelining, torch's composable DDP, DTensor's strided shard) on first use.
A torch that lacks one raises :class:`TorchVersionError` naming the torch release, the missing
name and the releases devmesh supports — not an ``AttributeError`` inside a training step.

See docs/reference/torch-versions.md for the releases and what each needed.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import types
from collections.abc import Iterator
from typing import Any, Callable, ParamSpec, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed import device_mesh as _device_mesh

from devmesh.errors import TorchVersionError

__all__ = [
    "SUPPORTED_TORCH", "TorchVersionError", "TORCH_MESH_ATTRIBUTES", "default_store",
    "default_group", "resolve_group", "functional_collectives", "BackendOptions",
    "fill_torch_mesh_state", "register_dim_groups", "register_flattened",
    "torch_mesh_state_for_pickle", "restore_torch_mesh_state", "torch_concatenate",
    "current_torch_mesh", "innermost_torch_mesh", "unwrap_fake_script_object",
    "current_graph_task_id", "queue_callback", "saved_tensors_hooks_in_force",
    "grad_scaler_flags", "grad_scaler_device",
    "disable_current_modes", "is_traceable_wrapper_subclass", "TorchDispatchMode", "pytree", "CFuture",
    "FakeTensor",
    "clear_dtensor_caches", "eager", "import_dynamo", "IncompatibleKeys", "strided_shard_type",
    "pipeline_stage_types", "cpu_flash_attention", "cpu_flash_attention_backward",
    "modify_graph_op_device", "compiled_module_inner", "composable_replicate_state",
    "has_composable_replicate", "storage_key", "fake_store", "stage_forward_contexts", "TORCH_RELEASE", "FSDP_REDUCES_IN_PARAM_DTYPE",
]

SUPPORTED_TORCH = ">=2.13,<2.16"  # pyproject.toml's requirement (checked by a test)

# -- public behaviour that changed between releases ---------------------------------------------
TORCH_RELEASE: tuple[int, int] = tuple(int(n) for n in torch.__version__.split(".")[:2])
# FSDP2 with ``param_dtype`` set and no ``reduce_dtype``: up to 2.14 it reduces gradients in
# ``param_dtype``; from 2.15 in the parameters' own dtype (the unsharded gradient is upcast to
# it, its ``grad_dtype``). devmesh follows the running torch, so results equal torch's.
FSDP_REDUCES_IN_PARAM_DTYPE: bool = TORCH_RELEASE < (2, 15)


def _missing(where: str, what: str) -> TorchVersionError:
    return TorchVersionError(
        f"devmesh needs torch's {where} ({what}), which torch {torch.__version__} does not "
        f"have: devmesh supports torch{SUPPORTED_TORCH}; install one of those releases "
        f"(pip install 'torch{SUPPORTED_TORCH}') or a devmesh release made for torch "
        f"{torch.__version__}", with_rank=False)


def _require(owner: object, name: str, where: str, *, params: tuple[str, ...] = ()) -> Any:
    """``owner.name``, checked: present, and (for a Python function) taking ``params``."""
    value = getattr(owner, name, None)
    if value is None:
        raise _missing(f"{where}.{name}", "missing")
    if params:
        try:
            signature = inspect.signature(value)
        except (TypeError, ValueError):  # a C++ builtin: no signature to compare
            return value
        lacking = [p for p in params if p not in signature.parameters]
        if lacking:
            raise _missing(f"{where}.{name}", f"its parameters {lacking} are gone")
    return value


def _import(name: str) -> types.ModuleType:
    try:
        __import__(name)
    except ImportError as exc:
        raise _missing(name, f"cannot import it: {exc}") from exc
    return sys.modules[name]


# -- c10d: the default store and group, group names --------------------------------------------
_get_default_store = _require(c10d, "_get_default_store", "torch.distributed.distributed_c10d")
_get_default_group = _require(c10d, "_get_default_group", "torch.distributed.distributed_c10d")
_resolve_process_group = _require(c10d, "_resolve_process_group",
                                  "torch.distributed.distributed_c10d")
BackendOptions: type = _require(
    _require(torch._C._distributed_c10d, "Backend", "torch._C._distributed_c10d"),
    "Options", "torch._C._distributed_c10d.Backend")


def default_store() -> dist.Store:
    """The store of the default process group (the rendezvous's): where devmesh's agreement
    checks, host records and failure notices meet."""
    return _get_default_store()


def default_group() -> dist.ProcessGroup:
    """The default (world) process group."""
    return _get_default_group()


def functional_collectives() -> types.ModuleType:
    """torch's functional collectives module (``torch.distributed._functional_collectives``),
    whose calls devmesh's collective trace wraps."""
    return _import("torch.distributed._functional_collectives")


def resolve_group(group: object) -> dist.ProcessGroup:
    """The process group torch's functional collectives mean by ``group`` (a mesh, a
    ``(mesh, dim)`` pair or a group name)."""
    funcol = functional_collectives()
    name = _require(funcol, "_resolve_group_name", "torch.distributed._functional_collectives")
    return _resolve_process_group(name(group))


# -- DeviceMesh: torch's bookkeeping a devmesh mesh fills in ------------------------------------
_mesh_layout = _import("torch.distributed._mesh_layout")
_MeshLayout = _require(_mesh_layout, "_MeshLayout", "torch.distributed._mesh_layout",
                       params=("axes",))
_FlatLayout = _require(_mesh_layout, "_FlatLayout", "torch.distributed._mesh_layout",
                       params=("shape", "stride"))
_mesh_resources = _require(_device_mesh, "_mesh_resources", "torch.distributed.device_mesh")
for _name in ("get_current_mesh", "mesh_stack"):
    _require(_mesh_resources, _name, "torch.distributed.device_mesh._mesh_resources")
# the private methods devmesh's DeviceMesh overrides: torch's code calls them by these names
for _name, _params in (("_concatenate", ("device_mesh_list",)),
                       ("_flatten", ("mesh_dim_name",)),
                       ("_unflatten", ("dim", "mesh_sizes", "mesh_dim_names"))):
    _require(_device_mesh.DeviceMesh, _name, "torch.distributed.device_mesh.DeviceMesh",
             params=_params)

# torch's DeviceMesh attributes a devmesh mesh sets; only this module writes them
TORCH_MESH_ATTRIBUTES = (
    "_layout", "_rank_map", "_flatten_rank_map", "_root_mesh", "_preserve_rank_order",
    "_mesh_dim_names", "_flatten_mapping", "_pg_registry", "_dim_group_names", "_thread_id",
    "_hash", "_coordinate_on_dim",
)


def fill_torch_mesh_state(mesh: Any, *, root: Any, ranks: Any, root_shape: tuple[int, ...],
                          dim_roots: tuple[tuple[int, ...], ...],
                          names: tuple[str, ...] | None,
                          coordinate: list[int] | None) -> None:
    """Fill in what torch's own DeviceMesh code reads of ``mesh``: a CuTe-style ``_layout`` of
    its dims as strides into the root's ``_rank_map`` (the root's row-major ranks, on the CPU
    whatever the default device, so torch's mesh works inside ``with torch.device("meta"):``),
    the root mesh, and empty group registries (:func:`register_dim_groups` fills them)."""
    if root is mesh:
        mesh._rank_map = torch.tensor(ranks.reshape(-1), dtype=torch.int,
                                      device="cpu").contiguous()
        mesh._flatten_rank_map = tuple(mesh._rank_map.tolist())
    else:
        mesh._rank_map = root._rank_map
        mesh._flatten_rank_map = root._flatten_rank_map
    strides = [1] * len(root_shape)
    for d in range(len(root_shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * root_shape[d + 1]
    mesh._layout = _MeshLayout([
        _FlatLayout(tuple(root_shape[d] for d in dims), tuple(strides[d] for d in dims))
        for dims in dim_roots
    ])
    mesh._root_mesh = None if root is mesh else root
    # torch >= 2.15: whether slicing and flattening keep a mesh's own rank order (its default,
    # False, is what torch's init_device_mesh gives; torch 2.13 and 2.14 do not read it)
    mesh._preserve_rank_order = False
    mesh._mesh_dim_names = names
    mesh._flatten_mapping = {}
    mesh._pg_registry = {}
    mesh._dim_group_names = []
    mesh._thread_id = None
    mesh._hash = None
    mesh._coordinate_on_dim = coordinate


def register_dim_groups(mesh: Any, root: Any, dim_groups: tuple) -> None:
    """Name ``mesh``'s per-dim groups where torch looks them up (by group name, in the root's
    registry)."""
    mesh._dim_group_names = [pg.group_name for pg in dim_groups]
    for pg in dim_groups:
        root._pg_registry[pg.group_name] = pg


def register_flattened(root: Any, name: str, flat: Any) -> None:
    """Record a flattened mesh where torch's own code finds it by name."""
    root._flatten_mapping.setdefault(name, flat)


def torch_mesh_state_for_pickle(state: dict) -> None:
    """Drop the process-local parts of torch's bookkeeping from a pickled mesh's ``state``;
    unpickling restores an empty registry (a pickled mesh is inspected, not used to send)."""
    state["_dim_group_names"] = []
    state.pop("_pg_registry", None)


def restore_torch_mesh_state(mesh: Any) -> None:
    mesh._pg_registry = {}


def torch_concatenate(meshes: list) -> Any:
    """torch's own ``DeviceMesh._concatenate`` (for meshes torch built)."""
    return _device_mesh.DeviceMesh._concatenate(meshes)


def current_torch_mesh() -> Any:
    """The mesh of the innermost ``with mesh:`` block; torch raises when there is none."""
    return _mesh_resources.get_current_mesh()


def innermost_torch_mesh() -> Any | None:
    """The mesh of the innermost ``with mesh:`` block, or ``None``."""
    stack = _mesh_resources.mesh_stack
    return stack[-1] if stack else None


def unwrap_fake_script_object(obj: object) -> object:
    """The mesh a ``torch.compile`` stand-in (torch's ``FakeScriptObject``) wraps; anything
    else as it is (and everything as it is on a torch without opaque objects)."""
    try:
        from torch._library.fake_class_registry import maybe_unwrap_fake_script_object
    except ImportError:
        return obj
    return maybe_unwrap_fake_script_object(obj)


# -- autograd and dispatch ---------------------------------------------------------------------
_graph_task_id = _require(torch._C, "_current_graph_task_id", "torch._C")
_engine = _require(torch.autograd.Variable, "_execution_engine", "torch.autograd.Variable")
_require(_engine, "queue_callback", "torch.autograd.Variable._execution_engine")
_top_saved_hooks = _require(torch._C._autograd, "_top_saved_tensors_default_hooks",
                            "torch._C._autograd")
_dispatch = _import("torch.utils._python_dispatch")
disable_current_modes: Callable = _require(_dispatch, "_disable_current_modes",
                                           "torch.utils._python_dispatch")
is_traceable_wrapper_subclass: Callable = _require(
    _dispatch, "is_traceable_wrapper_subclass", "torch.utils._python_dispatch")
#: torch's base class of a Python dispatch mode (what sees each op and its outputs)
TorchDispatchMode: type = _require(_dispatch, "TorchDispatchMode", "torch.utils._python_dispatch")
#: the fake tensors DTensor's sharding propagation computes shapes on (no device memory)
FakeTensor: type = _require(_import("torch._subclasses.fake_tensor"), "FakeTensor",
                            "torch._subclasses.fake_tensor")
pytree: types.ModuleType = _import("torch.utils._pytree")
for _name in ("tree_map_only", "tree_flatten", "tree_unflatten"):
    _require(pytree, _name, "torch.utils._pytree")
CFuture: type = _require(torch._C, "Future", "torch._C")  # torch.futures.Future's base
_clear_propagation_cache = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
_module_module = _import("torch.nn.modules.module")
IncompatibleKeys: type = _require(_module_module, "_IncompatibleKeys", "torch.nn.modules.module")


def storage_key(t: torch.Tensor) -> int:
    """An identity of ``t``'s storage that its views share: its address, or for a ``meta``
    tensor (whose storages have none) the storage object's own (a dry run's)."""
    storage = t.untyped_storage()
    return storage._cdata if t.is_meta else storage.data_ptr()


def current_graph_task_id() -> int:
    """The id of the autograd graph task running on this thread; -1 outside backward."""
    return _graph_task_id()


def queue_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward pass ends (autograd's engine callback)."""
    _engine.queue_callback(callback)


def saved_tensors_hooks_in_force() -> Any:
    """The innermost ``saved_tensors_hooks`` pair in force (``None`` if none)."""
    return _top_saved_hooks(False)


# -- torch.amp.GradScaler: the flags its unscale_ left, its scale's device ----------------------
_require(torch.amp.GradScaler, "_get_scale_async", "torch.amp.GradScaler")


def grad_scaler_flags(scaler: Any, optimizer: Any) -> dict:
    """The inf/nan flags per device that ``scaler.unscale_(optimizer)`` found (torch's
    per-optimizer state, read by its ``step``): a dict to change in place."""
    states = _require(scaler, "_per_optimizer_states", "torch.amp.GradScaler")
    return states[id(optimizer)]["found_inf_per_device"]


def grad_scaler_device(scaler: Any) -> torch.device:
    """The device of the scaler's scale (where its inf/nan flags are made)."""
    return scaler._get_scale_async().device


def clear_dtensor_caches() -> None:
    """Empty DTensor's caches that are keyed by mesh, those DTensor has loaded (a torch
    whose private caches moved has nothing here to clear): its redistribution plans and
    planners, sharding propagation, and mesh topologies. Each holds meshes, and through them
    their process groups: a process that runs one world after another (a test worker) would
    keep every world's gloo threads and sockets alive."""
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    api = sys.modules.get("torch.distributed.tensor._api")
    collectives = sys.modules.get("torch.distributed.tensor._collective_utils")
    try:
        if redistribute is not None:
            redistribute._gen_transform_infos.cache_clear()
            clear_planners = getattr(redistribute, "clear_redistribute_planner_cache", None)
            if clear_planners is not None:
                clear_planners()
        if collectives is not None:
            collectives.MeshTopoInfo.build_from_mesh.cache_clear()
        if api is not None:
            propagator = api.DTensor._op_dispatcher.sharding_propagator
            propagator.propagate_op_sharding.cache.cache_clear()
            propagator._propagate_tensor_meta_cached.cache_clear()
            if _clear_propagation_cache is not None:
                _clear_propagation_cache()  # the C++ fast path's cache
    except AttributeError:
        pass


_P = ParamSpec("_P")
_R = TypeVar("_R")


def eager(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` kept out of ``torch.compile``'s graphs, as ``torch.compiler.disable(fn)``, with
    torch's dynamo imported at fn's first call rather than at devmesh's import: importing it
    costs a process ~0.7 s, which a script that never compiles need not pay. torch decorates
    its own optimizers' and checkpointing's functions so (``torch._disable_dynamo``)."""
    lazy = getattr(torch, "_disable_dynamo", None)
    return lazy(fn) if lazy is not None else torch.compiler.disable(fn)


def import_dynamo() -> None:
    """Import torch's dynamo now (it keeps the process group alive at its import)."""
    _import("torch._dynamo")


# -- subsystems checked on first use -----------------------------------------------------------
def fake_store() -> dist.Store:
    """A store for torch's single-process ``fake`` process group (a dry run's world), from
    torch's testing package, where torch keeps it."""
    module = _import("torch.testing._internal.distributed.fake_pg")
    return _require(module, "FakeStore", "torch.testing._internal.distributed.fake_pg")()


@functools.cache
def cpu_flash_attention() -> Callable:
    """ATen's fused CPU attention returning the output and its log-sum-exp (what
    ``scaled_dot_product_attention`` runs on the CPU): ``(q, k, v, dropout_p, is_causal, *,
    attn_mask, scale) -> (out, lse)``."""
    return _require(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu",
                    "torch.ops.aten")


@functools.cache
def cpu_flash_attention_backward() -> Callable:
    """Its backward: ``(grad_out, q, k, v, out, lse, dropout_p, is_causal, *, attn_mask,
    scale) -> (grad_q, grad_k, grad_v)``."""
    return _require(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward",
                    "torch.ops.aten")


@functools.cache
def strided_shard_type() -> type:
    """DTensor's ``_StridedShard`` placement (what FSDP2 over TP produces)."""
    placements = _import("torch.distributed.tensor.placement_types")
    return _require(placements, "_StridedShard", "torch.distributed.tensor.placement_types",
                    params=("dim", "split_factor"))


def non_reentrant_checkpoint_wrapper(module: torch.nn.Module, **checkpoint_kwargs: Any
                                     ) -> torch.nn.Module:
    """torch's ``checkpoint_wrapper`` (non-reentrant), torchtitan's way to checkpoint a block:
    ``checkpoint_kwargs`` go to ``torch.utils.checkpoint.checkpoint`` (a ``context_fn`` for
    selective checkpointing)."""
    where = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
    wrappers = _import(where)
    impl = _require(wrappers, "CheckpointImpl", where)
    wrap = _require(wrappers, "checkpoint_wrapper", where, params=("checkpoint_impl",))
    return wrap(module, checkpoint_impl=impl.NO_REENTRANT, **checkpoint_kwargs)


@contextlib.contextmanager
def outside_selective_checkpointing() -> Iterator[None]:
    """Run what is inside hidden from torch's selective activation checkpointing: its
    dispatch modes (which record every op of a checkpointed region's forward and expect the
    same ops, in the same order, when the region runs again in backward) are set aside, the
    other modes kept. For work whose ops differ between a region's forward and its
    recomputation by design: an FSDP unit nested in a checkpointed block gathers its
    parameters inside the region in one pass and ahead of it (prefetched) in the other."""
    from torch.utils import checkpoint
    from torch.utils._python_dispatch import (
        _disable_current_modes,
        _get_current_dispatch_mode_stack,
    )

    sac = tuple(getattr(checkpoint, name) for name in
                ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode")
                if hasattr(checkpoint, name))
    if not sac or not any(isinstance(m, sac) for m in _get_current_dispatch_mode_stack()):
        yield
        return
    with _disable_current_modes() as modes, contextlib.ExitStack() as kept:
        for mode in modes:
            if not isinstance(mode, sac):
                kept.enter_context(mode)
        yield


@functools.cache
def pipeline_stage_types() -> tuple[type, type]:
    """torch's pipelining stage classes: ``(_PipelineStageBase, _PipelineStage)`` (the base of
    every stage, and the stage ``pipe.build_stage`` returns)."""
    stage = _import("torch.distributed.pipelining.stage")
    where = "torch.distributed.pipelining.stage"
    return _require(stage, "_PipelineStageBase", where), _require(stage, "_PipelineStage", where)


def stage_forward_contexts(stage: object) -> list[Callable]:
    """The context factories registered on a torch ``PipelineStage`` with its
    ``register_forward_context`` (torch 2.15; none before), so a stage handed to devmesh's
    schedules keeps them."""
    return list(getattr(stage, "_forward_contexts", {}).values())


def modify_graph_op_device(module: torch.nn.Module, device: torch.device) -> None:
    """Rewrite the devices a traced stage's graph names (torch's pipelining does it when a
    stage is built on another device than it was traced on)."""
    ir = _import("torch.distributed.pipelining._IR")
    _require(ir, "_modify_graph_op_device", "torch.distributed.pipelining._IR")(module, device)


def compiled_module_inner(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module ``torch.compile(module)`` wraps, or ``None`` when ``module`` is not one (no
    compiled module exists unless torch's dynamo was imported: nothing is imported here)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        return module._orig_mod
    return None


def has_composable_replicate(module: torch.nn.Module) -> bool:
    """Whether torch's composable ``replicate`` (either kind) was applied to ``module``."""
    contract = _import("torch.distributed._composable.contract")
    registry = _require(contract, "_get_registry", "torch.distributed._composable.contract")
    return "replicate" in (registry(module) or {})


def composable_replicate_state(module: torch.nn.Module) -> tuple[dict, Any]:
    """torch's DDP-based composable ``replicate`` of ``module``: the keyword arguments its DDP
    will be built from, and that DDP (``None`` before the module's first forward)."""
    composable = _import("torch.distributed._composable")
    where = "torch.distributed._composable.replicate"
    state = _require(_require(composable, "replicate", "torch.distributed._composable"),
                     "state", where)(module)
    return _require(state, "_init_kwargs", f"{where}'s state"), getattr(state, "_ddp", None)
