"""What a checkpoint holds when ranks hold different tensors (pipeline stages): the union of
what every rank lists, each block written by a rank that lists it.

Most models list the same tensors on every rank, and each rank plans the save alone. A
pipelined model does not: stage ``i``'s parameters (and their optimizer state) live only on
the ranks of pipeline index ``i``. torch.distributed.checkpoint saves the union of the
ranks' state dicts; devmesh does the same: ranks are grouped by the digest of their listing,
one rank of each group shares its listing, and every rank merges the listings the same way
(:func:`merge_listings`, pure), so the plan is again the same on every rank.

A listing is plain JSON data, the same on every rank that holds the same tensors. Merging
checks what a union could otherwise hide:

* a tensor listed by several groups must be the same in all (dtype, global shape, layout);
* a tensor laid out on a mesh must be listed by every rank of the mesh's slice through each
  rank listing it — the ranks of one stage hold its tensors together, so a rank missing from
  its slice means the ranks' models or optimizers differ by mistake;
* optimizer parameter groups must have the same settings wherever they are listed.

Any failure raises :class:`~devmesh.errors.CheckpointError`, the same on every rank.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from devmesh.errors import CheckpointError
from devmesh.layout import format_ranks
from devmesh.parallel.checkpoint.blocks import Block
from devmesh.parallel.checkpoint.encoding import decode, encode

__all__ = ["Listed", "Merged", "merge_listings", "listed_json", "slice_ranks"]


@dataclass(frozen=True)
class Listed:
    """One tensor of a save: its key, how it is stored, and its distinct blocks with the
    ranks that hold each (only ranks that list it, once merged)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    itemsize: int
    text: str  # the layout in words, for ``devmesh ckpt info``
    mesh: dict[str, Any] | None
    blocks: tuple[Block, ...]
    slice_of: dict[str, Any] | None = None  # root ranks, root shape, the mesh's root dims

    def same_tensor(self, other: Listed) -> bool:
        return (self.dtype, self.shape, self.text, [(b.start, b.size) for b in self.blocks]) \
            == (other.dtype, other.shape, other.text, [(b.start, b.size) for b in other.blocks])


@dataclass
class Merged:
    """The whole save: every tensor once, the model's names, tied names, optimizer layout."""

    tensors: list[Listed]
    model_keys: list[str]
    aliases: dict[str, str]
    optimizer: dict[str, Any] | None


def listed_json(merged: Merged) -> str:
    """The listing as JSON text (what ranks share): deterministic, so equal listings have
    equal digests."""
    return json.dumps({
        "tensors": [{"key": t.key, "dtype": t.dtype, "shape": list(t.shape),
                     "itemsize": t.itemsize, "text": t.text, "mesh": t.mesh,
                     "blocks": [[list(b.start), list(b.size), list(b.holders)]
                                for b in t.blocks], "slice_of": t.slice_of}
                    for t in merged.tensors],
        "model": merged.model_keys, "aliases": merged.aliases, "optimizer": merged.optimizer,
    }, sort_keys=True)


def _parse(text: str) -> Merged:
    raw = json.loads(text)
    tensors = [Listed(t["key"], t["dtype"], tuple(t["shape"]), t["itemsize"], t["text"],
                      t["mesh"], tuple(Block(tuple(s), tuple(n), tuple(h))
                                       for s, n, h in t["blocks"]), t["slice_of"])
               for t in raw["tensors"]]
    return Merged(tensors, raw["model"], raw["aliases"], raw["optimizer"])


def slice_ranks(slice_of: dict[str, Any], rank: int) -> list[int]:
    """The ranks of the mesh slice through ``rank``: the root ranks that share ``rank``'s
    coordinates along every root dim the mesh does not use."""
    ranks = np.asarray(slice_of["ranks"]).reshape(slice_of["root_shape"])
    where = np.argwhere(ranks == rank)
    if not len(where):
        return []
    used = {d for dims in slice_of["dims"] for d in dims}
    index = tuple(slice(None) if d in used else int(c) for d, c in enumerate(where[0]))
    return sorted(int(r) for r in np.asarray(ranks[index]).reshape(-1))


def merge_listings(listings: Sequence[tuple[str, Sequence[int]]]) -> Merged:
    """Merge ``(listing JSON, ranks that listed it)`` pairs into one save: tensors in order of
    first appearance, each block's holders restricted to the ranks listing the tensor."""
    parsed = [(_parse(text), sorted(ranks)) for text, ranks in listings]
    first: dict[str, tuple[Listed, list[int]]] = {}
    listers: dict[str, list[int]] = {}
    for merged, ranks in parsed:
        for t in merged.tensors:
            if t.key not in first:
                first[t.key] = (t, ranks)
            elif not t.same_tensor(first[t.key][0]):
                seen, where = first[t.key]
                raise CheckpointError(
                    f"save_checkpoint: {t.key} differs between ranks {format_ranks(where)} "
                    f"({seen.dtype} {list(seen.shape)} {seen.text}) and ranks "
                    f"{format_ranks(ranks)} ({t.dtype} {list(t.shape)} {t.text}): the ranks' "
                    "models or optimizers differ")
            listers.setdefault(t.key, []).extend(ranks)
    tensors = [_restrict(t, sorted(listers[key])) for key, (t, _) in first.items()]
    model_keys: list[str] = []
    aliases: dict[str, str] = {}
    for merged, _ in parsed:
        model_keys += [k for k in merged.model_keys if k not in model_keys]
        aliases.update(merged.aliases)
    optimizers = [(m.optimizer, r) for m, r in parsed if m.optimizer is not None]
    return Merged(tensors, model_keys, aliases, _merge_optimizers(optimizers))


def _restrict(t: Listed, listed_by: list[int]) -> Listed:
    """``t`` with each block held only by ranks that list it, after checking that the ranks
    listing it hold it together (whole mesh slices)."""
    if t.slice_of is not None:
        have = set(listed_by)
        for rank in listed_by:
            lacking = [r for r in slice_ranks(t.slice_of, rank) if r not in have]
            if lacking:
                raise CheckpointError(
                    f"save_checkpoint: {t.key} is laid out over ranks "
                    f"{format_ranks(slice_ranks(t.slice_of, rank))}, but ranks "
                    f"{format_ranks(lacking)} do not list it: the ranks' models or optimizers "
                    "differ (every rank of a mesh must hold the same modules)")
    blocks = []
    for b in t.blocks:
        holders = tuple(r for r in b.holders if r in set(listed_by)) if t.slice_of else \
            tuple(listed_by)
        if not holders:
            raise CheckpointError(f"save_checkpoint: no rank listing {t.key} holds its block "
                                  f"at {list(b.start)}")
        blocks.append(Block(b.start, b.size, holders))
    return Listed(t.key, t.dtype, t.shape, t.itemsize, t.text, t.mesh, tuple(blocks),
                  t.slice_of)


def _merge_optimizers(optimizers: list[tuple[dict[str, Any], list[int]]]
                      ) -> dict[str, Any] | None:
    """One optimizer layout: state by parameter name (the union), and each parameter group's
    settings (which must agree) with the union of its parameters."""
    if not optimizers:
        return None
    (base, base_ranks), *others = optimizers
    state = dict(base["state"])
    groups = _groups(base)
    for optimizer, ranks in others:
        theirs = _groups(optimizer)
        if len(theirs) != len(groups):
            raise CheckpointError(
                f"save_checkpoint: the optimizers of ranks {format_ranks(base_ranks)} and "
                f"{format_ranks(ranks)} have {len(groups)} and {len(theirs)} parameter groups: "
                "build every rank's optimizer with the same groups")
        for i, (group, mine) in enumerate(zip(theirs, groups, strict=True)):
            settings = {k: v for k, v in group.items() if k != "params"}
            if settings != {k: v for k, v in mine.items() if k != "params"}:
                raise CheckpointError(
                    f"save_checkpoint: parameter group {i} has other settings on ranks "
                    f"{format_ranks(ranks)} than on ranks {format_ranks(base_ranks)}: "
                    "per-stage settings cannot be told apart on load; use the same settings")
            mine["params"] += [p for p in group["params"] if p not in mine["params"]]
        state.update(optimizer["state"])
    return {"state": state, "param_groups": encode(groups, _no_tensor, "param_groups")}


def _groups(optimizer: dict[str, Any]) -> list[dict[str, Any]]:
    """An optimizer listing's parameter groups, decoded (they hold no tensors)."""
    return [dict(g) | {"params": list(g["params"])}
            for g in decode(optimizer["param_groups"], _no_tensor, "param_groups")]


def _no_tensor(*_: Any) -> Any:
    raise CheckpointError("optimizer parameter groups hold no tensors")
