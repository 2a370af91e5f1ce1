"""A checkpoint without a launch: list what it holds, or write its model as one plain
safetensors file, streaming (``devmesh ckpt info`` / ``devmesh ckpt consolidate``).

Neither needs a process group, torch.distributed, or the memory of the model: ``info`` reads
only the metadata; ``consolidate`` writes the safetensors header from the metadata and then
each tensor in slabs of rows read from the blocks that hold them, so its memory is one slab
(``buffer_mb``), whatever the model's size.
"""

from __future__ import annotations

import json
import math
import struct

import torch

from devmesh._files import atomic_file
from devmesh.parallel.checkpoint.format import CheckpointReader

__all__ = ["info", "consolidate"]

# safetensors' dtype codes (https://github.com/huggingface/safetensors, format section)
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64",
}


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError


def _ranks(files: list[str]) -> str:
    ranks = sorted({int(f.rsplit("-r", 1)[1].split(".")[0]) for f in files})
    from devmesh.layout import format_ranks

    return format_ranks(ranks) if ranks else "-"


def info(path: str, *, verify: bool = False) -> str:
    """What the checkpoint at ``path`` holds: every tensor with its dtype, shape, layout when
    saved, bytes and which ranks' files hold its blocks; then the files. ``verify``: also
    read every block and check it against the checksums written with it (raises
    :class:`~devmesh.errors.CheckpointChecksumError` naming the file, tensor and block)."""
    with CheckpointReader(path) as reader:
        verified = ""
        if verify:
            import time

            began = time.perf_counter()
            blocks, nbytes = reader.verify()
            verified = (f"\nverified: {blocks} blocks, {_size(nbytes)}, every checksum "
                        f"matches ({time.perf_counter() - began:.2f} s)")
        rows = [("tensor", "dtype", "shape", "saved layout", "bytes", "blocks", "files of ranks")]
        for key, meta in reader.tensors.items():
            rows.append((key, str(meta.dtype).removeprefix("torch."), str(list(meta.shape)),
                         meta.layout, _size(meta.nbytes), str(len(meta.blocks)),
                         _ranks([b.file for b in meta.blocks])))
        for alias, key in reader.aliases.items():
            rows.append((alias, "", "", f"tied: same as {key}", "0 B", "0", "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"devmesh checkpoint {path}: saved by {reader.world_size} rank(s), "
                 f"{len(reader.tensors)} tensors, {_size(sum(reader.files.values()))} in "
                 f"{len(reader.files)} data file(s)"]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths,
                                                       strict=True)).rstrip() for r in rows]
        lines.append("")
        lines += [f"{name}  {_size(size)}" for name, size in sorted(reader.files.items())]
        return "\n".join(lines) + verified


def consolidate(path: str, out: str, *, buffer_mb: float = 64) -> list[str]:
    """Write the model's full tensors (``model.`` entries, under their plain names; tied
    names each get their copy) as one safetensors file at ``out``, streaming. Returns the
    names written. ``model.load_state_dict(safetensors.torch.load_file(out))`` loads it
    (``strict=False`` where modules have extra states: safetensors holds tensors only)."""
    with CheckpointReader(path) as reader:
        names = list(reader.model_keys)
        header: dict[str, object] = {"__metadata__": {"format": "pt", "source": "devmesh"}}
        offset = 0
        for name in names:
            meta = reader.meta(f"model.{name}")
            if meta.dtype not in _SAFETENSORS_DTYPES:
                raise ValueError(f"{name}: safetensors cannot hold {meta.dtype}")
            header[name] = {"dtype": _SAFETENSORS_DTYPES[meta.dtype], "shape": list(meta.shape),
                            "data_offsets": [offset, offset + meta.nbytes]}
            offset += meta.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        with atomic_file(out, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for name in names:
                _write_streaming(f, reader, f"model.{name}", int(buffer_mb * 2**20))
    return names


def _write_streaming(f, reader: CheckpointReader, key: str, budget: int) -> None:
    meta = reader.meta(key)
    if not meta.shape:
        f.write(memoryview(reader.read(key).reshape(1).view(torch.uint8).numpy()))
        return
    row = math.prod(meta.shape[1:]) * meta.dtype.itemsize
    step = max(1, budget // max(row, 1))
    for first in range(0, meta.shape[0], step):
        rows = min(step, meta.shape[0] - first)
        slab = reader.read(key, (first, *[0] * (len(meta.shape) - 1)), (rows, *meta.shape[1:]))
        f.write(memoryview(slab.reshape(-1).view(torch.uint8).numpy()))
