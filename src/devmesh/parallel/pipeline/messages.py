"""The messages between pipeline stages: activations forward, gradients backward.

Each message is tagged by (stage, micro-batch, direction), so a receive names exactly the
message it waits for, whatever order the schedule plays; the receive of the next action is
posted before the current action computes, so its data arrives meanwhile. The shape and dtype
of a stage's input are announced once per step, in a small header before the step's first
activation (so the shape may change from one step to the next without any collective); later
messages of the step carry only data, and a gradient has the shape of the activation it
answers.

The header must not delay the first activation: over gloo, a receive posted after its
message was sent, while the sender is busy computing, waited 1-5 ms (measured: half of the
first messages of a step, against 0.4 ms for a receive posted in advance), at the head of the
pipeline where every stage waits for it. So at the start of a step each rank posts, for each
stage it receives activations for, the header's receive and the first activation's receive in
the shape of the previous step. When the shape stays (the common case), that receive is the
one the data lands in. When it changed (or the sender failed), the sender first sends zeros
of the old shape to fill the receive posted in advance, and the data follows on a tag of its
own; both sides know the old shape, so they agree without asking.

A stage that fails part-way through a step must not leave its neighbours waiting for a
message that never comes: it keeps every message flowing, zeros of the announced shape in
place of what it could not compute, or — when it failed before it could announce a shape —
a header saying so, after which neither side expects data for that stage in this step. The
runner then raises on every rank at the end of the step.
"""

from __future__ import annotations

import torch

from devmesh.distributed import comm
from devmesh.layout.schedule import Action, Schedule
from devmesh.mesh import DeviceMesh

__all__ = ["StageLinks", "Shape"]

Shape = tuple[tuple[int, ...], torch.dtype]

_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
           torch.int32]
_HEADER = 10  # ndim (-1: the sender failed first), dtype code, up to 8 sizes
_FAILED = -1


def _header_tag(stage: int) -> int:
    return 1 << 30 | stage


def _reshaped(tag: int) -> int:
    """The tag of a step's first activation on a link whose shape changed (the usual tag
    went to the zeros that filled the receive posted in advance)."""
    return 1 << 29 | tag


class StageLinks:
    """This rank's messages to and from the neighbouring stages' ranks along the pipeline
    dim, and the shapes announced on them."""

    def __init__(self, mesh: DeviceMesh, dim: int, schedule: Schedule) -> None:
        self.mesh, self.dim, self.schedule = mesh, dim, schedule
        self.device = comm.mesh_device(mesh)  # NCCL carries only the device's tensors
        self.received: dict[int, Shape | None] = {}  # stage -> its input, as announced here
        self.announced: dict[int, Shape | None] = {}  # stage -> its input, as this rank said
        # the same for the previous step: the receives posted in advance expect these shapes
        self.received_before: dict[int, Shape | None] = {}
        self.announced_before: dict[int, Shape | None] = {}
        self.sends: list[comm.Pending] = []
        self._posted: dict[tuple[int, int], comm.Pending] = {}  # (peer stage, tag) -> receive

    def start_step(self, actions: tuple[Action, ...]) -> None:
        """Announce every shape again (each step may bring a new micro-batch shape), and post
        the receives of each incoming link's header and first activation (the latter in the
        previous step's shape) for this rank's ``actions``."""
        self.received_before, self.received = self.received, {}
        self.announced_before, self.announced = self.announced, {}
        first = {}  # stage -> the micro-batch of its first forward this step
        for action in actions:
            if action.kind == "F" and action.stage > 0:
                first.setdefault(action.stage, action.microbatch)
        for stage, microbatch in first.items():
            self._post(((_HEADER,), torch.int64), stage - 1, _header_tag(stage))
            before = self.received_before.get(stage)
            if before is not None:
                self._post(before, stage - 1, self._tag(stage, microbatch, False))

    def _tag(self, stage: int, microbatch: int, backward: bool) -> int:
        return (stage * self.schedule.microbatches + microbatch) * 2 + int(backward)

    def _post(self, shape: Shape, stage: int, tag: int) -> None:
        """Post the receive of message ``tag`` from ``stage``'s rank (once)."""
        if (stage, tag) not in self._posted:
            self._posted[(stage, tag)] = comm.recv_async(
                shape[0], shape[1], self.mesh, self.dim, self.schedule.rank_of(stage), tag,
                self.device)

    def _send(self, tensor: torch.Tensor, stage: int, tag: int) -> None:
        peer = self.schedule.rank_of(stage)
        self.sends.append(comm.send_async(tensor, self.mesh, self.dim, peer, tag))

    def _recv(self, shape: Shape, stage: int, tag: int) -> torch.Tensor:
        posted = self._posted.pop((stage, tag), None)
        if posted is not None:
            return posted.wait()
        return comm.recv(shape[0], shape[1], self.mesh, self.dim, self.schedule.rank_of(stage),
                         tag, self.device)

    def prefetch(self, action: Action) -> None:
        """Post the receive ``action`` will wait for, when its shape is already known, so
        that its data lands while this rank computes the action before it."""
        s, mb = action.stage, action.microbatch
        if action.kind == "F" and s > 0:
            shape, peer, tag = self.received.get(s), s - 1, self._tag(s, mb, False)
        elif action.kind in ("B", "I") and s < self.schedule.stages - 1:
            shape, peer, tag = self.announced.get(s + 1), s + 1, self._tag(s, mb, True)
        else:
            return
        if shape is not None:
            self._post(shape, peer, tag)

    # -- forward ----------------------------------------------------------------------------
    def send_activation(self, out: torch.Tensor | None, stage: int, microbatch: int
                        ) -> str | None:
        """Send ``stage - 1``'s output for ``microbatch`` to ``stage`` (``None``: the sender
        failed; zeros of the announced shape go instead). Returns what is wrong with ``out``
        if it does not fit the announced shape or cannot cross a boundary (zeros go then)."""
        problem = None
        if out is not None and (out.ndim > _HEADER - 2 or out.dtype not in _DTYPES):
            problem = (f"stage {stage - 1}'s output ({tuple(out.shape)}, {out.dtype}) cannot "
                       f"cross a pipeline boundary: at most {_HEADER - 2} dims, dtype one of "
                       f"{[str(d) for d in _DTYPES]}")
            out = None
        tag = self._tag(stage, microbatch, False)
        if stage not in self.announced:
            fields = [_FAILED] + [0] * (_HEADER - 1)
            if out is not None:
                fields[:2 + out.ndim] = [out.ndim, _DTYPES.index(out.dtype), *out.shape]
            header = torch.tensor(fields, dtype=torch.int64, device=self.device)
            self._send(header, stage, _header_tag(stage))
            new = None if out is None else (tuple(out.shape), out.dtype)
            self.announced[stage] = new
            before = self.announced_before.get(stage)
            if before is not None and before != new:  # fill the receive posted in advance
                self._send(self._zeros(before), stage, tag)
                tag = _reshaped(tag)
        announced = self.announced[stage]
        if announced is None:
            return problem
        if out is not None and (tuple(out.shape), out.dtype) != announced:
            problem = (f"stage {stage - 1}'s output for micro-batch {microbatch} is "
                       f"{tuple(out.shape)} {out.dtype}, but it was {announced[0]} "
                       f"{announced[1]} for the step's first micro-batch: every micro-batch "
                       "of a step must give the same shape (pad data-dependent sizes)")
            out = None
        self._send(out if out is not None else self._zeros(announced), stage, tag)
        return problem

    def recv_activation(self, stage: int, microbatch: int) -> torch.Tensor | None:
        """``stage``'s input for ``microbatch``; ``None`` if the previous stage failed before
        it could announce a shape (no data comes then)."""
        tag = self._tag(stage, microbatch, False)
        if stage not in self.received:
            header = self._recv(((_HEADER,), torch.int64), stage - 1,
                                _header_tag(stage)).tolist()
            ndim = header[0]
            new = None if ndim == _FAILED else (tuple(header[2: 2 + ndim]), _DTYPES[header[1]])
            self.received[stage] = new
            before = self.received_before.get(stage)
            if before is not None and before != new:  # the sender filled the posted receive
                self._recv(before, stage - 1, tag)
                tag = _reshaped(tag)
        shape = self.received[stage]
        if shape is None:
            return None
        return self._recv(shape, stage - 1, tag)

    # -- backward ---------------------------------------------------------------------------
    def recv_gradient(self, stage: int, microbatch: int) -> torch.Tensor | None:
        """The gradient of ``stage``'s output for ``microbatch``, from ``stage + 1``; ``None``
        if this rank announced a failure instead of that output."""
        shape = self.announced.get(stage + 1)
        if shape is None:
            return None
        return self._recv(shape, stage + 1, self._tag(stage, microbatch, True))

    def send_gradient(self, grad: torch.Tensor | None, stage: int, microbatch: int) -> None:
        """Send the gradient of ``stage``'s input back to ``stage - 1`` (``None``: zeros of
        the input's shape, as the sender failed; nothing if no input shape was announced)."""
        shape = self.received.get(stage)
        if shape is None:
            return
        self._send(grad if grad is not None else self._zeros(shape), stage - 1,
                   self._tag(stage - 1, microbatch, True))

    def _zeros(self, shape: Shape) -> torch.Tensor:
        return torch.zeros(shape[0], dtype=shape[1], device=self.device)

    def wait_sends(self) -> None:
        for pending in self.sends:
            pending.wait()
        self.sends.clear()
