"""FSDP2-style ``fully_shard``: per-parameter sharding on dim 0, HSDP on a 2-D mesh.

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
  it (backward prefetch), for the units whose backward needed them in the previous step;
* backward: the unit's gradients are reduce-scattered (averaged over the shard dim) in one
  collective, in ``mp_policy.reduce_dtype`` (else ``param_dtype``); on a 2-D
  ``(replicate, shard)`` mesh they are then all-reduced (averaged) over the replicate dim:
  hybrid sharding.

Applied after tensor parallelism, the unit shards each parameter's TP-local block, and the
spec records dim 0 as split by ``("tp", "dp")``, so ``full_tensor()`` reassembles exactly.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes, is_traceable_wrapper_subclass

from devmesh.distributed import comm, groups
from devmesh.mesh import DeviceMesh
from devmesh.parallel.conversion import KeepsLayouts
from devmesh.parallel.param import (
    ParallelizeError,
    combined_mesh,
    describe_tensors,
    get_layout,
    place_parameter,
    replaced_parameters,
    sharded_parameter,
    world_mesh,
    GradientSyncControl,
    with_methods,
)
from devmesh.parallel.saved_activation import SavedActivation
from devmesh.tensor import ShardingSpec
from devmesh.layout.spec import chunk_bounds

__all__ = ["fully_shard", "MixedPrecisionPolicy", "FSDPUnit", "FSDPModule", "UnshardHandle",
           "register_fsdp_forward_method", "share_comm_ctx", "parameters_grouped_with"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``param_dtype``: dtype of the gathered parameters (compute); ``reduce_dtype``: dtype of
    gradient reduction (``None``: ``param_dtype``, as torch; neither: the parameters' own);
    ``output_dtype``: floating-point outputs of the unit's forward are
    cast to it; ``cast_forward_inputs``: floating-point inputs of each unit's forward are
    cast to ``param_dtype`` (torch's default too). Sharded parameters (the optimizer's master
    copy) keep their dtype. The fields and their order are torch's, whose own
    ``MixedPrecisionPolicy`` ``fully_shard`` accepts as well."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass
class _Param:
    places: list[tuple[nn.Module, str]]  # every module attribute holding it (tied weights)
    sharded: nn.Parameter
    full_shape: tuple[int, ...]  # the (TP-local) shape FSDP shards
    padded_rows: int
    shape: tuple[int, ...]  # the parameter's own shape (differs for 0-d parameters)

    @property
    def padded_numel(self) -> int:
        return self.padded_rows * math.prod(self.full_shape[1:])


class FSDPUnit:
    """The parameters of one ``fully_shard`` call and the hooks that gather and reduce them.
    ``modules``: the module, or the modules grouped by one call (``fully_shard([a, b])``)."""

    def __init__(self, modules: nn.Module | Sequence[nn.Module], mesh: DeviceMesh,
                 reshard_after_forward: bool | None, mp_policy: MixedPrecisionPolicy | None,
                 ignored_params: set[nn.Parameter] | None = None) -> None:
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
        self.mp = mp_policy or MixedPrecisionPolicy()
        self._ignored = {id(p) for p in ignored_params or ()}
        self.params: list[_Param] = []
        self._full: list[torch.Tensor] | None = None  # gathered for backward (resharded case)
        # gradient accumulation (set_requires_gradient_sync(False)): unsharded gradients summed
        # here until a backward with sync reduces them once
        self.requires_gradient_sync = True
        self.reshard_after_backward = True
        self.gradient_divide_factor: float | None = None  # None: the mean over the data ranks
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
        self._open: tuple[torch.Tensor, ...] | None = None
        self._to_run: set[int] = set()  # ids of the group's modules not run since the gather
        # the gathered parameters a recomputation inside this backward uses (activation
        # checkpointing inside the unit), with the backward's task id
        self._recomputed: tuple[int, tuple[torch.Tensor, ...]] | None = None
        self._recomputing: set[int] = set()  # ids of the modules holding them now
        self._order: _ForwardOrder | None = None  # the record the last forward used
        self._root_order: _ForwardOrder | None = None  # owned when this unit is the root
        ignored = [n for root in roots for n, p in root.named_parameters()
                   if id(p) in self._ignored]
        comm.agree(mesh, tuple(range(mesh.ndim)),
                   "fully_shard: every rank must hold the same parameters (and ignore the "
                   "same ones)", "\n".join(map(describe_tensors, roots))
                   + f"\nignored: {ignored}")
        self._collect(roots)

    # -- setup -----------------------------------------------------------------------------
    def _collect(self, roots: list[nn.Module]) -> None:
        """Shard every parameter of the ``roots``' subtrees that no child unit owns. A
        parameter registered in several places (tied weights, within a module or across the
        modules of a group) becomes one sharded parameter that every place holds, gathered
        with the rest of the unit."""
        owned: dict[int, _Param] = {}

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
                other_unit = getattr(param, _SHARDED_BY, None)
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

    def _shard(self, module: nn.Module, name: str, param: nn.Parameter) -> _Param:
        shape = tuple(param.shape)
        data = param.detach().reshape(-1) if param.ndim == 0 else param.detach()
        full_shape = tuple(data.shape)
        start, size = chunk_bounds(full_shape[0], self.k, self.index)
        local = data.narrow(0, start, size).clone()
        spec_mesh, spec = self._spec(param, full_shape)
        new = sharded_parameter(local, param.requires_grad, spec_mesh, spec,
                                shape=() if param.ndim == 0 else None)
        setattr(param, _SHARDED_BY, self)
        place_parameter(module, name, new)
        padded_rows = -(-full_shape[0] // self.k) if full_shape[0] else 0
        entry = _Param([(module, name)], new, full_shape, padded_rows, shape)
        self.params.append(entry)
        return entry

    def _spec(self, old: nn.Parameter, full_shape) -> tuple[DeviceMesh, ShardingSpec]:
        """Where the new shard lies: dim 0 split by the shard dim, nested inside any split
        tensor parallelism already made (on the mesh spanning both)."""
        tp = get_layout(old)
        names = self.mesh.mesh_dim_names
        if tp is None:
            spec = ShardingSpec(self.mesh.shape, full_shape,
                                ((self.shard_dim,),) + ((),) * (len(full_shape) - 1),
                                mesh_dim_names=names)
            return self.mesh, spec
        mesh = combined_mesh(tp.mesh, self.mesh)
        index = {n: i for i, n in enumerate(mesh.mesh_dim_names)}
        old_names = tp.mesh.mesh_dim_names
        dim_map = [tuple(index[old_names[m]] for m in dims) for dims in tp.spec.dim_map]
        dim_map[0] = dim_map[0] + (index[names[self.shard_dim]],)
        spec = ShardingSpec(mesh.shape, tp.spec.global_shape, tuple(dim_map),
                            mesh_dim_names=mesh.mesh_dim_names)
        return mesh, spec

    def follow(self, replaced: dict[int, torch.Tensor]) -> None:
        """``model.to_empty()`` / ``.to()`` made new parameter objects (see
        :mod:`devmesh.parallel.conversion`): hold those, in every place (tied weights stay
        one), and forget anything gathered from the old ones."""
        for p in self.params:
            new = replaced.get(id(p.sharded))
            if new is None:
                continue
            assert isinstance(new, nn.Parameter)
            p.sharded = new
            for module, name in p.places:
                module._parameters[name] = new
        self._kept = self._full = self._accumulated = self._unsharded = None
        for pending in (self._prefetched, self._regather_pending):
            if pending is not None:
                pending.wait()
        self._prefetched = self._regather_pending = None

    # -- communication ---------------------------------------------------------------------
    def _gather_dtypes(self) -> list[torch.dtype]:
        """Each parameter's dtype when gathered: ``mp_policy.param_dtype``, else its own."""
        return [self.mp.param_dtype or p.sharded.dtype for p in self.params]

    def _segments(self, dtypes: list[torch.dtype]) -> tuple[list[int], int]:
        """Byte offset of each parameter's padded shard in a rank's row of the gather buffer,
        and the row's length. Parameters of different dtypes (a float32 norm in a bfloat16
        model) share the one all-gather as bytes; every segment starts at a multiple of the
        widest element size, so it can be viewed as its own dtype."""
        align = max(d.itemsize for d in dtypes)
        offsets, end = [], 0
        for p, dtype in zip(self.params, dtypes):
            offsets.append(end)
            end += -(-p.padded_numel * dtype.itemsize // align) * align
        return offsets, end

    def start_gather(self, shards: list[torch.Tensor]) -> comm.Pending:
        """Start the unit's one all-gather (packed, padded shards) asynchronously. The shards
        are copied once, straight into the send buffer (and cast on the way)."""
        dtypes = self._gather_dtypes()
        offsets, row_bytes = self._segments(dtypes)
        buffer = torch.empty(row_bytes, dtype=torch.uint8)
        for p, shard, dtype, start in zip(self.params, shards, dtypes, offsets):
            segment = buffer[start: start + p.padded_numel * dtype.itemsize].view(dtype)
            n = shard.numel()
            segment[:n].copy_(shard.detach().reshape(-1))
            segment[n:].zero_()
        return comm.all_gather_async(buffer, self.mesh, (self.shard_dim,))

    def finish_gather(self, pending: comm.Pending) -> list[torch.Tensor]:
        """Unpack the gathered buffer into the unit's full parameters."""
        stacked = pending.wait()
        dtypes = self._gather_dtypes()
        offsets, _ = self._segments(dtypes)
        out = []
        for p, dtype, start in zip(self.params, dtypes, offsets):
            nbytes_per_row = math.prod(p.full_shape[1:]) * dtype.itemsize
            rows = []
            for j in range(self.k):
                size = chunk_bounds(p.full_shape[0], self.k, j)[1]
                rows.append(stacked[j, start: start + size * nbytes_per_row].view(dtype))
            out.append(torch.cat(rows).view(p.full_shape))
        return out

    def gather(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """All parameters of the unit, unsharded, from one all-gather (a prefetched one if the
        previous unit started it)."""
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
        if (self._prefetched is None and self._kept is None and self._open is None
                and self._unsharded is None and self.params):
            self.adopt_replaced()
            self._prefetched = self.start_gather([p.sharded for p in self.params])

    def prefetch_for_backward(self) -> None:
        """Start re-gathering this unit's parameters for its backward (unless they are there
        or on their way, or its backward did not need them in the previous step)."""
        if self._backward_ran and not self._needed_regather:
            return
        if (self.params and self._full is None and self._kept is None
                and self._regather_pending is None):
            self._regather_pending = self.start_gather([p.sharded for p in self.params])

    def unshard(self) -> None:
        """torch's ``unshard()``: the unit's gathered parameters in its modules' places now
        (this call waits for the gather), until its next forward uses them, without another
        all-gather, or :meth:`reshard` puts the shards back."""
        if not self.params or self._open is not None:
            return  # nothing to gather, or a forward has them in place already
        if self._unsharded is None and self._kept is None:
            self.prefetch()
            pending, self._prefetched = self._prefetched, None
            self._unsharded = self.finish_gather(pending)
        fulls = self._unsharded if self._unsharded is not None else self._kept
        with torch.no_grad():
            for p, full in zip(self.params, fulls):
                for holder, name in p.places:
                    holder._parameters[name] = full.view(p.shape)

    def reshard(self) -> None:
        """The shards back in the modules' places, and nothing gathered kept (from
        ``unshard()``, a prefetch, or between micro-batches)."""
        self.drop_prefetched()
        self._kept = self._unsharded = None
        if self._open is None:
            for p in self.params:
                for holder, name in p.places:
                    holder._parameters[name] = p.sharded

    def drop_prefetched(self) -> None:
        """Wait for and drop gathers started ahead that were not used: parameters gathered
        before an optimizer step must never reach a later forward or backward."""
        for attr in ("_prefetched", "_regather_pending"):
            pending = getattr(self, attr)
            if pending is not None:
                pending.wait()
                setattr(self, attr, None)

    def reduce_grads(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Reduce-scatter (average) all gradients of the unit in one collective; HSDP adds one
        all-reduce over the replicate dims. Without gradient sync, add them to the unit's
        unsharded accumulated gradients instead and reduce nothing.

        A parameter that got no gradient (``None``: unused in the forward) on every rank
        keeps no gradient, as in single-process training and torch's FSDP2, so optimizers
        skip it (a zero gradient would still move it under weight decay or momentum); one
        flag per parameter rides in the same collective to tell which were used anywhere."""
        # torch's rule: reduce_dtype, else the compute dtype (param_dtype), else the
        # parameters' own; mixed dtypes reduce in the widest (float32 gradients beside
        # float64 ones are averaged exactly and rounded once, back into their own dtype)
        dtype = self.mp.reduce_dtype or self.mp.param_dtype or functools.reduce(
            torch.promote_types, (p.sharded.dtype for p in self.params))
        self._backward_ran = True
        if self._accumulated is not None:
            grads = [_add(a, g, dtype) for a, g in zip(self._accumulated, grads)]
            self._accumulated = None
        if not self.requires_gradient_sync:
            self._accumulated = [None if g is None else g.detach().to(dtype) for g in grads]
            self._drop_backward_state(keep=not self.reshard_after_backward)
            return [None] * len(self.params)
        # one buffer, row j for peer j: each gradient is copied (and cast) once, into place;
        # after the gradients, one "used here" flag per parameter in every row
        total = sum(p.padded_numel for p in self.params)
        stacked = torch.empty(self.k, total + len(self.params), dtype=dtype)
        stacked[:, total:] = torch.tensor([float(g is not None) for g in grads], dtype=dtype)
        offset = 0
        for p, grad in zip(self.params, grads):
            row = math.prod(p.full_shape[1:])
            for j in range(self.k):
                start, size = chunk_bounds(p.full_shape[0], self.k, j)
                target = stacked[j, offset: offset + p.padded_numel]
                if grad is None:
                    target.zero_()
                    continue
                target[: size * row].view(size, *p.full_shape[1:]).copy_(
                    grad.narrow(0, start, size))
                target[size * row:].zero_()
            offset += p.padded_numel
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
        if self.gradient_divide_factor is not None:
            mine[:total].div_(self.gradient_divide_factor)
        used = mine[total:].tolist()
        out: list[torch.Tensor | None] = []
        offset = 0
        for p, used_somewhere in zip(self.params, used):
            size = chunk_bounds(p.full_shape[0], self.k, self.index)[1]
            row = math.prod(p.full_shape[1:])
            local = mine[offset: offset + size * row].view(size, *p.full_shape[1:])
            out.append(local.to(p.sharded.dtype).view(p.sharded.shape) if used_somewhere > 0
                       else None)
            offset += p.padded_numel
        self._drop_backward_state(keep=False)  # the optimizer step follows: nothing kept
        return out

    def _drop_backward_state(self, keep: bool) -> None:
        """Backward of this unit is done: drop the re-gathered parameters (unless ``keep``:
        the next micro-batch's forward uses them without an all-gather)."""
        if keep and self._kept is None:
            self._kept = self._full
        if not keep:
            self._kept = None
        self._release_full()

    def _release_full(self) -> None:
        """Drop the parameters gathered for a backward, and a re-gather started for one."""
        self._full = None
        self._full_for_weight_grads = False
        if self._regather_pending is not None:  # prefetched but not needed this time
            self._regather_pending.wait()
            self._regather_pending = None

    def _release_after_backward(self) -> None:
        """Drop ``_full`` when the running backward ends, if its reduction did not (torch's
        FSDP2 reshards every group still unsharded at the end of a backward): a unit whose
        parameters are all frozen, or a backward that does not reach them (gradients of the
        inputs only), never reduces, and its gathered copy would otherwise serve the next
        backward after the values changed (an optimizer step, a load) — wrong gradients for
        the layers before it. Kept while a pipeline's ``W`` is to follow."""
        task = torch._C._current_graph_task_id()
        if task == self._release_task:
            return
        self._release_task = task

        def at_end() -> None:
            self._release_task = -1
            self._recomputed = None
            if self._full is not None:
                if _WEIGHT_GRADS_LATER[0]:
                    self._full_for_weight_grads = True
                    _KEPT_FOR_WEIGHT_GRADS.append(self)
                else:
                    self._release_full()

        torch.autograd.Variable._execution_engine.queue_callback(at_end)

    def reset(self) -> None:
        """Forget every gathered copy and every gradient held back for a later reduction:
        after an exception aborted a forward or backward (torch's ``reset_iter_state``)."""
        for attr in ("_prefetched", "_regather_pending"):
            pending = getattr(self, attr)
            if pending is not None:
                pending.wait()
                setattr(self, attr, None)
        self._full = self._kept = self._accumulated = self._partial = None
        self._full_for_weight_grads = False
        self._release_task = -1
        self._recomputed = None
        self._running = 0
        self._close()
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

    @torch._dynamo.disable  # collectives on devmesh's mesh: eager under torch.compile
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        root = _ORDER.active is None  # this unit starts the forward
        if torch._C._current_graph_task_id() == -1:
            self._recomputed = None  # left by a backward that raised before its end
            if self._full is not None and not self._full_for_weight_grads:
                self._release_full()  # the same
        self.adopt_replaced()
        if root:
            self._running = 0  # nothing runs: a count left by a forward that raised
        _ORDER.enter(self)
        shards = [p.sharded for p in self.params]
        cast = self._cast_inputs(args, kwargs)
        if self._running:  # a module of this group called inside another's forward: the
            self._running += 1  # parameters are gathered already, and stay so until it ends
            self._to_run.discard(id(module))
            return cast
        if not shards:
            self._order.prefetch_after(self)
            return cast
        if self._open is not None and id(module) in self._to_run:
            fulls = self._open  # an earlier module of the group gathered them this forward
        else:
            self._close()  # a module of the group running again: its own gather
            fulls = _Unshard.apply(self, *shards)
            for p, full in zip(self.params, fulls):
                for holder, name in p.places:
                    holder._parameters[name] = full.view(p.shape)
            self._open, self._to_run = fulls, {id(m) for m in self.modules}
            _OPEN.append(self)
        self._order.prefetch_after(self)  # the next unit's all-gather overlaps this unit's forward
        for other in self.forward_prefetch:  # torch's explicit list, the same on every rank
            other.prefetch()
        reshard = self.reshard_after_forward
        if reshard is None:  # torch's default: the root's backward starts at once, keep it
            reshard = not root
        if reshard and torch.is_grad_enabled() and not users_saved_tensor_hooks():
            storages = {f.untyped_storage().data_ptr(): i for i, f in enumerate(fulls)}
            self._hooks = torch.autograd.graph.saved_tensors_hooks(
                lambda t: self._pack(t, storages), self._unpack)
            self._hooks.__enter__()
        self._running = 1
        return cast

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Floating-point inputs in the compute dtype, positional and keyword, inside lists,
        tuples and dicts too, as torch's FSDP2 casts them (``None``: leave the inputs as
        they are)."""
        dtype = self.mp.param_dtype
        if dtype is None or not self.mp.cast_forward_inputs:
            return None
        return torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t,
            (args, kwargs))

    @torch._dynamo.disable
    def post_forward(self, module: nn.Module, args, output):
        self._running = max(0, self._running - 1)
        if self._running:  # the outer module of the group is still running
            _ORDER.exit(self)
            return self._cast_output(output)
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        self._to_run.discard(id(module))
        if not self._to_run:  # every module of the unit ran: reshard
            self._close()
        _ORDER.exit(self)
        return self._cast_output(output)

    def _close(self) -> None:
        """Put the shards back in every place: the gather serves no more of the group's
        modules in this forward (their backward re-gathers, or uses what autograd saved)."""
        if self._open is None:
            return
        self._open, self._to_run = None, set()
        for p in self.params:
            for holder, name in p.places:
                holder._parameters[name] = p.sharded

    def _cast_output(self, output):
        """Floating-point outputs in ``mp_policy.output_dtype``, if set."""
        dtype = self.mp.output_dtype
        if dtype is None:
            return output
        return torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, output)

    def _pack(self, t: torch.Tensor, storages: dict[int, int]):
        """What autograd keeps for a tensor the unit's forward saves: a handle for a view of
        a gathered parameter (backward gathers it again), any other tensor as autograd keeps
        it without hooks (:class:`SavedActivation`)."""
        index = storages.get(_storage_address(t))
        if index is None:
            return SavedActivation(t)
        return (_HANDLE, index, tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)

    def _unpack(self, packed):
        if isinstance(packed, SavedActivation):
            return packed.unpack()
        _, index, shape, stride, offset, dtype = packed
        return self.full_for_backward()[index].as_strided(shape, stride, offset)

    def full_for_backward(self) -> list[torch.Tensor]:
        """The unit's parameters gathered for the running backward: kept, prefetched, or
        gathered now (once per backward; dropped when it ends or reduces)."""
        if self._full is None and self._kept is not None:
            self._full = self._kept
        if self._full is None:
            with torch.no_grad():
                pending, self._regather_pending = self._regather_pending, None
                if pending is None:
                    pending = self.start_gather([p.sharded for p in self.params])
                self._full = self.finish_gather(pending)
            self._regathered_now = True
            if self._order is not None:
                self._order.prefetch_backward_before(self)
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
        (a non-reentrant one keeps the recomputed values only)."""
        task = torch._C._current_graph_task_id()
        if task == -1:
            return
        if not any(module._parameters[name] is self.params[i].sharded for i, name in named):
            return  # the unit's forward is running (a forward called inside a backward)
        # outside any dispatch mode: selective checkpointing's replays the forward's
        # operations one for one, and the forward gathered outside the checkpointed region
        with _disable_current_modes():
            if self._recomputed is None or self._recomputed[0] != task:
                shards = [p.sharded for p in self.params]
                self._recomputed = (task, _Regather.apply(self, *shards))
                self._release_after_backward()  # drops _recomputed at the backward's end
            fulls = self._recomputed[1]
            for i, name in named:
                module._parameters[name] = fulls[i].view(self.params[i].shape)
        self._recomputing.add(id(module))

    def _after_recompute(self, named: list[tuple[int, str]], module: nn.Module, args,
                         output) -> None:
        if id(module) in self._recomputing:  # only what _before_recompute swapped
            self._recomputing.discard(id(module))
            for i, name in named:
                module._parameters[name] = self.params[i].sharded


_HANDLE = object()


def users_saved_tensor_hooks() -> bool:
    """Are saved-tensor hooks other than a unit's own active: activation checkpointing
    around this unit (``checkpoint(block, x)``), ``torch.autograd.graph.save_on_cpu()``, a
    user's own? Only one pair applies at a time (the innermost), so a unit's own would
    replace them for everything its forward saves: the checkpoint would recompute nothing
    and keep every activation, the offload would copy none. With them active the unit sets
    none, and they save its gathered parameters too (as under torch's FSDP2): a checkpoint
    gathers them again to recompute, an offload copies them."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top is not None and getattr(top[1], "__func__", None) is not FSDPUnit._unpack


_SHARDED_BY = "_devmesh_sharded_by"  # on an original parameter: the unit that replaced it
# set while a pipeline computes input gradients only (zero-bubble's I): the weight-gradient
# half (W) follows later and may need the units' gathered parameters again
_WEIGHT_GRADS_LATER = [False]
_KEPT_FOR_WEIGHT_GRADS: list[FSDPUnit] = []  # units keeping a gather for a W to come


@contextlib.contextmanager
def weight_gradients_follow():
    """Around a backward of the input gradients alone whose weight gradients a later
    backward computes: units keep what they gathered for it until that one reduces, or
    until :func:`release_weight_gradient_gathers`."""
    before, _WEIGHT_GRADS_LATER[0] = _WEIGHT_GRADS_LATER[0], True
    try:
        yield
    finally:
        _WEIGHT_GRADS_LATER[0] = before


def release_weight_gradient_gathers() -> None:
    """Drop what units kept for weight gradients still to come (a pipeline step's end: a
    unit whose parameters are frozen has no ``W`` that would reduce and drop it)."""
    while _KEPT_FOR_WEIGHT_GRADS:
        unit = _KEPT_FOR_WEIGHT_GRADS.pop()
        if unit._full_for_weight_grads:
            unit._release_full()


class _ForwardOrder:
    """The order in which units run their forward, recorded on the first pass, so that each
    unit can start the next one's all-gather (prefetch). Every rank runs the same code, so
    every rank issues the prefetches in the same order. A prefetch not consumed by the end of
    the outermost forward (a unit skipped this time) is waited on and dropped, so no stale
    parameters survive an optimizer step."""

    def __init__(self) -> None:
        self.order: list[FSDPUnit] = []
        self.recording: list[FSDPUnit] | None = None
        self.depth = 0
        self.generation = -1
        # where in the recorded order the forward is: a unit may run several times in one
        # forward (the modules of a group, a module called twice), each time followed by
        # its own next unit
        self.cursor = 0
        self.following: int | None = None  # the index after the unit that entered last

    def enter(self, unit: FSDPUnit) -> None:
        if self.depth == 0:
            self.cursor = 0
            self.recording = [] if not self.order or self.order[0] is not unit else None
            for other in self.order:  # what backward needed last step predicts this step
                other._needed_regather, other._regathered_now = other._regathered_now, False
                other._running = 0  # no forward runs: a count left by one that raised
            if torch._C._current_graph_task_id() == -1:  # not a recompute inside backward
                for other in self._explicit_backward_targets():  # a prefetch never used
                    if other._regather_pending is not None:
                        other._regather_pending.wait()
                        other._regather_pending = None
        self.depth += 1
        if self.recording is not None:
            self.recording.append(unit)
            return
        self.following = None
        if unit in self.order:  # its next run in the record, else its first (order changed)
            at = (self.order.index(unit, self.cursor) if unit in self.order[self.cursor:]
                  else self.order.index(unit))
            self.cursor = self.following = at + 1

    def prefetch_after(self, unit: FSDPUnit) -> None:
        """Start the all-gather of the unit that ran after ``unit`` (which just entered)
        when the order was recorded."""
        if self.recording is not None or self.following is None:
            return
        if self.following < len(self.order):
            self.order[self.following].prefetch()

    def prefetch_backward_before(self, unit: FSDPUnit) -> None:
        """Backward runs units in reverse: start re-gathering the closest earlier unit whose
        backward needed its parameters in the previous step."""
        if unit not in self.order:
            return
        for other in reversed(self.order[: self.order.index(unit)]):
            if other._needed_regather and other.params:
                if other._full is None and other._regather_pending is None:
                    other._regather_pending = other.start_gather(
                        [p.sharded for p in other.params])
                return

    def exit(self, unit: FSDPUnit, failed: bool = False) -> None:
        self.depth -= 1
        if self.depth == 0:
            if self.recording is not None:  # a forward that raised records nothing
                self.order = [] if failed else self.recording
                self.recording = None
            for other in self._prefetch_targets():
                if other._prefetched is not None:
                    other._prefetched.wait()
                    other._prefetched = None

    def _prefetch_targets(self) -> list[FSDPUnit]:
        """The recorded units and those their explicit forward prefetch lists name."""
        named = [u for unit in self.order for u in unit.forward_prefetch if u not in self.order]
        return self.order + list(dict.fromkeys(named))

    def _explicit_backward_targets(self) -> list[FSDPUnit]:
        """The units the recorded units' explicit backward prefetch lists name: a unit whose
        backward did not run (its output unused) would otherwise keep a re-gather started
        before the optimizer step for its next backward."""
        return list(dict.fromkeys(u for unit in self.order for u in unit.backward_prefetch))


class _Orders:
    """One :class:`_ForwardOrder` per root: the unit that starts a forward (the outermost one)
    owns the record of that model's units, so two models (a copy, an EMA model) trained side
    by side each keep their own order and prefetches. A unit remembers the record its last
    forward used, for its backward."""

    def __init__(self) -> None:
        self.active: _ForwardOrder | None = None

    def enter(self, unit: FSDPUnit) -> None:
        if self.active is None:
            if unit._root_order is None or unit._root_order.generation != groups.generation():
                unit._root_order = _ForwardOrder()  # first forward, or a new world
                unit._root_order.generation = groups.generation()
            self.active = unit._root_order
        unit._order = self.active
        self.active.enter(unit)

    def exit(self, unit: FSDPUnit) -> None:
        order = self.active
        assert order is not None
        order.exit(unit, failed=sys.exc_info()[0] is not None)  # an always_call hook after
        # an exception runs inside torch's `except` block
        if order.depth == 0:
            self.active = None
            while _OPEN:  # a group some of whose modules did not run: resharded at the end
                _OPEN.pop()._close()  # of the forward, as torch's FSDP2 forces it


_ORDER = _Orders()
_OPEN: list[FSDPUnit] = []  # units whose gather is still in their modules' places


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


class FSDPModule(GradientSyncControl, KeepsLayouts):
    """What ``fully_shard`` adds to a module (torch FSDP2's names), for gradient accumulation
    and prefetching:

    * ``set_requires_gradient_sync(False)``: backward adds each unit's gradients to its
      unsharded accumulated gradients (memory: one full gradient per unit, as FSDP2) and
      reduces nothing; the next backward with sync on reduces the sum once;
    * ``set_reshard_after_backward(False)``: while gradients are not synchronized, a unit
      keeps its gathered parameters after backward, so the next micro-batch needs no
      all-gather (memory: one full copy of the unit's parameters);
    * ``no_sync()``: a context with sync off, as DDP's;
    * ``set_reshard_after_forward(bool)``: as the ``fully_shard`` argument, changed later;
    * ``set_gradient_divide_factor(f)``: this unit's gradients are summed over the
      data-parallel ranks and divided by ``f`` instead of averaged (this module's unit only,
      as torch's; torchtitan sets it on expert modules);
    * ``set_is_last_backward(bool)``: accepted; devmesh finishes every backward's reductions
      at its end, so there is nothing left for the last one to wait for;
      ``set_force_sum_reduction_for_comms(bool)``: accepted; devmesh never uses PreMulSum;
    * ``set_requires_all_reduce(False)``: HSDP accumulation, the all-reduce left to the last
      micro-batch;
    * ``unshard()`` / ``reshard()`` and ``set_modules_to_forward_prefetch`` /
      ``set_modules_to_backward_prefetch``: torch's explicit prefetching (this module's unit);
    * ``reset_iter_state()``: after a failed iteration, drop every gathered copy and held
      back gradient in the subtree; ``set_unshard_in_backward(bool)``: accepted (devmesh
      gathers in backward only what the backward uses); ``set_reduce_scatter_divide_factor``:
      torch's older name of ``set_gradient_divide_factor``.

    Not here: torch's CUDA stream and memory switches (``set_post_optim_event``,
    ``set_symm_mem_for_comm``, ``set_allocate_memory_from_process_group_for_comm``,
    ``set_reduce_scatter_max_input_buffers``), custom collectives
    (``set_custom_all_gather``, ``set_custom_reduce_scatter``,
    ``set_separate_reduce_scatter_group``), ``set_all_reduce_hook`` and
    ``set_reduce_scatter_unused_params``.

    Those with a ``recurse`` argument apply to every unit in the module's subtree
    (``recurse=False``: this one only); the others to this module's unit, as torch's."""

    def _units(self, recurse: bool) -> list[FSDPUnit]:
        modules = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        return [m._devmesh_fsdp for m in modules if getattr(m, "_devmesh_fsdp", None)]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        for unit in self._units(recurse):
            unit.requires_gradient_sync = bool(requires_gradient_sync)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        for unit in self._units(recurse):
            unit.reshard_after_backward = bool(reshard_after_backward)
            if reshard_after_backward:
                unit._kept = None

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True
                                  ) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ParallelizeError(f"set_reshard_after_forward takes True or False, got "
                                   f"{reshard_after_forward!r}")
        for unit in self._units(recurse):
            unit.reshard_after_forward = reshard_after_forward

    def set_gradient_divide_factor(self, factor: float) -> None:
        if not factor > 0:
            raise ParallelizeError(f"set_gradient_divide_factor takes a positive number, got "
                                   f"{factor!r}")
        for unit in self._units(False):  # this unit only, as torch's
            unit.gradient_divide_factor = float(factor)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for torch's FSDP2 code: nothing is pending after a devmesh backward."""

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True
                                ) -> None:
        """Under HSDP, ``False`` reduce-scatters each backward's gradients over the shard dim
        but leaves the all-reduce over the replicate dims (and the ``.grad`` update) to the
        next backward with it on, which adds the kept sum in: gradient accumulation with one
        all-reduce, as torch's. Without replicate dims it changes nothing."""
        for unit in self._units(recurse):
            unit.requires_all_reduce = bool(requires_all_reduce)

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this module's own unit now, as torch's: its modules then hold the full
        parameters (read them, run a method that uses them) until the next forward, which
        uses them without another all-gather (torch's explicit prefetch), or ``reshard()``.
        ``async_op=True`` starts the all-gather and returns a handle whose ``wait()`` puts
        the parameters in place; else this waits. As under torch's, an optimizer step
        between would leave the gathered copies stale: call it just before the forward."""
        unit = _unit_of(self, "unshard")
        unit.prefetch()
        handle = UnshardHandle(unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Put this module's shards back and drop what was gathered (by ``unshard()``, or
        kept between micro-batches by ``set_reshard_after_backward(False)``), freeing its
        memory."""
        _unit_of(self, "reshard").reshard()

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward (torch's recovery call): drop
        every gathered copy (prefetched, kept between micro-batches by
        ``set_reshard_after_backward(False)``, re-gathered for a backward) and the gradients
        held back for a later reduction (``set_requires_gradient_sync(False)``,
        ``set_requires_all_reduce(False)``), in every unit of this module's subtree: treat
        the failed iteration's micro-batches as lost and restart them, as torch's docs say.
        devmesh needs it less than torch: a forward that raises leaves the parameters
        sharded, and a backward that raised leaves no gathered copy for the next one; call
        it on the root (torch requires that; devmesh takes any ``fully_shard`` module)."""
        for unit in self._units(True):
            unit.reset()

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Accepted for torch's FSDP2 code: devmesh gathers a unit's parameters in backward
        only when the backward uses them (an embedding's does not), so there is nothing to
        switch off."""
        if not isinstance(unshard_in_backward, bool):
            raise ParallelizeError(f"set_unshard_in_backward takes True or False, got "
                                   f"{unshard_in_backward!r}")

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """torch's older name of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """When this module gathers in forward, also start the all-gathers of ``modules``
        (``fully_shard`` modules), in this order, on every rank alike. devmesh already
        prefetches the next unit by the recorded order; this adds to it, as torch's."""
        _unit_of(self, "set_modules_to_forward_prefetch").forward_prefetch = _units_named(
            modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """When this module re-gathers in backward, also start re-gathering ``modules``
        (``fully_shard`` modules) for their backward. A prefetch a module's backward does not
        use is dropped by the next forward (never used across an optimizer step)."""
        _unit_of(self, "set_modules_to_backward_prefetch").backward_prefetch = _units_named(
            modules, "set_modules_to_backward_prefetch")

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted for torch's FSDP2 code: devmesh's reductions are sums or averages, with a
        divide factor a sum then a division, never NCCL's PreMulSum (which gloo lacks:
        torch's FSDP2 needs this switch for ``set_gradient_divide_factor`` on CPU)."""


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns: ``wait()`` finishes the all-gather and puts
    the parameters in the modules' places."""

    def __init__(self, unit: FSDPUnit | None) -> None:
        self._unit = unit

    def wait(self) -> None:
        if self._unit is not None:
            self._unit.unshard()
            self._unit = None


def _unit_of(module: nn.Module, method: str) -> FSDPUnit:
    unit = getattr(module, "_devmesh_fsdp", None)
    if unit is None:  # a copy of the class without the unit, say
        raise ParallelizeError(f"{method}: this {type(module).__name__} has no fully_shard "
                               "unit of its own")
    return unit


def _units_named(modules, method: str) -> list[FSDPUnit]:
    units = []
    for module in modules:
        unit = getattr(module, "_devmesh_fsdp", None)
        if unit is None:
            raise ParallelizeError(
                f"{method}: {type(module).__name__} is not a module devmesh's fully_shard was "
                "applied to (torch's fully_shard modules and plain modules cannot be "
                "prefetched by devmesh): pass modules from devmesh.parallel.fully_shard")
        units.append(unit)
    return units


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
    but the root, whose parameters backward needs first; ``ignored_params`` stay plain,
    unsharded tensors whose gradients are not reduced; ``mp_policy`` may be torch's
    ``MixedPrecisionPolicy``. What devmesh does not do is refused with a clear error rather
    than silently ignored: resharding to a smaller world (an ``int``), a placement other
    than ``Shard(0)`` from ``shard_placement_fn``, offloading on a GPU mesh,
    ``dp_mesh_dims``, and embeddings with ``sparse=True`` (ignore them, and ``replicate``)."""
    modules = _grouped(module)
    for one in modules:
        if getattr(one, "_devmesh_fsdp", None) is not None:
            raise ParallelizeError(f"fully_shard was already applied to this "
                                   f"{type(one).__name__}")
    mesh = mesh if mesh is not None else world_mesh()
    for one in modules:
        _refuse_unsupported(one, mesh, reshard_after_forward, shard_placement_fn,
                            offload_policy, dp_mesh_dims, ignored_params)
    unit = FSDPUnit(modules, mesh, reshard_after_forward, mp_policy, ignored_params)
    for one in modules:
        one._devmesh_fsdp = unit  # type: ignore[attr-defined]
        with_methods(one, FSDPModule)
        # gather before any other pre-hook of the module (a sequence-parallel style's, say)
        one.register_forward_pre_hook(unit.pre_forward, prepend=True, with_kwargs=True)
        one.register_forward_hook(unit.post_forward, always_call=True)
    unit.watch_recomputation(modules)
    return module


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
    _units_named(modules, "share_comm_ctx")


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


def _refuse_unsupported(module: nn.Module, mesh: DeviceMesh, reshard_after_forward,
                        shard_placement_fn, offload_policy, dp_mesh_dims,
                        ignored_params) -> None:
    """Raise for an argument of torch's that devmesh cannot honour (the same on every rank:
    they are checked before any collective)."""
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise ParallelizeError(
            f"reshard_after_forward={reshard_after_forward} (reshard to a smaller world after "
            "forward) is not supported by devmesh: use True (reshard), False (keep) or None "
            "(keep the root only)")
    if shard_placement_fn is not None:
        from devmesh.layout.placement import Shard

        for name, param in module.named_parameters():
            placement = shard_placement_fn(param)
            if placement is not None and not (isinstance(placement, Shard)
                                              or type(placement).__name__ == "Shard"):
                raise ParallelizeError(
                    f"shard_placement_fn gave {placement!r} for {name}: devmesh shards over "
                    "the mesh given to fully_shard only (return None or Shard(0))")
            if placement is not None and placement.dim != 0:
                raise ParallelizeError(
                    f"shard_placement_fn gave {placement!r} for {name}: devmesh's fully_shard "
                    "shards dim 0 only (return None or Shard(0); transpose the parameter, "
                    "or shard it with distribute_tensor, for another dim)")
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
    for name, sub in module.named_modules():
        if (isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse
                and any(id(p) not in ignored for p in sub.parameters(recurse=False))):
            raise ParallelizeError(
                f"fully_shard cannot shard {name or type(sub).__name__}: an embedding with "
                "sparse=True gives sparse gradients, which cannot be reduce-scattered into "
                "shards; use sparse=False, or keep it out of the unit (ignored_params) and "
                "replicate it (replicate all-reduces sparse gradients)")


def _storage_address(t: torch.Tensor) -> int | None:
    """Where ``t``'s data lives, or ``None`` for a tensor without storage of its own: a meta
    tensor, or a wrapper subclass such as the DTensor activations TP styles hand on with
    ``use_local_output=False`` (touching its storage raises "invalid python storage"); such
    a tensor is never a view of a gathered parameter, so autograd keeps it as it is."""
    if t.device.type == "meta" or is_traceable_wrapper_subclass(t):
        return None
    return t.untyped_storage().data_ptr()
