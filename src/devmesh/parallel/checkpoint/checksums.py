"""Checksums of a checkpoint's blocks, so that a changed byte is found instead of loaded.

One flipped byte in a data file used to load without a word (an embedding came back with
values of 2e38); torch's DCP stores no checksum either. devmesh stores a checksum for each
*chunk* of a block: a run of whole rows (dim 0) of about :data:`CHUNK_BYTES`. Chunks, not the
whole block, because a load that reshards reads only some rows of a block: it widens its read
to the chunks those rows lie in (at most two chunks more than it needs) and checks each, so
every byte a load uses is checked, whatever the layout it loads into. The rows a chunk holds
are written beside the checksums, so a reader never depends on its own constant.

The checksum is XXH3 (64 bits, its top bit dropped so that it fits a signed 64-bit integer;
xxhash's, 18 GB/s measured here against 3.3 GB/s for zlib's CRC-32 and writes of 1-2 GB/s to
the page cache): a changed byte goes unnoticed with probability 2^-63. Checkpoints written
before carry zlib's CRC-32, which the reader still checks (the metadata names which a block
carries). Neither is a defence against a crafted file (they are not MACs).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable, Sequence

import xxhash

__all__ = ["CHUNK_BYTES", "WRITTEN", "checksum", "checksum_limit",
           "chunk_rows", "chunk_count", "checksums_of", "chunk_bounds"]

#: About how many bytes one checksum covers.
CHUNK_BYTES = 4 << 20


def _xxh3(data) -> int:
    return xxhash.xxh3_64_intdigest(data) >> 1


# each checksum a checkpoint may carry, by its name in the metadata: the function of a
# chunk's bytes, and the bound of its values
_ALGORITHMS: dict[str, tuple[Callable[..., int], int]] = {
    "xxh3": (_xxh3, 1 << 63),
    "crc32": (zlib.crc32, 1 << 32),  # checkpoints written before XXH3
}

#: The checksum a save writes.
WRITTEN = "xxh3"


def checksum(data, algorithm: str) -> int:
    """The checksum ``algorithm`` (``"xxh3"``, or ``"crc32"`` of older checkpoints) of the
    bytes ``data``."""
    return _ALGORITHMS[algorithm][0](data)


def xxh3_of_pieces(pieces: Iterable) -> int:
    """``checksum(b"".join(pieces), "xxh3")`` without joining them: the bytes of a block
    that must be copied to be read, one slab at a time."""
    state = xxhash.xxh3_64()
    for piece in pieces:
        state.update(piece)
        del piece  # before the next is made: one slab held at a time
    return state.intdigest() >> 1


def checksum_limit(algorithm: str) -> int:
    """One more than the largest value checksum ``algorithm`` takes."""
    return _ALGORITHMS[algorithm][1]


def _rows_and_row_bytes(size: Sequence[int], itemsize: int) -> tuple[int, int]:
    """A block's rows (dim 0; a 0-d block is one row) and the bytes of one row."""
    if not size:
        return 1, itemsize
    return size[0], math.prod(size[1:]) * itemsize


def chunk_rows(size: Sequence[int], itemsize: int) -> int:
    """How many rows one chunk of a block of ``size`` holds (at least one)."""
    _, row = _rows_and_row_bytes(size, itemsize)
    return max(1, CHUNK_BYTES // max(row, 1))


def chunk_count(size: Sequence[int], itemsize: int, per: int) -> int:
    """How many checksums a block of ``size`` has in chunks of ``per`` rows: none for an
    empty block."""
    rows, row = _rows_and_row_bytes(size, itemsize)
    if rows * row == 0:
        return 0
    return -(-rows // per)


def checksums_of(data: memoryview | bytes, size: Sequence[int], itemsize: int, per: int,
                 algorithm: str = WRITTEN) -> list[int]:
    """The checksums of a block's bytes ``data`` (row-major, as written), ``per`` rows a
    chunk."""
    step = per * _rows_and_row_bytes(size, itemsize)[1]
    view = memoryview(data).cast("B")
    return [checksum(view[at:at + step], algorithm)
            for at in range(0, len(view), step)] if step else []


def chunk_bounds(size: Sequence[int], itemsize: int, per: int, first: int, last: int
                 ) -> tuple[int, int, int]:
    """For rows ``first..last`` of a block in chunks of ``per`` rows: the first chunk they
    touch and the rows ``(start, stop)`` of the chunks that hold them (what a checked read
    reads)."""
    rows, _ = _rows_and_row_bytes(size, itemsize)
    chunk = first // per
    return chunk, chunk * per, min(rows, -(-last // per) * per)
