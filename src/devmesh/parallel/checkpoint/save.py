"""``save_checkpoint``: every rank writes the blocks it owns, in parallel; rank 0 writes the
metadata last.

No rank gathers anything: a rank writes its own local blocks (the ones
:func:`~devmesh.parallel.checkpoint.blocks.place_blocks` assigns it, each distinct block once),
so a save needs no memory beyond the model it already holds (synchronous) or one host copy of
the rank's own blocks (``async_=True``). The steps, each agreed by every rank so that a
failure anywhere raises everywhere instead of hanging the others:

1. *prepare*: list the tensors to save (model, optimizer state, ``extra``); one digest
   all-reduce shows whether every rank lists the same ones. When they do not (pipeline
   stages hold different parameters), one rank per distinct listing shares it and every rank
   merges them the same way (:mod:`~devmesh.parallel.checkpoint.union`): the checkpoint holds
   the union, as torch.distributed.checkpoint's does;
2. *write*: each rank writes its data file (exclusively created, fsynced, renamed);
3. *commit*: once every rank reports success, rank 0 writes ``metadata.json`` atomically and
   removes the data files no metadata names any more (the previous save's, a killed save's).

Steps 2 and 3 run in a background thread when ``async_=True``; their collectives use a gloo
group of their own, so they never interleave with the training's.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from devmesh._files import TMP_SUFFIX, atomic_file, fsync_directory
from devmesh._log import get_logger
from devmesh._progress import Progress, bytes_text
from devmesh.distributed import comm, consensus, exchange, groups
from devmesh.errors import CheckpointError
from devmesh.layout import format_ranks
from devmesh.parallel.checkpoint.blocks import (Block, Placed, TensorLayout, distinct_blocks,
                                                packed_parts, place_blocks)
from devmesh.parallel.checkpoint.checksums import (WRITTEN, checksum, checksums_of, chunk_count,
                                                   chunk_rows, xxh3_of_pieces)
from devmesh.parallel.checkpoint.encoding import check_plain, dtype_name, encode
from devmesh.parallel.checkpoint.format import DATA_FILE, FORMAT, METADATA, data_file_name
from devmesh.parallel.checkpoint.union import Listed, Merged, listed_json, merge_listings
from devmesh.parallel.dtensor_params import refuse_partial_dtensors
from devmesh.parallel.param import layout_of, local_of
from devmesh.parallel.state_dict import (extra_states, module_of, named_parameters,
                                         persistent_buffers)

__all__ = ["save_checkpoint", "SaveHandle", "wait_for_pending_save"]


@dataclass
class _Entry:
    """One tensor to save: how it is laid out and this rank's block (or the whole tensor)."""

    layout: TensorLayout
    local: torch.Tensor
    text: str  # the layout, in words, for ``devmesh ckpt info``
    mesh: dict[str, Any] | None = None
    coordinate: tuple[int, ...] = ()  # this rank's on the layout's mesh (a packed one's)

    def data(self, block: Block) -> torch.Tensor:
        """The bytes of ``block`` (one this rank holds), contiguous on the host: the local
        tensor, or, for a packed parameter, the one part of it the block is."""
        local = self.local
        packed = self.layout.packed
        if packed is not None:
            spec = self.layout.spec
            assert spec is not None
            bounds = spec.local_bounds(self.coordinate)
            for i, start, size in packed_parts(bounds, packed, self.layout.shape):
                if start == block.start:
                    local = local.select(packed[0], i).reshape(size)
                    break
            else:  # pragma: no cover - the block was placed from this rank's own bounds
                raise AssertionError(f"{self.layout.key}: no part starts at {block.start}")
        return local.contiguous().cpu()

    def listed(self, world_size: int) -> Listed:
        layout = self.layout
        slice_of = None if layout.spec is None else {
            "ranks": list(layout.ranks), "root_shape": list(layout.root_shape),
            "dims": [list(d) for d in layout.dim_roots]}
        return Listed(layout.key, dtype_name(self.local.dtype), tuple(layout.shape),
                      layout.itemsize, self.text, self.mesh,
                      tuple(distinct_blocks(layout, world_size)), slice_of)


def _entry(key: str, tensor: torch.Tensor, like: torch.Tensor | None = None,
           writer: int | None = None) -> _Entry:
    """``tensor`` laid out like parameter ``like`` (its block), or whole on every rank."""
    layout = layout_of(like) if like is not None else None
    local = local_of(tensor)
    if layout is None:
        return _Entry(TensorLayout(key, tuple(local.shape), local.element_size(), writer=writer),
                      local, "whole")
    if layout.shape == ():
        # a 0-d parameter under fully_shard: one element, held by the mesh's first rank (and
        # its replicas); saved whole in its own shape, so any layout (or a plain model)
        # loads it as single-process training has it
        holder = int(layout.mesh.mesh.flatten()[0])
        value = local.reshape(layout.shape) if local.numel() == 1 else local
        return _Entry(TensorLayout(key, layout.shape, local.element_size(), writer=holder),
                      value, "whole")
    spec = layout.spec
    mesh = layout.mesh
    root = mesh._root
    # a packed parameter is stored in its own shape, each of its parts a block
    return _Entry(TensorLayout(key, layout.full_shape, local.element_size(), spec,
                               tuple(root.mesh.flatten().tolist()), tuple(root.mesh.shape),
                               mesh._dim_roots, packed=layout.packed),
                  layout.spec_block(local), str(spec) + _packed_text(layout.packed),
                  {"shape": list(spec.mesh_shape), "names": list(mesh.mesh_dim_names or ())},
                  tuple(mesh.get_coordinate()) if layout.packed else ())


def _packed_text(packed: tuple[int, int] | None) -> str:
    if packed is None:
        return ""
    dim, parts = packed
    return f" (of dim {dim} cut into its {parts} packed parts)"


class _Contents:
    """Everything one save writes, listed the same way on every rank (``extra`` excepted:
    rank 0's is saved)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 extra: dict[str, Any] | None) -> None:
        self.entries: list[_Entry] = []
        self.aliases: dict[str, str] = {}
        self.model_keys: list[str] = []
        self.parameter_keys: set[str] = set()
        seen: dict[int, str] = {}
        # torch's DTensor parameters are saved as blocks of their layout; a partial sum has none
        refuse_partial_dtensors(model, set(), "save_checkpoint", CheckpointError)
        for name, p in named_parameters(model):
            self.model_keys.append(name)
            if id(p) in seen:  # a tied parameter: its bytes once, under its first name
                self.aliases[f"model.{name}"] = seen[id(p)]
                continue
            seen[id(p)] = f"model.{name}"
            self.parameter_keys.add(f"model.{name}")
            self.entries.append(_entry(f"model.{name}", p, like=p))
        for name, b in persistent_buffers(model).items():
            self.model_keys.append(name)
            self.entries.append(_entry(f"model.{name}", b))
        self.optimizer = None if optimizer is None else self._optimizer(model, optimizer)
        self.extra = None
        self.extra_entries: list[_Entry] = []
        # what modules keep beyond tensors (get_extra_state: nn.Module.state_dict's
        # ``_extra_state`` keys), rank 0's as with ``extra``, as plain data
        self.extra_state: dict[str, Any] = {}
        for key, module in extra_states(model).items():
            value = module.get_extra_state()
            where = f"model.{key}"
            try:
                check_plain(value, where)
            except CheckpointError as exc:
                raise CheckpointError(
                    f"{exc} ({type(module).__name__}.get_extra_state() returned it): a "
                    "checkpoint holds a module's extra state as plain data, tensors, lists "
                    "and dicts") from None
            self.extra_state[key] = encode(value, self._extra_tensor, where)
        if extra is not None:
            check_plain(extra, "extra")
            self.extra = encode(extra, self._extra_tensor, "extra")

    def _optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        names = {id(p): name for name, p in named_parameters(model, remove_duplicate=True)}
        state: dict[str, Any] = {}
        groups_ = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in names:
                    raise CheckpointError("the optimizer holds a parameter that is not in the "
                                          "model: save the model it was built over")
            groups_.append({k: v for k, v in group.items() if k != "params"}
                           | {"params": [names[id(p)] for p in group["params"]]})
            for p in group["params"]:
                name = names[id(p)]

                def ref(value: torch.Tensor, where: str, p=p) -> str:
                    key = f"optim.state.{where}"
                    like = p if value.shape == p.shape and value.ndim else None
                    self.entries.append(_entry(key, value, like=like))
                    return key

                state[name] = encode(dict(optimizer.state.get(p, {})), ref, name)
        check_plain(groups_, "optimizer.param_groups")
        return {"state": state, "param_groups": encode(
            groups_, lambda t, w: _refuse_tensor(w), "param_groups")}

    def _extra_tensor(self, value: torch.Tensor, where: str) -> str:
        """``extra`` is rank 0's: its tensors are written by rank 0."""
        self.extra_entries.append(_entry(where, value, writer=0))
        return where

    def listing(self, world_size: int) -> Merged:
        """What this rank saves, ``extra`` aside (rank 0's alone is saved)."""
        return Merged([e.listed(world_size) for e in self.entries], self.model_keys,
                      self.aliases, self.optimizer)


def _agree_on_path_and_contents(path: str, contents: _Contents | None,
                                error: BaseException | None, world_size: int) -> Merged:
    """The union of what every rank saves, the same on every rank, after checking that no
    rank failed to list its tensors and that every rank passed the same path: one all-reduce
    of a digest when every rank passed the same path and lists the same tensors (the
    texts travel only when they differ). Raises the same refusal on every rank."""
    mine = None
    if error is None:
        try:
            assert contents is not None
            mine = contents.listing(world_size)
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = exc
    failure = None if error is None else f"{type(error).__name__}: {error}"
    value = json.dumps({"failed": failure} if failure else
                       {"path": os.fspath(path), "listing": listed_json(mine)})
    held = consensus.differing(value) if world_size > 1 else {}
    if not held:  # the same on every rank: every rank succeeded, or failed alike
        if error is not None:
            raise error
        assert mine is not None
        return mine
    parsed = [(json.loads(text), ranks) for text, ranks in held.items()]
    failed = {r: v["failed"] for v, ranks in parsed if "failed" in v for r in ranks}
    if failed:
        if error is not None:
            raise error
        listing = "; ".join(f"rank {r}: {t}" for r, t in sorted(failed.items()))
        raise CheckpointError(f"save_checkpoint failed — {listing}")
    by_path: dict[str, list[int]] = {}
    for v, ranks in parsed:
        by_path.setdefault(v["path"], []).extend(ranks)
    if len(by_path) > 1:  # ranks writing to different directories: each a part of a checkpoint
        raise _differing_error(by_path, "save_checkpoint: the ranks passed different paths",
                               "pass every rank the same directory (a path built from the "
                               "rank, the host or the time differs between ranks)")
    return merge_listings([(v["listing"], ranks) for v, ranks in parsed])


def _refuse_tensor(where: str) -> str:
    raise CheckpointError(f"optimizer param group setting {where} is a tensor: only plain "
                          "settings (numbers, strings, tuples) can be saved")


class SaveHandle:
    """A save in progress: :meth:`wait` blocks until it is complete everywhere and raises
    :class:`~devmesh.errors.CheckpointError` (on every rank) if it failed."""

    def __init__(self, work, background: bool) -> None:
        self._error: BaseException | None = None
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._run, args=(work,), daemon=True,
                                            name="devmesh-checkpoint-writer")
            self._thread.start()
        else:
            self._run(work)

    def _run(self, work) -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            self._error = exc

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        global _pending
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the checkpoint save is still writing after {timeout} s")
        if _pending is self:
            _pending = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


_pending: SaveHandle | None = None


def wait_for_pending_save() -> None:
    """Finish the previous ``async_`` save before anything else touches checkpoints."""
    if _pending is not None:
        _pending.wait()


def _raise_if_failed(error: BaseException | str | None, what: str, group=None) -> None:
    """Every rank raises if any rank failed (this rank's own exception where it failed)."""
    text = None if error is None else (error if isinstance(error, str)
                                       else f"{type(error).__name__}: {error}")
    failed = consensus.failures(text, group)
    if not failed:
        return
    if isinstance(error, BaseException):
        raise error
    listing = "; ".join(f"rank {r}: {t}" for r, t in sorted(failed.items()))
    raise CheckpointError(f"{what} failed — {listing}")


def refuse_differing(value: str, what: str, fix: str) -> None:
    """Raise :class:`CheckpointError` on every rank if the ranks hold different ``value``s
    (one all-reduce of a digest; the values travel only when they differ)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    held = consensus.differing(value)
    if held:
        raise _differing_error(held, what, fix)


def _differing_error(held: dict[str, list[int]], what: str, fix: str) -> CheckpointError:
    listing = "; ".join(f"ranks {format_ranks(sorted(ranks))}: {text}"
                        for text, ranks in held.items())
    return CheckpointError(f"{what} ({listing}): {fix}")


def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    *, extra: dict[str, Any] | None = None, async_: bool = False,
                    check_replicas: bool = True) -> SaveHandle:
    """Collective over every rank of the world: write a sharded checkpoint of ``model`` (and
    ``optimizer``) to the directory ``path``; every rank writes only its own blocks, each
    block is written once.

    ``extra`` (epoch, data position, RNG states as tensors, ...) must be plain data; rank 0's
    is saved. With ``async_=True`` this rank's blocks are copied to host memory and the call
    returns; the files are written in the background (call ``handle.wait()`` to know it
    succeeded; the next save or load waits for it). The previous checkpoint at ``path`` stays
    loadable until the new one is complete; a failed save raises on every rank. ``model``
    may be a pipeline runner: its ``module`` (this rank's stages) is saved, and the
    checkpoint holds the union of every rank's — the whole model.

    A block several ranks hold is written by one of them, so ``check_replicas`` first checks
    (one all-reduce of digests) that they hold the same values, and refuses the save on every
    rank if not; ``check_replicas=False`` keeps one holder's copy unchecked, as torch's DCP
    does."""
    global _pending
    wait_for_pending_save()
    consensus.warn_if_called_alone("save_checkpoint")  # inside `if rank == 0:`, say so
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    contents = None
    try:
        contents = _Contents(module_of(model, "save_checkpoint"), optimizer, extra)
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        error: BaseException | None = exc
    else:
        error = None
    merged = _agree_on_path_and_contents(path, contents, error, world)
    assert contents is not None
    group = groups.private_world_group("checkpoint") if distributed and world > 1 else None
    extras = [e.listed(world) for e in contents.extra_entries]
    placed = place_blocks(merged.tensors + extras, world)
    mine = [p for p in placed if p.rank == rank]
    entries = {e.layout.key: e for e in contents.entries + contents.extra_entries}
    local = {key: e.local for key, e in entries.items()}
    if group is not None and check_replicas:
        save_id = _refuse_differing_replicas(placed, local, contents.parameter_keys, rank,
                                             group)
    else:
        save_id = _agree_on_save_id(group)
    blocks = [(p, entries[p.key].data(p.block)) for p in mine]
    if async_:  # a host copy now, so training may change the parameters right away
        blocks = [(p, t.clone() if _shares_memory(t, local[p.key]) else t) for p, t in blocks]

    def work() -> None:
        _write_and_commit(path, save_id, rank, world, blocks, placed, merged, extras,
                          (contents.extra, contents.extra_state), group)

    handle = SaveHandle(work, background=async_)
    if async_:
        _pending = handle
    else:
        handle.wait()
    return handle


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _refuse_differing_replicas(placed: list[Placed], local: dict[str, torch.Tensor],
                               parameter_keys: set[str], rank: int, group) -> str:
    """A block several ranks hold (a replica: DDP, HSDP's replicated half, a whole
    parameter) is written once, by one of them; so they must hold the same values, or the
    checkpoint mixes them silently — as when pipeline stages whose modules repeat names
    (each stage an ``nn.Sequential`` numbered from 0) list different layers under one name,
    and one stage's rank wrote ``0.weight`` and the other's ``0.bias``. One all-reduce of
    each parameter block's digest and its negation (the largest and the smallest digest
    over its holders): equal when the holders agree; the same verdict on every rank. The
    same all-reduce agrees on the save's id (the largest of the ranks' random proposals),
    which it returns."""
    # the same blocks in the same order on every rank (``placed`` is); a rank digests those
    # of its own parameters it holds (buffers may differ: DDP's ranks update their
    # BatchNorm statistics each on its own data, and torch's DCP too keeps one copy)
    shared = [p for p in placed if len(p.block.holders) > 1 and p.key.startswith("model.")]
    if not shared:
        return _agree_on_save_id(group)
    absent = torch.iinfo(torch.int64).min  # a rank not holding the block never wins a MAX
    mine: list[int] = []
    failure: Exception | None = None
    try:
        for p in shared:
            held = p.key in parameter_keys and rank in p.block.holders
            digest = _digest(local[p.key]) if held else None
            mine += [absent, absent] if digest is None else [digest, -digest]
    except Exception as exc:  # noqa: BLE001 - raised on every rank after the all-reduce
        failure, mine = exc, [absent] * (2 * len(shared))
    mine.append(secrets.randbits(63))  # the save id: the largest proposal
    mine.append(int(failure is not None))  # last: did any rank fail to digest its blocks
    extremes = torch.tensor(mine, dtype=torch.int64, device=comm.small_tensor_device(group))
    exchange.all_reduce_over(extremes, dist.ReduceOp.MAX, group)
    if failure is not None:
        raise failure
    if int(extremes[-1]):
        raise CheckpointError("save_checkpoint failed on another rank while reading its "
                              "parameters (see that rank's error); nothing was written")
    differ = [p for i, p in enumerate(shared) if int(extremes[2 * i]) != absent
              and int(extremes[2 * i]) != -int(extremes[2 * i + 1])]
    if differ:
        names = list(dict.fromkeys(p.key[len("model."):] for p in differ))
        listed = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        raise CheckpointError(
            f"save_checkpoint: parameter(s) {listed} differ between the ranks that hold them "
            f"as the same block (e.g. {names[0]}'s block at {list(differ[0].block.start)} on "
            f"ranks {format_ranks(differ[0].block.holders)}), and a checkpoint keeps one copy "
            "of each block, so it would mix them. Pipeline stages whose modules repeat names (each stage an "
            "nn.Sequential numbered from 0) hold different layers under the same names: keep "
            "the whole model's names in each stage (devmesh's split_sequential keeps them; "
            "or delete the other stages' layers from a copy of the whole model, as "
            "torchtitan does). Otherwise the replicas diverged: a parameter changed on "
            "some ranks only (check_replicas=False keeps one holder's copy of each block, "
            "as torch's DCP does). Nothing was written")
    return f"{int(extremes[-2]):016x}"


#: Bytes of a block digested at a time where it is not one run of bytes already (a strided
#: view on the host, or a block on an accelerator, whose 32-bit words are summed: the sum
#: widens them to 64 bits, a copy twice the slab's size), so a block is never copied whole.
DIGEST_SLAB_BYTES = 1 << 20


def _digest(block: torch.Tensor) -> int:
    """A 63-bit digest of ``block``'s bytes: equal for equal blocks, and different blocks —
    other layers, diverged replicas — differ in it. Not a defence against crafted collisions.
    On the host, XXH3 of the bytes in row-major order (xxhash's, ~18 GB/s here against
    3.3 GB/s for zlib's CRC-32: a replicated model's every parameter is digested on every
    rank at each save), read in place; on an accelerator, their 32-bit words (or bytes, where
    they do not make whole words) summed modulo 2^62 there, so nothing crosses to the host.
    Every holder of a block has it on the same kind of device, so all compute the same kind
    of digest; a block is digested in slabs of :data:`DIGEST_SLAB_BYTES` where it must be
    copied, so saving a replicated model costs no memory beyond it."""
    flat = block.detach().reshape(-1)
    if flat.device.type == "cpu":
        if flat.is_contiguous():
            return checksum(flat.view(torch.uint8).numpy(), "xxh3")
        step = max(1, DIGEST_SLAB_BYTES // flat.element_size())
        return xxh3_of_pieces(flat[start:start + step].contiguous().view(torch.uint8).numpy()
                              for start in range(0, flat.numel(), step))
    raw = flat.contiguous().view(torch.uint8)
    as_words = raw.numel() % 4 == 0  # the same rule on every holder: it depends on the size
    total = 0
    for start in range(0, raw.numel(), DIGEST_SLAB_BYTES):
        slab = raw[start:start + DIGEST_SLAB_BYTES]
        if as_words:
            if slab.storage_offset() % 4:  # a view into a buffer, off a word boundary
                slab = slab.clone()
            slab = slab.view(torch.int32)
        total += int(torch.sum(slab, dtype=torch.int64))
    return total % (1 << 62)


def _agree_on_save_id(group) -> str:
    """A fresh random id for this save's data files, rank 0's on every rank."""
    value = torch.tensor([secrets.randbits(63)], dtype=torch.int64)
    if group is not None:
        dist.broadcast(value, src=0, group=group)
    return f"{int(value.item()):016x}"


_SLAB = 64 << 20  # bytes written at a time


def checkpoint_progress(title: str, total: int, rank: int) -> Progress:
    """Plain progress lines from rank 0 for a save or load that takes long (the bytes of
    this rank's own blocks)."""
    return Progress(f"{title} (rank {rank}'s blocks)", total, show=rank == 0, bar=False,
                    amount=bytes_text)


def _write_and_commit(path: str, save_id: str, rank: int, world: int,
                      blocks: list[tuple[Placed, torch.Tensor]], placed: list[Placed],
                      merged: Merged, extras: list[Listed], extra: tuple[Any, Any],
                      group) -> None:
    """Write this rank's blocks; rank 0 commits (``extra``: the caller's ``extra`` and the
    modules' extra state, rank 0's both)."""
    name = data_file_name(save_id, rank)
    began = time.perf_counter()
    error: BaseException | None = None
    written: dict[int, list[int]] = {}  # id(placed block) -> its chunks' checksums
    try:
        os.makedirs(path, exist_ok=True)
        if blocks:
            total = sum(p.nbytes for p, _ in blocks)
            # the directory is fsynced once, by rank 0 before the metadata (_commit)
            with (atomic_file(os.path.join(path, name), "wb", sync_directory=False) as f,
                  checkpoint_progress("checkpoint save", total, rank) as progress):
                for p, tensor in blocks:
                    assert f.tell() == p.offset
                    data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
                    for start in range(0, len(data), _SLAB):  # slabs: progress as it goes
                        f.write(data[start:start + _SLAB])
                        progress.advance(min(_SLAB, len(data) - start))
                    written[id(p)] = checksums_of(data, p.block.size, _itemsize(p), _per(p))
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        error = CheckpointError(f"save_checkpoint could not write {os.path.join(path, name)}: "
                                f"{type(exc).__name__}: {exc}; the previous checkpoint, if "
                                "any, is untouched")
    checksums, anyone_failed = _checksums_on_every_rank(placed, written, group,
                                                        error is not None)
    if anyone_failed:  # the same on every rank
        _raise_if_failed(error, "save_checkpoint (writing data files; the previous checkpoint, "
                         "if any, is untouched)", group)
    commit_error = None
    if rank == 0:
        try:
            _commit(path, save_id, world, placed, merged, extras, extra, checksums)
        except Exception as exc:  # noqa: BLE001
            commit_error = CheckpointError(
                f"save_checkpoint could not write {os.path.join(path, METADATA)}: "
                f"{type(exc).__name__}: {exc}; the previous checkpoint, if any, is untouched")
    _raise_if_failed(commit_error, "save_checkpoint (rank 0 writing the metadata; the "
                     "previous checkpoint, if any, is untouched)", group)
    get_logger("checkpoint").info(
        "saved checkpoint %s: this rank wrote %d bytes (%d blocks) of %d in %.2f s", path,
        sum(p.nbytes for p, _ in blocks), len(blocks), sum(p.nbytes for p in placed),
        time.perf_counter() - began)


def _itemsize(p: Placed) -> int:
    """The bytes of one element of ``p``'s tensor (its blocks are never empty)."""
    return p.nbytes // max(1, math.prod(p.block.size))


def _per(p: Placed) -> int:
    """The rows of ``p``'s block one checksum covers (written in the metadata with them)."""
    return chunk_rows(p.block.size, _itemsize(p))


def _checksums_on_every_rank(placed: list[Placed], written: dict[int, list[int]], group,
                             failed: bool) -> tuple[list[list[int]], bool]:
    """Every placed block's chunk checksums, for rank 0 to write in the metadata, and whether
    any rank failed to write its blocks: each rank fills the slots of the blocks it wrote
    (every rank knows every block's slots, from the placement) and a last slot with its
    failure, and one all-reduce sums them (each slot has one writer)."""
    counts = [chunk_count(p.block.size, _itemsize(p), _per(p)) for p in placed]
    slots = torch.zeros(sum(counts) + 1, dtype=torch.int64)
    at = 0
    for p, n in zip(placed, counts, strict=True):
        if id(p) in written:
            slots[at:at + n] = torch.tensor(written[id(p)], dtype=torch.int64)
        at += n
    slots[-1] = int(failed)
    if group is not None:  # the same slots on every rank: from the placement
        exchange.all_reduce_over(slots, group=group)
    values = slots.tolist()
    out, at = [], 0
    for n in counts:
        out.append(values[at:at + n])
        at += n
    return out, bool(values[-1])


def _commit(path: str, save_id: str, world: int, placed: list[Placed], merged: Merged,
            extras: list[Listed], extra: tuple[Any, Any], checksums: list[list[int]]) -> None:
    """Rank 0: write the metadata (the checkpoint now exists), then drop unnamed data files."""
    sizes: dict[str, int] = {}
    for p in placed:
        name = data_file_name(save_id, p.rank)
        sizes[name] = max(sizes.get(name, 0), p.offset + p.nbytes)
    tensors: dict[str, Any] = {}
    for t in merged.tensors + extras:
        tensors[t.key] = {"dtype": t.dtype, "shape": list(t.shape), "layout": t.text,
                          "mesh": t.mesh, "blocks": []}
    for p, sums in zip(placed, checksums, strict=True):
        tensors[p.key]["blocks"].append({
            "file": data_file_name(save_id, p.rank), "offset": p.offset,
            "start": list(p.block.start), "size": list(p.block.size), WRITTEN: sums,
            "chunk_rows": _per(p)})
    metadata = {"format": FORMAT, "world_size": world, "files": sizes, "tensors": tensors,
                "aliases": merged.aliases, "model": merged.model_keys,
                "optimizer": merged.optimizer, "extra": extra[0], "extra_state": extra[1]}
    # every rank renamed its data file before the checksums' all-reduce: one fsync of the
    # directory makes them all durable before the metadata that names them can be
    fsync_directory(path)
    with atomic_file(os.path.join(path, METADATA), "w") as f:
        f.write(json.dumps(metadata))  # dumps: C's encoder (dump streams through Python's)
    for stale in os.listdir(path):  # every rank is done writing: these are left over
        leftover_tmp = stale.startswith(".data-") and stale.endswith(TMP_SUFFIX)
        if (DATA_FILE.fullmatch(stale) and stale not in sizes) or leftover_tmp:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(path, stale))
