"""Interop with ``torch.distributed.checkpoint`` (DCP), both ways.

* **devmesh → torch**: :class:`DevmeshReader` is a DCP ``StorageReader`` over a devmesh
  checkpoint, so torch's own loader reshards it into torch's FSDP2 / DTensor models::

      dcp.load({"model": get_model_state_dict(torch_model)}, storage_reader=DevmeshReader(path))

  devmesh stores the model under DCP's own flattened names (``model.<fqn>``) and Adam's
  moments under ``optim.state.<fqn>.<key>``, as DCP flattens ``get_optimizer_state_dict``;
  optimizer *param groups* are JSON here and pickled bytes in DCP, so they are not offered to
  torch's loader (load the model, and optimizer tensors with ``allow_partial_load``).
* **torch → devmesh**: :func:`load_torch_dcp` loads a DCP checkpoint (``dcp.save`` of
  ``{"model": ...}``) into a devmesh model of any layout: each parameter is viewed as a DTensor
  on the same ranks and torch's loader fills it. DCP's ``.metadata`` file is a pickle; it is
  read with an unpickler that builds only DCP's metadata classes, sizes and dtypes and refuses
  anything else, so a hostile file cannot run code (torch's own reader unpickles it freely).
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.futures import Future
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from devmesh.distributed import consensus
from devmesh.errors import CheckpointError
from devmesh.parallel.checkpoint.format import METADATA, CheckpointReader
from devmesh.parallel.checkpoint.save import wait_for_pending_save
from devmesh.parallel.param import as_sharded, get_layout, local_block
from devmesh.parallel.state_dict import named_parameters, persistent_buffers

__all__ = ["DevmeshReader", "SafeFileSystemReader", "load_torch_dcp"]


class DevmeshReader(dcp.StorageReader):
    """A devmesh checkpoint seen through DCP's ``StorageReader`` interface: every block is a
    DCP chunk, read straight from the data files (only the requested box)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = os.fspath(path)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with CheckpointReader(self.path) as reader:
            tensors: dict[str, Any] = {}
            for key in [*reader.tensors, *reader.aliases]:
                meta = reader.meta(key)
                tensors[key] = TensorStorageMetadata(
                    TensorProperties(dtype=meta.dtype), torch.Size(meta.shape),
                    [ChunkStorageMetadata(torch.Size(b.start), torch.Size(b.size))
                     for b in meta.blocks])
        return Metadata(state_dict_metadata=tensors, storage_data={})

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        with CheckpointReader(self.path) as reader:
            for request in plan.items:
                index: MetadataIndex = request.storage_index
                chunk_start = tuple(index.offset or ())
                start = tuple(c + o for c, o in zip(chunk_start, request.storage_offsets,
                                                    strict=True))
                value = reader.read(index.fqn, start, tuple(request.lengths))
                target = planner.resolve_tensor(request).detach()
                target.copy_(value.reshape(target.shape))
                planner.commit_tensor(request, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return os.path.isfile(os.path.join(os.fspath(checkpoint_id), METADATA))


# what a DCP .metadata pickle may build: DCP's metadata records, and plain torch values
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


class SafeFileSystemReader(dcp.FileSystemReader):
    """torch's ``FileSystemReader``, except that ``.metadata`` is unpickled by an unpickler
    that builds only DCP's metadata classes (torch's reader would run any pickle). Tensor
    data is read by torch with ``weights_only=True`` already."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise CheckpointError(f"{self.path} holds no DCP .metadata: not a torch "
                                  "distributed checkpoint, or its save never completed") from None
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"{path} was refused without running anything: {exc}. A torch DCP metadata "
                "file holds only DCP's metadata records") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} is not DCP metadata (it holds a "
                                  f"{type(metadata).__name__})")
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_torch_dcp(path: str | os.PathLike, model: nn.Module, *, prefix: str = "model.") -> None:
    """Collective: load a torch DCP checkpoint holding ``{"model": state_dict}`` (the names
    ``prefix + fqn``) into ``model``, whatever its devmesh layout. Each parameter is offered
    to torch's loader as a DTensor over this rank's block (nested FSDP-over-TP splits
    included), so each rank reads only what overlaps its blocks."""
    wait_for_pending_save()
    reader = SafeFileSystemReader(os.fspath(path))
    # a refused or missing file: our error, before torch's loader runs, on every rank
    with consensus.refused_everywhere(None, "load_torch_dcp", CheckpointError, outcome="failed"):
        reader.read_metadata()
    views: dict[str, torch.Tensor] = {}
    targets: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, p in named_parameters(model, remove_duplicate=True):
        layout = get_layout(p)
        if layout is None:
            view = p.detach()
        elif layout.shape is not None:
            # a 0-d parameter under fully_shard (one element, on the shard dim's first rank),
            # or a packed one (each part split: not one box, which torch's loader needs):
            # offered whole in its own shape, as DCP stores it, and cut after
            view = torch.empty(layout.full_shape, dtype=p.dtype)
        else:
            view = as_sharded(p).to_dtensor()
        views[name] = view
        targets.append((p, view))
    for name, b in persistent_buffers(model).items():
        views[name] = b
    # torch's loader fills views in place; parameters whose view is a copy get it after
    dcp.load({prefix.rstrip("."): views} if prefix else views,
             storage_reader=reader)
    with torch.no_grad():
        for p, view in targets:
            local = view.to_local() if hasattr(view, "to_local") else view
            if local.data_ptr() != p.data_ptr():  # read whole: this rank's block of it
                layout = get_layout(p)
                p.copy_(local_block(p, local.reshape(layout.spec.global_shape)).reshape(p.shape))
