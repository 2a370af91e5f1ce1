"""Tokens to the ranks that hold their experts and back, over an ``ep`` mesh dim.

Rank ``r`` of ``ep`` holds experts ``r * L .. (r + 1) * L - 1`` (``L = experts / ep``). A
forward: (1) one all-to-all of ``L`` integers per rank pair says how many tokens each rank
sends to each of the receiver's experts; (2) one all-to-all of the tokens, with uneven
split sizes; (3) the received tokens regrouped by local expert and run; (4) the outputs put
back in arrival order and (5) returned by one more all-to-all. Backward runs the two token
all-to-alls the other way. Every exchange is devmesh's counted, watched all-to-all.

On the ``meta`` device (a dry run: shapes, no values) where a token goes cannot be read: the
routing is taken as balanced (:func:`expert_counts`), every rank sending each expert the
same share, so the sizes each exchange moves are known without the values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from devmesh.distributed import comm
from devmesh.mesh import DeviceMesh

__all__ = ["ExpertParallelDispatch", "expert_counts"]


def expert_counts(expert: torch.Tensor, experts: int) -> list[int]:
    """How many of the assignments ``expert`` (expert indices) go to each of the
    ``experts``. On the ``meta`` device, where no index has a value, as a balanced router
    sends them: evenly, the first experts taking one more where they do not divide."""
    if expert.is_meta:
        n = expert.numel()
        return [n // experts + (e < n % experts) for e in range(experts)]
    return torch.bincount(expert, minlength=experts).tolist()


class _AllToAll(torch.autograd.Function):
    """Rows of ``tokens`` split ``send`` ways to the ranks, ``receive[i]`` rows from rank
    ``i``; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor,  # type: ignore[override]
                send: list[int], receive: list[int], mesh: DeviceMesh) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.mesh = send, receive, mesh
        return _exchange(tokens, send, receive, mesh)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _exchange(grad.contiguous(), ctx.receive, ctx.send, ctx.mesh), None, None, None


def _exchange(tokens: torch.Tensor, send: list[int], receive: list[int], mesh: DeviceMesh
              ) -> torch.Tensor:
    width = tokens.shape[1:]
    pieces = comm.all_to_all(list(tokens.split(send)), mesh, (0,),
                             [(n, *width) for n in receive])
    return torch.cat(pieces)


class ExpertParallelDispatch:
    """Experts split over the 1-D ``ep`` mesh; assignment counts of the aux loss summed
    over ``data_mesh`` (the ranks whose tokens differ)."""

    def __init__(self, mesh: DeviceMesh, data_mesh: DeviceMesh) -> None:
        self.mesh, self.data_mesh = mesh, data_mesh

    def total_counts(self, counts: torch.Tensor) -> torch.Tensor:
        total = counts.detach().clone()
        return comm.all_reduce(total, self.data_mesh, tuple(range(self.data_mesh.ndim)))

    def run(self, tokens: torch.Tensor, per_expert: list[int],
            experts: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> torch.Tensor:
        """``tokens`` sorted by expert, ``per_expert[e]`` of them for expert ``e`` of the
        whole layer; ``experts(arriving, counts)`` runs this rank's experts on the arriving
        tokens sorted by local expert, ``counts[l]`` for local expert ``l``."""
        ep = self.mesh.size()
        local = len(per_expert) // ep
        counts = torch.tensor(per_expert, dtype=torch.int64).view(ep, local)
        # (1) how many tokens each rank sends to each of my experts: received[s][l]
        received = torch.stack(comm.all_to_all(list(counts), self.mesh, (0,),
                                               [(local,)] * ep))
        if tokens.is_meta:  # balanced routing: every rank sends my experts what I send them
            received = counts[self.mesh.get_local_rank()].expand(ep, local).clone()
        send = counts.sum(1).tolist()
        arriving = received.sum(1).tolist()
        # (2) the tokens, grouped by source rank, each source's sorted by my experts
        mine = _AllToAll.apply(tokens, send, arriving, self.mesh)
        # (3) regroup by expert: expert l's tokens from every source, in source order
        runs = received.reshape(-1).tolist()  # (source, expert) runs in arrival order
        starts = [0]
        for n in runs[:-1]:
            starts.append(starts[-1] + n)
        by_expert = [s * local + e for e in range(local) for s in range(ep)]
        # on the tokens' device: index_copy below takes no index from another device
        index = torch.cat([torch.arange(starts[i], starts[i] + runs[i], device=tokens.device)
                           for i in by_expert])
        out = experts(mine[index], received.sum(0).tolist())
        # (4) back to arrival order, (5) back to the senders
        back = torch.zeros_like(out).index_copy(0, index, out)
        return _AllToAll.apply(back, arriving, send, self.mesh)
