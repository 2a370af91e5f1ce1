"""``replicate``: data parallelism (DDP) over a mesh of one or several dims.

Parameters and buffers are broadcast from the mesh's first rank (one collective per dtype),
so every replica starts equal. As in DDP (``forward_sync_buffers``, on by default), buffers
(BatchNorm's running statistics) are broadcast from the first rank again before each forward
that follows a training forward, so replicas evaluate and checkpoint alike.

During backward, gradients are packed into buckets (in the reverse order
of registration, about the order backward produces them); as soon as a bucket's gradients are
all accumulated, its all-reduce (averaging over the flattened group of the mesh's dims) starts
asynchronously, overlapping the rest of backward. At the end of backward every bucket is
waited on and copied back into ``param.grad``. A bucket's flat buffer is kept from step to
step, as DDP's is (never handed out: the gradients are copies, so one kept by the user is not
overwritten by the next step).

A communication hook (``module.register_comm_hook(state, hook)``, DDP's: torch's
``fp16_compress_hook``, PowerSGD, one's own) replaces a bucket's averaging: it gets the
bucket (torch's ``GradBucket`` methods: ``buffer()``, ``gradients()``, ``parameters()``,
``index()``, ``is_last()``, ``set_buffer()``) holding the local gradients, and returns a
future of the reduced buffer, which is copied back into ``param.grad``.

Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``) are
all-reduced as sparse tensors at the end of backward, one collective each, and stay sparse
(as in DDP, which gives those parameters buckets of their own): ``torch.optim.SparseAdam``
and SGD take them as in single-process training.

Parameters already sharded by tensor parallelism keep their layout: DDP replicates over the
given (data-parallel) mesh only — devmesh's tensor parallelism, or torch's, whose DTensor
parameters are held as devmesh blocks (:mod:`devmesh.parallel.dtensor_params`).
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from devmesh import _torch_compat
from devmesh.distributed import comm, consensus
from devmesh.mesh import DeviceMesh
from devmesh.parallel.conversion import KeepsLayouts
from devmesh.parallel.dtensor_params import (
    adopt_dtensor_parameters,
    hide_dtensor_views,
    show_dtensor_views,
)
from devmesh.parallel.param import (
    ParallelizeError,
    describe_tensors,
    get_layout,
    set_layout,
    world_mesh,
    GradientSyncControl,
    with_methods,
)
from devmesh.parallel.placement import replaced_parameters
from devmesh.parallel.compute_dtype import compute_in
from devmesh.parallel.fsdp.mixed_precision import MixedPrecisionPolicy
from devmesh.parallel.swap import swap_parameter
from devmesh.tensor import ShardingSpec

__all__ = ["replicate", "DataParallelState", "ReplicateModule", "GradBucket"]


_FLAGS = "ddp-used-flags"  # the purpose of the group the flags travel on under a hook


class _Bucket:
    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.ready = 0
        self.pending: comm.Pending | torch.futures.Future | None = None
        self.buffer: torch.Tensor | None = None
        self.used: torch.Tensor | None = None  # with a comm hook: the "used here" flags
        # the flat buffer the gradients are packed into, kept from step to step as DDP's
        # buckets are: made anew each step, it cost a fresh (zero-filled) allocation of
        # every gradient's bytes per step
        self.storage: torch.Tensor | None = None

    def flat(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The bucket's flat buffer of ``numel`` elements: the kept one where it fits."""
        kept = self.storage
        if kept is None or kept.numel() != numel or kept.dtype != dtype or kept.device != device:
            kept = self.storage = torch.empty(numel, dtype=dtype, device=device)
        return kept


class GradBucket:
    """What a DDP communication hook gets: torch's ``dist.GradBucket`` methods over one
    bucket's flat buffer of local gradients (torch's class cannot be built from Python)."""

    def __init__(self, index: int, last: bool, buffer: torch.Tensor,
                 params: list[nn.Parameter]) -> None:
        self._index, self._last, self._buffer, self._params = index, last, buffer, params

    def index(self) -> int:
        """The bucket's place among this model's buckets (0: the first reduced)."""
        return self._index

    def is_last(self) -> bool:
        """Whether this is the last bucket of the backward (PowerSGD counts steps by it)."""
        return self._last

    def buffer(self) -> torch.Tensor:
        """The flat local gradients of the bucket's parameters, in order."""
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def parameters(self) -> list[nn.Parameter]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient: views of :meth:`buffer`."""
        out, offset = [], 0
        for p in self._params:
            out.append(self._buffer[offset: offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out


class DataParallelState:
    """Buckets and hooks of one ``replicate`` call."""

    def __init__(self, module: nn.Module, mesh: DeviceMesh, bucket_cap_mb: float,
                 ignored: set[int] | frozenset[int] = frozenset(), *,
                 forward_sync_buffers: bool = True, init_params: bool = True,
                 init_buffers: bool = True, reduce_dtype: torch.dtype | None = None,
                 compute_dtype: torch.dtype | None = None) -> None:
        if mesh.get_coordinate() is None:
            raise ParallelizeError(f"rank {mesh.get_rank()} is not part of {mesh!r}")
        self.mesh = mesh
        self.dims = tuple(range(mesh.ndim))
        named = [(n, p) for n, p in module.named_parameters() if id(p) not in ignored]
        ignored_names = [n for n, p in module.named_parameters() if id(p) in ignored]
        # the settings too: another bucket size or buffer sync mismatches the collectives
        consensus.agree(mesh, self.dims, "replicate: every replica must hold the same parameters "
                   "(and ignore the same ones) and pass the same settings",
                   describe_tensors(module) + f"\nignored: {ignored_names}\n"
                   f"bucket_cap_mb={bucket_cap_mb}, forward_sync_buffers="
                   f"{forward_sync_buffers}, init_sync of parameters {init_params} and of "
                   f"buffers {init_buffers}, computing in {compute_dtype}, reducing in "
                   f"{reduce_dtype}")
        self.reduce_dtype = reduce_dtype  # None: the gradients' own
        self._ignored = [t for t in list(module.parameters()) + list(module.buffers())
                         if id(t) in ignored]
        # DDP's broadcast_buffers=False leaves even the first broadcast to the parameters
        first = ((list(module.parameters()) if init_params else [])
                 + (list(module.buffers()) if init_buffers else []))
        # a model built on the meta device has no values yet (to_empty and initialization
        # come later): its replicas are made equal before its first forward instead
        self._first_broadcast = first if any(t.is_meta for t in first) else []
        self._broadcast(first)
        # DDP's rule: sync before a forward unless the previous forward was without
        # gradients or without gradient sync (evaluation, no_sync)
        self.forward_sync_buffers = forward_sync_buffers
        self._sync_buffers_next = True
        self.requires_gradient_sync = True
        self._cap = int(bucket_cap_mb * 2**20)
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]  # averaged while they require gradients
        # every module slot holding one of them (a tied weight has several): where a
        # conversion run on a child alone (child.to_empty()) leaves its new parameters
        self._places = [(m, name, p) for m in module.modules()
                        for name, p in m._parameters.items()
                        if p is not None and id(p) not in ignored]
        # DDP's rule for which gradients come sparse: the weights of sparse embeddings
        self._sparse = {id(p) for m in module.modules()
                        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
                        for p in m.parameters(recurse=False)}
        self._hooked: set[int] = set()  # parameters with our gradient hook (it stays)
        self.comm_hook: tuple[object, Callable] | None = None  # DDP's register_comm_hook
        self._bucket(tuple(p.requires_grad for p in self._params))

    def _bucket(self, trainable: tuple[bool, ...]) -> None:
        """Buckets of the parameters that require gradients (the last parameters in the first
        bucket, about the order backward produces them), and a hook on each that fills its
        bucket."""
        self._trainable = trainable
        buckets: list[list[nn.Parameter]] = []
        current: list[nn.Parameter] = []
        size = 0
        self.sparse_params = [p for p, t in zip(self._params, trainable, strict=True)
                              if t and id(p) in self._sparse]
        for p, t in zip(reversed(self._params), reversed(trainable), strict=True):
            if not t or id(p) in self._sparse:
                continue
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= self._cap:
                buckets.append(current)
                current, size = [], 0
        if current:
            buckets.append(current)
        # inside a bucket, the parameters in registration order, as DDP's (a communication
        # hook sees them so: PowerSGD draws its random factors in that order)
        self.buckets = [_Bucket(params[::-1]) for params in buckets]
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._callback_queued = False
        # the hook lives on the tensor (C++), where Python's garbage collector cannot see
        # it: holding this state strongly would make the cycle param -> hook -> state ->
        # module -> param uncollectable, keeping the model and its mesh's process groups
        # alive forever; the module holds the state, the hook only a weak reference to it
        on_grad = weakref.WeakMethod(self._on_grad)
        hooked = [p for b in self.buckets for p in b.params] + self.sparse_params
        for p in (p for p in hooked if id(p) not in self._hooked):
            p.register_post_accumulate_grad_hook(lambda param: _call(on_grad, param))
            self._hooked.add(id(p))
        for p in self._params:
            if get_layout(p) is None:
                spec = ShardingSpec(self.mesh.shape, tuple(p.shape), ((),) * p.ndim,
                                    mesh_dim_names=self.mesh.mesh_dim_names)
                set_layout(p, self.mesh, spec)

    def _follow_requires_grad(self) -> None:
        """Parameters unfrozen (or frozen) since the buckets were made — fine-tuning that
        unfreezes the backbone after some steps — get buckets anew, so they are averaged
        (DDP keeps the set from construction and silently leaves them per rank). Every
        rank must change the same ones: checked with one small collective, on change only
        (ranks that changed differently all raise; a rank that changed alone waits in that
        check until the collective timeout names it)."""
        trainable = tuple(p.requires_grad for p in self._params)
        if trainable == self._trainable:
            return
        consensus.agree(self.mesh, self.dims, "replicate: every replica must train the same "
                   "parameters (requires_grad was changed differently on some ranks)",
                   " ".join(n for n, t in zip(self._names, trainable, strict=True) if t))
        self._bucket(trainable)

    def __deepcopy__(self, memo: dict) -> DataParallelState:
        """``copy.deepcopy(model)`` (an EMA copy, a frozen teacher) gives a model that
        averages its own gradients, as a deep copy of DDP does: tensor hooks do not travel
        with a copied parameter, so the copy's parameters get their own. The mesh (its
        process groups) is shared."""
        new = copy.copy(self)
        memo[id(self)] = new
        new._ignored = [copy.deepcopy(t, memo) for t in self._ignored]
        new._params = [copy.deepcopy(p, memo) for p in self._params]
        new._sparse = {id(c) for p, c in zip(self._params, new._params,
                                             strict=True) if id(p) in self._sparse}
        new._first_broadcast = [copy.deepcopy(t, memo) for t in self._first_broadcast]
        new._hooked = set()
        new._bucket(self._trainable)
        return new

    def follow(self, replaced: dict[int, torch.Tensor]) -> None:
        """``model.to_empty()`` / ``.to()`` made new parameter and buffer objects (see
        :mod:`devmesh.parallel.conversion`): average the new parameters' gradients (they get
        their own hooks) and keep the ignored ones ignored."""
        def new(t):
            return replaced.get(id(t), t)

        self._sparse = {id(new(p)) for p in self._params if id(p) in self._sparse}
        self._hooked = {id(p) for p in self._params
                        if id(p) in self._hooked and id(p) not in replaced}  # the new: none
        self._params = [new(p) for p in self._params]
        self._places = [(m, name, new(p)) for m, name, p in self._places]
        self._ignored = [new(t) for t in self._ignored]
        self._first_broadcast = [new(t) for t in self._first_broadcast]
        self._bucket(self._trainable)

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Give ``tensors`` (those not ignored) the mesh's first rank's values, in one
        broadcast of their bytes: every value arrives exactly, whatever its dtype — integers
        (BatchNorm's batch counter), ``bool`` and float8, which gloo cannot broadcast as
        such (torch's DDP fails there with "Invalid scalar type")."""
        ignored = {id(t) for t in self._ignored}
        tensors = [t for t in tensors if id(t) not in ignored and not t.is_meta]
        if not tensors or self.mesh.size() == 1:
            return
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in tensors])
            comm.broadcast(flat, self.mesh, self.dims, 0)
            offset = 0
            for t in tensors:
                nbytes = t.numel() * t.element_size()
                # copied out first: a piece's offset need not suit its dtype's alignment
                t.copy_(flat[offset: offset + nbytes].clone().view(t.dtype).view(t.shape))
                offset += nbytes

    def adopt_replaced(self) -> None:
        """Take the parameters a conversion run on a child module alone put in place of
        ours (``child.to_empty()``: torch's class, so devmesh's conversion did not run):
        average their gradients from now on and tie again what was tied. Without this the
        replicas trained apart, silently (their new parameters had no gradient hook)."""
        replaced = replaced_parameters(self._places)
        if not replaced:
            return
        for module, name, old in self._places:  # a tie replaced in one place: one again
            if id(old) in replaced:
                swap_parameter(module, name, replaced[id(old)])
        self.follow(replaced)

    def before_forward(self, module: nn.Module) -> None:
        """DDP's buffer sync: broadcast the buffers if the previous forward trained."""
        self.adopt_replaced()
        if self._first_broadcast:  # built on meta: the start every replica takes
            self._first_broadcast, first = [], self._first_broadcast
            self._broadcast(first)
        self._follow_requires_grad()
        if self.forward_sync_buffers and self._sync_buffers_next:
            self._broadcast(list(module.buffers()))

    def after_forward(self) -> None:
        self._sync_buffers_next = torch.is_grad_enabled() and self.requires_gradient_sync

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.requires_gradient_sync:  # accumulating: p.grad sums micro-batches locally
            return
        if not self._callback_queued:
            self._callback_queued = True
            _torch_compat.queue_callback(self._finish)
        bucket = self.bucket_of.get(id(param))
        if bucket is None:  # a sparse gradient: reduced at the end of backward
            return
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        # after the gradients, one "used here" flag per parameter: a parameter no rank
        # computed a gradient for keeps none (as in DDP and single-process training), so
        # optimizers skip it rather than moving it with a zero gradient
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        sparse = [p for p, g in zip(bucket.params, grads, strict=True) if g.is_sparse]
        if sparse:  # the same parameters on every rank: all raise, none waits
            raise ParallelizeError(
                f"replicate: a parameter of shape {tuple(sparse[0].shape)} got a sparse "
                "gradient, but only the weights of nn.Embedding/nn.EmbeddingBag with "
                "sparse=True are reduced as sparse (as in DDP); make its gradient dense")
        if self.comm_hook is not None:  # the hook reduces the gradients; the flags: _finish
            state, hook = self.comm_hook
            # a hook may issue collectives from its futures' callbacks (PowerSGD's second
            # all-reduce), on gloo's thread: the previous bucket's must all be issued before
            # this bucket's first, or ranks would issue them in different orders
            for other in self.buckets:
                if other is not bucket and other.pending is not None:
                    other.pending.wait()
            bucket.buffer = torch.cat([g.reshape(-1) for g in grads])
            bucket.used = torch.tensor([float(p.grad is not None) for p in bucket.params],
                                       device=grads[0].device)
            index = self.buckets.index(bucket)
            bucket.pending = hook(state, GradBucket(index, index == len(self.buckets) - 1,
                                                    bucket.buffer, bucket.params))
            if not isinstance(bucket.pending, _torch_compat.CFuture):  # torch.futures.Future too
                raise ParallelizeError(
                    f"the communication hook {getattr(hook, '__name__', hook)!r} returned "
                    f"a {type(bucket.pending).__name__}: a hook returns a "
                    "torch.futures.Future of the bucket's reduced buffer, as DDP's do "
                    "(dist.all_reduce(..., async_op=True).get_future())")
            return
        used = torch.tensor([float(p.grad is not None) for p in bucket.params],
                            dtype=grads[0].dtype, device=grads[0].device)
        pieces = [g.reshape(-1) for g in grads] + [used]
        dtype = functools.reduce(torch.promote_types, (t.dtype for t in pieces))
        if self.reduce_dtype is not None and dtype.is_floating_point:
            dtype = self.reduce_dtype  # mp_policy's reduce_dtype: each value cast once
        if any(t.requires_grad for t in pieces):  # backward(create_graph=True): a graph
            bucket.buffer = torch.cat(pieces).to(dtype)
        else:
            bucket.buffer = bucket.flat(sum(t.numel() for t in pieces), dtype, used.device)
            torch.cat(pieces, out=bucket.buffer)
        # summed, and divided by the replica count while copied back into ``param.grad``
        # (one pass over the gradients fewer than averaging in the bucket; the same values)
        bucket.pending = comm.all_reduce_async(bucket.buffer, self.mesh, self.dims, "sum")

    def reduce_accumulated(self) -> None:
        """Reduce the gradients accumulated without sync now, as the last backward with sync
        on would have: for a backward done in several autograd calls (a pipeline's
        zero-bubble ``W``), each of which would otherwise end in a reduction of every bucket
        (right values, since averaging is linear, but one all-reduce per call)."""
        self._finish()

    def _finish(self) -> None:
        self._callback_queued = False
        for bucket in self.buckets:
            if bucket.pending is None:  # some parameter got no gradient: reduce anyway
                self._launch(bucket)
        # under a comm hook, the "used" flags travel on a group of their own, beside the
        # hook's collectives (a hook may still be issuing some from its callbacks)
        flags_pending = self._start_hooked_flags()
        if self.comm_hook is not None:  # every hook's collectives issued before ours
            for bucket in self.buckets:
                bucket.pending.wait()
        sparse = [self._launch_sparse(p) for p in self.sparse_params]
        hooked_flags = flags_pending.wait() if flags_pending is not None else None
        replicas = None if self.comm_hook is not None else self.mesh.size()  # to divide by
        for bucket in self.buckets:
            assert bucket.pending is not None and bucket.buffer is not None
            flat = bucket.pending.wait()
            if hooked_flags is not None:  # a comm hook's future: the reduced buffer
                flat = flat[0] if isinstance(flat, (list, tuple)) else flat
                flags = hooked_flags[:len(bucket.params)]
                hooked_flags = hooked_flags[len(bucket.params):]
            else:
                flags = flat[flat.numel() - len(bucket.params):]
            if flags.is_meta:  # a dry run (devmesh.tools.dry_run): every gradient counts
                used = [1.0] * len(bucket.params)
            else:
                used = (flags.real if flags.is_complex() else flags).tolist()
            offset = 0
            for p, used_somewhere in zip(bucket.params, used, strict=True):
                chunk = flat[offset: offset + p.numel()].view_as(p)
                offset += p.numel()
                if chunk.is_complex() and not p.dtype.is_complex:
                    chunk = chunk.real  # a bucket widened by a complex parameter's gradient
                if used_somewhere == 0:
                    continue
                if (replicas is not None and p.grad is not None and not chunk.requires_grad
                        and not p.grad.requires_grad):
                    torch.div(chunk, replicas, out=p.grad)  # the average, in the bucket's dtype
                    continue
                if replicas is not None:
                    chunk = chunk / replicas
                if p.grad is None:
                    p.grad = chunk.to(p.dtype, copy=replicas is None)  # the bucket may be wider
                else:
                    p.grad.copy_(chunk)
            bucket.pending, bucket.buffer, bucket.used, bucket.ready = None, None, None, 0
        for p, pending in zip(self.sparse_params, sparse, strict=True):
            grad = pending.wait()
            if p.grad is not None or grad._nnz() > 0:  # none where no rank used it
                p.grad = grad

    def _start_hooked_flags(self) -> comm.Pending | None:
        """Under a comm hook, which parameters any rank used: every bucket's flags summed in
        one all-reduce (the hook reduces the gradients alone, as DDP's reducer all-reduces
        its "locally used" map apart from the hook), on a group of its own."""
        if self.comm_hook is None or not self.buckets:
            return None
        flags = torch.cat([b.used for b in self.buckets if b.used is not None])
        return comm.all_reduce_async(flags, self.mesh, self.dims, "sum", _FLAGS)

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """DDP's ``register_comm_hook``: ``hook(state, bucket)`` reduces each bucket of
        gradients from now on (see :class:`GradBucket`); once per model, as DDP's."""
        if self.comm_hook is not None:
            raise ParallelizeError("register_comm_hook or register_builtin_comm_hook can only "
                                   "be called once: this model has a communication hook "
                                   "already")
        if not callable(hook):
            raise ParallelizeError(f"Communication hook must be callable, got {hook!r}")
        group = getattr(state, "process_group", state)  # PowerSGDState holds its group
        if group is None and self.mesh.size() != dist.get_world_size():
            import warnings

            warnings.warn(
                f"register_comm_hook: this model is replicated over {self.mesh!r}, part of "
                "the world, and the hook's state names no process group: torch's hooks then "
                "reduce over the whole world. Pass the mesh's group (mesh.get_group() for a "
                "1-D mesh, mesh._flatten().get_group() for several dims)", stacklevel=3)
        comm.process_group(self.mesh, self.dims, _FLAGS)  # made now, on every rank together
        self.comm_hook = (state, hook)

    def _launch_sparse(self, param: nn.Parameter) -> comm.Pending:
        """Start averaging one sparse gradient (an embedding's: its rows are the sparse
        dim); a rank that did not use the parameter contributes no rows."""
        grad = param.grad
        if grad is None:
            grad = torch.sparse_coo_tensor(
                torch.empty((1, 0), dtype=torch.long, device=param.device),
                torch.empty((0, *param.shape[1:]), dtype=param.dtype, device=param.device),
                param.shape, check_invariants=True, is_coalesced=True)
        elif not grad.is_sparse:
            raise ParallelizeError(
                f"replicate: the weight of a sparse embedding (shape {tuple(param.shape)}) "
                "got a dense gradient; every rank must give it sparse ones")
        return comm.all_reduce_async(grad.coalesce(), self.mesh, self.dims, "avg")


def _call(method: weakref.WeakMethod, param: nn.Parameter) -> None:
    bound = method()
    if bound is not None:
        bound(param)


@_torch_compat.eager  # collectives on devmesh's mesh: eager under torch.compile
def _before_forward(module: nn.Module, args: tuple) -> None:
    module._devmesh_ddp.before_forward(module)  # type: ignore[attr-defined]


@_torch_compat.eager
def _after_forward(module: nn.Module, args: tuple, output: object) -> None:
    module._devmesh_ddp.after_forward()  # type: ignore[attr-defined]


def _show_views(module: nn.Module, args: tuple) -> None:
    show_dtensor_views(module)


def _hide_views(module: nn.Module, args: tuple, output: object) -> None:
    hide_dtensor_views(module)


class ReplicateModule(GradientSyncControl, KeepsLayouts):
    """What ``replicate`` adds to a module, for gradient accumulation as in DDP:
    ``no_sync()`` (a context) or ``set_requires_gradient_sync(False)`` lets gradients
    accumulate in ``param.grad`` without communication; the first backward with sync on
    averages the accumulated sum once."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        self._devmesh_ddp.requires_gradient_sync = bool(requires_gradient_sync)  # type: ignore[attr-defined]

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """DDP's communication hook (torch's ``fp16_compress_hook``, PowerSGD's
        ``powerSGD_hook``, one's own): ``hook(state, bucket)`` returns a future of the
        bucket's reduced gradients, used instead of devmesh's averaging. torch's hooks
        reduce over ``state`` (a process group; ``None``: the whole world), so a model
        replicated over part of the world passes its mesh's group."""
        self._devmesh_ddp.register_comm_hook(state, hook)  # type: ignore[attr-defined]


# DDP options that may be given as None (their default) without changing anything
_DDP_NONE = frozenset({"device_ids", "device_id", "output_device", "process_group",
                       "mixed_precision"})


def replicate(module: nn.Module, *, mesh: DeviceMesh | None = None,
              bucket_cap_mb: float = 25.0, ignored_params: set[nn.Parameter] | None = None,
              ignored_modules: Iterable[nn.Module] | None = None,
              device_mesh: DeviceMesh | None = None,
              forward_sync_buffers: bool | None = None,
              broadcast_buffers: bool | None = None,
              init_sync: bool = True,
              find_unused_parameters: bool = False,
              gradient_as_bucket_view: bool = False,
              static_graph: bool = False,
              mp_policy: MixedPrecisionPolicy | None = None,
              **ddp_options: object) -> nn.Module:
    """Data-parallel ``module`` over ``mesh`` (all of its dims): gradients are averaged.
    Returns ``module``; ``module._devmesh_ddp`` holds the state.

    Takes the arguments of both of torch's ``replicate`` functions: ``mesh`` (the FSDP-based
    one) or ``device_mesh`` (the DDP-based one; the same thing); neither: the whole world as
    a 1-D mesh. ``ignored_params`` and the parameters of ``ignored_modules`` are neither
    broadcast nor averaged: they stay each rank's own (buffers of ``ignored_modules`` too).

    Buffers follow DDP: ``forward_sync_buffers`` (default on) broadcasts them from the mesh's
    first rank before each forward that follows a training forward (with gradients, not
    under ``no_sync``); ``broadcast_buffers`` is DDP's older name — ``False`` there also
    skips the first broadcast, so buffers stay each rank's own. ``init_sync=False`` (DDP's)
    skips the first broadcast of parameters and buffers: each replica keeps its own start.

    DDP's ``find_unused_parameters``, ``gradient_as_bucket_view`` and ``static_graph`` are
    accepted and change nothing in the result: devmesh always finds unused parameters (one
    flag each in the reduction, so either value trains as DDP with ``True`` would), and the
    other two are DDP's memory and speed hints for its own reducer. Any other DDP option
    (devices, ``process_group``, DDP's mixed precision, ...) is refused with the fix.

    ``mp_policy`` (torch's FSDP-based ``replicate`` takes it too): compute in its
    ``param_dtype`` while the parameters keep their dtype (each module casts its own in its
    forward: :mod:`devmesh.parallel.compute_dtype`), gradients reduced in ``reduce_dtype``
    (``None``: as ``fully_shard`` under the running torch — ``param_dtype`` up to 2.14, the
    parameters' own from 2.15), inputs and outputs cast as FSDP casts them.

    Parameters torch's ``parallelize_module`` made (DTensors: torchtitan's DDP + TP) are held
    as devmesh blocks and shown to their modules as DTensors while the model runs
    (:mod:`devmesh.parallel.dtensor_params`)."""
    resolved = mesh if mesh is not None else device_mesh
    resolved = resolved if resolved is not None else world_mesh()
    # a refusal of one rank's own arguments is raised on every rank, not left to a hang
    with consensus.refused_everywhere(comm.process_group(resolved, range(resolved.ndim)),
                                 "replicate", ParallelizeError):
        if not isinstance(module, nn.Module):  # torch's FSDP-based replicate groups a list
            raise ParallelizeError(
                f"replicate takes one module, got a {type(module).__name__}: replicate the "
                "module holding them, or each one (gradients are averaged per parameter "
                "either way); fully_shard takes a list of modules as one unit")
        refused = sorted(k for k, v in ddp_options.items()
                         if v is not None or k not in _DDP_NONE)
        if refused:
            raise ParallelizeError(
                f"replicate does not take {', '.join(refused)}: devmesh's replicate "
                "runs on the mesh's devices and process groups (pass mesh= or device_mesh=; "
                "for mixed precision mp_policy=MixedPrecisionPolicy(...), as fully_shard's)")
        if mp_policy is not None and not all(hasattr(mp_policy, f) for f in (
                "param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")):
            raise ParallelizeError(
                f"replicate: mp_policy must be a MixedPrecisionPolicy (devmesh's or torch's), "
                f"got {type(mp_policy).__name__}")
        if getattr(module, "_devmesh_ddp", None) is not None:
            raise ParallelizeError("replicate was already applied to this module")
        if mesh is not None and device_mesh is not None and mesh is not device_mesh:
            raise ParallelizeError("replicate got both mesh and device_mesh: pass one (they "
                                   "are the same argument under torch's two names)")
    del find_unused_parameters, gradient_as_bucket_view, static_graph  # see the docstring
    mesh = resolved
    ignored = {id(p) for p in ignored_params or ()}
    ignored |= {id(t) for m in ignored_modules or ()
                for t in list(m.parameters()) + list(m.buffers())}
    # torch's tensor parallelism (torchtitan's DDP + TP): its DTensor parameters become
    # devmesh blocks, shown to their modules as DTensors while the model runs
    if adopt_dtensor_parameters(module, ignored, "replicate"):
        module.register_forward_pre_hook(_show_views)
        module.register_forward_hook(_hide_views, always_call=True)
    if forward_sync_buffers is not None:
        sync, init_buffers = forward_sync_buffers, True
    else:
        sync = init_buffers = broadcast_buffers if broadcast_buffers is not None else True
    compute = mp_policy.param_dtype if mp_policy is not None else None
    reduce = mp_policy.reduce_dtype if mp_policy is not None else None
    if reduce is None and _torch_compat.FSDP_REDUCES_IN_PARAM_DTYPE:
        reduce = compute
    state = DataParallelState(module, mesh, bucket_cap_mb, ignored,
                              forward_sync_buffers=sync, init_params=init_sync,
                              init_buffers=init_sync and init_buffers, reduce_dtype=reduce,
                              compute_dtype=compute)
    if mp_policy is not None:
        compute_in(module, mp_policy, ignored)
    module._devmesh_ddp = state  # type: ignore[attr-defined]
    # module-level functions that find the state on the module they are called with: a
    # deep copy of the module then syncs its own buffers
    module.register_forward_pre_hook(_before_forward)
    module.register_forward_hook(_after_forward)
    with_methods(module, ReplicateModule)
    return module
