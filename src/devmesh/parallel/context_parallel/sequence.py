"""Which tokens of a sequence each rank of a ``cp`` mesh dim holds.

Causal attention makes late tokens expensive (they attend to everything before them) and
early ones cheap. Split into ``cp`` contiguous pieces, the last rank would do ``2 cp - 1``
times the first one's work. With load balancing (the default, as in Megatron-LM and
torchtitan) the sequence is cut into ``2 cp`` chunks and rank ``r`` holds chunks ``r`` and
``2 cp - 1 - r``, a head and a tail: every rank does the same work.
"""

from __future__ import annotations

import torch

from devmesh.distributed import comm
from devmesh.errors import ParallelizeError
from devmesh.mesh import DeviceMesh

__all__ = ["shard_sequence", "gather_sequence", "sequence_positions", "check_cp_mesh"]


def check_cp_mesh(mesh: DeviceMesh, what: str) -> None:
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ParallelizeError(
            f"{what} takes the 1-D mesh of the context-parallel dim, e.g. mesh['cp'], "
            f"got {mesh!r}")


def _chunks_of(rank: int, cp: int, load_balance: bool) -> tuple[int, ...]:
    return (rank, 2 * cp - 1 - rank) if load_balance else (rank,)


def _check_length(length: int, cp: int, load_balance: bool, what: str) -> int:
    """The chunk length; refuses a sequence the chunks do not divide."""
    pieces = 2 * cp if load_balance else cp
    if length % pieces:
        fix = (f"pad it to a multiple of {pieces} (2 x cp, a head and a tail chunk per "
               "rank), or pass load_balance=False" if load_balance
               else f"pad it to a multiple of {pieces}")
        raise ParallelizeError(
            f"{what}: a sequence of {length} tokens does not split into {pieces} equal "
            f"chunks over cp = {cp}: {fix}")
    return length // pieces


def sequence_positions(length: int, mesh: DeviceMesh, *, load_balance: bool = True,
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """The positions in the whole sequence of the ``length // cp`` tokens this rank holds
    (for position embeddings and masks): with load balancing, a head chunk and a tail."""
    check_cp_mesh(mesh, "sequence_positions")
    return positions_of(mesh.get_local_rank(), mesh.size(), length, load_balance, device)


def positions_of(rank: int, cp: int, length: int, load_balance: bool,
                 device: torch.device | str = "cpu", what: str = "sequence_positions"
                 ) -> torch.Tensor:
    chunk = _check_length(length, cp, load_balance, what)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device)
                      for c in _chunks_of(rank, cp, load_balance)])


def shard_sequence(tensor: torch.Tensor, mesh: DeviceMesh, dim: int = 1, *,
                   load_balance: bool = True) -> torch.Tensor:
    """This rank's tokens of ``tensor``, whose dim ``dim`` is the whole sequence (every rank
    passes the same tensor: the batch, a mask, position ids). The result is a new tensor."""
    check_cp_mesh(mesh, "shard_sequence")
    cp, rank = mesh.size(), mesh.get_local_rank()
    dim = dim % tensor.ndim
    _check_length(tensor.shape[dim], cp, load_balance, "shard_sequence")
    pieces = tensor.chunk(2 * cp if load_balance else cp, dim)
    return torch.cat([pieces[c] for c in _chunks_of(rank, cp, load_balance)], dim)


def _whole(gathered: torch.Tensor, cp: int, dim: int, load_balance: bool) -> torch.Tensor:
    """The whole sequence from the ranks' tokens stacked ``(cp, *local)``."""
    pieces: list[torch.Tensor | None] = [None] * (2 * cp if load_balance else cp)
    for rank in range(cp):
        chunks = _chunks_of(rank, cp, load_balance)
        for c, part in zip(chunks, gathered[rank].chunk(len(chunks), dim), strict=True):
            pieces[c] = part
    return torch.cat(pieces, dim)  # type: ignore[arg-type]


def _by_rank(whole: torch.Tensor, cp: int, dim: int, load_balance: bool) -> torch.Tensor:
    """Every rank's tokens of the whole sequence, stacked ``(cp, *local)``."""
    pieces = whole.chunk(2 * cp if load_balance else cp, dim)
    return torch.stack([torch.cat([pieces[c] for c in _chunks_of(rank, cp, load_balance)], dim)
                        for rank in range(cp)])


class _GatherSequence(torch.autograd.Function):
    """All-gather of the ranks' tokens into the whole sequence. Backward: ``same`` — every
    rank computed the same thing from the whole, so each takes its own tokens' gradient; else
    each rank's use of the whole differs (its own queries over all keys), and the gradients
    of every rank's tokens are summed where they belong (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, mesh: DeviceMesh, dim: int,  # type: ignore[override]
                load_balance: bool, same: bool) -> torch.Tensor:
        ctx.mesh, ctx.dim, ctx.load_balance, ctx.same = mesh, dim, load_balance, same
        gathered = comm.all_gather(local.contiguous(), mesh, (0,))  # (cp, *local.shape)
        return _whole(gathered, mesh.size(), dim, load_balance)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if ctx.same:
            mine = shard_sequence(grad, ctx.mesh, ctx.dim, load_balance=ctx.load_balance)
        else:
            stacked = _by_rank(grad, ctx.mesh.size(), ctx.dim, ctx.load_balance)
            mine = comm.reduce_scatter(stacked, ctx.mesh, (0,))
        return mine, None, None, None, None


def gather_keys(local: torch.Tensor, mesh: DeviceMesh, dim: int, load_balance: bool
                ) -> torch.Tensor:
    """Every rank's keys (or values) as the whole sequence, each rank using them for its own
    queries: their gradients come back reduce-scattered."""
    return _GatherSequence.apply(local, mesh, dim % local.ndim, load_balance, False)


def gather_sequence(local: torch.Tensor, mesh: DeviceMesh, dim: int = 1, *,
                    load_balance: bool = True) -> torch.Tensor:
    """The whole sequence from every rank's tokens (the inverse of :func:`shard_sequence`),
    differentiable: a loss computed from it on every rank gives each rank the gradient of
    its own tokens."""
    check_cp_mesh(mesh, "gather_sequence")
    return _GatherSequence.apply(local, mesh, dim % local.ndim, load_balance, True)
