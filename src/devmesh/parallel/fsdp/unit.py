"""One ``fully_shard`` unit: the parameters one call shards, gathered around the forward of
its modules and reduced in their backward.

Each call makes one *unit* of the parameters of ``module`` not already in a child unit.
Every parameter is replaced by a plain ``nn.Parameter`` holding this rank's rows (uneven sizes
follow ``torch.chunk``), with its spec attached. Around the unit's forward:

* before: all parameters of the unit are gathered in **one** collective (their padded shards
  packed into one buffer, as bytes: parameters may differ in dtype), in
  ``mp_policy.param_dtype`` if given; from the second step on, the previous unit has already
  started this all-gather asynchronously (prefetch);
* after: with ``reshard_after_forward`` the full parameters are dropped; tensors autograd saved
  for backward are replaced by a handle (saved-tensor hooks) and the unit gathers again, once,
  when backward first needs them — from the second step on already started by the unit after
  it (backward prefetch), for the units whose backward needed them in the previous step.
  With ``reshard_after_forward=n`` (an int) a rank keeps ``k / n`` of the all-gather's ``k``
  rows after forward, so that each group of ``n`` consecutive ranks holds them all, and the
  backward gathers within that group (inside a host, when ``n`` is its GPU count);
* backward: the unit's gradients are reduce-scattered (averaged over the shard dim) in one
  collective, in ``mp_policy.reduce_dtype`` (else ``param_dtype`` up to torch
  2.14, the parameters' own dtype from 2.15, as torch's); on a 2-D
  ``(replicate, shard)`` mesh they are then all-reduced (averaged) over the replicate dim:
  hybrid sharding.

Applied after tensor parallelism, the unit shards each parameter's TP-local block, and the
spec records dim 0 as split by ``("tp", "dp")``, so ``full_tensor()`` reassembles exactly.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence

import torch
from torch import nn

from devmesh import _torch_compat
from devmesh.distributed import comm, consensus
from devmesh.mesh import DeviceMesh
from devmesh.parallel.fsdp.collectives import (
    ShardedParam,
    gather_dtypes,
    gradient_numel,
    pack_gradients,
    pack_shards,
    unpack_gathered,
    unpack_reduced,
)
from devmesh.parallel.fsdp.mixed_precision import MixedPrecisionPolicy
from devmesh.parallel.fsdp.state import TRANSITIONS, Slots, check_transition
from devmesh.parallel.fsdp.order import (
    ForwardOrder,
    enter_forward,
    exit_forward,
    forward_running,
    keep_open,
)
from devmesh.parallel.fsdp.weight_grads import keep_for_weight_gradients, weight_gradients_later
from devmesh.parallel.param import (
    ParallelizeError,
    ParamLayout,
    combined_mesh,
    describe_tensors,
    get_layout,
    is_dtensor,
    sharded_parameter,
)
from devmesh.parallel.placement import (
    place_parameter,
    refuse_torch_fsdp_over_blocks,
    replaced_parameters,
)
from devmesh.parallel.saved_activation import SavedActivation
from devmesh.parallel.swap import swap_parameter
from devmesh.tensor import ShardedTensor, ShardingSpec
from devmesh.layout import MeshLayout
from devmesh.layout.spec import chunk_bounds

SHARDED_BY = "_devmesh_sharded_by"  # on an original parameter: the unit that replaced it
_HANDLE = object()  # marks a saved view of a gathered parameter (see FSDPUnit._pack)


AGREED = ("fully_shard: every rank must hold the same parameters (and ignore the same ones) "
          "and pass the same settings")


def agreement_text(roots: Sequence[nn.Module], reshard_after_forward: bool | int | None,
                   mp: object, ignored: set[int], split_dims: dict[int, int]) -> str:
    """What every rank of a unit must agree on (``AGREED``): its parameters (names, shapes,
    dtypes), the ignored ones, and the settings — ranks that gather, reshard or cast
    differently mismatch every collective of the unit (gloo aborts the process on the
    first one). ``ignored`` and ``split_dims`` are keyed by the parameters' ids."""
    names = [n for root in roots for n, p in root.named_parameters() if id(p) in ignored]
    split = {n: split_dims[id(p)] for root in roots
             for n, p in root.named_parameters() if split_dims.get(id(p))}
    settings = ", ".join(f"{f}={getattr(mp, f, None)}" for f in (
        "param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs"))
    return ("\n".join(map(describe_tensors, roots)) + f"\nignored: {names}\n"
            f"reshard_after_forward={reshard_after_forward}, {settings}, split along "
            f"dims {split}")


class FSDPUnit:
    """The parameters of one ``fully_shard`` call and the hooks that gather and reduce them.
    ``modules``: the module, or the modules grouped by one call (``fully_shard([a, b])``)."""

    def __init__(self, modules: nn.Module | Sequence[nn.Module], mesh: DeviceMesh,
                 reshard_after_forward: bool | None, mp_policy: MixedPrecisionPolicy | None,
                 ignored_params: set[nn.Parameter] | None = None,
                 split_dims: dict[int, int] | None = None, *, agreed: bool = False) -> None:
        roots = [modules] if isinstance(modules, nn.Module) else list(modules)
        if mesh.ndim not in (1, 2):
            raise ParallelizeError(
                f"fully_shard needs a 1-D (shard) or 2-D (replicate, shard) mesh, got {mesh!r}"
            )
        if mesh.get_coordinate() is None:
            raise ParallelizeError(f"rank {mesh.get_rank()} is not part of {mesh!r}")
        self.mesh = mesh
        self.shard_dim = mesh.ndim - 1
        self.replicate_dims = tuple(range(mesh.ndim - 1))
        self.k = mesh.shape[self.shard_dim]
        self.index = mesh.get_coordinate()[self.shard_dim]
        self.reshard_after_forward = reshard_after_forward  # None: all but the root unit
        # reshard_after_forward=n: after forward, groups of n ranks hold the parameters
        self.post_forward_size: int | None = None
        self._post_forward_mesh: DeviceMesh | None = None
        self._post_forward: torch.Tensor | None = None  # this rank's rows, kept for backward
        self.mp = mp_policy or MixedPrecisionPolicy()
        self._ignored = {id(p) for p in ignored_params or ()}
        # the dim each parameter is split along, by id (torch's shard_placement_fn); else 0
        self._split_dims = split_dims or {}
        self.params: list[ShardedParam] = []
        self._owners: list[nn.Module] | None = None  # the modules holding them, once listed
        self._full: list[torch.Tensor] | None = None  # gathered for backward (resharded case)
        # gradient accumulation (set_requires_gradient_sync(False)): unsharded gradients summed
        # here until a backward with sync reduces them once
        self.requires_gradient_sync = True
        self.reshard_after_backward = True
        self.gradient_divide_factor: float | None = None  # None: the mean over the data ranks
        self.all_reduce_hook = None  # torch's set_all_reduce_hook: runs on the reduced shards
        self.reduce_unused = False  # torch's set_reduce_scatter_unused_params
        self._accumulated: list[torch.Tensor | None] | None = None
        # HSDP accumulation (set_requires_all_reduce(False)): this rank's reduce-scattered
        # gradients summed here until a backward with the all-reduce adds them in
        self.requires_all_reduce = True
        self._partial: torch.Tensor | None = None
        # torch's explicit prefetching: units to gather when this one gathers
        self.forward_prefetch: list[FSDPUnit] = []
        self.backward_prefetch: list[FSDPUnit] = []
        self._kept: list[torch.Tensor] | None = None  # full parameters kept between backwards
        self._prefetched: comm.Pending | None = None  # started by the previous unit
        self._unsharded: list[torch.Tensor] | None = None  # unshard()'s, in the places now
        self._regather_pending: comm.Pending | None = None  # backward prefetch, by the next unit
        self._needed_regather = False  # backward re-gathered this unit in the previous step
        self._backward_ran = False  # so the flag above means something
        self._regathered_now = False
        # _full outlives its backward only for a pipeline's weight-gradient half (W) to come;
        # else the end of the backward drops it (see _release_after_backward)
        self._full_for_weight_grads = False
        self._release_task = -1  # the backward whose end is set to drop _full
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._running = 0  # forwards of the unit's modules running now (nested: a group's)
        # a group's gather of this forward, kept in the modules' places until each module of
        # the group ran (torch's FSDP2 keeps a group unsharded the same way): one all-gather
        # and one reduce-scatter for norm and head, not one per module
        self.modules: list[nn.Module] = roots
        # what the modules' parameter slots hold; moved only by _place (see fsdp/state.py)
        self.slots = Slots.SHARDS
        self._open: tuple[torch.Tensor, ...] | None = None  # the forward's gather (FORWARD)
        self._to_run: set[int] = set()  # ids of the group's modules not run since the gather
        # the gathered parameters a recomputation inside this backward uses (activation
        # checkpointing inside the unit), with the backward's task id
        self._recomputed: tuple[int, tuple[torch.Tensor, ...]] | None = None
        self._recomputing: set[int] = set()  # ids of the modules holding them now
        # the record of units in forward order the last forward used, and the one this unit
        # keeps when it starts forwards (its model's root): both set by fsdp/order.py
        self.forward_order: ForwardOrder | None = None
        self.root_order: ForwardOrder | None = None
        # torch 2.15's manual backward finalization: finalize_backward() ends a step's backward
        self.manual_finalization = False
        self.reduction_handle = None  # finalize_backward(async_op=True)'s, until waited on
        if not agreed:
            consensus.agree(mesh, tuple(range(mesh.ndim)), AGREED, agreement_text(
                roots, reshard_after_forward, self.mp, self._ignored, self._split_dims))
        if not isinstance(reshard_after_forward, bool) and isinstance(reshard_after_forward, int):
            # torch's reading: 1 keeps the parameters (with a warning), the whole shard dim
            # is True; anything between reshards to groups of that many ranks
            if reshard_after_forward == 1:
                warnings.warn("reshard_after_forward=1 (int) means resharding parameters to "
                              "world size 1, instead of reshard_after_forward=True (bool): "
                              "the parameters stay gathered after forward", stacklevel=3)
            self.reshard_after_forward = reshard_after_forward > 1
            if 1 < reshard_after_forward < self.k:
                self.set_post_forward_size(reshard_after_forward)
        self._collect(roots)

    # -- setup -----------------------------------------------------------------------------
    def _collect(self, roots: list[nn.Module]) -> None:
        """Shard every parameter of the ``roots``' subtrees that no child unit owns. A
        parameter registered in several places (tied weights, within a module or across the
        modules of a group) becomes one sharded parameter that every place holds, gathered
        with the rest of the unit."""
        owned: dict[int, ShardedParam] = {}

        def visit(module: nn.Module) -> None:
            if (all(module is not root for root in roots)
                    and getattr(module, "_devmesh_fsdp", None) is not None):
                return  # a child unit owns this subtree
            for name, param in list(module._parameters.items()):
                if param is None or id(param) in self._ignored:
                    continue  # an ignored parameter stays this rank's plain tensor
                if id(param) in owned:
                    owned[id(param)].places.append((module, name))
                    place_parameter(module, name, owned[id(param)].sharded)
                    continue
                other_unit = getattr(param, SHARDED_BY, None)
                if other_unit is not None:
                    raise ParallelizeError(
                        f"{type(module).__name__}.{name} is tied to a parameter that another "
                        "fully_shard unit already sharded (e.g. an output projection sharing "
                        "the embedding's weight, with fully_shard applied to the embedding): "
                        "apply fully_shard to a module that contains every use of the tied "
                        "parameter (usually the root) and not to the smaller one"
                    )
                owned[id(param)] = self._shard(module, name, param)
            for child in module.children():
                visit(child)

        for root in roots:
            visit(root)

    def _shard(self, module: nn.Module, name: str, param: nn.Parameter) -> ShardedParam:
        tp = get_layout(param)
        made_by_torch = None
        if is_dtensor(param):  # torch's tensor parallelism: shard its local block
            made_by_torch = (param.device_mesh, tuple(param.placements), param.shape,
                             param.stride())
            block = ShardedTensor.from_dtensor(param.detach())
            tp = ParamLayout(block.device_mesh, block.spec)
            param_data = param.detach().to_local()
        else:
            param_data = param.detach()
        shape = tuple(param_data.shape)
        if param_data.ndim == 0:  # sharded as one element
            data, whole = param_data.reshape(-1), ()
        elif tp is not None and tp.packed is not None:
            # a packed parameter (its parts split by tensor parallelism): FSDP shards the
            # view whose blocks are boxes, and the module computes with it reshaped back
            data, whole = tp.spec_block(param_data), tp.full_shape
        else:
            data, whole = param_data, None
        full_shape = tuple(data.shape)
        dim = self._split_dims.get(id(param), 0)
        if whole and dim > tp.packed[0]:  # the view has the packed dim cut in two
            dim += 1
        start, size = chunk_bounds(full_shape[dim], self.k, self.index)
        local = data.narrow(dim, start, size).clone()
        spec_mesh, spec = self._spec(tp, full_shape, dim)
        new = sharded_parameter(local, param.requires_grad, spec_mesh, spec, shape=whole)
        setattr(param, SHARDED_BY, self)
        place_parameter(module, name, new)
        padded_rows = -(-full_shape[dim] // self.k) if full_shape[dim] else 0
        entry = ShardedParam([(module, name)], new, full_shape, padded_rows, shape, dim,
                             made_by_torch)
        self.params.append(entry)
        return entry

    def _spec(self, tp: ParamLayout | None, full_shape, dim: int
              ) -> tuple[DeviceMesh, ShardingSpec]:
        """Where the new shard lies: tensor dim ``dim`` split by the shard dim, nested inside
        the split tensor parallelism already made, if any (``tp``; on the mesh spanning
        both)."""
        names = self.mesh.mesh_dim_names
        if tp is None:
            dim_map = [()] * len(full_shape)
            dim_map[dim] = (self.shard_dim,)
            spec = ShardingSpec(self.mesh.shape, full_shape, tuple(dim_map),
                                mesh_dim_names=names)
            return self.mesh, spec
        mesh = combined_mesh(tp.mesh, self.mesh)
        index = {n: i for i, n in enumerate(mesh.mesh_dim_names)}
        old_names = tp.mesh.mesh_dim_names
        dim_map = [tuple(index[old_names[m]] for m in dims) for dims in tp.spec.dim_map]
        dim_map[dim] = dim_map[dim] + (index[names[self.shard_dim]],)
        spec = ShardingSpec(mesh.shape, tp.spec.global_shape, tuple(dim_map),
                            mesh_dim_names=mesh.mesh_dim_names)
        return mesh, spec

    def follow(self, replaced: dict[int, torch.Tensor]) -> None:
        """``model.to_empty()`` / ``.to()`` made new parameter objects (see
        :mod:`devmesh.parallel.conversion`): hold those, in every place (tied weights stay
        one), and forget anything gathered from the old ones."""
        for p in self.params:
            new = replaced.get(id(p.sharded))
            if new is not None:
                assert isinstance(new, nn.Parameter)
                p.sharded = new
        self._open, self._to_run = None, set()
        self._place(Slots.SHARDS)
        self._kept = self._full = self._accumulated = self._unsharded = None
        self.drop_prefetched()

    def set_post_forward_size(self, size: int | None) -> None:
        """Reshard to groups of ``size`` consecutive ranks of the shard dim after forward
        (``None``: to the whole shard dim). Their process group is made now, while every
        rank of the mesh is here (in ``fully_shard``)."""
        self._post_forward = None
        self.post_forward_size = size
        self._post_forward_mesh = None if size is None else _post_forward_mesh(self.mesh, size)
        if self._post_forward_mesh is not None:
            comm.process_group(self._post_forward_mesh, (self._post_forward_mesh.ndim - 1,))

    def _post_forward_rows(self, fulls: list[torch.Tensor]) -> torch.Tensor:
        """What this rank keeps after forward under ``reshard_after_forward=n``: the
        all-gather rows of ``k / n`` consecutive shard ranks — the ``q``-th such run for the
        ``q``-th rank of its group of ``n`` — so the group's ``n`` ranks hold all ``k``."""
        n = self.post_forward_size
        assert n is not None
        per = self.k // n
        first = (self.index % n) * per
        dtypes = self._gather_dtypes()
        rows = []
        for j in range(first, first + per):
            shards = [full.detach().narrow(p.dim, *chunk_bounds(p.full_shape[p.dim], self.k, j))
                      for p, full in zip(self.params, fulls, strict=True)]
            rows.append(pack_shards(self.params, shards, dtypes))
        return torch.stack(rows)

    def start_regather(self) -> comm.Pending:
        """Start gathering the unit's parameters for backward: within this rank's group of
        ``n`` from the rows it kept after forward, else over the whole shard dim."""
        if self._post_forward is not None:
            mesh = self._post_forward_mesh
            assert mesh is not None
            return comm.all_gather_async(self._post_forward, mesh, (mesh.ndim - 1,))
        return self.start_gather([p.sharded for p in self.params])

    # -- communication ---------------------------------------------------------------------
    def start_gather(self, shards: list[torch.Tensor]) -> comm.Pending:
        """Start the unit's one all-gather (packed, padded shards) asynchronously."""
        buffer = pack_shards(self.params, shards, self._gather_dtypes())
        return comm.all_gather_async(buffer, self.mesh, (self.shard_dim,))

    def finish_gather(self, pending: comm.Pending) -> list[torch.Tensor]:
        """Unpack the gathered buffer into the unit's full parameters (a gather within a
        post-forward group arrives as ``n`` runs of ``k / n`` rows: the same ``k`` rows)."""
        stacked = pending.wait()
        if stacked.dim() == 3:
            stacked = stacked.reshape(self.k, -1)
        return unpack_gathered(self.params, stacked, self._gather_dtypes(), self.k)

    def _gather_dtypes(self) -> list[torch.dtype]:
        return gather_dtypes(self.params, self.mp.param_dtype)

    def gather(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """All parameters of the unit, unsharded, from one all-gather (a prefetched one if the
        previous unit started it). Hidden from selective checkpointing: a unit inside a
        checkpointed block (experts split over ep) is gathered within the block's forward
        in one pass and prefetched ahead of it in the other."""
        with _torch_compat.outside_selective_checkpointing():
            return self._gather(shards)

    def _gather(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        if self._kept is not None:  # kept since the last backward: no all-gather
            return [t.view(t.shape) for t in self._kept]
        if self._unsharded is not None:  # unshard() gathered them: no all-gather either
            full, self._unsharded = self._unsharded, None
            out = [t.view(t.shape) for t in full]
            if not (self.reshard_after_backward or self.requires_gradient_sync):
                self._kept = full
            return out
        pending, self._prefetched = self._prefetched, None
        full = self.finish_gather(pending if pending is not None else self.start_gather(shards))
        if not (self.reshard_after_backward or self.requires_gradient_sync):
            self._kept = full
        return full

    def prefetch(self) -> None:
        """Start gathering this unit's parameters now, to overlap with the running unit."""
        if (self._prefetched is None and self._kept is None and self.slots is not Slots.FORWARD
                and self._unsharded is None and self.params):
            self.adopt_replaced()
            with _torch_compat.outside_selective_checkpointing():
                self._prefetched = self.start_gather([p.sharded for p in self.params])

    def prefetch_for_backward(self) -> None:
        """Start re-gathering this unit's parameters for its backward (unless they are there
        or on their way, or its backward did not need them in the previous step)."""
        if self._backward_ran and not self._needed_regather:
            return
        if (self.params and self._full is None and self._kept is None
                and self._regather_pending is None):
            self._regather_pending = self.start_regather()

    def unshard(self) -> None:
        """torch's ``unshard()``: the unit's gathered parameters in its modules' places now
        (this call waits for the gather), until its next forward uses them, without another
        all-gather, or :meth:`reshard` puts the shards back."""
        if not self.params or self.slots is Slots.FORWARD:
            return  # nothing to gather, or a forward has them in place already
        if self._unsharded is None and self._kept is None:
            self.prefetch()
            pending, self._prefetched = self._prefetched, None
            self._unsharded = self.finish_gather(pending)
        fulls = self._unsharded if self._unsharded is not None else self._kept
        with torch.no_grad():
            self._place(Slots.UNSHARDED, fulls)

    def reshard(self) -> None:
        """The shards back in the modules' places, and nothing gathered kept (from
        ``unshard()``, a prefetch, or between micro-batches)."""
        self.drop_prefetched()
        self._kept = self._unsharded = None
        if self.slots is not Slots.FORWARD:  # a forward's gather stays until it ends
            self._place(Slots.SHARDS)

    def _place(self, slots: Slots, fulls: Sequence[torch.Tensor] | None = None) -> None:
        """Write the unit's parameters into every place its modules hold them: the shards
        (``Slots.SHARDS``) or views of ``fulls``, the gathered parameters (``FORWARD``,
        ``UNSHARDED``). The one writer of the unit's slots, checked against the legal
        transitions (:data:`~devmesh.parallel.fsdp.state.TRANSITIONS`)."""
        if slots not in TRANSITIONS[self.slots]:  # the name is built only to raise
            check_transition(self.describe(), self.slots, slots)
        if slots is Slots.SHARDS:
            for p in self.params:
                for holder, name in p.places:
                    swap_parameter(holder, name, p.sharded)
        else:
            assert fulls is not None
            for p, full in zip(self.params, fulls, strict=True):
                for holder, name in p.places:
                    swap_parameter(holder, name, p.in_place(full))
        self.slots = slots

    def describe(self) -> str:
        """The unit's modules by class, for messages."""
        return "[" + ", ".join(type(m).__name__ for m in self.modules) + "]"

    def drop_prefetched(self) -> None:
        """Wait for and drop gathers started ahead that were not used: parameters gathered
        before an optimizer step must never reach a later forward or backward."""
        self.drop_forward_prefetch()
        self.drop_regather()

    def drop_forward_prefetch(self) -> None:
        """Wait for and drop the forward all-gather started ahead, if no forward used it."""
        if self._prefetched is not None:
            self._prefetched.wait()
            self._prefetched = None

    def drop_regather(self) -> None:
        """Wait for and drop the backward re-gather started ahead, if no backward used it."""
        if self._regather_pending is not None:
            self._regather_pending.wait()
            self._regather_pending = None

    def regather_ahead(self) -> None:
        """Start the backward re-gather now (the recorded order says this unit's backward
        comes next and needed it last step), unless it is gathered or on its way; within
        this rank's group of ``n`` when it kept rows (``reshard_after_forward=n``)."""
        if self._full is None and self._regather_pending is None:
            self._regather_pending = self.start_regather()

    @property
    def needed_regather(self) -> bool:
        """Whether this unit's backward re-gathered its parameters in the previous step."""
        return self._needed_regather

    def begin_forward_of_step(self) -> None:
        """A model's outermost forward begins: what the backward needed last step predicts
        this step's, and no forward of this unit runs (a count left by one that raised)."""
        self._needed_regather, self._regathered_now = self._regathered_now, False
        self._running = 0

    def forget_kept(self) -> None:
        """Drop the parameters kept between backwards (``set_reshard_after_backward(True)``)."""
        self._kept = None

    def accumulated_gradient_bytes(self) -> int:
        """The bytes of the unsharded gradients held between backwards without
        synchronization (``set_requires_gradient_sync(False)``: a pipeline's micro-batches,
        gradient accumulation): what the dry run counts."""
        return sum(g.numel() * g.element_size() for g in self._accumulated or ()
                   if g is not None)

    def release_weight_gradient_gather(self) -> None:
        """A pipeline step ended: drop the parameters still kept for a weight-gradient half
        (``W``) that never came (a unit whose parameters are frozen has none)."""
        if self._full_for_weight_grads:
            self._release_full()

    def reduce_grads(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Reduce-scatter (average) all gradients of the unit in one collective; HSDP adds one
        all-reduce over the replicate dims. Without gradient sync, add them to the unit's
        unsharded accumulated gradients instead and reduce nothing.

        A parameter that got no gradient (``None``: unused in the forward) on every rank
        keeps no gradient, as in single-process training and torch's FSDP2, so optimizers
        skip it (a zero gradient would still move it under weight decay or momentum); one
        flag per parameter rides in the same collective to tell which were used anywhere."""
        dtype = self._reduce_dtype()
        self._backward_ran = True
        if self._accumulated is not None:
            grads = [_add(a, g, dtype) for a, g in zip(self._accumulated, grads, strict=True)]
            self._accumulated = None
        if not self.requires_gradient_sync:
            self._accumulated = [None if g is None else g.detach().to(dtype) for g in grads]
            self._drop_backward_state(keep=not self.reshard_after_backward)
            return [None] * len(self.params)
        stacked = pack_gradients(self.params, grads, self.k, dtype)
        op = "avg" if self.gradient_divide_factor is None else "sum"
        mine = comm.reduce_scatter(stacked, self.mesh, (self.shard_dim,), op)
        if self.replicate_dims:
            if self._partial is not None:
                mine += self._partial
                self._partial = None
            if not self.requires_all_reduce:  # HSDP accumulation: all-reduce the sum later
                self._partial = mine
                self._drop_backward_state(keep=False)
                return [None] * len(self.params)
            comm.all_reduce(mine, self.mesh, self.replicate_dims, op)
        if self.all_reduce_hook is not None:
            self.all_reduce_hook(mine[:gradient_numel(self.params)])
        if self.gradient_divide_factor is not None:
            mine[:gradient_numel(self.params)].div_(self.gradient_divide_factor)
        out = unpack_reduced(self.params, mine, self.k, self.index, self.reduce_unused)
        self._drop_backward_state(keep=False)  # the optimizer step follows: nothing kept
        return out

    def _reduce_dtype(self) -> torch.dtype:
        """The dtype of the unit's one reduction. torch's rule: ``reduce_dtype``, else (torch
        up to 2.14) the compute dtype (``param_dtype``), else the parameters' own; mixed
        dtypes reduce in the widest (float32 gradients beside float64 ones are averaged
        exactly and rounded once, back into their own dtype). A complex parameter's gradient
        keeps its imaginary part: a unit holding one reduces in a complex dtype (torch reduces
        each parameter in its own dtype, and never casts a complex one to ``param_dtype``)."""
        compute = self.mp.param_dtype if _torch_compat.FSDP_REDUCES_IN_PARAM_DTYPE else None
        dtype = self.mp.reduce_dtype or compute or functools.reduce(
            torch.promote_types, (p.sharded.dtype for p in self.params))
        complex_dtypes = [p.sharded.dtype for p in self.params if p.sharded.dtype.is_complex]
        if complex_dtypes and not dtype.is_complex:
            dtype = functools.reduce(torch.promote_types, complex_dtypes, dtype)
        return dtype

    def _drop_backward_state(self, keep: bool) -> None:
        """Backward of this unit is done: drop the re-gathered parameters (unless ``keep``:
        the next micro-batch's forward uses them without an all-gather)."""
        if keep and self._kept is None:
            self._kept = self._full
        if not keep:
            self._kept = None
        self._release_full()

    def _release_full(self) -> None:
        """Drop the parameters gathered for a backward, a re-gather started for one, and the
        rows kept after forward for it — those stay while gradients accumulate without sync
        (a pipeline's micro-batches: their forwards ran before the first backward, and each
        backward gathers from them; the parameters change only after a synced step)."""
        self._full = None
        if self.requires_gradient_sync:
            self._post_forward = None
        self._full_for_weight_grads = False
        self.drop_regather()  # prefetched but not needed this time

    def _release_after_backward(self) -> None:
        """Drop ``_full`` when the running backward ends, if its reduction did not (torch's
        FSDP2 reshards every group still unsharded at the end of a backward): a unit whose
        parameters are all frozen, or a backward that does not reach them (gradients of the
        inputs only), never reduces, and its gathered copy would otherwise serve the next
        backward after the values changed (an optimizer step, a load) — wrong gradients for
        the layers before it. Kept while a pipeline's ``W`` is to follow."""
        task = _torch_compat.current_graph_task_id()
        if task == self._release_task:
            return
        self._release_task = task

        def at_end() -> None:
            self._release_task = -1
            self._recomputed = None
            if self._full is not None:
                if weight_gradients_later():
                    self._full_for_weight_grads = True
                    keep_for_weight_gradients(self)
                else:
                    self._release_full()

        _torch_compat.queue_callback(at_end)

    @property
    def ran_forward(self) -> bool:
        """Whether a forward ran through this unit (before it, which unit is the root of its
        model is not known: torch's FSDP2 decides it lazily too)."""
        return self.forward_order is not None

    @property
    def is_root(self) -> bool:
        """Whether this unit started the last forward it ran in (its model's outermost)."""
        return self.root_order is not None

    def reduce_held_back(self) -> bool:
        """Reduce the gradients backwards without sync summed here, now that sync is on
        (torch's ``finalize_backward``: a schedule that reduces gradients as an action of its
        own), adding the reduced shards to the parameters' ``.grad`` as autograd would have.
        Returns whether there was anything to reduce (the same on every rank: the same
        backwards ran everywhere)."""
        if not self.requires_gradient_sync or self._accumulated is None:
            return False
        reduced = self.reduce_grads([None] * len(self.params))
        for param, grad in zip(self.params, reduced, strict=True):
            if grad is not None:
                held = param.sharded.grad
                param.sharded.grad = grad if held is None else held + grad
        return True

    def reset(self) -> None:
        """Forget every gathered copy and every gradient held back for a later reduction:
        after an exception aborted a forward or backward (torch's ``reset_iter_state``)."""
        self.drop_prefetched()
        self._full = self._kept = self._accumulated = self._partial = None
        self._post_forward = None
        self._full_for_weight_grads = False
        self._release_task = -1
        self._recomputed = None
        self._running = 0
        self.close_forward_gather()
        self.reshard()

    # -- hooks -----------------------------------------------------------------------------
    def adopt_replaced(self) -> None:
        """Take the parameters torch's conversion put in this unit's places without devmesh
        (``child.to_empty()`` on a plain child module): torch's FSDP2 re-reads its parameters
        by name the same way. A tied weight replaced in one place only is tied again."""
        replaced = replaced_parameters((module, name, p.sharded) for p in self.params
                                       for module, name in p.places)
        if replaced:
            self.follow(replaced)

    @_torch_compat.eager  # collectives on devmesh's mesh: eager under torch.compile
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        consensus.settle_held()  # the setup's checks held back (the first forward ends it)
        if self._owners is None:  # the places are fixed when the unit is made
            self._owners = list({id(m): m for p in self.params for m, _ in p.places}.values())
        for owner in self._owners:
            refuse_torch_fsdp_over_blocks(owner)  # torch's fully_shard applied over this unit
        root = not forward_running()  # this unit starts the forward
        if _torch_compat.current_graph_task_id() == -1:
            self._recomputed = None  # left by a backward that raised before its end
            if self._full is not None and not self._full_for_weight_grads:
                self._release_full()  # the same
        self.adopt_replaced()
        if root:
            self._running = 0  # nothing runs: a count left by a forward that raised
        enter_forward(self)
        shards = [p.sharded for p in self.params]
        cast = self._cast_inputs(args, kwargs)
        if self._running:  # a module of this group called inside another's forward: the
            self._running += 1  # parameters are gathered already, and stay so until it ends
            self._to_run.discard(id(module))
            return cast
        if not shards:
            self.forward_order.prefetch_after(self)
            return cast
        if self.slots is Slots.FORWARD and id(module) in self._to_run:
            fulls = self._open  # an earlier module of the group gathered them this forward
        else:
            self.close_forward_gather()  # a module of the group running again: its own gather
            fulls = _Unshard.apply(self, *shards)
            self._place(Slots.FORWARD, fulls)
            self._open, self._to_run = fulls, {id(m) for m in self.modules}
            keep_open(self)
        # the next unit's all-gather overlaps this unit's forward
        self.forward_order.prefetch_after(self)
        for other in self.forward_prefetch:  # torch's explicit list, the same on every rank
            other.prefetch()
        reshard = self.reshard_after_forward
        if reshard is None:  # torch's default: the root's backward starts at once, keep it
            reshard = not root
        if reshard and torch.is_grad_enabled() and not users_saved_tensor_hooks():
            storages = {_storage_address(f): i for i, f in enumerate(fulls)}
            self._hooks = torch.autograd.graph.saved_tensors_hooks(
                lambda t: self._pack(t, storages), self._unpack)
            self._hooks.__enter__()
            if self.post_forward_size is not None:
                self._post_forward = self._post_forward_rows(list(fulls))
        self._running = 1
        return cast

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Floating-point inputs in the compute dtype, positional and keyword, inside lists,
        tuples and dicts too, as torch's FSDP2 casts them (``None``: leave the inputs as
        they are)."""
        dtype = self.mp.param_dtype
        if dtype is None or not self.mp.cast_forward_inputs:
            return None
        return _torch_compat.pytree.tree_map_only(
            torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t,
            (args, kwargs))

    @_torch_compat.eager
    def post_forward(self, module: nn.Module, args, output):
        self._running = max(0, self._running - 1)
        if self._running:  # the outer module of the group is still running
            exit_forward(self)
            return self._cast_output(output)
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        self._to_run.discard(id(module))
        if not self._to_run:  # every module of the unit ran: reshard
            self.close_forward_gather()
        exit_forward(self)
        return self._cast_output(output)

    def close_forward_gather(self) -> None:
        """Put the shards back in every place: the gather serves no more of the group's
        modules in this forward (their backward re-gathers, or uses what autograd saved)."""
        if self.slots is not Slots.FORWARD:
            return
        self._open, self._to_run = None, set()
        self._place(Slots.SHARDS)

    def _cast_output(self, output):
        """Floating-point outputs in ``mp_policy.output_dtype``, if set."""
        dtype = self.mp.output_dtype
        if dtype is None:
            return output
        return _torch_compat.pytree.tree_map_only(
            torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, output)

    def _pack(self, t: torch.Tensor, storages: dict[int, int]):
        """What autograd keeps for a tensor the unit's forward saves: a handle for a view of
        a gathered parameter (backward gathers it again), any other tensor as autograd keeps
        it without hooks (:class:`SavedActivation`)."""
        # torch's styles (a parameter torch's tensor parallelism made) save the DTensor view
        # of the gathered block: recognized by its local tensor, rebuilt in backward
        local = t._local_tensor if is_dtensor(t) else t
        index = storages.get(_storage_address(local))
        if index is None:
            return SavedActivation(t)
        as_dtensor = (t.device_mesh, t.placements, t.shape, t.stride()) if local is not t else None
        return (_HANDLE, index, tuple(local.shape), local.stride(), local.storage_offset(),
                as_dtensor)

    def _unpack(self, packed):
        if isinstance(packed, SavedActivation):
            return packed.unpack()
        _, index, shape, stride, offset, as_dtensor = packed
        view = self.full_for_backward()[index].as_strided(shape, stride, offset)
        if as_dtensor is None:
            return view
        from torch.distributed.tensor import DTensor  # imported already: a DTensor was saved

        mesh, placements, global_shape, global_stride = as_dtensor
        return DTensor.from_local(view, mesh, placements, run_check=False, shape=global_shape,
                                  stride=global_stride)

    def full_for_backward(self) -> list[torch.Tensor]:
        """The unit's parameters gathered for the running backward: kept, prefetched, or
        gathered now (once per backward; dropped when it ends or reduces)."""
        if self._full is None and self._kept is not None:
            self._full = self._kept
        if self._full is None:
            with torch.no_grad():
                pending, self._regather_pending = self._regather_pending, None
                if pending is None:
                    pending = self.start_regather()
                self._full = self.finish_gather(pending)
            self._regathered_now = True
            if self.forward_order is not None:
                self.forward_order.prefetch_backward_before(self)
            for other in self.backward_prefetch:  # torch's explicit list
                other.prefetch_for_backward()
        self._release_after_backward()
        return self._full

    # -- activation checkpointing inside the unit ------------------------------------------
    def watch_recomputation(self, unit_modules: list[nn.Module]) -> None:
        """Hook every module holding this unit's parameters (the unit's own modules aside):
        ``checkpoint(self.block, x)`` inside the unit's forward (torchtitan's order:
        checkpointing applied first, then ``fully_shard`` on the wrapper) recomputes
        ``block`` in backward, outside the unit's forward, where its parameters are the
        shards. torch's FSDP2 has its parameters unsharded for the unit's whole backward."""
        places: dict[nn.Module, list[tuple[int, str]]] = {}
        for i, p in enumerate(self.params):
            for module, name in p.places:
                if all(module is not own for own in unit_modules):
                    places.setdefault(module, []).append((i, name))
        for module, named in places.items():
            # first in, last out: a sequence-parallel style's hooks (applied before
            # fully_shard) then wrap the gathered parameters, as in the unit's forward
            module.register_forward_pre_hook(functools.partial(self._before_recompute, named),
                                             prepend=True)
            module.register_forward_hook(functools.partial(self._after_recompute, named),
                                         always_call=True)

    def _before_recompute(self, named: list[tuple[int, str]], module: nn.Module, args) -> None:
        """A forward inside a backward while the unit's parameters are the shards: a
        recomputation. Give it the gathered parameters, through a node whose backward
        reduces them, for reentrant checkpointing's backward through the recomputed graph
        (a non-reentrant one keeps the recomputed values only).

        Inside a compiled region (``block.compile()``, then ``fully_shard(block)``, as
        torchtitan orders them) it does nothing: a compiled graph recomputes in its own
        backward, never through module hooks, and returning at once keeps the hook from
        splitting the block's graph (reading the autograd task id is not traceable)."""
        if torch.compiler.is_compiling():
            return
        task = _torch_compat.current_graph_task_id()
        if task == -1:
            return
        if not any(module._parameters[name] is self.params[i].sharded for i, name in named):
            return  # the unit's forward is running (a forward called inside a backward)
        # outside any dispatch mode: selective checkpointing's replays the forward's
        # operations one for one, and the forward gathered outside the checkpointed region
        with _torch_compat.disable_current_modes():
            if self._recomputed is None or self._recomputed[0] != task:
                shards = [p.sharded for p in self.params]
                self._recomputed = (task, _Regather.apply(self, *shards))
                self._release_after_backward()  # drops _recomputed at the backward's end
            fulls = self._recomputed[1]
            for i, name in named:
                swap_parameter(module, name, self.params[i].in_place(fulls[i]))
        self._recomputing.add(id(module))

    def _after_recompute(self, named: list[tuple[int, str]], module: nn.Module, args,
                         output) -> None:
        if torch.compiler.is_compiling():
            return
        if id(module) in self._recomputing:  # only what _before_recompute swapped
            self._recomputing.discard(id(module))
            for i, name in named:
                swap_parameter(module, name, self.params[i].sharded)


def _post_forward_mesh(mesh: DeviceMesh, size: int) -> DeviceMesh:
    """``mesh`` with its shard dim (the last) split into groups of ``size`` consecutive
    ranks, the last dim: a layout for devmesh's collectives (no agreement, no groups of its
    own beyond the one :meth:`FSDPUnit.set_post_forward_size` makes)."""
    names = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
    shard = names[-1]
    shape = mesh.shape[:-1] + (mesh.shape[-1] // size, size)
    layout = MeshLayout(ranks=mesh.layout.ranks.reshape(shape),
                        names=names[:-1] + (f"{shard}_outer", f"{shard}_within_{size}"))
    return DeviceMesh._build(mesh.device_type, layout, timeout=mesh.timeout)


def users_saved_tensor_hooks() -> bool:
    """Are saved-tensor hooks other than a unit's own active: activation checkpointing
    around this unit (``checkpoint(block, x)``), ``torch.autograd.graph.save_on_cpu()``, a
    user's own? Only one pair applies at a time (the innermost), so a unit's own would
    replace them for everything its forward saves: the checkpoint would recompute nothing
    and keep every activation, the offload would copy none. With them active the unit sets
    none, and they save its gathered parameters too (as under torch's FSDP2): a checkpoint
    gathers them again to recompute, an offload copies them."""
    top = _torch_compat.saved_tensors_hooks_in_force()
    return top is not None and getattr(top[1], "__func__", None) is not FSDPUnit._unpack


def _add(accumulated: torch.Tensor | None, grad: torch.Tensor | None, dtype: torch.dtype
         ) -> torch.Tensor | None:
    """Accumulated micro-batch gradients, ``None`` while no micro-batch gave one."""
    if grad is None:
        return accumulated
    grad = grad.to(dtype)
    return grad if accumulated is None else accumulated + grad


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, unit: FSDPUnit, *shards):  # type: ignore[override]
        ctx.unit = unit
        ctx.set_materialize_grads(False)  # an unused parameter's gradient stays None
        return tuple(unit.gather(list(shards)))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        return (None, *ctx.unit.reduce_grads(list(grads)))


class _Regather(torch.autograd.Function):
    """The unit's parameters as gathered for the running backward (a recomputation's), fresh
    views; their gradients are reduced as the forward's are."""

    @staticmethod
    def forward(ctx, unit: FSDPUnit, *shards):  # type: ignore[override]
        ctx.unit = unit
        ctx.set_materialize_grads(False)
        return tuple(t.view(t.shape) for t in unit.full_for_backward())

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        return (None, *ctx.unit.reduce_grads(list(grads)))


def _storage_address(t: torch.Tensor) -> int | None:
    """Where ``t``'s data lives (a ``meta`` tensor's storage has no address: its storage
    object's identity stands in, shared by its views, so a dry run re-gathers for backward
    exactly as a real run does), or ``None`` for a tensor without storage of its own: a
    wrapper subclass such as the DTensor activations TP styles hand on with
    ``use_local_output=False`` (touching its storage raises "invalid python storage"); such
    a tensor is never a view of a gathered parameter, so autograd keeps it as it is."""
    if _torch_compat.is_traceable_wrapper_subclass(t):
        return None
    return _torch_compat.storage_key(t)
