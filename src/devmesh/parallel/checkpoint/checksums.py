"""Checksums of a checkpoint's blocks, so that a changed byte is found instead of loaded.

One flipped byte in a data file used to load without a word (an embedding came back with
values of 2e38); torch's DCP stores no checksum either. devmesh stores a CRC-32 for each
*chunk* of a block: a run of whole rows (dim 0) of about :data:`CHUNK_BYTES`. Chunks, not the
whole block, because a load that reshards reads only some rows of a block: it widens its read
to the chunks those rows lie in (at most two chunks more than it needs) and checks each, so
every byte a load uses is checked, whatever the layout it loads into. The rows a chunk holds
are written beside the checksums, so a reader never depends on its own constant.

CRC-32 is zlib's (the standard library's, 2.4 GB/s measured here, against writes of 1-2 GB/s
to the page cache): it finds every burst of up to 32 changed bits and other damage with
probability 1 - 2^-32. It is not a defence against a crafted file (it is not a MAC).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

__all__ = ["CHUNK_BYTES", "chunk_rows", "chunk_count", "crcs_of", "chunk_bounds"]

#: About how many bytes one checksum covers.
CHUNK_BYTES = 4 << 20


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


def crcs_of(data: memoryview | bytes, size: Sequence[int], itemsize: int, per: int
            ) -> list[int]:
    """The checksums of a block's bytes ``data`` (row-major, as written), ``per`` rows a
    chunk."""
    step = per * _rows_and_row_bytes(size, itemsize)[1]
    view = memoryview(data).cast("B")
    return [zlib.crc32(view[at:at + step]) for at in range(0, len(view), step)] if step else []


def chunk_bounds(size: Sequence[int], itemsize: int, per: int, first: int, last: int
                 ) -> tuple[int, int, int]:
    """For rows ``first..last`` of a block in chunks of ``per`` rows: the first chunk they
    touch and the rows ``(start, stop)`` of the chunks that hold them (what a checked read
    reads)."""
    rows, _ = _rows_and_row_bytes(size, itemsize)
    chunk = first // per
    return chunk, chunk * per, min(rows, -(-last // per) * per)
