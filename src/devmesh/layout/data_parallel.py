"""The data-parallel dims of a job's mesh as devmesh places them: which combinations with
context parallelism it runs, what dims flattened together are called, and from how many
tokens per rank a sequence is worth splitting. Pure (no torch): ``parallelize``, the dry
run, the mesh search and the CLI's help read the same rules here."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["MIN_TOKENS_PER_CP_RANK", "cp_beside_one_data_dim", "cp_shards_parameters",
           "ep_beside", "flattened_name"]

#: context parallelism is tried (by the mesh search) while each rank keeps at least this many
#: tokens of every sequence: below, the ring's messages of a block outweigh its attention,
#: and the search would spend its time on rings of hundreds of ranks nobody runs
MIN_TOKENS_PER_CP_RANK = 4096


def cp_beside_one_data_dim(replicated: bool, sharded: bool) -> bool:
    """Whether a ``cp`` dim fits beside the mesh's data-parallel dims: its ranks join one of
    them for the parameters (DDP over ``dp x cp``, or FSDP over ``shard x cp``), so a mesh
    that both replicates and shards (HSDP) has no one dim for them to join."""
    return not (replicated and sharded)


def cp_shards_parameters(replicated: bool, sharded: bool) -> bool:
    """Whether a ``cp`` dim with no data-parallel dim beside it shards the parameters (FSDP
    over ``cp``), as torchtitan does (its FSDP mesh is ``dp_shard x cp``, FSDP on whenever
    either is above 1): a long-context job of one data rank keeps ``1/cp`` of the model
    per rank. Beside a data-parallel dim, ``cp`` joins it (DDP over ``dp x cp``, FSDP over
    ``shard x cp``)."""
    return not replicated and not sharded


def ep_beside(replicated: bool, context: bool) -> bool:
    """Whether an ``ep`` dim fits beside the mesh's other dims: its ranks are data ranks
    beside a shard dim or alone (FSDP over ``shard x ep`` for the dense parameters, the
    experts split over ``ep``), so neither a replicate dim (``dp``: HSDP) nor ``cp`` (which
    borrows the same data ranks) may be there too."""
    return not replicated and not context


def flattened_name(names: Sequence[str]) -> str:
    """The name of mesh dims flattened together, as torch's ``DeviceMesh._flatten`` names
    them without a name given: theirs joined by ``_`` (``dp_shard_cp``)."""
    return "_".join(names)
