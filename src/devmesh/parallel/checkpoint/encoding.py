"""Plain data as JSON, and the checks that make a checkpoint's metadata safe to read.

A checkpoint's metadata, optimizer settings and ``extra`` are stored as JSON: reading them can
never build an object or run code. Containers are tagged (``{"list": [...]}``,
``{"tuple": [...]}``, ``{"dict": [[key, value], ...]}``) so that tuples stay tuples and integer
keys stay integers, and a tensor is a reference ``{"tensor": key}`` to a block entry whose bytes
live in a data file. Everything read back is checked for type before it is used: a hostile or
damaged file gives a :class:`~devmesh.errors.CheckpointError`, never a ``KeyError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from devmesh.errors import CheckpointError, CheckpointFormatError

__all__ = ["check_plain", "encode", "decode", "dtype_name", "dtype_of", "Malformed"]

_SCALARS = (str, int, float, bool, type(None))

# every dtype a checkpoint may hold, by the name stored in the metadata
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
    torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}


Malformed = CheckpointFormatError  # the metadata is not what devmesh writes


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise CheckpointError(f"a checkpoint cannot hold {dtype} tensors (supported: "
                              f"{', '.join(_DTYPES)})")
    return name


def dtype_of(name: object) -> torch.dtype:
    if not isinstance(name, str) or name not in _DTYPES:
        raise Malformed(f"unknown dtype {name!r}")
    return _DTYPES[name]


def check_plain(value: Any, where: str) -> None:
    """``value`` must be data a checkpoint can hold: numbers, strings, None, tensors, dtypes,
    and lists, tuples and dicts (str or int keys) of those."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise CheckpointError(f"{where} has a key {k!r}: keys must be str or int")
            check_plain(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]")
    elif not isinstance(value, (*_SCALARS, torch.Tensor, torch.dtype)):
        raise CheckpointError(
            f"{where} is a {type(value).__name__}: a checkpoint holds tensors and plain data "
            "(numbers, strings, lists, dicts) only, so that loading it never runs code; store "
            "its state instead (e.g. a dict of numbers)"
        )


def encode(value: Any, tensor_ref: Callable[[torch.Tensor, str], str], where: str = "") -> Any:
    """JSON-ready form of plain data; each tensor is handed to ``tensor_ref(tensor, path)``,
    which stores it and returns the key it is stored under."""
    if isinstance(value, torch.Tensor):
        return {"tensor": tensor_ref(value, where)}
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if isinstance(value, dict):
        return {"dict": [[k, encode(v, tensor_ref, f"{where}.{k}")] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        tag = "tuple" if isinstance(value, tuple) else "list"
        return {tag: [encode(v, tensor_ref, f"{where}.{i}") for i, v in enumerate(value)]}
    if isinstance(value, _SCALARS):
        return value
    raise CheckpointError(f"{where} is a {type(value).__name__}, not plain data")


def decode(value: Any, tensor: Callable[[str], torch.Tensor], where: str = "value") -> Any:
    """The inverse of :func:`encode`; ``tensor(key)`` reads a stored tensor. Raises
    :class:`Malformed` on anything :func:`encode` never writes."""
    if isinstance(value, _SCALARS):
        return value
    if not isinstance(value, dict) or len(value) != 1:
        raise Malformed(f"{where}: unexpected {type(value).__name__}")
    (tag, body), = value.items()
    if tag == "tensor" and isinstance(body, str):
        return tensor(body)
    if tag == "dtype":
        return dtype_of(body)
    if tag in ("list", "tuple") and isinstance(body, list):
        items = [decode(v, tensor, f"{where}[{i}]") for i, v in enumerate(body)]
        return tuple(items) if tag == "tuple" else items
    if tag == "dict" and isinstance(body, list):
        out = {}
        for item in body:
            if (not isinstance(item, list) or len(item) != 2
                    or not isinstance(item[0], (str, int)) or isinstance(item[0], bool)):
                raise Malformed(f"{where}: a dict entry is not a [key, value] pair")
            out[item[0]] = decode(item[1], tensor, f"{where}[{item[0]!r}]")
        return out
    raise Malformed(f"{where}: unknown tag {tag!r}")
