"""How a pipeline step fails: on every rank alike, never by one rank alone.

A stage's forward or backward that raises on one rank stops that rank computing, but not
sending: it still sends what it owes (zeros) so no neighbour waits. It tells its stage's
copies over the mesh's other dims at once (:mod:`~devmesh.distributed.stops`), so that they
give up the stage's collectives instead of waiting for it until the timeout. At the step's
end one tiny agreement (:func:`~devmesh.distributed.consensus.failures`) — along the
pipeline, or over the whole mesh where it has other dims — tells every rank of every failure,
and every rank raises the same :class:`PipelineError`, naming each failed rank and where.
"""

from __future__ import annotations

from devmesh.distributed import comm, consensus, stops
from devmesh.mesh import DeviceMesh
from devmesh.parallel.pipeline.messages import StageLinks
from devmesh.parallel.pipeline.split import PipelineError
from devmesh.parallel.pipeline.step_state import StepState

__all__ = ["StepFailures"]


class StepFailures:
    """The failure protocol (mixed into :class:`PipelineRunner`, which sets the mesh, its
    pipeline dim, the links along it, and the groups of this rank's copies and of the whole
    mesh)."""

    mesh: DeviceMesh
    dim: int
    _links: StageLinks
    _copies: object | None
    _everyone: object

    def _agree_or_raise(self, problem: str | None, what: str, group=None) -> None:
        """Raise on every rank of ``group`` (the pipeline dim's by default) if any has a
        ``problem`` (one tiny all-reduce)."""
        failed = consensus.failures(problem, group or self.mesh.get_group(self.dim))
        if failed:
            listing = "; ".join(f"rank {rank}: {text}" for rank, text in sorted(failed.items()))
            raise PipelineError(f"{what} — {listing}")

    def _announce_stop(self, step: StepState) -> None:
        """This rank stopped computing mid-step (its stage's forward or backward raised):
        its copies may be waiting in, or about to enter, one of the stage's collectives
        it will not enter now — tell them, so they give up at once instead of at the
        collective timeout (:mod:`~devmesh.distributed.stops`). A rank that gave up stops
        here too, and tells its own copies in turn."""
        step.announced = True
        if self._copies is None:
            return
        me, layout = self.mesh.get_rank(), self.mesh.layout
        copies = layout.group_of(me, tuple(d for d in range(layout.ndim) if d != self.dim))
        # the groups it still uses in this step: the messages, and the step's end
        still_used = [layout.group_of(me, (self.dim,)),
                      layout.group_of(me, tuple(range(layout.ndim)))]
        stops.announce(step.error or "", copies, still_used=still_used)

    def _raise_if_any_stage_failed(self, step: StepState) -> None:
        """One tiny all-reduce along the pipeline; where the mesh has other dims, over the
        whole mesh instead, so every pipeline hears of every failure and every rank raises
        alike (a copy that went on would apply gradients its copies' reductions left
        partial; one collective over the mesh costs less here than one along the pipeline
        and one among the copies: each is a point where all of its ranks wait)."""
        if self._copies is None:
            watch, group = self._links.watch, self.mesh.get_group(self.dim)
        else:
            watch, group = comm.exchange_watch(
                "pipeline step's end", self.mesh, range(self.mesh.ndim),
                absent="never reached the end of the step — they are stuck in their own "
                       "code (a stage's forward or backward, the loss), waiting for a "
                       "message from a rank that is, or dead"), self._everyone
        with watch.guard():  # a rank stuck in its code is named here too
            failed = consensus.failures(step.error, group)
        listing = "; ".join(f"rank {rank}: {text}" for rank, text in sorted(failed.items()))
        if not listing:
            return
        message = f"pipeline step failed — {listing}"
        broken = stops.learn_broken()
        if broken:  # a copy gave up on a collective that stays posted: no step can follow
            raise PipelineError(
                f"{message}. A stage's copy stopped between the stage's collectives and the "
                "others gave up waiting for it, so this world's collectives are out of step: "
                "restart the job (from the last checkpoint); devmesh refuses further "
                "collectives here") from step.exception
        if step.training:
            message = (message.rstrip(".") + ". The step's gradients are partial: zero them "
                       "before the next step")
        raise PipelineError(message) from step.exception
