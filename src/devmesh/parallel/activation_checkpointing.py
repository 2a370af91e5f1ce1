"""Activation checkpointing of a model's blocks, torchtitan's modes: none, full, selective
per op, or every k-th block in full.

A checkpointed block keeps only its inputs after its forward and runs again in backward to
rebuild what its backward needs; "selective" keeps, as torchtitan's op-level policy does, the
outputs of its attention and of every other matmul (the first, the third, ...: half of the
costly ops to recompute at about half of their memory) and recomputes the rest (the other
matmuls, norms, activations, element-wise ops). Blocks are wrapped in torch's non-reentrant
``checkpoint_wrapper`` in their parents' places, before FSDP wraps them (torchtitan's
order), so FSDP's gather covers the recomputation too. ``devmesh.parallel.parallelize`` and
the dry run (``devmesh plan --model ... --activation-checkpointing``) both checkpoint
through here.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from devmesh import _torch_compat
from devmesh.errors import ParallelizeError

__all__ = ["MODES", "MATMULS", "check_mode", "checkpoint_blocks", "saved_ops",
           "recomputed_inside"]

_INSIDE = threading.local()  # how deep this thread is in regions recomputed whole


@contextlib.contextmanager
def recomputed_inside() -> Iterator[None]:
    """Selective checkpointing keeps no op's output inside: the region (ring attention's
    blockwise loop, whose matmuls are each sequence-chunk pair's scores, quadratic in the
    chunk) is recomputed in backward from its inputs, as its own backward needs its inputs
    and outputs only."""
    _INSIDE.depth = getattr(_INSIDE, "depth", 0) + 1
    try:
        yield
    finally:
        _INSIDE.depth -= 1


def _inside() -> bool:
    return getattr(_INSIDE, "depth", 0) > 0

MODES = ("none", "full", "selective")
Mode = str | int


def check_mode(mode: Mode, what: str = "activation_checkpointing") -> None:
    """Refuse, by name, what is not one of :data:`MODES` or an int ``k >= 1``."""
    if isinstance(mode, bool) or not (mode in MODES or (isinstance(mode, int) and mode >= 1)):
        raise ParallelizeError(f"{what}={mode!r}: give one of {MODES}, or an int k >= 1 to "
                               "checkpoint every k-th block")


#: the matmuls, of which selective checkpointing keeps every other output in a block's forward
MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


@functools.cache
def _saved_set() -> frozenset:
    return frozenset(saved_ops())


def saved_ops() -> list:
    """The ops selective checkpointing considers keeping: matmuls (every other one kept,
    :data:`MATMULS`) and attention (always kept); everything else in a block is recomputed."""
    aten = torch.ops.aten
    ops = [*MATMULS, aten._scaled_dot_product_flash_attention.default,
           aten._scaled_dot_product_efficient_attention.default]
    for name in ("_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_cudnn_attention"):
        op = getattr(aten, name, None)
        if op is not None:
            ops.append(op.default)
    return ops


class _Choice:
    """One checkpointed forward's (or recomputation's) choices: which ops' outputs are kept.
    The matmuls are counted in the order they run, the first kept and the second recomputed
    alike in the forward and in its recomputation (torchtitan's "op" policy), so the two
    agree on what was kept."""

    def __init__(self) -> None:
        self._ops = _saved_set()  # each checkpointed forward makes a _Choice: built once
        self._matmuls = {False: 0, True: 0}  # counted in the forward, in the recomputation
        self.kept = False  # the last op's choice, read by :class:`_ReportSaved`

    def keep(self, op, recompute: bool) -> bool:
        keep = op in self._ops and not _inside()
        if keep and op in MATMULS:
            self._matmuls[recompute] += 1
            keep = self._matmuls[recompute] % 2 == 1
        self.kept = keep
        return keep


class _ReportSaved(_torch_compat.TorchDispatchMode):
    """Hands each output selective checkpointing's forward keeps to ``on_saved`` (entered
    inside that forward's caching mode: it sees the op first, and the choice once the op has
    run)."""

    def __init__(self, choice: _Choice, on_saved: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self._choice, self._on_saved = choice, on_saved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._choice.kept = False
        out = func(*args, **(kwargs or {}))
        if self._choice.kept:
            for t in _torch_compat.pytree.tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._on_saved(t)
        return out


def _selective_contexts(on_saved: Callable[[torch.Tensor], None] | None):
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    choice = _Choice()

    def policy(ctx, op, *_args, **_kwargs):
        return (CheckpointPolicy.MUST_SAVE if choice.keep(op, ctx.is_recompute)
                else CheckpointPolicy.PREFER_RECOMPUTE)

    forward, recompute = create_selective_checkpoint_contexts(policy)
    if on_saved is None:
        return forward, recompute
    stack = contextlib.ExitStack()
    stack.enter_context(forward)
    stack.enter_context(_ReportSaved(choice, on_saved))
    return stack, recompute


def checkpoint_blocks(root: nn.Module, blocks: Sequence[nn.Module], mode: Mode, *,
                      on_saved: Callable[[torch.Tensor], None] | None = None
                      ) -> list[nn.Module]:
    """Wrap the chosen ``blocks`` of ``root`` for ``mode`` (``"none"``: none; ``"full"``:
    all; ``"selective"``: all, keeping attention's outputs and every other matmul's; ``k``: every k-th,
    from the first, in full) in their parents' places; returns the blocks as ``root`` now
    holds them. ``on_saved`` (the dry run's count) gets each tensor a selective block keeps
    in its forward."""
    check_mode(mode)
    if mode == "none":
        return list(blocks)
    if not blocks:
        raise ParallelizeError(
            f"activation_checkpointing={mode!r} wraps the model's blocks, and "
            f"{type(root).__name__} names none: pass blocks=[...] (the decoder layers)")
    kwargs = {}
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(_selective_contexts, on_saved)
    every = mode if isinstance(mode, int) else 1
    where = {id(m): name for name, m in root.named_modules()}
    out = []
    for i, block in enumerate(blocks):
        if i % every:
            out.append(block)
            continue
        wrapped = _torch_compat.non_reentrant_checkpoint_wrapper(block, **kwargs)
        parent_name, _, child = where[id(block)].rpartition(".")
        setattr(root.get_submodule(parent_name), child, wrapped)
        out.append(wrapped)
    return out
