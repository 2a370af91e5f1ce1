"""devmesh's exception types.

Every error devmesh raises is a :class:`DevmeshError` *and* a subclass of the builtin type
PyTorch raises in the same situation (``KeyError``, ``ValueError``, ``RuntimeError``,
``TimeoutError``), so ``except`` clauses written against ``torch.distributed`` keep working.

Messages say what is wrong, on which rank (when a process group exists), and how to fix it.
This module imports nothing heavy: the pure layout layer and the CLI use it without torch.
"""

from __future__ import annotations

import os

__all__ = [
    "DevmeshError",
    "TorchVersionError",
    "MeshShapeError",
    "MeshDimNameError",
    "MeshNamesError",
    "MeshFlattenNameError",
    "DeviceTypeError",
    "MeshRankError",
    "LaunchEnvironmentError",
    "WorldSizeMismatchError",
    "DeviceUnavailableError",
    "MeshMismatchError",
    "MeshTimeoutError",
    "CollectiveTimeoutError",
    "CollectiveAbandonedError",
    "MeshBrokenError",
    "RankFailedError",
    "RankTimeoutError",
    "MeshUsageError",
    "ParallelizeError",
    "FSDPStateError",
    "ShardingSpecError",
    "NestedShardingError",
    "TopologyError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "StateDictError",
    "PipelineError",
    "ScheduleError",
    "DryRunError",
    "CheckpointFormatError",
    "CheckpointChecksumError",
    "LaunchCapacityError",
    "WorkerStartError",
    "TopologyWarning",
    "WaitingForRanksWarning",
    "BlockwiseOptimizerWarning",
    "rank_prefix",
    "is_peer_gone",
    "is_timeout",
]


def rank_prefix() -> str:
    """``"[rank 3] "`` when this process knows its rank, else ``""``.

    Read from the launcher's environment so that it works before (and without) a process
    group, and does not import torch.
    """
    rank = os.environ.get("RANK")
    return f"[rank {rank}] " if rank is not None else ""


class DevmeshError(Exception):
    """Base class of every devmesh error."""

    def __init__(self, message: str, *, with_rank: bool = True) -> None:
        self.message = (rank_prefix() if with_rank else "") + message
        super().__init__(self.message)

    def __str__(self) -> str:  # KeyError would otherwise print the message in quotes
        return self.message


class TorchVersionError(DevmeshError, ImportError):
    """The running torch lacks (or changed) a private name devmesh builds on
    (``devmesh._torch_compat`` checks them): install a supported torch release."""


class MeshShapeError(DevmeshError, ValueError):
    """A mesh shape or rank array is malformed (non-positive size, duplicate ranks, ...)."""


class MeshDimNameError(DevmeshError, KeyError):
    """A mesh dimension name is unknown, duplicated, or names are missing.

    A ``KeyError`` because torch raises ``KeyError`` for an invalid name in slicing.
    """


class MeshNamesError(MeshDimNameError, RuntimeError):
    """The names given to a new mesh are wrong (count, duplicates, empty).

    A ``RuntimeError`` because torch's ``init_device_mesh`` raises one; still a ``KeyError``
    (through :class:`MeshDimNameError`) because devmesh 0.1 raised that.
    """


class MeshFlattenNameError(MeshDimNameError, ValueError):
    """``_flatten`` was given a name that already stands for other dimensions.

    A ``ValueError`` because torch's ``_flatten`` raises one; still a ``KeyError`` (through
    :class:`MeshDimNameError`) because devmesh raised that before.
    """


class DeviceTypeError(MeshShapeError, RuntimeError):
    """``device_type`` is not a plain device type (``"cuda:0"`` instead of ``"cuda"``).

    A ``RuntimeError`` as in torch's ``init_device_mesh``; a ``ValueError`` as in devmesh 0.1.
    """


class MeshRankError(DevmeshError, ValueError):
    """A rank is not part of a mesh or a coordinate is out of range."""


class LaunchEnvironmentError(DevmeshError, KeyError):
    """The process was not started by a launcher (torchrun sets ``RANK``, ``WORLD_SIZE``, ...).

    A ``KeyError`` because that is what ``os.environ["RANK"]`` raises in torch's path.
    """


class WorldSizeMismatchError(DevmeshError, RuntimeError):
    """``init_device_mesh`` was asked for a mesh whose size is not the world size."""


class DeviceUnavailableError(DevmeshError, RuntimeError):
    """The requested device type is missing or has fewer devices than local ranks."""


class MeshMismatchError(DevmeshError, RuntimeError):
    """Ranks passed different meshes (shape, names or ranks) to the same collective call."""


class MeshTimeoutError(DevmeshError, TimeoutError):
    """Some ranks did not reach a mesh-wide step (mesh creation) within the timeout."""


class CollectiveTimeoutError(DevmeshError, RuntimeError, TimeoutError):
    """A collective timed out; names the ranks of its group that never entered it. A
    ``RuntimeError`` as torch's own gloo/NCCL timeout, which is its cause."""

    def __init__(self, message: str, *, missing: list[int], waited: list[int]) -> None:
        self.missing = missing
        self.waited = waited
        super().__init__(message)


class CollectiveAbandonedError(DevmeshError, RuntimeError):
    """This rank gave up waiting in a collective: a rank of its group said it stopped before
    entering it (its error is named), so it never would. The collective stays posted, so the
    world's collectives are out of step after this (:class:`MeshBrokenError`)."""

    def __init__(self, message: str, *, collective: str, stopped: int) -> None:
        self.collective = collective  # "all_gather over dp (collective #15)"
        self.stopped = stopped  # the rank that stopped
        super().__init__(message)


class MeshBrokenError(DevmeshError, RuntimeError):
    """A rank gave up on a collective that stays posted (:class:`CollectiveAbandonedError`),
    so the next collective on that group would pair with it: devmesh refuses every
    collective after that; the job must restart (from its last checkpoint)."""


class RankFailedError(DevmeshError, RuntimeError):
    """A rank of a local launch raised; carries the rank and its remote traceback."""

    def __init__(self, message: str, *, rank: int, remote_traceback: str) -> None:
        self.rank = rank
        self.remote_traceback = remote_traceback
        super().__init__(message, with_rank=False)


class RankTimeoutError(DevmeshError, TimeoutError):
    """Ranks of a local launch did not finish within the timeout (a hang)."""

    def __init__(self, message: str, *, ranks: list[int], stacks: dict[int, str]) -> None:
        self.ranks = ranks
        self.stacks = stacks
        super().__init__(message, with_rank=False)


class MeshUsageError(DevmeshError, RuntimeError):
    """A DeviceMesh method was called in a way torch also refuses (a ``RuntimeError`` there)."""


class ParallelizeError(DevmeshError, ValueError):
    """A parallelism was applied in a way that cannot work (wrong mesh, wrong module...)."""


class FSDPStateError(DevmeshError, RuntimeError):
    """A ``fully_shard`` unit was asked to move its parameter slots between two states that no
    legal sequence of forward, backward, ``unshard()`` and ``reshard()`` connects: a bug in
    devmesh, or hooks run out of order (e.g. a module's forward hooks called by hand)."""


class ShardingSpecError(DevmeshError, ValueError):
    """A sharding spec or placement list is inconsistent with the mesh or the tensor."""


class NestedShardingError(ShardingSpecError):
    """The spec splits a dim by mesh dims out of mesh order; plain placements cannot say so."""


class CheckpointError(DevmeshError, RuntimeError):
    """A checkpoint cannot be written or read: refused, truncated, corrupted, or for another
    model. Raised before anything in the model or optimizer is changed."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint file does not exist (a ``FileNotFoundError`` too)."""


class StateDictError(ParallelizeError, RuntimeError):
    """A state dict does not fit the model (missing or unexpected keys, shapes): a
    ``RuntimeError`` as ``nn.Module.load_state_dict`` raises; nothing was copied."""


class PipelineError(ParallelizeError, ValueError):
    """A pipeline cannot be built or run as asked (sizes, splits, shapes)."""


class DryRunError(DevmeshError, ValueError):
    """A dry run (``devmesh plan --model``) asked for something it cannot build: an unknown
    model config, a mesh that does not fit the model or the batch."""

    def __init__(self, message: str) -> None:
        super().__init__(message, with_rank=False)


class ScheduleError(DevmeshError, ValueError):
    """A schedule cannot be built (bad sizes) or cannot run (it waits on itself)."""


class CheckpointFormatError(CheckpointError):
    """The checkpoint's metadata does not have the structure devmesh writes (damaged or
    foreign)."""


class CheckpointChecksumError(CheckpointError):
    """A block of a checkpoint's data does not match the checksum written with it: the file
    was changed or damaged after it was saved. Names the file, the tensor and the block."""


class LaunchCapacityError(DevmeshError, ValueError):
    """A local launch asked for more ranks than this machine can hold (memory or cores);
    refused before any process starts."""


class WorkerStartError(DevmeshError, RuntimeError):
    """Local worker processes did not start (import torch, connect back) within the start
    timeout: a busy machine, or too many ranks for it."""


class TopologyError(DevmeshError, RuntimeError):
    """A bandwidth-heavy mesh dim would cross hosts (with ``strict=True``)."""


class WaitingForRanksWarning(UserWarning):
    """A collective call (``save_checkpoint``, ``state_dict(full=True)``) has waited long for
    ranks that have not made it: most often it was called inside ``if rank == 0:``."""


class TopologyWarning(UserWarning):
    """A bandwidth-heavy mesh dim crosses hosts: its traffic goes over the network."""


class BlockwiseOptimizerWarning(UserWarning):
    """An optimizer devmesh does not know steps split parameters (this rank's blocks): right
    if its update of an element reads only that element, wrong if it reads across them."""


def is_peer_gone(error: BaseException | str) -> bool:
    """Whether ``error`` (an exception, or its ``"Type: message"`` text) is gloo's error for a
    peer that closed its connection mid-collective: the peer crashed or its task ended, or
    its own wait timed out first (gloo then closes its pairs), so this rank hears of the
    same timeout as a closed connection."""
    if isinstance(error, BaseException) and not isinstance(error, RuntimeError):
        return False
    text = str(error)
    return "Connection closed by peer" in text or "Connection reset by peer" in text


def is_timeout(error: BaseException) -> bool:
    """Whether ``error`` is torch's collective timeout (gloo: ``Timed out waiting``; NCCL's
    watchdog: ``Watchdog caught collective operation timeout``)."""
    text = str(error)
    return isinstance(error, RuntimeError) and ("Timed out waiting" in text
                                                 or "operation timeout" in text)
