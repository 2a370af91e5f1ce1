"""One step of a redistribution plan: a collective over some mesh dims, or a local operation,
with what it moves and copies (filled in by :mod:`devmesh.layout.traffic`)."""

from __future__ import annotations

from dataclasses import dataclass

from devmesh.layout.cost import CostModel
from devmesh.layout.spec import ShardingSpec

__all__ = ["Step", "COLLECTIVES"]

COLLECTIVES = ("all_to_all", "permute", "reduce_scatter", "all_reduce", "all_gather")


@dataclass(frozen=True)
class Step:
    """One step of a plan: a collective over ``mesh_dims`` or a local operation.

    ``nbytes`` is the collective's buffer on one rank as ``comm_stats`` counts it; ``wire``
    the bytes the rank receives from others (the algorithm's factor applied); ``copied`` the
    bytes the executor copies locally around the collective (reorders, packing, padding).
    """

    kind: str  # all_to_all | permute | reduce_scatter | all_reduce | all_gather | chunk | make_partial
    mesh_dims: tuple[int, ...]
    before: ShardingSpec
    after: ShardingSpec
    nbytes: int = 0
    tensor_dim: int | None = None  # reduce_scatter: the dim scattered; all_to_all: the target
    source_dim: int | None = None  # all_to_all: the dim gathered
    op: str | None = None
    group_size: int = 1
    wire: int = 0
    copied: int = 0

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVES

    @property
    def comm_kind(self) -> str:
        """The devmesh collective the step issues (a permute is an all-to-all)."""
        return "all_to_all" if self.kind == "permute" else self.kind

    def seconds(self, model: CostModel) -> float:
        """Predicted time: the collective (hops and bytes received) plus the local copies."""
        collective = (model.collective_seconds(self.comm_kind, self.group_size, self.wire)
                      if self.is_collective else 0.0)
        return collective + model.copy_seconds(self.copied)

    def describe(self) -> str:
        names = ", ".join(self.before.name(m) for m in self.mesh_dims)
        over = f"over ({names})" if len(self.mesh_dims) > 1 else f"over {names}"
        what = {
            "all_to_all": f"all_to_all {over}: dim {self.source_dim} -> dim {self.tensor_dim}",
            "permute": f"all_to_all {over}: each rank sends the pieces its peers' new blocks "
                       "overlap",
            "reduce_scatter": f"reduce_scatter({self.op}) {over} onto dim {self.tensor_dim}",
            "all_reduce": f"all_reduce({self.op}) {over}",
            "all_gather": f"all_gather {over}",
            "chunk": f"local chunk by ({names}) (no communication)",
            "make_partial": f"make partial over ({names}) (local, no communication)",
        }[self.kind]
        moved = f", {self.nbytes:,} bytes" if self.is_collective else ""
        return f"{what}{moved}  -> {self.after}"
