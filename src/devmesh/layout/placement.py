"""PyTorch-style placements: what one mesh dimension does to a tensor.

``Shard(d)`` splits tensor dim ``d`` across the mesh dim, ``Replicate()`` keeps a full copy on
every rank of it, ``Partial(op)`` holds a partial value that the mesh dim reduces with ``op``.
A list with one placement per mesh dim converts to and from a
:class:`~devmesh.layout.spec.ShardingSpec`, the form devmesh computes with; placements cannot
state nesting (FSDP over TP splits a dim by ``tp`` first, then ``dp``), the spec can.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Placement", "Shard", "Replicate", "Partial", "REDUCE_OPS", "as_placement"]

REDUCE_OPS = ("sum", "avg", "max", "min")


class Placement:
    """Base class of the per-mesh-dim placements."""


@dataclass(frozen=True)
class Shard(Placement):
    """Split tensor dim ``dim`` across this mesh dim (uneven sizes follow ``torch.chunk``)."""

    dim: int

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"


@dataclass(frozen=True)
class Replicate(Placement):
    """Every rank along this mesh dim holds the same full (along this dim) value."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial(Placement):
    """Every rank holds a partial value; the true value is their reduction with ``reduce_op``."""

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in REDUCE_OPS:
            raise ValueError(
                f"Partial reduce_op must be one of {REDUCE_OPS}, got {self.reduce_op!r}"
            )

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op})"


def as_placement(placement: object) -> Placement:
    """devmesh's placement for ``placement``: devmesh's own, or torch's ``Shard``,
    ``Replicate`` and ``Partial`` (``torch.distributed.tensor``), recognised without importing
    torch. Anything else, torch's private ``_StridedShard`` included, is refused by name."""
    if isinstance(placement, Placement):
        return placement
    kind = type(placement)
    if kind.__module__.startswith("torch.distributed.tensor"):
        if kind.__name__ == "Shard":
            return Shard(placement.dim)  # type: ignore[attr-defined]
        if kind.__name__ == "Replicate":
            return Replicate()
        if kind.__name__ == "Partial":
            return Partial(placement.reduce_op)  # type: ignore[attr-defined]
    from devmesh.errors import ShardingSpecError

    raise ShardingSpecError(
        f"{placement!r} is not a placement devmesh understands: use Shard(d), Replicate() or "
        "Partial(op) (devmesh's or torch.distributed.tensor's); a nested split is stated with "
        "a ShardingSpec"
    )
