"""``load_checkpoint``: each rank reads the boxes of the saved blocks that overlap its own
blocks, into whatever layout the model has now (another mesh shape, another world size, a
plain model), and changes nothing unless every rank could read and check everything.

The steps: *read* — this rank checks the metadata and data files, the model's names and
global shapes, the optimizer's parameter groups, and reads its blocks into new tensors;
*agree* — one all-reduce of a flag tells every rank whether some rank failed (then every rank
raises, the failing rank its own error), one all-reduce of a digest that the ranks read the
same checkpoint, and one all-reduce of a flag per saved name checks that the ranks together
load everything the checkpoint holds; *apply* — copy into the model and load the optimizer's
state dict.

Replicated tensors (DDP's weights, buffers, Adam's step: a whole tensor stored as one block)
are read by every rank that holds them, but checked against their checksums once per host:
the ranks of a host (``LOCAL_RANK`` of ``LOCAL_WORLD_SIZE``) read them from the host's page
cache, and each checks its share of the chunks. The same digest that confirms the checkpoint
also confirms that the ranks read the same such chunks; where they did not (a pipeline's
stages read their own layers), each rank then checks the chunks it left to others itself,
from the bytes it read.

A rank loads the names its model has: a pipeline stage loads its own layers from a checkpoint
of the whole model (saved by any layout, pipelined or not), and every stage together must
load all of it — a saved name no rank's model has is an error, as a strict
``load_state_dict`` makes it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from devmesh._log import get_logger
from devmesh.distributed import comm, consensus, exchange
from devmesh.errors import CheckpointError, CheckpointNotFoundError, StateDictError
from devmesh.parallel.checkpoint import legacy
from devmesh.parallel.checkpoint.encoding import Malformed, decode
from devmesh.parallel.checkpoint.blocks import packed_parts
from devmesh.parallel.checkpoint.format import CheckpointReader, CheckShare
from devmesh.parallel.checkpoint.save import (
    _raise_if_failed,
    checkpoint_progress,
    refuse_differing,
    wait_for_pending_save,
)
from devmesh.parallel.dtensor_params import refuse_partial_dtensors
from devmesh.parallel.param import layout_of, local_block, local_of, shaped_like
from devmesh.parallel.state_dict import (extra_states, module_of, named_parameters,
                                         persistent_buffers)

__all__ = ["load_checkpoint", "read_block"]


def read_block(reader: CheckpointReader, key: str, target: torch.Tensor,
               like: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's block of stored tensor ``key`` for ``target`` (laid out like parameter
    ``like``, default itself), in the saved dtype, after checking the global shape."""
    meta = reader.meta(key)
    like = like if like is not None else target
    layout = layout_of(like)
    shape = layout.full_shape if layout else tuple(target.shape)
    # (a 0-d parameter fully_shard holds as one element: saved in its own shape, or, by
    # checkpoints written before that was fixed, as its one-element spec)
    as_spec = layout is not None and layout.shape == () and meta.shape == layout.spec.global_shape
    if meta.shape != shape and not as_spec:
        raise StateDictError(
            f"size mismatch for {key}: copying a param with shape {meta.shape} from "
            f"checkpoint, the shape in current model is {shape}")
    if layout is None:
        return reader.read(key)
    if layout.packed is None and meta.shape != tuple(layout.spec.global_shape):
        # a 0-d parameter, stored whole in its own shape
        full = reader.read(key).reshape(layout.spec.global_shape)
        return local_block(like, full).reshape(target.shape)
    coord = layout.mesh.get_coordinate()
    bounds = layout.spec.local_bounds(coord)
    if layout.packed is not None:  # stored in its own shape: this rank's piece of each part
        parts = [reader.read(key, start, size)
                 for _, start, size in packed_parts(bounds, layout.packed, shape)]
        block = torch.stack(parts, layout.packed[0]) if parts else torch.empty(
            tuple(n for _, n in bounds), dtype=meta.dtype)
        return block.reshape(target.shape)
    block = reader.read(key, tuple(s for s, _ in bounds), tuple(n for _, n in bounds))
    return block.reshape(target.shape)


def _model_writes(reader: CheckpointReader, model: nn.Module
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    refuse_partial_dtensors(model, set(), "load_checkpoint", CheckpointError)
    params = dict(named_parameters(model))
    buffers = persistent_buffers(model)
    expected = list(params) + list(buffers)
    saved = set(reader.model_keys)
    _refuse_missing(reader, model, [k for k in expected if k not in saved])
    writes = []
    blocks, done = [], set()
    for name, target in list(params.items()) + list(buffers.items()):
        if id(target) not in done:  # a tied parameter once, under its first name
            done.add(id(target))
            blocks.append((name, local_of(target), target))
    rank = dist.get_rank() if dist.is_initialized() else 0
    with checkpoint_progress("checkpoint load", sum(b.nbytes for _, b, _ in blocks),
                             rank) as progress:
        for name, block, target in blocks:
            # a saved dtype other than the model's is converted by the copy, as torch's DCP
            # and ``load_state_dict`` do (a float32 checkpoint into a bfloat16 model for
            # inference); a DTensor's local tensor is written (torch's tensor parallelism)
            writes.append((block, read_block(reader, f"model.{name}", block, like=target)))
            progress.advance(block.nbytes)
    return writes


def _optimizer_state(reader: CheckpointReader, model: nn.Module,
                     optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    if not isinstance(reader.optimizer, dict):
        raise CheckpointError(f"{reader.path} holds no optimizer state (saved without one)")
    named = named_parameters(model, remove_duplicate=True)
    names = {id(p): name for name, p in named}
    by_name = dict(named)
    saved_groups = decode(reader.optimizer.get("param_groups"), _no_tensor, "param_groups")
    current = [[names.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]
    # the saved groups as far as this rank's model goes (a pipeline stage: its own layers)
    stored = [[n for n in g.get("params", []) if n in by_name] if isinstance(g, dict) else None
              for g in saved_groups]
    if len(current) != len(stored) or any(s is None or set(c) != set(s)
                                          for c, s in zip(current, stored, strict=True)):
        raise CheckpointError(
            f"{reader.path}: the optimizer's parameter groups differ from the saved ones "
            f"(saved {[len(g or ()) for g in stored]} parameters per group, this optimizer "
            f"{[len(g) for g in current]}); build the optimizer over the same parameters")
    index = {name: i for i, name in enumerate(n for g in current for n in g)}
    state: dict[int, Any] = {}
    raw_state = reader.optimizer.get("state")
    if not isinstance(raw_state, dict):
        raise Malformed("optimizer state is not an object")
    for name, entry in raw_state.items():
        if name not in by_name:
            continue  # another pipeline stage's parameter
        if name not in index:
            raise CheckpointError(f"{reader.path}: optimizer state for parameter {name!r}, "
                                  "which no parameter group holds")
        p = by_name[name]

        def tensor(key: str, p=p) -> torch.Tensor:
            meta = reader.meta(key)
            layout = layout_of(p)
            global_shape = layout.full_shape if layout else tuple(p.shape)
            if meta.shape and meta.shape == tuple(global_shape):  # laid out like its parameter
                return shaped_like(p, read_block(reader, key, local_of(p), like=p))
            return reader.read(key)

        state[index[name]] = decode(entry, tensor, f"optimizer state of {name}")
    groups = [g | {"params": [index[n] for n in names_]}
              for g, names_ in zip(saved_groups, current, strict=True)]
    return {"state": state, "param_groups": groups}


def _no_tensor(key: str) -> torch.Tensor:
    raise Malformed(f"a parameter group setting refers to tensor {key!r}")


@dataclass
class _Read:
    """What this rank read of a checkpoint, nothing applied yet."""

    prepared: tuple[Any, Any, Any]  # (writes, optimizer state, extra states)
    extra: Any
    saved: list[str]  # the checkpoint's model names (and extra-state keys)
    save: str  # the data files read: their names tell one save from another
    reader: CheckpointReader | None = None  # closed; for the chunks left to other ranks


def _check_share() -> CheckShare | None:
    """This rank's share of checking the chunks that every rank of its host reads, or None
    (one rank on the host, or no launcher saying which ranks share it)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    try:
        local, count = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    return CheckShare(local, count) if count > 1 and 0 <= local < count else None


def _load_sharded(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None
                  ) -> _Read:
    """Read and check everything this rank needs (the chunks it shares with its host's other
    ranks: its share), nothing applied yet. Each save names its data files after a random id,
    so their names tell one save from another."""
    with CheckpointReader(path) as reader:
        reader.share = _check_share()
        try:
            writes = _model_writes(reader, model)
            optimizer_state = (None if optimizer is None
                               else _optimizer_state(reader, model, optimizer))
            extra = None if reader.extra is None else decode(reader.extra, reader.read, "extra")
            states = _extra_states(reader, model)
        except Malformed as exc:
            raise CheckpointError(f"{path} is damaged or not written by devmesh: {exc}"
                                  ) from None
        except KeyError as exc:
            raise CheckpointError(f"{path} does not hold tensor {exc}: damaged, or written "
                                  "for another model") from None
    saved = list(reader.model_keys) + list(reader.extra_state or ())
    return _Read((writes, optimizer_state, states), extra, saved, ", ".join(reader.files),
                 reader)


def _agree_on_what_was_read(path: str, read: _Read) -> None:
    """Every rank raises if the ranks read different checkpoints; where they read the same
    checkpoint but different chunks of it, each rank checks the chunks it left to others.
    One all-reduce of a digest when they read the same chunks."""
    share = read.reader.share if read.reader is not None else None
    files = f"{os.fspath(path)} (files {read.save})"
    if not consensus.differing(f"{files}\nchunks {share.digest() if share else '-'}"):
        return  # the same chunks everywhere: each was checked by one rank of each host
    refuse_differing(files, "load_checkpoint: the ranks read different checkpoints",
                     "pass every rank the same path; where they did, a save replaced the "
                     "checkpoint while they read it — load again once it is done")
    error: BaseException | None = None
    if read.reader is not None:
        try:
            read.reader.check_unchecked()
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
    _raise_if_failed(error, f"load_checkpoint({path!r})")


def _refuse_missing(reader: CheckpointReader, model: nn.Module, missing: list[str]) -> None:
    if missing:
        raise StateDictError(
            f"Error(s) in loading checkpoint {reader.path} for {type(model).__name__}: "
            f"Missing key(s): {', '.join(map(repr, missing))}. Nothing was loaded; the "
            "checkpoint must come from the same model")


def _extra_states(reader: CheckpointReader, model: nn.Module) -> list[tuple[nn.Module, Any]]:
    """Each of this rank's modules with an extra state and its saved value (a checkpoint
    saved without extra states, before devmesh kept them, has none to give)."""
    saved = reader.extra_state
    if saved is None:
        return []
    if not isinstance(saved, dict):
        raise Malformed("extra_state is not an object")
    modules = extra_states(model)
    _refuse_missing(reader, model, [key for key in modules if key not in saved])
    return [(module, decode(saved[key], reader.read, key)) for key, module in modules.items()]


def _unloaded(saved: list[str], model: nn.Module) -> list[str]:
    """The saved model names that no rank's model has: one all-reduce of a flag per name."""
    mine = set(dict(named_parameters(model))) | set(
        persistent_buffers(model)) | set(extra_states(model))
    if not (dist.is_initialized() and dist.get_world_size() > 1 and len(saved)):
        return [name for name in saved if name not in mine]
    loaded = torch.tensor([name in mine for name in saved], dtype=torch.int32,
                          device=comm.small_tensor_device(None))
    exchange.all_reduce_over(loaded, dist.ReduceOp.MAX)
    return [name for name, flag in zip(saved, loaded.tolist(), strict=True) if not flag]


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
                    ) -> dict[str, Any] | None:
    """Collective: load the checkpoint at ``path`` into ``model`` (and ``optimizer``) in
    whatever parallel layout they have now; returns the saved ``extra``.

    Each rank reads only the bytes overlapping its blocks. Nothing changes unless everything
    fits: a missing or damaged checkpoint, or a model or optimizer that does not match (names,
    shapes, parameter groups) raises :class:`~devmesh.errors.CheckpointError` or
    :class:`~devmesh.errors.StateDictError` on every rank first. A single file written by
    devmesh before sharded checkpoints existed loads too (with ``weights_only=True``).
    ``model`` may be a pipeline runner: each rank loads its stages' part."""
    wait_for_pending_save()
    consensus.warn_if_called_alone("load_checkpoint")  # inside `if rank == 0:`, say so
    began = time.perf_counter()
    model = module_of(model, "load_checkpoint")  # the same kind of object on every rank
    read: _Read | None = None
    error: BaseException | None = None
    try:
        if os.path.isdir(path):
            read = _load_sharded(path, model, optimizer)
        elif os.path.isfile(path):
            (writes, optimizer_state), extra = legacy.prepare(path, model, optimizer)
            read = _Read((writes, optimizer_state, []), extra, [], "a single file")
        else:
            raise CheckpointNotFoundError(f"no checkpoint at {path}")
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        error = exc
    if dist.is_initialized():
        _raise_if_failed(error, f"load_checkpoint({path!r})")
        # ranks that read different checkpoints would train on as replicas that differ
        assert read is not None
        _agree_on_what_was_read(path, read)
    elif error is not None:
        raise error
    assert read is not None
    prepared, extra = read.prepared, read.extra
    unloaded = _unloaded(read.saved, model)  # the same list on every rank
    if unloaded:
        raise StateDictError(
            f"Error(s) in loading checkpoint {path} for {type(model).__name__}: Unexpected "
            f"key(s): {', '.join(map(repr, unloaded))} (no rank's model has them). Nothing was "
            "loaded; the checkpoint must come from the same model")
    writes, optimizer_state, states = prepared
    with torch.no_grad():
        for target, value in writes:
            target.copy_(value)
    for module, value in states:
        module.set_extra_state(value)
    if optimizer is not None and optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    get_logger("checkpoint").info(
        "loaded checkpoint %s: %d bytes into this rank's model%s in %.2f s; extra %s", path,
        sum(value.numel() * value.element_size() for _, value in writes),
        " and optimizer" if optimizer_state is not None else "", time.perf_counter() - began,
        extra)
    return extra
