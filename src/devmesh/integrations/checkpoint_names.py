"""Where each of a model's tensors lies in a transformers checkpoint folder.

A checkpoint does not always store a tensor under the model's name: transformers renames
some keys when it loads them (Mixtral's ``block_sparse_moe.`` is the model's ``mlp.``) and
merges others (each expert's ``w1`` and ``w3`` — Qwen-MoE's ``gate_proj`` and ``up_proj``
— stacked over the experts and concatenated into the model's ``experts.gate_up_proj``), by
its own conversion mapping (``transformers.conversion_mapping``); its ``save_pretrained``
writes the original names back, and the checkpoints people download have them. This module
reads that mapping (transformers' own: never a copy of its patterns), so that
:func:`~devmesh.integrations.load_pretrained` finds each model tensor's source, and reads a
block of a merged tensor from the experts' own tensors: only the experts, and the rows of
each, that the block covers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from devmesh.integrations import transformers as hf

__all__ = ["Stored", "Stacked", "Source", "sources"]

Bounds = Sequence[tuple[int, int]]
"""A block: ``(start, size)`` along each dim of the model's tensor."""

Opener = Callable[["Stored"], object]
"""The safetensors slice of a stored tensor (``get_shape()``, indexing by slices)."""


@dataclass(frozen=True)
class Stored:
    """The model's tensor is the checkpoint's tensor ``key`` (in ``file``) as it is."""

    key: str
    file: Path

    def shape(self, open_: Opener) -> tuple[int, ...]:
        return tuple(open_(self).get_shape())

    def read(self, open_: Opener, bounds: Bounds) -> torch.Tensor:
        piece = open_(self)
        if not bounds:  # a 0-d tensor
            return piece[:]
        return piece[tuple(slice(start, start + size) for start, size in bounds)]

    def describe(self) -> str:
        return self.key


@dataclass(frozen=True)
class Stacked:
    """The model's tensor is the checkpoint's per-expert tensors stacked along a new dim 0
    (transformers' ``MergeModulelist(dim=0)``), one stack per part, the parts concatenated
    along ``concat_dim`` of the stacked tensor (``Concatenate(dim=...)``; ``None``: one part).
    ``parts[p][e]`` is expert ``e``'s tensor of part ``p``."""

    parts: tuple[tuple[Stored, ...], ...]
    concat_dim: int | None

    def shape(self, open_: Opener) -> tuple[int, ...]:
        extents = [self._expert_shape(part, open_) for part in self.parts]
        first = extents[0]
        if self.concat_dim is None:
            return (len(self.parts[0]), *first)
        along = self.concat_dim - 1
        for other in extents[1:]:
            if len(other) != len(first) or any(a != b for d, (a, b) in
                                               enumerate(zip(other, first)) if d != along):
                raise ValueError(f"its parts' shapes {first} and {other} cannot be "
                                 f"concatenated along dim {self.concat_dim}")
        return (len(self.parts[0]), *first[:along], sum(e[along] for e in extents),
                *first[along + 1:])

    @staticmethod
    def _expert_shape(part: tuple[Stored, ...], open_: Opener) -> tuple[int, ...]:
        shapes = {stored.shape(open_) for stored in part}
        if len(shapes) != 1:
            raise ValueError(f"its experts' tensors have different shapes {sorted(shapes)}")
        return shapes.pop()

    def read(self, open_: Opener, bounds: Bounds) -> torch.Tensor:
        (first, count), inner = bounds[0], list(bounds[1:])
        experts = []
        for e in range(first, first + count):
            if self.concat_dim is None:
                experts.append(self.parts[0][e].read(open_, inner))
                continue
            along = self.concat_dim - 1
            start, size = inner[along]
            pieces, offset = [], 0
            for part in self.parts:  # the rows of each part the block covers
                extent = part[e].shape(open_)[along]
                low, high = max(start, offset), min(start + size, offset + extent)
                if low < high:
                    rows = list(inner)
                    rows[along] = (low - offset, high - low)
                    pieces.append(part[e].read(open_, rows))
                offset += extent
            if not pieces:  # none: an empty block, from the first part
                rows = list(inner)
                rows[along] = (0, 0)
                pieces.append(self.parts[0][e].read(open_, rows))
            experts.append(torch.cat(pieces, dim=along))
        if experts:
            return torch.stack(experts)
        # no expert of the tensor on this rank: an empty block of the right shape and dtype
        empty = self.parts[0][0].read(open_, [(0, 0)] * len(inner))
        return empty.new_empty((0, *(size for _, size in inner)))

    def describe(self) -> str:
        return (f"{len(self.parts[0])} experts' "
                + " and ".join(part[0].key for part in self.parts) + " (and the other experts')")


Source = Stored | Stacked


def sources(model: nn.Module, files: dict[str, Path], names: Collection[str]
            ) -> tuple[dict[str, Source], list[str]]:
    """Each model tensor name the checkpoint ``files`` (key -> file) holds -> where to read
    it; and what cannot be read (a conversion this module does not perform, experts
    missing), each named. ``names``: the model's tensor names, against which a transformers
    checkpoint's keys gain or lose the model's ``base_model_prefix`` as transformers' loading
    does (a ``LlamaForCausalLM`` checkpoint's ``model.layers.0...`` into a ``LlamaModel``).
    A model that is not a transformers model reads keys as they are."""
    renamings, converters = _conversions(model)
    if not renamings and not converters:
        return {key: Stored(key, file) for key, file in files.items()}, []
    from transformers.core_model_loading import apply_renamings, rename_source_key

    found: dict[str, Source] = {}
    merged: dict[str, tuple[object, dict[str, dict[int, Stored]]]] = {}
    problems = []

    prefix = getattr(model, "base_model_prefix", None) or None
    known = dict.fromkeys(names, True)  # transformers asks which names the model has
    for key, file in files.items():
        name, pattern = rename_source_key(key, renamings, converters, base_model_prefix=prefix,
                                          meta_state_dict=known)
        if pattern is None:
            found[name] = Stored(key, file)
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        try:
            index = _expert_index(apply_renamings(key, renamings), pattern)
        except ValueError as exc:  # a key the pattern takes, with no expert number in it
            problems.append(f"{name}: {exc}")
            continue
        merged.setdefault(name, (converter, {}))[1].setdefault(pattern, {})[index] = \
            Stored(key, file)
    for name, (converter, by_pattern) in merged.items():
        try:
            found[name] = _stacked(converter, by_pattern)
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
    return found, problems


def _conversions(model: nn.Module) -> tuple[list, list]:
    """transformers' renamings and converters for ``model`` (none for any other model)."""
    if not hf.is_transformers_model(model):
        return [], []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # a transformers before 5 loads checkpoints under the model's names
        return [], []

    transforms = get_model_conversion_mapping(model)
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])


def _expert_index(key: str, pattern: str) -> int:
    """The number a source pattern's ``*`` stands for in ``key`` (the expert's index)."""
    match = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
    if match is None or not match.groups():
        raise ValueError(f"no expert number in {key!r} for transformers' pattern {pattern!r}")
    return int(match.group(1))


def _stacked(converter, by_pattern: dict[str, dict[int, Stored]]) -> Stacked:
    """The :class:`Stacked` source of a converter's keys, if its operations are the ones
    read here: ``MergeModulelist(dim=0)``, then ``Concatenate`` along a later dim when it has
    several parts."""
    operations = [type(op).__name__ for op in converter.operations]
    dims = [getattr(op, "dim", None) for op in converter.operations]
    patterns = list(converter.source_patterns)
    if operations == ["MergeModulelist"] and dims == [0] and len(patterns) == 1:
        concat_dim = None
    elif operations == ["MergeModulelist", "Concatenate"] and dims[0] == 0 and dims[1] >= 1:
        concat_dim = dims[1]
    else:
        raise ValueError(
            f"transformers converts its checkpoint tensors ({', '.join(patterns)}) with "
            f"{' then '.join(operations)}, which load_pretrained does not perform (it stacks "
            "experts and concatenates their parts); load the model with from_pretrained "
            "and parallelize it, or save the checkpoint in the model's own names")
    missing = [p for p in patterns if p not in by_pattern]
    if missing:
        raise ValueError(f"the checkpoint has no tensors for {missing}, beside "
                         f"{sorted(by_pattern)}")
    counts = {p: sorted(by_pattern[p]) for p in patterns}
    for pattern, indices in counts.items():
        if indices != list(range(len(indices))) or indices != counts[patterns[0]]:
            raise ValueError(f"the checkpoint's experts for {pattern!r} are numbered "
                             f"{indices}, not 0 to {len(counts[patterns[0]]) - 1} as for "
                             f"{patterns[0]!r}")
    return Stacked(tuple(tuple(by_pattern[p][e] for e in counts[p]) for p in patterns),
                   concat_dim)
