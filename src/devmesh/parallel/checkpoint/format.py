"""The on-disk format of a sharded checkpoint: a directory of raw data files and one JSON
metadata file, and the reader that checks and reads them.

::

    PATH/
      metadata.json                  written last, atomically: the checkpoint exists when it does
      data-<save id>-r00003.bin      rank 3's blocks, raw bytes, one after another

``metadata.json`` names every tensor (``model.<name>``, ``optim.state.<name>.<key>``,
``extra...``), its dtype, global shape and layout, and for each distinct block the file,
byte offset, start, size and the checksum of each chunk of its rows
(:mod:`~devmesh.parallel.checkpoint.checksums`: a load checks every byte it uses); tied
parameters are aliases of one entry. Data files are raw
little-endian bytes in row-major order: no pickle anywhere, so reading a checkpoint can never
run code. Each save writes data files under a fresh id, so a save killed half-way leaves the
previous metadata and the data files it names intact; the next save removes the orphans.

:class:`CheckpointReader` checks the metadata's structure, that every data file exists and is
as long as the metadata says, and reads any box of any tensor, touching only the rows of the
blocks that overlap it. Ranks of one host that all read the same blocks can split the checking
among them (:class:`CheckShare`): each chunk is read by every rank from the host's page cache
and checked by one, and the chunks a rank left to others are listed so that a load can check
them itself where the ranks turn out to have read different blocks.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any

import torch

from devmesh.errors import CheckpointChecksumError, CheckpointError, CheckpointNotFoundError
from devmesh.parallel.checkpoint.blocks import overlap
from devmesh.parallel.checkpoint.checksums import (CHUNK_BYTES, WRITTEN, checksum,
                                                    checksum_limit, chunk_bounds, chunk_count)
from devmesh.parallel.checkpoint.encoding import Malformed, dtype_of

__all__ = ["FORMAT", "METADATA", "BlockMeta", "TensorMeta", "CheckpointReader", "CheckShare",
           "data_file_name", "DATA_FILE"]

FORMAT = "devmesh-sharded-checkpoint/1"
METADATA = "metadata.json"
DATA_FILE = re.compile(r"data-[0-9a-f]{16}-r[0-9]{5}\.bin")  # the writer's rank at [-9:-4]


def data_file_name(save_id: str, rank: int) -> str:
    return f"data-{save_id}-r{rank:05d}.bin"


@dataclass(frozen=True)
class BlockMeta:
    file: str
    offset: int
    start: tuple[int, ...]
    size: tuple[int, ...]
    # the checksum of each chunk of rows (:mod:`~devmesh.parallel.checkpoint.checksums`);
    # None in a checkpoint written before devmesh stored them (read unchecked)
    checksums: tuple[int, ...] | None = None
    chunk_rows: int = 1  # the rows each checksum covers
    algorithm: str = WRITTEN  # which checksum: "xxh3", or "crc32" (older checkpoints)


@dataclass(frozen=True)
class TensorMeta:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: str
    blocks: tuple[BlockMeta, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class CheckShare:
    """This rank's part in checking chunks that ``count`` ranks of one host all read (whole
    tensors stored as one block: replicated ones): the chunks whose :meth:`owner` is
    ``index``. What the rank read and what it left unchecked are kept, so that the ranks can
    confirm they read the same chunks (then every chunk was checked on the host) or check
    the rest themselves."""

    index: int
    count: int
    read: set[tuple[str, int]] = field(default_factory=set)  # (file, byte offset) per chunk
    # (tensor, block, chunk, the chunk's bytes as read) per chunk left to another rank
    unchecked: list[tuple[TensorMeta, BlockMeta, int, Any]] = field(default_factory=list)

    def owner(self, file: str, at: int) -> int:
        """The rank (of ``count``) that checks the chunk at byte ``at`` of ``file``: chunks
        one after another in a file go to ranks one after another, starting at the rank
        that wrote the file (so a save spread evenly over the ranks is checked evenly)."""
        return (int(file[-9:-4]) + at // CHUNK_BYTES) % self.count

    def digest(self) -> str:
        """The chunks read, as a short text equal on ranks that read the same ones."""
        listed = "\n".join(f"{f}:{at}" for f, at in sorted(self.read))
        return hashlib.blake2b(listed.encode(), digest_size=8).hexdigest()


def _ints(value: Any, where: str, length: int | None = None) -> tuple[int, ...]:
    if (not isinstance(value, list) or any(type(v) is not int or v < 0 for v in value)
            or (length is not None and len(value) != length)):
        raise Malformed(f"{where} is not a list of {length or ''} non-negative integers")
    return tuple(value)


def _tensor_meta(key: str, raw: Any, files: dict[str, int]) -> TensorMeta:
    if not isinstance(raw, dict):
        raise Malformed(f"tensor {key!r} is not an object")
    dtype = dtype_of(raw.get("dtype"))
    shape = _ints(raw.get("shape"), f"{key}.shape")
    blocks = []
    covered = 0
    for i, b in enumerate(raw.get("blocks") if isinstance(raw.get("blocks"), list) else ()):
        where = f"{key}.blocks[{i}]"
        if not isinstance(b, dict) or b.get("file") not in files:
            raise Malformed(f"{where} names a data file the metadata does not list")
        size = _ints(b.get("size"), f"{where}.size", len(shape))
        sums, per, algorithm = None, 1, WRITTEN
        # a block carries one checksum's list and its chunk rows: xxh3 and chunk_rows, or
        # crc32 and crc_rows (checkpoints written before XXH3)
        for name, rows_key in (("xxh3", "chunk_rows"), ("crc32", "crc_rows")):
            if name in b:
                per = _ints([b.get(rows_key)], f"{where}.{rows_key}")[0]
                if per < 1:
                    raise Malformed(f"{where}.{rows_key} is not a positive number of rows")
                sums = _ints(b[name], f"{where}.{name}", chunk_count(size, dtype.itemsize, per))
                if any(c >= checksum_limit(name) for c in sums):
                    raise Malformed(f"{where}.{name} holds values that are not {name} sums")
                algorithm = name
                break
        block = BlockMeta(b["file"], _ints([b.get("offset")], where)[0],
                          _ints(b.get("start"), f"{where}.start", len(shape)), size, sums,
                          per, algorithm)
        if any(s + n > d for s, n, d in zip(block.start, block.size, shape, strict=True)):
            raise Malformed(f"{where} lies outside the tensor's shape {shape}")
        nbytes = math.prod(block.size) * dtype.itemsize
        if block.offset + nbytes > files[block.file]:
            raise Malformed(f"{where} ends past the end of {block.file}")
        covered += math.prod(block.size)
        blocks.append(block)
    if covered != math.prod(shape):
        raise Malformed(f"the blocks of {key!r} cover {covered} of its {math.prod(shape)} "
                        "elements")
    layout = raw.get("layout", "")
    return TensorMeta(key, dtype, shape, layout if isinstance(layout, str) else "", tuple(blocks))


class CheckpointReader:
    """A checked view of the sharded checkpoint at ``path`` (a directory). Construction reads
    only ``metadata.json`` and the data files' sizes; :meth:`read` reads bytes."""

    def __init__(self, path: str) -> None:
        self.path = path
        meta_path = os.path.join(path, METADATA)
        if not os.path.isdir(path):
            raise CheckpointNotFoundError(f"no checkpoint at {path}")
        if not os.path.exists(meta_path):
            raise CheckpointError(
                f"{path} holds no {METADATA}: not a devmesh checkpoint, or its first save never "
                "completed (a checkpoint exists only once its metadata is written)")
        try:
            with open(meta_path, encoding="utf-8") as f:
                raw = json.load(f)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{meta_path} is truncated or corrupted: not valid JSON "
                                  f"({exc})") from None
        try:
            self._parse(raw)
        except Malformed as exc:
            raise CheckpointError(f"{meta_path} is damaged or not written by devmesh: {exc}"
                                  ) from None
        self._handles: dict[str, Any] = {}
        self.share: CheckShare | None = None  # None: this reader checks every chunk it reads

    def _parse(self, raw: Any) -> None:
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            found = raw.get("format") if isinstance(raw, dict) else None
            raise Malformed(f"format is {found!r}, expected {FORMAT!r}")
        files = raw.get("files")
        if not isinstance(files, dict) or not all(
                isinstance(k, str) and DATA_FILE.fullmatch(k) and type(v) is int and v >= 0
                for k, v in files.items()):
            raise Malformed("'files' is not a map of data file names to sizes")
        for name, size in files.items():
            try:  # lstat: a data file is a plain file, never a link to one elsewhere
                found = os.lstat(os.path.join(self.path, name))
            except FileNotFoundError:
                raise CheckpointError(f"{self.path}: data file {name} is missing (the metadata "
                                      "lists it); the checkpoint cannot be loaded") from None
            if not stat.S_ISREG(found.st_mode):
                raise CheckpointError(
                    f"{self.path}: data file {name} is a link or not a plain file; devmesh "
                    "writes plain files and reads no others (a link could hand it another "
                    "file's bytes as weights). Copy the checkpoint with its files resolved")
            actual = found.st_size
            if actual != size:
                raise CheckpointError(f"{self.path}: data file {name} is {actual} bytes, the "
                                      f"metadata says {size}: truncated or overwritten")
        self.files: dict[str, int] = files
        tensors = raw.get("tensors")
        if not isinstance(tensors, dict):
            raise Malformed("'tensors' is not an object")
        self.tensors = {k: _tensor_meta(k, v, files) for k, v in tensors.items()}
        aliases = raw.get("aliases", {})
        if not isinstance(aliases, dict) or any(v not in self.tensors for v in aliases.values()):
            raise Malformed("'aliases' names tensors that are not stored")
        self.aliases: dict[str, str] = aliases
        model = raw.get("model")
        if not isinstance(model, list) or any(
                f"model.{k}" not in self.tensors and f"model.{k}" not in aliases for k in model):
            raise Malformed("'model' is not the list of the model's stored names")
        self.model_keys: list[str] = model
        self.optimizer = raw.get("optimizer")
        self.extra = raw.get("extra")
        # the modules' get_extra_state() values by state-dict key (absent: saved without)
        self.extra_state = raw.get("extra_state")
        self.world_size = raw.get("world_size")

    def meta(self, key: str) -> TensorMeta:
        return self.tensors[self.aliases.get(key, key)]

    def _file(self, name: str):
        if name not in self._handles:
            fd = os.open(os.path.join(self.path, name), os.O_RDONLY | os.O_NOFOLLOW)
            self._handles[name] = os.fdopen(fd, "rb")
        return self._handles[name]

    def read(self, key: str, start: tuple[int, ...] | None = None,
             size: tuple[int, ...] | None = None) -> torch.Tensor:
        """The box ``start``/``size`` (default: all) of tensor ``key``, read from the rows of
        the blocks that overlap it."""
        meta = self.meta(key)
        start = start if start is not None else (0,) * len(meta.shape)
        size = size if size is not None else meta.shape
        pieces = [(block, box) for block in meta.blocks
                  if (box := overlap(start, size, block.start, block.size)) is not None]
        self._check_tiled(key, start, size, [box for _, box in pieces])
        whole = tuple((s, s + n) for s, n in zip(start, size, strict=True))
        if len(pieces) == 1 and pieces[0][1] == whole:  # one block holds the box: no copy
            block, box = pieces[0]
            # a whole tensor stored as one block: what every holder of a replicated tensor
            # reads, so its checking may be shared (its bytes stay in the tensor returned)
            shared = size == meta.shape and block.size == meta.shape
            rows = self._read_block_box(meta, block, box, shared)
            if rows.is_contiguous() and rows.untyped_storage().nbytes() == rows.nbytes:
                return rows
            return rows.clone()
        out = torch.empty(size, dtype=meta.dtype)
        for block, box in pieces:
            out[tuple(slice(lo - s, hi - s) for (lo, hi), s in zip(box, start, strict=True))] = \
                self._read_block_box(meta, block, box)
        return out

    def _check_tiled(self, key: str, start: tuple[int, ...], size: tuple[int, ...],
                     boxes: list[tuple[tuple[int, int], ...]]) -> None:
        """The blocks must fill the box read exactly once: blocks that overlap (their
        element counts can still add up to the tensor's) would leave a hole of uninitialized
        memory in the loaded tensor. A box two or more blocks fill is checked by counting
        each element's blocks."""
        filled = sum(math.prod(hi - lo for lo, hi in box) for box in boxes)
        once = filled == math.prod(size)
        if once and len(boxes) > 1 and all(size):
            hits = torch.zeros(size, dtype=torch.uint8)
            for box in boxes:
                hits[tuple(slice(lo - s, hi - s) for (lo, hi), s in zip(box, start,
                                                                        strict=True))] += 1
            once = bool(hits.eq(1).all())
        if not once:
            raise CheckpointError(
                f"{self.path} is damaged or not written by devmesh: the blocks of {key!r} "
                "overlap, leaving part of it unwritten")

    def _read_block_box(self, meta: TensorMeta, block: BlockMeta,
                        box: tuple[tuple[int, int], ...], shared: bool = False) -> torch.Tensor:
        if not block.size:  # a 0-d tensor
            raw = self._bytes(block.file, block.offset, meta.dtype.itemsize)
            if block.checksums is not None:
                self._check_chunks(meta, block, raw, 0, 0, shared)
            return raw.view(meta.dtype).reshape(())
        row = math.prod(block.size[1:]) * meta.dtype.itemsize
        first, last = box[0][0] - block.start[0], box[0][1] - block.start[0]
        if block.checksums is None:
            raw = self._bytes(block.file, block.offset + first * row, (last - first) * row)
        else:  # read whole chunks and check them, then keep the rows asked for
            chunk, lo, hi = chunk_bounds(block.size, meta.dtype.itemsize, block.chunk_rows,
                                         first, last)
            raw = self._bytes(block.file, block.offset + lo * row, (hi - lo) * row)
            self._check_chunks(meta, block, raw, chunk, lo * row, shared)
            raw = raw[(first - lo) * row:(last - lo) * row]
        rows = raw.view(meta.dtype).reshape((last - first, *block.size[1:]))
        return rows[(slice(None), *(slice(lo - s, hi - s) for (lo, hi), s in
                                    zip(box[1:], block.start[1:], strict=True)))]

    def _check_chunks(self, meta: TensorMeta, block: BlockMeta, raw: torch.Tensor,
                      chunk: int, start: int, shared: bool = False) -> None:
        """``raw``, the block's bytes from ``start`` (chunk ``chunk``'s first), against the
        checksums written with them; where the reading is ``shared`` and this reader has a
        :attr:`share`, only the chunks this rank checks (the others are kept in it, with
        their bytes)."""
        row = math.prod(block.size[1:]) * meta.dtype.itemsize if block.size else len(raw)
        step = block.chunk_rows * row if block.size else len(raw)
        data = raw.numpy()
        share = self.share if shared else None
        for i, at in enumerate(range(0, len(raw), step)):
            if share is not None:
                offset = block.offset + start + at
                share.read.add((block.file, offset))
                if share.owner(block.file, offset) != share.index:
                    share.unchecked.append((meta, block, chunk + i, data[at:at + step]))
                    continue
            if checksum(data[at:at + step], block.algorithm) != block.checksums[chunk + i]:
                raise self._mismatch(meta, block, chunk + i)

    def _mismatch(self, meta: TensorMeta, block: BlockMeta, chunk: int
                  ) -> CheckpointChecksumError:
        per = block.chunk_rows
        first = chunk * per
        row = math.prod(block.size[1:]) * meta.dtype.itemsize if block.size else 0
        rows = f"rows {first}..{min(first + per, block.size[0]) - 1} of " if block.size else ""
        return CheckpointChecksumError(
            f"{self.path}: {block.file} does not match the checksum written with it "
            f"at bytes {block.offset + first * row}.. ({rows}the block of {meta.key!r} "
            f"starting at {list(block.start)}, size {list(block.size)}): the file "
            "was changed or damaged after the save; nothing was loaded. Restore the "
            "checkpoint from a copy, or load an earlier one")

    def check_unchecked(self) -> None:
        """Check the chunks this rank left to other ranks of its :attr:`share` (when the
        ranks read different chunks, some may have been checked by nobody): their bytes,
        kept since the read, not read again."""
        if self.share is None:
            return
        for meta, block, chunk, data in self.share.unchecked:
            if checksum(data, block.algorithm) != block.checksums[chunk]:
                raise self._mismatch(meta, block, chunk)
        self.share.unchecked.clear()

    def verify(self) -> tuple[int, int]:
        """Read every block and check it against its checksums: ``(blocks, bytes)`` checked;
        raises :class:`~devmesh.errors.CheckpointChecksumError` at the first mismatch."""
        checked = nbytes = 0
        for meta in self.tensors.values():
            for block in meta.blocks:
                if block.checksums is None or not math.prod(block.size):
                    continue
                whole = tuple((s, s + n) for s, n in zip(block.start, block.size, strict=True))
                per = block.chunk_rows if block.size else 1
                for row in range(0, block.size[0] if block.size else 1, per):  # chunk by chunk
                    top = block.start[0] + row if block.size else 0
                    box = whole and ((top, min(top + per, whole[0][1])),) + whole[1:]
                    self._read_block_box(meta, block, box)
                checked += 1
                nbytes += math.prod(block.size) * meta.dtype.itemsize
        return checked, nbytes

    def _bytes(self, name: str, offset: int, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        f = self._file(name)
        f.seek(offset)
        if f.readinto(memoryview(buffer.numpy())) != nbytes:
            raise CheckpointError(f"{self.path}: {name} ended early (truncated while loading?)")
        return buffer

    def close(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
