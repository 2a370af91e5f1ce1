"""When a data-parallel pipeline stage reduces its gradients: once per step, at its last
backward, after every micro-batch's gradients have accumulated locally.

A stage may be data parallel in one of three ways, each with its own switch:

- modules with ``set_requires_gradient_sync`` read at *backward* time (devmesh's
  ``replicate`` and ``fully_shard``, torch's FSDP2 ``fully_shard``): the runner turns sync on
  for the stage's last backward action and off for the others — unless the user turned a
  devmesh module's sync off before the step (accumulating over several steps): then it stays
  off for the whole step, and the step reduces nothing there;
- torch's ``DistributedDataParallel``: its reducer is armed by the *forward*
  (``prepare_for_backward`` at the end of a forward outside ``no_sync``) and expects that
  forward's backward next. A pipeline runs several forwards before their backwards, so every
  forward runs under ``no_sync()`` (nothing armed: the backwards accumulate locally), and the
  reducer is armed by hand just before the stage's last backward, which then reduces the
  accumulated gradients in DDP's buckets (with the user's comm hook, if any) — as torch's
  pipelining does for a DDP stage, here also for a DDP module inside a stage;
- torch's DDP-based composable ``replicate``: the same reducer, switched through its
  ``set_requires_gradient_sync``, which its forward hook reads; off for the step's forwards.

DDP's reducer reduces when autograd accumulates into ``.grad`` and must see every gradient of
the step in one backward, so a zero-bubble ``I``/``W`` split cannot spread a DDP stage's
weight gradients over several calls: such a stage does its whole backward in ``I``
(:attr:`StageGradSync.whole`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from devmesh import _torch_compat

__all__ = ["StageGradSync"]


class StageGradSync:
    """The data-parallel switches of one pipeline stage (none for a plain stage)."""

    def __init__(self, stage: nn.Module) -> None:
        self._ddp: list[DistributedDataParallel] = []
        self._composable: list[nn.Module] = []  # torch's DDP-based composable replicate
        self._switches: list[nn.Module] = []  # set_requires_gradient_sync read in backward
        for module in stage.modules():
            if isinstance(module, DistributedDataParallel):
                self._ddp.append(module)
            elif _is_composable_ddp(module):
                self._composable.append(module)
            elif hasattr(module, "set_requires_gradient_sync"):
                self._switches.append(module)
        self._wanted = [True] * len(self._switches)  # the user's settings, read each step
        # switches whose fully_shard unit another stage of this rank reduces (hold_for_later)
        self._held: set[int] = set()

    def hold_for_later(self, unit: object) -> None:
        """Keep ``unit``'s sync off in this stage's backwards: it groups modules of several
        stages of this rank (``fully_shard([stage_a, stage_b])``), and reduces once, at the
        last of those stages' final backwards, over everything the others accumulated."""
        self._held.update(id(module) for module in self._switches
                          if getattr(module, "_devmesh_fsdp", None) is unit)

    def problem(self, where: str) -> str | None:
        """Why this stage cannot run in a pipeline, if it cannot: DDP's ``static_graph``
        replays the first iteration's one-backward-per-forward order (measured: its reducer
        asserts in the first backward)."""
        # a composable replicate builds its DDP at its first forward, from these arguments
        pending = [_torch_compat.composable_replicate_state(m)[0] for m in self._composable]
        if any(ddp.static_graph for ddp in self._reducers()) or any(
                kwargs.get("static_graph") for kwargs in pending):
            return (f"{where} is under torch's DistributedDataParallel with "
                    "static_graph=True, whose reducer expects each forward's backward "
                    "before the next forward: build it without static_graph (the default) "
                    "or use devmesh.parallel.replicate")
        return None

    @property
    def whole(self) -> bool:
        """A zero-bubble ``I`` must do this stage's whole backward (DDP's reducer, above)."""
        return bool(self._ddp or self._composable)

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Around each of the stage's forwards: DDP's reducer left unarmed."""
        with contextlib.ExitStack() as stack:
            for module in self._ddp:
                stack.enter_context(module.no_sync())
            for module in self._composable:
                module.set_requires_gradient_sync(False)
            yield

    def start_step(self) -> None:
        """Before the step: read the user's sync setting of each switch."""
        self._wanted = [_user_sync(module) for module in self._switches]

    def before_backward(self, final: bool, outputs: Sequence[torch.Tensor]) -> None:
        """Before a backward action that computes weight gradients: ``final`` is the step's
        last one for this stage (it reduces, if the user's setting lets it), ``outputs`` what
        it starts from."""
        for module, wanted in zip(self._switches, self._wanted, strict=True):
            module.set_requires_gradient_sync(final and wanted and id(module) not in self._held)
        if final:
            for ddp in self._reducers():
                # DDP's own forward does this when not under no_sync; with find_unused_parameters
                # it finds the parameters this backward will not reach from the outputs
                ddp.reducer.prepare_for_backward(
                    list(outputs) if ddp.find_unused_parameters else [])

    @contextlib.contextmanager
    def one_reduction(self) -> Iterator[None]:
        """Around a backward that computes the stage's weight gradients in several autograd
        calls (zero-bubble's ``W``): devmesh's ``replicate`` reduces at the end of every
        backward call that reached its parameters (measured: 3 and 5 all-reduces per step on
        the stages of a (pp, dp) = (2, 2) zero-bubble pipeline, against 1 under 1F1B); here
        it accumulates through the calls and reduces once after them, if it was to reduce.
        The reduction runs even if a call raised, so the data-parallel peers' all-reduces
        are matched and the step's error is agreed on at its end rather than hanging.
        (``fully_shard`` reduces a unit in the one call that reaches its gather node.)"""
        replicas = [module._devmesh_ddp for module in self._switches
                    if getattr(module, "_devmesh_ddp", None) is not None
                    and module._devmesh_ddp.requires_gradient_sync]
        for state in replicas:
            state.requires_gradient_sync = False
        try:
            yield
        finally:
            for state in replicas:
                state.requires_gradient_sync = True
                state.reduce_accumulated()

    def end_step(self) -> None:
        """After the step: every switch back as the user set it (torch's composable
        replicate: on, as outside a pipeline). The modules come parent first, so a child
        unit's own setting is the one it keeps."""
        for module, wanted in zip(self._switches, self._wanted, strict=True):
            module.set_requires_gradient_sync(wanted)
        for module in self._composable:
            module.set_requires_gradient_sync(True)

    def _reducers(self) -> list[DistributedDataParallel]:
        reducers = list(self._ddp)
        for module in self._composable:
            ddp = _torch_compat.composable_replicate_state(module)[1]
            if ddp is not None:  # built at the module's first forward
                reducers.append(ddp)
        return reducers


def _user_sync(module: nn.Module) -> bool:
    """The gradient sync a devmesh ``fully_shard`` or ``replicate`` module is set to (on for
    anything else: torch's FSDP2 has no public way to read it)."""
    state = getattr(module, "_devmesh_fsdp", None) or getattr(module, "_devmesh_ddp", None)
    return True if state is None else bool(state.requires_gradient_sync)


def _is_composable_ddp(module: nn.Module) -> bool:
    """torch's DDP-based composable ``replicate`` (not the FSDP-based one, an FSDPModule)."""
    from torch.distributed.fsdp import FSDPModule

    return (_torch_compat.has_composable_replicate(module)
            and not isinstance(module, FSDPModule))
