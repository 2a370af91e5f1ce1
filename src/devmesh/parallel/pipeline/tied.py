"""Parameters a model uses in more than one pipeline stage, such as a language model's input
embedding tied to its output head.

In one process a tied weight is one tensor: both uses add to its gradient. Split into stages
on different ranks it becomes one copy per rank, and each copy would learn only from its own
stage's use — training silently diverges from the unsplit model. Megatron keeps an
"embedding group" for this and DeepSpeed has "tied layers"; devmesh finds the ties itself when
:func:`~devmesh.parallel.pipeline.split_sequential` splits the model (the same ``Parameter``
object under several stages), and the runner keeps the copies one tensor:

* at construction, every copy takes the value of the copy in the lowest stage (so copies
  that were initialized apart start equal), after the holders checked that their copies
  have the same shape, dtype and sharding;
* after each step's backward, the holders exchange their gradients and each sets the sum,
  added in stage order on every holder, so the copies stay bitwise equal under any optimizer.

Only the ranks holding a tied parameter exchange it (point-to-point along the pipeline dim);
a stage that is itself data parallel or sharded has already reduced its gradient over those
dims, and its copy on another stage is sharded the same way, so the shards add up directly.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from devmesh.distributed import comm
from devmesh.layout.schedule import Schedule
from devmesh.mesh import DeviceMesh
from devmesh.parallel.param import get_layout

__all__ = ["Tie", "find_ties", "mark_ties", "record_ties", "TiedCopies"]

_ATTR = "pipeline_ties"  # set on every stage split_sequential returns
_TAG = 1 << 29  # apart from the pipeline messages (tag 0), which never overlap these in time


@dataclass(frozen=True)
class Tie:
    """One tensor of the unsplit model used by several stages: ``holders`` lists each
    ``(stage, parameter name in the model)`` that refers to it, in stage order."""

    holders: tuple[tuple[int, str], ...]

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(sorted({stage for stage, _ in self.holders}))


def find_ties(stages: Sequence[nn.Module]) -> tuple[Tie, ...]:
    """The parameters that appear (as the same object) in more than one of ``stages``."""
    seen: dict[int, list[tuple[int, str]]] = {}
    for index, stage in enumerate(stages):
        for name, param in stage.named_parameters(remove_duplicate=False):
            seen.setdefault(id(param), []).append((index, name))
    return tuple(Tie(tuple(holders)) for holders in seen.values()
                 if len({stage for stage, _ in holders}) > 1)


def mark_ties(stages: Sequence[nn.Module]) -> None:
    """Record the ties between ``stages`` on each of them, for the runner to find."""
    record_ties(stages, find_ties(stages))


def record_ties(stages: Sequence[nn.Module], ties: tuple[Tie, ...]) -> None:
    """Record ``ties`` (holders numbered by position in ``stages``) on each stage."""
    for stage in stages:
        setattr(stage, _ATTR, ties)


def ties_of(stages: Mapping[int, nn.Module]) -> tuple[Tie, ...]:
    """The ties recorded on this rank's stages (those of the stages' split)."""
    found: dict[Tie, None] = {}
    for stage in stages.values():
        found.update(dict.fromkeys(getattr(stage, _ATTR, ())))
    return tuple(found)


class TiedCopies:
    """This rank's copies of the model's tied parameters, kept equal to each other and to
    the other stages' copies."""

    def __init__(self, stages: Mapping[int, nn.Module], ties: Sequence[Tie], mesh: DeviceMesh,
                 dim: int, schedule: Schedule) -> None:
        self.mesh, self.dim = mesh, dim
        self.device = comm.mesh_device(mesh)
        me = mesh.get_coordinate()[dim]
        self._mine: list[tuple[int, list[int], list[nn.Parameter]]] = []
        for number, tie in enumerate(ties):
            indices = sorted({schedule.rank_of(stage) for stage in tie.stages})
            if me not in indices:
                continue
            params: dict[int, nn.Parameter] = {}
            for stage, name in tie.holders:
                if stage in stages:
                    param = stages[stage].get_parameter(name)
                    params.setdefault(id(param), param)
            copies = list(params.values())
            if len(indices) > 1 or len(copies) > 1:
                self._mine.append((number, indices, copies))
        self._me = me

    @property
    def counted_once(self) -> set[int]:
        """``id`` of the local copies that a global gradient norm leaves out: all but one
        copy of each tie, and every copy on a rank that is not the tie's lowest holder."""
        skip = set()
        for _, indices, copies in self._mine:
            keep = copies[0] if self._me == indices[0] else None
            skip.update(id(p) for p in copies if p is not keep)
        return skip

    def check_and_share_values(self) -> str | None:
        """Make every copy equal to the lowest stage's; what is wrong, if the copies differ
        in shape, dtype or sharding (then nothing is copied). Collective over each tie's
        holders: every holder sees the same mismatch."""
        problems = []
        for number, indices, copies in self._mine:
            local = [_describe(p) for p in copies]
            if len(set(local)) > 1:
                problems.append(f"tied parameter copies on this rank differ: {local}")
            theirs = self._exchange(number, indices, torch.tensor(local[0], dtype=torch.int64))
            if any(t.tolist() != list(local[0]) for t in theirs.values()):
                problems.append(f"tie #{number} (stages' copies of one tensor) is "
                                f"{_text(local[0])} here but "
                                f"{ {i: _text(t.tolist()) for i, t in theirs.items()} } on "
                                "other pipeline ranks: shard a tied parameter the same way "
                                "in every stage")
        if problems:
            return "; ".join(problems)
        for number, indices, copies in self._mine:
            with torch.no_grad():
                if len(indices) > 1:
                    first = self._from_lowest(number, indices, copies[0].detach())
                    copies[0].copy_(first)
                for copy in copies[1:]:
                    copy.copy_(copies[0])
        return None

    def add_gradients(self) -> None:
        """Set every copy's gradient to the sum over all copies (collective over the holders
        of each tie; a copy without a gradient counts as zeros)."""
        for number, indices, copies in self._mine:
            local = torch.zeros_like(copies[0])
            for copy in copies:
                if copy.grad is not None:
                    local += copy.grad
            total = local
            if len(indices) > 1:
                parts = self._exchange(number, indices, local)
                parts[self._me] = local
                total = parts[indices[0]].clone()
                for index in indices[1:]:
                    total += parts[index]
            for copy in copies:
                if copy.grad is None:
                    copy.grad = total.clone()
                else:
                    copy.grad.copy_(total)

    def _exchange(self, number: int, indices: list[int], tensor: torch.Tensor
                  ) -> dict[int, torch.Tensor]:
        """Send ``tensor`` to every other holder and receive theirs (same shape)."""
        tensor = tensor.to(self.device).contiguous()
        others = [i for i in indices if i != self._me]
        sends = [comm.send_async(tensor, self.mesh, self.dim, i, _TAG + number) for i in others]
        received = {i: comm.recv(tensor.shape, tensor.dtype, self.mesh, self.dim, i,
                                 _TAG + number, self.device) for i in others}
        for pending in sends:
            pending.wait()
        return received

    def _from_lowest(self, number: int, indices: list[int], tensor: torch.Tensor
                     ) -> torch.Tensor:
        tensor = tensor.to(self.device).contiguous()
        if self._me == indices[0]:
            for pending in [comm.send_async(tensor, self.mesh, self.dim, i, _TAG + number)
                            for i in indices[1:]]:
                pending.wait()
            return tensor
        return comm.recv(tensor.shape, tensor.dtype, self.mesh, self.dim, indices[0],
                         _TAG + number, self.device)


def _describe(param: torch.Tensor) -> tuple[int, ...]:
    """Shape, dtype and sharding of a copy, as integers two ranks can compare."""
    layout = get_layout(param)
    sharding = zlib.crc32(repr(layout.spec).encode()) if layout is not None else 0
    dtype = zlib.crc32(f"{param.dtype} {tuple(param.shape)}".encode())  # sizes past the 8th
    sizes = list(param.shape[:8])
    return (param.ndim, *sizes, *([0] * (8 - len(sizes))), dtype, sharding)


def _text(described: Sequence[int]) -> str:
    ndim = min(described[0], 8)
    return f"shape {tuple(described[1:1 + ndim])} (dtype/sharding digest {described[-2:]})"
