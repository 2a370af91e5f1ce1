"""What ``fully_shard`` adds to a module: torch FSDP2's ``FSDPModule`` methods (gradient
accumulation, resharding switches, explicit prefetching), applied to the module's unit."""

from __future__ import annotations

from typing import Literal, overload

from torch import nn

from devmesh import _torch_compat
from devmesh.parallel.conversion import KeepsLayouts
from devmesh.parallel.fsdp.unit import FSDPUnit
from devmesh.parallel.param import GradientSyncControl, ParallelizeError


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
    * ``set_manual_backward_finalization(True)`` on the root, then ``finalize_backward()``
      after the backwards of a step: gradients held back by backwards without sync are
      reduced there once sync is on again (a schedule that reduces gradients as an action of
      its own), as torch's; ``finalize_backward(async_op=True)`` returns a
      ``GradientReductionHandle`` (devmesh's reductions are done when it returns);
    * ``set_keep_unsharded_storage(bool)``: accepted; torch keeps the gathered parameters'
      storage for CUDA graph capture, which devmesh's FSDP does not support (its gathered
      copies are allocated anew each time).

    * ``set_all_reduce_hook(hook)``: ``hook(reduced)`` runs on the unit's reduced gradient
      shards (after the reduce-scatter, or HSDP's all-reduce), before any divide factor, as
      torch's; it may change them in place (a reduction over a group of one's own);
    * ``set_reduce_scatter_unused_params(True)``: a parameter no rank used gets a zero
      gradient rather than none, as torch's (devmesh's collectives never mismatch when ranks
      use different parameters, with the switch or without);
    * torch's CUDA stream, memory and collective-scheduling switches are accepted and change
      nothing: ``set_post_optim_event`` (devmesh's collectives are ordered after the
      optimizer's work by the process group itself), ``set_symm_mem_for_comm``,
      ``set_allocate_memory_from_process_group_for_comm``,
      ``set_reduce_scatter_max_input_buffers``, ``set_separate_reduce_scatter_group``.

    Not here: custom collectives (``set_custom_all_gather``, ``set_custom_reduce_scatter``):
    they raise, naming why — a unit's collectives move packed bytes of every parameter.

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
                unit.forget_kept()

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

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """``True``: :meth:`finalize_backward` ends each step's backward, as torch's. Call it
        on the root module (the outermost ``fully_shard``), and not during a backward."""
        if not isinstance(enabled, bool):
            raise ParallelizeError(f"set_manual_backward_finalization takes True or False, "
                                   f"got {enabled!r}")
        unit = unit_of(self, "set_manual_backward_finalization")
        if unit.ran_forward and not unit.is_root:
            raise ParallelizeError(f"set_manual_backward_finalization must be called on the "
                                   f"root module (the outermost fully_shard), not on this "
                                   f"{type(self).__name__}")
        if _torch_compat.current_graph_task_id() != -1 and enabled != unit.manual_finalization:
            raise ParallelizeError("set_manual_backward_finalization cannot change mode "
                                   "during backward: set it before the forward")
        for each in self._units(True):
            each.manual_finalization = enabled

    @overload
    def finalize_backward(self, *, async_op: Literal[False] = False) -> None: ...

    @overload
    def finalize_backward(self, *, async_op: Literal[True]) -> GradientReductionHandle: ...

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """End the step's backward (torch's, with manual finalization on): every unit of the
        subtree that summed gradients over backwards without sync reduces them now, if sync
        is on again, into the parameters' ``.grad``. Before the first forward it does
        nothing. ``async_op=True`` returns a handle to ``wait()`` on (the reductions are
        already done when this returns: devmesh's collectives are issued and waited here)."""
        unit = unit_of(self, "finalize_backward")
        if not unit.ran_forward:
            return GradientReductionHandle(None) if async_op else None
        if not unit.is_root:
            raise ParallelizeError(f"finalize_backward must be called on the root module "
                                   f"(the outermost fully_shard), not on this "
                                   f"{type(self).__name__}")
        if not unit.manual_finalization:
            raise ParallelizeError(f"{type(self).__name__}.finalize_backward requires manual "
                                   "backward finalization: call "
                                   "set_manual_backward_finalization(True) before forward")
        if _torch_compat.current_graph_task_id() != -1:
            raise ParallelizeError("finalize_backward cannot run inside a backward: call it "
                                   "after every backward of the step returned")
        if unit.reduction_handle is not None:
            raise ParallelizeError("The previous gradient reduction must be waited on before "
                                   "finalizing backward again: call wait() on the handle "
                                   "finalize_backward(async_op=True) returned")
        for each in reversed(self._units(True)):  # backward's order: the innermost first
            each.reduce_held_back()
        if not async_op:
            return None
        handle = GradientReductionHandle(unit)
        unit.reduction_handle = handle
        return handle

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Accepted for torch's FSDP2 code: torch keeps the gathered parameters' storage
        across reshard and unshard for CUDA graph capture, which devmesh's FSDP does not
        support; devmesh allocates its gathered copies anew each time."""
        if not isinstance(keep, bool):
            raise ParallelizeError(f"set_keep_unsharded_storage takes True or False, got "
                                   f"{keep!r}")

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this module's own unit now, as torch's: its modules then hold the full
        parameters (read them, run a method that uses them) until the next forward, which
        uses them without another all-gather (torch's explicit prefetch), or ``reshard()``.
        ``async_op=True`` starts the all-gather and returns a handle whose ``wait()`` puts
        the parameters in place; else this waits. As under torch's, an optimizer step
        between would leave the gathered copies stale: call it just before the forward."""
        unit = unit_of(self, "unshard")
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
        unit_of(self, "reshard").reshard()

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
            if unit.reduction_handle is not None:
                unit.reduction_handle._invalidate()

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
        unit_of(self, "set_modules_to_forward_prefetch").forward_prefetch = units_named(
            modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """When this module re-gathers in backward, also start re-gathering ``modules``
        (``fully_shard`` modules) for their backward. A prefetch a module's backward does not
        use is dropped by the next forward (never used across an optimizer step)."""
        unit_of(self, "set_modules_to_backward_prefetch").backward_prefetch = units_named(
            modules, "set_modules_to_backward_prefetch")

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted for torch's FSDP2 code: devmesh's reductions are sums or averages, with a
        divide factor a sum then a division, never NCCL's PreMulSum (which gloo lacks:
        torch's FSDP2 needs this switch for ``set_gradient_divide_factor`` on CPU)."""


    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        """torch's hook on the reduced gradients: ``hook(reduced)`` gets this unit's reduced
        gradient shards as one flat tensor — after the reduce-scatter (FSDP) or after HSDP's
        all-reduce — before ``set_gradient_divide_factor``'s division, as torch's, and may
        change them in place. ``stream`` (a CUDA stream to run it on) is refused under HSDP,
        as torch refuses it, and otherwise taken: devmesh runs the hook where it reduces."""
        if not callable(hook):
            raise ParallelizeError(f"set_all_reduce_hook takes a callable, got {hook!r}")
        unit = unit_of(self, "set_all_reduce_hook")
        if stream is not None and unit.replicate_dims:
            raise ParallelizeError("set_all_reduce_hook: stream cannot be set when using "
                                   "HSDP (torch's rule): the hook runs after its all-reduce")
        unit.all_reduce_hook = hook

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """``True``: a parameter that no rank used in the backward gets a zero gradient (torch
        then includes it in the reduce-scatter); ``False`` (the default) leaves it without
        one. Either way devmesh's one reduce-scatter per unit carries every parameter, so
        ranks that use different parameters (mixture of experts) never mismatch."""
        for unit in self._units(recurse):
            unit.reduce_unused = bool(reduce_scatter_unused_params)

    def set_post_optim_event(self, event: object) -> None:
        """Accepted for torch's FSDP2 code: torch's all-gathers run on streams of their own,
        which must wait for the optimizer step; devmesh's run on the process group's, which
        c10d orders after the work already issued."""

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Accepted for torch's FSDP2 code (NCCL symmetric-memory staging buffers): devmesh's
        all-gather buffers are ordinary tensors."""

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted for torch's FSDP2 code (staging buffers from the process group's
        allocator): devmesh's buffers come from torch's allocator."""

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        """Accepted for torch's FSDP2 code: a devmesh unit reduces its gradients in one
        buffer, freed when its reduce-scatter returns."""

    def set_separate_reduce_scatter_group(self, enable: bool = True, *,
                                          recurse: bool = True) -> None:
        """Accepted for torch's FSDP2 code (a second process group so reduce-scatters overlap
        all-gathers): devmesh's collectives share the mesh's groups."""

    def set_custom_all_gather(self, comm: object) -> None:
        raise ParallelizeError(
            "set_custom_all_gather is not supported by devmesh: a unit's all-gather moves the "
            "packed bytes of all its parameters at once, which torch's AllGather objects do "
            "not describe; use torch's fully_shard for a custom collective")

    def set_custom_reduce_scatter(self, comm: object) -> None:
        raise ParallelizeError(
            "set_custom_reduce_scatter is not supported by devmesh: a unit's reduce-scatter "
            "moves every gradient and its used-here flags in one buffer; use "
            "set_all_reduce_hook for a reduction of one's own after it, or torch's "
            "fully_shard")


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns: ``wait()`` finishes the all-gather and puts
    the parameters in the modules' places."""

    def __init__(self, unit: FSDPUnit | None) -> None:
        self._unit = unit

    def wait(self) -> None:
        if self._unit is not None:
            self._unit.unshard()
            self._unit = None


class GradientReductionHandle:
    """What ``finalize_backward(async_op=True)`` returns (torch's): ``wait()`` before reading
    the gradients or finalizing again. devmesh's reductions are done when
    ``finalize_backward`` returns, so ``wait()`` only releases the handle; after
    ``reset_iter_state()`` it raises, as torch's."""

    def __init__(self, unit: FSDPUnit | None) -> None:
        self._unit = unit
        self._invalid = False

    def _invalidate(self) -> None:
        self._invalid = True
        if self._unit is not None:
            self._unit.reduction_handle = None
        self._unit = None

    def wait(self) -> None:
        if self._invalid:
            raise ParallelizeError("this GradientReductionHandle was invalidated by "
                                   "reset_iter_state(): the iteration's gradients were dropped")
        if self._unit is not None and self._unit.reduction_handle is self:
            self._unit.reduction_handle = None
        self._unit = None


def unit_of(module: nn.Module, method: str) -> FSDPUnit:
    unit = getattr(module, "_devmesh_fsdp", None)
    if unit is None:  # a copy of the class without the unit, say
        raise ParallelizeError(f"{method}: this {type(module).__name__} has no fully_shard "
                               "unit of its own")
    return unit


def units_named(modules, method: str) -> list[FSDPUnit]:
    units = []
    for module in modules:
        unit = getattr(module, "_devmesh_fsdp", None)
        if unit is None:
            raise ParallelizeError(
                f"{method}: {type(module).__name__} is not a module devmesh's fully_shard was "
                "applied to (torch's fully_shard modules and plain modules cannot be "
                "prefetched by devmesh): pass modules that devmesh.parallel.fully_shard sharded")
        units.append(unit)
    return units
