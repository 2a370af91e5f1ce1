"""What one pipeline step keeps between its actions, and the first failure on this rank
(raised on every rank once the step's messages are all sent: see the runner)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from devmesh.errors import CollectiveAbandonedError, rank_prefix
from devmesh.layout.schedule import Action

__all__ = ["StepState"]


@dataclass
class StepState:
    """What one step keeps between actions."""

    chunks: dict[str, tuple[torch.Tensor, ...]]
    training: bool = True  # False: forward only (evaluate), nothing kept for a backward
    loss_kwargs: dict[str, Any] = field(default_factory=dict)
    saved: dict[tuple[int, int], dict] = field(default_factory=dict)  # (stage, mb) -> tensors
    losses: list[torch.Tensor] = field(default_factory=list)
    outputs: dict[int, tuple[Any, torch.Tensor | None]] = field(default_factory=dict)
    compute: dict[Action, float] = field(default_factory=dict)
    # stages whose I did a whole backward this step (SplitBackward.whole: a compiled stage)
    whole_stages: set[int] = field(default_factory=set)
    error: str | None = None  # the first failure on this rank, raised at the end of the step
    exception: BaseException | None = None
    halted: bool = False  # nothing more is computed (messages owed are still sent)
    announced: bool = False  # this rank's copies were told it stopped (or stopped with it)

    def fail(self, exc: BaseException, where: str | None = None, *, halt: bool = True
             ) -> None:
        """Remember the first failure: ``where`` it happened, or devmesh's own refusal;
        ``halt``: compute nothing more (a failure that left the stage's collectives where
        its copies' are, as a loss function's, need not)."""
        if self.error is None:
            message = str(exc).removeprefix(rank_prefix())
            if isinstance(exc, CollectiveAbandonedError):  # the rank that stopped says why
                message = (f"gave up waiting in {exc.collective} for rank {exc.stopped}, "
                           "which stopped first")
                self.error = f"{where}: {message}" if where else message
            else:
                self.error = f"{where}: {type(exc).__name__}: {message}" if where else message
            self.exception = exc
        self.halted = self.halted or halt
