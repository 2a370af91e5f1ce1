"""torch's own collectives on devmesh's meshes, counted: what DTensor's redistributions and
``loss_parallel()`` send (``comm_stats(include_torch=True)``).

A torch ``DTensor`` on a devmesh mesh redistributes through torch's functional collectives,
not through :mod:`devmesh.distributed.comm`; torchtitan's tensor-parallel plan (sequence
parallelism's norms hand DTensors to the next module) and torch's loss parallelism move
activations that way. While a counting ``comm_stats`` is active, the functional collectives
torch calls by module attribute (``funcol.all_gather_tensor`` and the like) are wrapped, and
each call is recorded under the mesh dim it runs over, with its bytes counted as devmesh
counts its own (the output of an all-gather, the input of a reduce-scatter or all-to-all, the
tensor of an all-reduce or broadcast). The wrappers are removed when the last counting
context ends; nothing is wrapped otherwise.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["counting"]

Record = Callable[[str, str, int], None]

# torch's functional collectives, as (devmesh's name for the collective, whether the bytes
# counted are the input's times the group size: an all-gather's output)
# (the names differ between torch releases: those present are wrapped)
_COUNTED = {
    "all_gather_single": ("all_gather", True),
    "all_gather_single_autograd": ("all_gather", True),
    "reduce_scatter_single": ("reduce_scatter", False),
    "reduce_scatter_single_autograd": ("reduce_scatter", False),
    "all_gather_tensor": ("all_gather", True),
    "all_gather_tensor_autograd": ("all_gather", True),
    "reduce_scatter_tensor": ("reduce_scatter", False),
    "reduce_scatter_tensor_autograd": ("reduce_scatter", False),
    "all_reduce": ("all_reduce", False),
    "all_to_all_single": ("all_to_all", False),
    "all_to_all_single_autograd": ("all_to_all", False),
    "broadcast": ("broadcast", False),
}

_lock = threading.Lock()
_originals: dict[str, Callable] = {}
_records: list[Record] = []
_inside = threading.local()


def _group_of(fn: Callable) -> Callable[[tuple, dict], Any]:
    names = list(inspect.signature(fn).parameters)
    index = names.index("group")
    return lambda args, kwargs: kwargs["group"] if "group" in kwargs else args[index]


def _label_and_size(group: Any) -> tuple[str, int]:
    """The mesh dim a functional collective's ``group`` names, and its size: a
    ``(mesh, dim)`` pair (DTensor's), a 1-D mesh, or anything else torch resolves to a
    process group (labelled by its ranks)."""
    import torch.distributed as dist

    if isinstance(group, tuple) and len(group) == 2 and not isinstance(group[1], (list, tuple)):
        mesh, dim = group
        if isinstance(dim, str):
            dim = list(mesh.mesh_dim_names).index(dim)
        names = mesh.mesh_dim_names
        return (names[dim] if names else f"dim{dim}"), mesh.size(dim)
    if hasattr(group, "mesh_dim_names") and getattr(group, "ndim", 0) == 1:
        names = group.mesh_dim_names
        return (names[0] if names else "dim0"), group.size()
    from devmesh import _torch_compat

    pg = group if isinstance(group, dist.ProcessGroup) else _torch_compat.resolve_group(group)
    ranks = dist.get_process_group_ranks(pg)
    return "ranks " + ",".join(map(str, ranks)), len(ranks)


def _counted(name: str, original: Callable) -> Callable:
    collective, gathers = _COUNTED[name]
    find_group = _group_of(original)

    @functools.wraps(original)
    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not getattr(_inside, "call", False) and _records:
            label, size = _label_and_size(find_group((tensor, *args), kwargs))
            nbytes = tensor.numel() * tensor.element_size() * (size if gathers else 1)
            for record in list(_records):
                record(collective, label, nbytes)
        _inside.call = True
        try:
            return original(tensor, *args, **kwargs)
        finally:
            _inside.call = False
    counted.__devmesh_counted__ = True  # type: ignore[attr-defined]
    return counted


class counting:
    """While active, hand every functional collective torch issues to ``record``
    (``record(collective, dims label, bytes)``)."""

    def __init__(self, record: Record) -> None:
        self._record = record

    def __enter__(self) -> counting:
        from devmesh import _torch_compat

        funcol = _torch_compat.functional_collectives()
        with _lock:
            if not _records:
                for name in _COUNTED:
                    original = getattr(funcol, name, None)
                    if original is not None:
                        _originals[name] = original
                        setattr(funcol, name, _counted(name, original))
            _records.append(self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        from devmesh import _torch_compat

        funcol = _torch_compat.functional_collectives()
        with _lock:
            _records.remove(self._record)
            if _records:
                return
            for name, original in _originals.items():
                # another wrapper put on top since (the collective recorder) stays in place
                if getattr(getattr(funcol, name, None), "__devmesh_counted__", False):
                    setattr(funcol, name, original)
            _originals.clear()
