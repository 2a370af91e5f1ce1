"""``fully_shard`` and its companions, torch FSDP2's public functions: what a user calls to
make units, the checks on torch's arguments devmesh cannot honour, and what a pipeline asks
of the units in a stage."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn

from devmesh.mesh import DeviceMesh
from devmesh.distributed import comm, consensus
from devmesh.parallel.dtensor_params import refuse_partial_dtensors
from devmesh.parallel.fsdp.mixed_precision import MixedPrecisionPolicy
from devmesh.parallel.fsdp.module import FSDPModule, units_named
from devmesh.parallel.fsdp.unit import AGREED, FSDPUnit, agreement_text
from devmesh.parallel.param import (
    ParallelizeError,
    with_methods,
    world_mesh,
)


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], object] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: object | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: object | None = None,
) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters over ``mesh`` (FSDP2's API): apply to submodules first,
    then to the root. Returns ``module``; ``module._devmesh_fsdp`` is its unit.

    The ranks check that they passed the same settings and hold the same parameters, and a
    refusal of one rank's arguments reaches every rank; a model's calls do so together,
    in one all-reduce at the root's call (or its first forward, or devmesh's next
    collective), so the setup waits for the other ranks once, not once per call.

    A list of modules makes **one** unit of them all, as torch's ``fully_shard([a, b])``:
    torchtitan groups the final norm with the output head
    (``fully_shard([model.norm, model.output])``), or a tied embedding with the head that
    shares its weight (a weight sharded by one unit cannot be tied into another). Each
    module of the group gets the unit's hooks and methods, and the list is returned. As
    torch's, the first of the group's modules to run in a forward gathers the whole group
    (one all-gather), which stays in place until every module of the group ran (then
    resharded; at the latest when the outermost forward ends), and the group reduces its
    gradients in one reduce-scatter; a module running again (a head applied per chunk)
    gathers anew. The modules must be apart (none inside another), each listed once.

    torch's signature, so FSDP2 code runs unchanged: ``mesh=None`` is the whole world as a
    1-D mesh; ``reshard_after_forward=None`` (the default, as torch's) reshards every unit
    but the root, whose parameters backward needs first; an ``int`` ``n`` (a factor of the
    shard dim's size, e.g. the GPUs of a host) reshards to groups of ``n`` consecutive ranks
    after forward, so backward gathers within those groups only (``1`` is ``False``, the
    shard dim's size ``True``, as torch's); ``ignored_params`` stay plain,
    unsharded tensors whose gradients are not reduced; ``mp_policy`` may be torch's
    ``MixedPrecisionPolicy``; ``shard_placement_fn(param)`` may return ``Shard(d)`` to split
    a parameter along dim ``d`` instead of 0 (uneven blocks as ``torch.chunk``, which torch
    refuses on a dim other than 0). Parameters torch's ``parallelize_module`` made (DTensors
    on a tensor-parallel slice of the same mesh) are sharded inside their blocks, as torch's
    FSDP2 shards them, and the modules get those DTensors back in forward. What devmesh
    does not do is refused with a clear error rather than silently ignored: a placement on
    another mesh from ``shard_placement_fn``,
    offloading on a GPU mesh, ``dp_mesh_dims``, and embeddings with ``sparse=True`` (ignore
    them, and ``replicate``)."""
    mesh = mesh if mesh is not None else world_mesh()
    # a refusal of one rank's own arguments is raised on every rank, not left to a hang,
    # and the ranks agree on what the unit holds and how it is set, in the same collective:
    # held until the root's call, the first forward or the next collective, so a model's
    # calls agree in one all-reduce, not one each (consensus.refused_or_agreed's ``hold``)
    with consensus.refused_or_agreed(comm.process_group(mesh, range(mesh.ndim)), "fully_shard",
                                     ParallelizeError, AGREED, hold=True) as agreed:
        modules = _grouped(module)
        for one in modules:
            if getattr(one, "_devmesh_fsdp", None) is not None:
                raise ParallelizeError(f"fully_shard was already applied to this "
                                       f"{type(one).__name__}")
        dims: dict[int, int] = {}
        for one in modules:
            _refuse_unsupported(one, mesh, reshard_after_forward, offload_policy,
                                dp_mesh_dims, ignored_params)
            dims |= split_dims(one, shard_placement_fn, ignored_params)
        agreed.append(agreement_text(modules, reshard_after_forward,
                                     mp_policy or MixedPrecisionPolicy(),
                                     {id(p) for p in ignored_params or ()}, dims))
    unit = FSDPUnit(modules, mesh, reshard_after_forward, mp_policy, ignored_params, dims,
                    agreed=True)
    for one in modules:
        one._devmesh_fsdp = unit  # type: ignore[attr-defined]
        with_methods(one, FSDPModule)
        # gather before any other pre-hook of the module (a sequence-parallel style's, say)
        one.register_forward_pre_hook(unit.pre_forward, prepend=True, with_kwargs=True)
        one.register_forward_hook(unit.post_forward, always_call=True)
    unit.watch_recomputation(modules)
    if any(inner is not one and getattr(inner, "_devmesh_fsdp", None) is not None
           for one in modules for inner in one.modules()):
        consensus.settle_held()  # the root's call (it holds units made before): setup ends
    return module


@contextlib.contextmanager
def batched_checks() -> Iterator[None]:
    """Collective over the world: the ``fully_shard`` calls inside check their arguments and
    agree across their ranks once, at the end of the block. A model of hundreds of blocks
    then pays two small collectives for its setup, however many meshes its calls use
    (torch's ``fully_shard`` checks nothing across ranks). Calls outside a block are held
    and agreed together too (one all-reduce per mesh they use), where the setup ends by
    itself: at the root's call, the first forward, or devmesh's next collective::

        with batched_checks():
            for block in model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)

    Every refusal still reaches every rank: a call refused on one rank raises there at once
    (its block ends), and at the end of the block the other ranks raise a
    :class:`~devmesh.parallel.ParallelizeError` naming it; ranks that passed different
    settings or hold different parameters raise the
    :class:`~devmesh.errors.MeshMismatchError` of the first call that differs. The errors
    come at the end of the block, once the other calls have sharded their modules (they
    are not undone). Put only ``fully_shard`` calls inside, and make each mesh's process
    groups before it (a mesh used by an earlier call, or one sliced before the block, has
    them): a devmesh collective, or a process group made inside, raises
    :class:`~devmesh.errors.MeshUsageError` on the rank that tries, as a rank refused
    earlier in the block would never join it. ``devmesh.parallel.parallelize`` shards a
    model's blocks this way."""
    with consensus.batched("fully_shard", ParallelizeError):
        yield


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """torch's FSDP2 function of the same name: make ``module.method_name`` (a ``generate``,
    a ``score``) gather the unit's parameters before it runs and release them after, as
    ``forward`` does, for a method that uses the parameters without going through
    ``forward`` (called alone it would see this rank's shards). A ``forward`` it calls
    inside finds them gathered. A module without a devmesh unit is left alone, as torch's
    leaves modules that are not its FSDP modules."""
    unit = getattr(module, "_devmesh_fsdp", None)
    if unit is None:
        return
    method = getattr(module, method_name)

    @functools.wraps(method)
    def gathered(*args, **kwargs):
        cast = unit.pre_forward(module, args, kwargs)
        if cast is not None:
            args, kwargs = cast
        try:
            output = method(*args, **kwargs)
        except BaseException:
            unit.post_forward(module, args, None)  # reshard, and the forward's record ends
            raise
        return unit.post_forward(module, args, output)

    setattr(module, method_name, gathered)


def share_comm_ctx(modules: list[nn.Module]) -> None:
    """torch's FSDP2 function (pipeline stages, each an FSDP root, sharing CUDA streams for
    their collectives): accepted for code that calls it; devmesh's collectives run on the
    process groups' own streams, so there is nothing to share. The modules must be devmesh
    ``fully_shard`` modules."""
    units_named(modules, "share_comm_ctx")


def parameters_grouped_with(module: nn.Module) -> list[nn.Parameter]:
    """The parameters outside ``module`` whose gradients the ``fully_shard`` units in its
    subtree hand to autograd with its own: those of the other modules of their groups
    (``fully_shard([a, b])``). A backward restricted to some parameters (autograd's
    ``inputs=``, as a pipeline's weight-gradient half asks for a stage's) must list them
    too: a unit's reduction returns every gradient it accumulated, and autograd drops the
    ones for parameters it was not asked for."""
    own = {id(p) for p in module.parameters()}
    units = {id(m._devmesh_fsdp): m._devmesh_fsdp for m in module.modules()
             if getattr(m, "_devmesh_fsdp", None) is not None}
    extra: dict[int, nn.Parameter] = {}
    for unit in units.values():
        for p in unit.params:
            if id(p.sharded) not in own:
                extra.setdefault(id(p.sharded), p.sharded)
    return list(extra.values())


def _grouped(module: nn.Module | list[nn.Module]) -> list[nn.Module]:
    """The modules one ``fully_shard`` call makes a unit of, checked: a module, or a
    non-empty list (or tuple) of distinct modules none of which is inside another."""
    if isinstance(module, nn.Module):
        return [module]
    if not isinstance(module, (list, tuple)) or not module:
        raise ParallelizeError(f"fully_shard takes a module or a non-empty list of modules, "
                               f"got {module!r}")
    for i, one in enumerate(module):
        if not isinstance(one, nn.Module):
            raise ParallelizeError(f"fully_shard: item {i} of the list is a "
                                   f"{type(one).__name__}, not an nn.Module")
    for i, outer in enumerate(module):
        for j, inner in enumerate(module):
            if i != j and any(sub is inner for sub in outer.modules()):
                what = "listed twice" if outer is inner else f"inside item {i}"
                raise ParallelizeError(
                    f"fully_shard: item {j} of the list ({type(inner).__name__}) is {what}: "
                    "a group's modules must be apart (shard an inner module first with its "
                    "own call, then group the outer ones)")
    return list(module)


def split_dims(module: nn.Module, shard_placement_fn, ignored_params) -> dict[int, int]:
    """The dim each of ``module``'s parameters is split along, by id, from torch's
    ``shard_placement_fn`` (``None`` or ``Shard(0)``: dim 0; ``Shard(-1)``: the last dim).
    Unlike torch's FSDP2, which refuses a dim other than 0 that the ranks do not divide,
    uneven blocks follow ``torch.chunk`` along any dim. Called before any collective: every
    rank holds the same parameters, so a refusal is the same on every rank."""
    from devmesh.layout.placement import Shard

    dims: dict[int, int] = {}
    if shard_placement_fn is None:
        return dims
    ignored = {id(p) for p in ignored_params or ()}
    for name, param in module.named_parameters():
        if id(param) in ignored:
            continue
        placement = shard_placement_fn(param)
        if placement is None:
            continue
        if not (isinstance(placement, Shard) or type(placement).__name__ == "Shard"):
            raise ParallelizeError(
                f"shard_placement_fn gave {placement!r} for {name}: devmesh's fully_shard "
                "takes Shard(dim) or None (a placement on another mesh, torch's "
                "ShardPlacementResult, is not supported: shard that parameter in a "
                "fully_shard call of its own on that mesh)")
        ndim = max(param.ndim, 1)  # a 0-d parameter is sharded as one element
        if not -ndim <= placement.dim < ndim:
            raise ParallelizeError(
                f"shard_placement_fn gave {placement!r} for {name}, whose shape "
                f"{tuple(param.shape)} has no dim {placement.dim}: return Shard(d) with "
                f"-{ndim} <= d < {ndim}, or None for dim 0")
        dims[id(param)] = placement.dim % ndim
    return dims


def _refuse_unsupported(module: nn.Module, mesh: DeviceMesh, reshard_after_forward,
                        offload_policy, dp_mesh_dims, ignored_params) -> None:
    """Raise for an argument of torch's that devmesh cannot honour (the same on every rank:
    they are checked before any collective)."""
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, int):
        raise ParallelizeError(
            "reshard_after_forward should be a bool or an int representing the group size to "
            f"reshard to, not {reshard_after_forward!r}")
    if not isinstance(reshard_after_forward, bool) and isinstance(reshard_after_forward, int):
        size = mesh.shape[-1]
        if not 1 <= reshard_after_forward <= size or size % reshard_after_forward:
            raise ParallelizeError(
                "If passing reshard_after_forward as an int, it should be a factor of "
                f"{size}, not {reshard_after_forward}: the shard dim of {mesh!r} has {size} "
                "ranks, and each group the parameters are resharded to after forward "
                "holds a whole number of them")
    if offload_policy is not None and type(offload_policy).__name__ != "OffloadPolicy":
        if mesh.device_type != "cpu":
            raise ParallelizeError(
                f"{type(offload_policy).__name__}: devmesh does not offload a GPU mesh's "
                "parameters to CPU; on a CPU mesh they are already there")
    if dp_mesh_dims is not None:
        raise ParallelizeError(
            "dp_mesh_dims is not supported by devmesh: pass the data-parallel mesh itself "
            "(mesh['dp'], or mesh['replicate', 'shard'] for HSDP)")
    if ignored_params is not None and not all(isinstance(p, torch.Tensor)
                                              for p in ignored_params):
        raise ParallelizeError("ignored_params must be a set of the module's parameters")
    ignored = {id(p) for p in ignored_params or ()}
    refuse_partial_dtensors(module, ignored, "fully_shard")
    for name, sub in module.named_modules():
        if (isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse
                and any(id(p) not in ignored for p in sub.parameters(recurse=False))):
            raise ParallelizeError(
                f"fully_shard cannot shard {name or type(sub).__name__}: an embedding with "
                "sparse=True gives sparse gradients, which cannot be reduce-scattered into "
                "shards; use sparse=False, or keep it out of the unit (ignored_params) and "
                "replicate it (replicate all-reduces sparse gradients)")
