"""Pure rank algebra of an N-dimensional device mesh.

A :class:`MeshLayout` is a shape, optional dimension names and the array of global ranks laid
out on that shape. Everything a mesh needs to know about *which ranks talk to which* follows
from it: the coordinate of a rank, the group of ranks along any set of dimensions, slicing,
flattening and unflattening. None of it needs a process group, so the CLI can show the layout
of a million-rank mesh instantly and every distributed object in devmesh is a thin binding of
a layout to this process's rank.

Conventions (shared with ``torch.distributed.device_mesh``):

* ranks are laid out row-major: the last dimension is the fastest-varying one;
* the group of a rank along dims ``(a, b)`` lists ranks with ``a`` major and ``b`` minor, in
  the order the dims were given;
* the list of all groups along some dims is ordered row-major over the *other* dims.

The rank array is stored as a read-only ``numpy`` array; groups are produced by a transpose
and a reshape, so enumerating every group of every dimension of a 1,048,576-rank mesh takes
milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Union

import numpy as np

from devmesh.errors import MeshDimNameError, MeshNamesError, MeshRankError, MeshShapeError
from devmesh.layout.data_parallel import flattened_name

__all__ = ["MeshLayout", "Dim", "Dims", "format_ranks"]

Dim = Union[int, str]
"""A mesh dimension, by index (negative counts from the end) or by name."""

Dims = Union[Dim, Sequence[Dim]]
"""One dimension or an ordered sequence of dimensions."""


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``: short enough for a message about many ranks."""
    values = sorted(int(r) for r in ranks)
    parts: list[str] = []
    start = prev = None
    for v in values + [None]:  # type: ignore[list-item]
        if v is not None and prev is not None and v == prev + 1:
            prev = v
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = v
    return ", ".join(parts)


def ranks_phrase(ranks: Iterable[int]) -> str:
    """``[0]`` -> ``"rank 0"``, ``[0, 1, 2]`` -> ``"ranks 0-2"``: ranks named in a sentence."""
    values = sorted(int(r) for r in ranks)
    return f"rank {values[0]}" if len(values) == 1 else f"ranks {format_ranks(values)}"


def _check_shape(shape: object) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        sizes = tuple(shape)  # type: ignore[arg-type]
    except TypeError:
        raise MeshShapeError(
            f"mesh shape must be a tuple of positive integers, got {shape!r}; "
            "for example (2, 4) for 2 groups of 4 ranks"
        ) from None
    if not sizes:
        raise MeshShapeError("mesh shape must have at least one dimension, got ()")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise MeshShapeError(
                f"mesh shape {sizes!r} has {size!r}: every size must be a positive integer "
                "(a dimension of size 1 is fine; 0, negatives, floats and None are not)"
            )
    return tuple(int(s) for s in sizes)


def _check_names(names: object, ndim: int) -> tuple[str, ...] | None:
    if names is None:
        return None
    if isinstance(names, str):
        names = (names,)
    names = tuple(names)  # type: ignore[arg-type]
    if len(names) != ndim:
        raise MeshNamesError(
            "mesh_shape and mesh_dim_names should have same length! "
            f"mesh_dim_names {names!r} has {len(names)} names for a {ndim}-D mesh; "
            f"give exactly one name per dimension"
        )
    for name in names:
        if not isinstance(name, str) or not name:
            raise MeshNamesError(
                f"mesh_dim_names {names!r} contains {name!r}: names must be non-empty strings"
            )
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise MeshNamesError(
            "Each mesh_dim_name must be unique. "
            f"mesh_dim_names {names!r} repeats {', '.join(map(repr, duplicates))}: "
            "every dimension needs its own name"
        )
    return names


def _check_ranks(ranks: object, shape: tuple[int, ...] | None) -> np.ndarray:
    try:
        array = np.asarray(ranks)
    except (TypeError, ValueError):
        raise MeshShapeError(f"mesh ranks {ranks!r} are not a rectangular array") from None
    if array.dtype == object or array.ndim == 0:
        raise MeshShapeError(
            f"mesh ranks must be a rectangular, non-empty array of integers, got {ranks!r}"
        )
    if array.size == 0:
        raise MeshShapeError("mesh ranks are empty: a mesh needs at least one rank")
    if not np.issubdtype(array.dtype, np.integer):
        if np.issubdtype(array.dtype, np.floating) and np.all(np.mod(array, 1) == 0):
            array = array.astype(np.int64)
        else:
            raise MeshShapeError(f"mesh ranks must be integers, got dtype {array.dtype}")
    array = array.astype(np.int64, copy=False)
    if shape is not None and array.shape != shape:
        if array.size != math.prod(shape):
            raise MeshShapeError(
                f"mesh ranks have {array.size} entries but shape {shape} needs "
                f"{math.prod(shape)}"
            )
        array = array.reshape(shape)
    negative = array[array < 0]
    if negative.size:
        raise MeshShapeError(f"mesh ranks must be non-negative, found {int(negative[0])}")
    flat = np.sort(array, axis=None)
    repeated = flat[1:][flat[1:] == flat[:-1]]
    if repeated.size:
        raise MeshShapeError(
            f"mesh ranks must be distinct, but rank {int(repeated[0])} appears more than once"
        )
    return array


class MeshLayout:
    """Shape, dimension names and global ranks of a device mesh; immutable and hashable.

    Args:
        shape: size of every dimension, outermost first, e.g. ``(2, 4)``.
        names: optional name of every dimension, e.g. ``("dp", "tp")``.
        ranks: optional array of distinct non-negative global ranks with that shape (or with
            that many entries). Defaults to ``arange(prod(shape))`` row-major. A mesh may cover
            only part of the world: ``MeshLayout((2,), ranks=[4, 6])``.

    Example:
        >>> layout = MeshLayout((2, 4), ("dp", "tp"))
        >>> layout.groups("tp")
        [(0, 1, 2, 3), (4, 5, 6, 7)]
        >>> layout.group_of(5, "dp")
        (1, 5)
    """

    __slots__ = ("_shape", "_names", "_ranks", "_hash", "_sorted_ranks", "_sorted_index")

    def __init__(
        self,
        shape: int | Sequence[int] | None = None,
        names: Sequence[str] | None = None,
        ranks: object = None,
    ) -> None:
        if shape is None and ranks is None:
            raise MeshShapeError("MeshLayout needs a shape, ranks, or both")
        sizes = _check_shape(shape) if shape is not None else None
        if ranks is None:
            assert sizes is not None
            array = np.arange(math.prod(sizes), dtype=np.int64).reshape(sizes)
        else:
            array = _check_ranks(ranks, sizes)
            sizes = tuple(array.shape)
        array.flags.writeable = False
        self._shape: tuple[int, ...] = sizes
        self._names = _check_names(names, len(sizes))
        self._ranks = array
        self._hash: int | None = None
        self._sorted_ranks: np.ndarray | None = None
        self._sorted_index: np.ndarray | None = None

    @classmethod
    def _trusted(cls, ranks: np.ndarray, names: tuple[str, ...] | None) -> MeshLayout:
        """Build from an array already known to be valid (a view of a valid layout)."""
        self = cls.__new__(cls)
        ranks = np.ascontiguousarray(ranks)
        ranks.flags.writeable = False
        self._shape = tuple(int(s) for s in ranks.shape)
        self._names = names
        self._ranks = ranks
        self._hash = None
        self._sorted_ranks = None
        self._sorted_index = None
        return self

    # -- basic properties ------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def names(self) -> tuple[str, ...] | None:
        return self._names

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        """Number of ranks in the mesh."""
        return int(self._ranks.size)

    @property
    def ranks(self) -> np.ndarray:
        """The read-only array of global ranks, of shape :attr:`shape`."""
        return self._ranks

    def rank_list(self) -> list[int]:
        """All ranks in row-major order."""
        return self._ranks.reshape(-1).tolist()

    # -- dimensions ------------------------------------------------------------------------
    def dim(self, dim: Dim) -> int:
        """Index of a dimension given by index or name; raises a clear error otherwise."""
        if isinstance(dim, str):
            if self._names is None:
                raise MeshDimNameError(
                    f"cannot look up mesh dimension {dim!r}: this {self.ndim}-D mesh has no "
                    "dimension names; pass mesh_dim_names=... when creating it, or use an "
                    "integer dimension"
                )
            try:
                return self._names.index(dim)
            except ValueError:
                raise MeshDimNameError(
                    f"Mesh dimension '{dim}' does not exist; valid names are "
                    f"{', '.join(map(repr, self._names))}"
                ) from None
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
            raise MeshDimNameError(
                f"a mesh dimension is an int or a name, got {dim!r} ({type(dim).__name__})"
            )
        if not -self.ndim <= dim < self.ndim:
            raise MeshDimNameError(
                f"mesh dimension {dim} is out of range for a {self.ndim}-D mesh "
                f"(valid: {-self.ndim}..{self.ndim - 1})"
            )
        return int(dim) % self.ndim

    def dims(self, dims: Dims | None = None) -> tuple[int, ...]:
        """Indices of one or several dimensions, in the order given (all dims if ``None``)."""
        if dims is None:
            return tuple(range(self.ndim))
        if isinstance(dims, (str, int, np.integer)):
            return (self.dim(dims),)
        indices = tuple(self.dim(d) for d in dims)
        if not indices:
            raise MeshDimNameError("at least one mesh dimension is needed, got none")
        if len(set(indices)) != len(indices):
            raise MeshDimNameError(f"mesh dimensions {tuple(dims)!r} name a dimension twice")
        return indices

    def dim_name(self, dim: Dim) -> str:
        """Name of a dimension, or ``"dim{i}"`` when the mesh has no names."""
        index = self.dim(dim)
        return self._names[index] if self._names else f"dim{index}"

    def _names_of(self, dims: Iterable[int]) -> tuple[str, ...] | None:
        return tuple(self._names[d] for d in dims) if self._names else None

    # -- ranks and coordinates -------------------------------------------------------------
    def _flat_position(self, rank: int) -> int | None:
        if self._sorted_ranks is None:
            flat = self._ranks.reshape(-1)
            order = np.argsort(flat, kind="stable")
            self._sorted_index = order
            self._sorted_ranks = flat[order]
        i = int(np.searchsorted(self._sorted_ranks, rank))
        if i < self._sorted_ranks.size and self._sorted_ranks[i] == rank:
            assert self._sorted_index is not None
            return int(self._sorted_index[i])
        return None

    def __contains__(self, rank: object) -> bool:
        return isinstance(rank, (int, np.integer)) and self._flat_position(int(rank)) is not None

    def coordinate_of(self, rank: int) -> tuple[int, ...] | None:
        """Coordinate of ``rank`` in the mesh, or ``None`` if the mesh does not contain it."""
        position = self._flat_position(int(rank))
        if position is None:
            return None
        return tuple(int(c) for c in np.unravel_index(position, self._shape))

    def rank_at(self, coordinate: Sequence[int]) -> int:
        """Global rank at ``coordinate``."""
        coordinate = tuple(coordinate)
        if len(coordinate) != self.ndim or any(
            not 0 <= c < s for c, s in zip(coordinate, self._shape, strict=True)
        ):
            raise MeshRankError(f"coordinate {coordinate} is outside a mesh of shape {self._shape}")
        return int(self._ranks[coordinate])

    def _require_coordinate(self, rank: int) -> tuple[int, ...]:
        coordinate = self.coordinate_of(rank)
        if coordinate is None:
            raise MeshRankError(
                f"rank {rank} is not in this mesh (its ranks are {self._describe_ranks()})"
            )
        return coordinate

    def _describe_ranks(self) -> str:
        flat = self._ranks.reshape(-1)
        if flat.size <= 16:
            return str(flat.tolist())
        return f"{flat.size} ranks from {int(flat.min())} to {int(flat.max())}"

    # -- groups ----------------------------------------------------------------------------
    def group_array(self, dims: Dims | None = None) -> np.ndarray:
        """All groups along ``dims`` as a 2-D array: one row per group, in canonical order."""
        chosen = self.dims(dims)
        rest = [d for d in range(self.ndim) if d not in chosen]
        group_size = math.prod(self._shape[d] for d in chosen)
        return self._ranks.transpose(rest + list(chosen)).reshape(-1, group_size)

    def groups(self, dims: Dims | None = None) -> list[tuple[int, ...]]:
        """All groups of ranks along ``dims`` (ranks that differ only in those coordinates)."""
        return list(map(tuple, self.group_array(dims).tolist()))

    def group_of(self, rank: int, dims: Dims | None = None) -> tuple[int, ...]:
        """The group along ``dims`` that contains ``rank``."""
        return tuple(self.slice(dims, rank=rank).rank_list())

    def group_index(self, rank: int, dims: Dims | None = None) -> int:
        """Position of ``rank``'s group in :meth:`groups` (the row-major index of the other dims)."""
        chosen = self.dims(dims)
        coordinate = self._require_coordinate(rank)
        rest = [d for d in range(self.ndim) if d not in chosen]
        index = 0
        for d in rest:
            index = index * self._shape[d] + coordinate[d]
        return index

    # -- views -----------------------------------------------------------------------------
    def slice(
        self,
        dims: Dims | None = None,
        *,
        rank: int | None = None,
        coordinate: Sequence[int] | None = None,
    ) -> MeshLayout:
        """The sub-mesh over ``dims`` (in the order given) through ``rank`` or ``coordinate``.

        The coordinates of the other dimensions are fixed to those of ``rank`` (or of
        ``coordinate``; the origin if neither is given). Unlike torch, the dims may be given in
        any order: ``slice(("tp", "dp"))`` is the transposed sub-mesh.
        """
        chosen = self.dims(dims)
        if rank is not None and coordinate is not None:
            raise MeshRankError("give either rank= or coordinate=, not both")
        if rank is not None:
            anchor = self._require_coordinate(rank)
        elif coordinate is not None:
            anchor = tuple(coordinate)
            self.rank_at(anchor)  # validates
        else:
            anchor = (0,) * self.ndim
        index = tuple(slice(None) if d in chosen else anchor[d] for d in range(self.ndim))
        kept = [d for d in range(self.ndim) if d in chosen]  # order after basic indexing
        sub = self._ranks[index].transpose([kept.index(d) for d in chosen])
        return MeshLayout._trusted(sub, self._names_of(chosen))

    def submeshes(self, dims: Dims | None = None) -> list[MeshLayout]:
        """Every sub-mesh over ``dims``, in the order of :meth:`groups`."""
        chosen = self.dims(dims)
        sub_shape = tuple(self._shape[d] for d in chosen)
        names = self._names_of(chosen)
        return [
            MeshLayout._trusted(row.reshape(sub_shape), names)
            for row in self.group_array(chosen)
        ]

    def flatten(self, dims: Dims | None = None, name: str | None = None) -> MeshLayout:
        """Merge ``dims`` (major to minor in the order given) into one dimension.

        The merged dimension takes the place of the first of ``dims`` in mesh order; the
        other dimensions keep their order. Its name defaults to the merged names joined by
        ``"_"`` (``("dp", "cp")`` becomes ``"dp_cp"``), as in torch.
        """
        chosen = self.dims(dims)
        first = min(chosen)
        before = [d for d in range(first) if d not in chosen]
        after = [d for d in range(first, self.ndim) if d not in chosen]
        order = before + list(chosen) + after
        merged = math.prod(self._shape[d] for d in chosen)
        new_shape = (
            [self._shape[d] for d in before] + [merged] + [self._shape[d] for d in after]
        )
        names: tuple[str, ...] | None = None
        if self._names is not None or name is not None:
            merged_name = name or flattened_name([self.dim_name(d) for d in chosen])
            others = [self.dim_name(d) for d in before + after]
            if merged_name in others:
                raise MeshDimNameError(
                    f"cannot name the flattened dimension {merged_name!r}: another dimension "
                    "already has that name"
                )
            names = tuple(others[: len(before)] + [merged_name] + others[len(before) :])
        ranks = self._ranks.transpose(order).reshape(new_shape)
        return MeshLayout._trusted(ranks, names)

    def unflatten(
        self, dim: Dim, sizes: Sequence[int], names: Sequence[str] | None = None
    ) -> MeshLayout:
        """Split one dimension into several (row-major), e.g. ``world`` into ``(dp, tp)``."""
        index = self.dim(dim)
        sizes = _check_shape(sizes)
        if math.prod(sizes) != self._shape[index]:
            raise MeshShapeError(
                f"cannot unflatten dimension {self.dim_name(index)!r} of size "
                f"{self._shape[index]} into {sizes}: the sizes multiply to {math.prod(sizes)}"
            )
        if self._names is not None and names is None:
            raise MeshDimNameError(
                "this mesh has dimension names, so unflatten needs one name per new dimension"
            )
        new_names: tuple[str, ...] | None = None
        if names is not None:
            names = tuple(names)
            if len(names) != len(sizes):
                raise MeshDimNameError(
                    f"unflatten into {sizes} needs {len(sizes)} names, got {names!r}"
                )
            others = [self.dim_name(d) for d in range(self.ndim) if d != index]
            new_names = _check_names(
                tuple(others[:index]) + names + tuple(others[index:]), self.ndim - 1 + len(sizes)
            )
        new_shape = self._shape[:index] + sizes + self._shape[index + 1 :]
        return MeshLayout._trusted(self._ranks.reshape(new_shape), new_names)

    def with_names(self, names: Sequence[str] | None) -> MeshLayout:
        """The same ranks under other dimension names."""
        return MeshLayout._trusted(self._ranks, _check_names(names, self.ndim))

    # -- value semantics -------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MeshLayout):
            return NotImplemented
        return (
            self._shape == other._shape
            and self._names == other._names
            and bool(np.array_equal(self._ranks, other._ranks))
        )

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash((self._shape, self._names, self._ranks.tobytes()))
        return self._hash

    def __repr__(self) -> str:
        ranks = (
            self._ranks.tolist() if self._ranks.size <= 64 else f"<{self._ranks.size} ranks>"
        )
        names = f", names={self._names!r}" if self._names else ""
        return f"MeshLayout(shape={self._shape}{names}, ranks={ranks})"

    def __reduce__(self):
        return (MeshLayout, (self._shape, self._names, self._ranks.copy()))
