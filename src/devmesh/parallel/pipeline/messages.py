"""The messages between pipeline stages: activations forward, gradients backward.

Messages are matched by order, as NCCL matches them (it ignores tags): every message has one
tag, and each rank posts its receives from a peer in the order the peer sends
(:mod:`devmesh.layout.pipeline_messages`). An action's sends start after it, in one batch
with the receives of the next actions (two ahead on gloo, so a message's receive is posted
while the action before it computes and its data lands meanwhile). The shape and dtype
of a stage's input are announced once per step, in a small header before the step's first
activation (so the shape may change from one step to the next without any collective); later
messages of the step carry only data, and a gradient has the shape of the activation it
answers.

The header must not delay the first activation: over gloo, a receive posted after its
message was sent, while the sender is busy computing, waited 1-5 ms (measured: half of the
first messages of a step, against 0.4 ms for a receive posted in advance), at the head of the
pipeline where every stage waits for it. So the header's receive and the first activation's
receive are posted ahead like any other message's, the latter in the shape of the previous
step. When the shape stays (the common case), that receive is the one the data lands in. When it changed (or the sender failed), the sender first sends zeros
of the old shape to fill the receive posted in advance, and the data follows; the receiver
posts nothing more from that peer until it has read the header, so the data is next in line.
Both sides know the old shape, so they agree without asking.

A stage may pass several tensors to the next (a tuple: hidden states and a mask, say), as
torch's pipelining allows. They cross as one message: a single tensor as it is, several packed
into one byte buffer (each part 8-byte aligned, so the receiver's parts are views of it, no
copy); the header lists every part. The gradient message answers the floating-point parts only
(a mask or token ids get no gradient), packed the same way.

Two neighbouring stages on the same rank (the turn of a V placement, or every stage on a
single rank) exchange nothing: the tensors are handed over in memory, detached as a
message's would be, and the message model (:mod:`~devmesh.layout.pipeline_messages`) has no
message there.

A stage that fails part-way through a step must not leave its neighbours waiting for a
message that never comes: it keeps every message flowing, zeros of the announced shape in
place of what it could not compute, or — when it failed before it could announce a shape —
a header saying so, after which neither side expects data for that stage in this step. The
runner then raises on every rank at the end of the step.
"""

from __future__ import annotations

import torch

from devmesh.distributed import comm
from devmesh.distributed.timeouts import Watch
from devmesh.layout.pipeline_messages import (
    READY,
    SKIP,
    SPECULATE,
    UNKNOWN,
    Message,
    ReceiveOrder,
    forward_only,
)
from devmesh.layout.schedule import Schedule
from devmesh.mesh import DeviceMesh

__all__ = ["StageLinks", "Shape", "Layout", "layout_of", "gradient_layout", "describe",
           "MAX_TENSORS", "HEADER_BYTES"]

Shape = tuple[tuple[int, ...], torch.dtype]
Layout = tuple[Shape, ...]  # the tensors one stage passes to the next, in order

_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
_MAX_DIMS = 8
MAX_TENSORS = 8  # per boundary
_PART = 2 + _MAX_DIMS  # ndim, dtype code, sizes
_HEADER = 1 + MAX_TENSORS * _PART  # the part count (-1: the sender failed first), the parts
HEADER_BYTES = _HEADER * 8  # int64 fields: what a step's header costs on the wire
_FAILED = -1
_ALIGN = 8  # bytes: every packed part starts at a multiple, so it is viewed in place


def layout_of(tensors: tuple[torch.Tensor, ...]) -> Layout:
    """The shapes and dtypes of the tensors one stage passes to the next."""
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


def gradient_layout(layout: Layout) -> Layout:
    """The parts of ``layout`` that get a gradient back: the floating-point ones."""
    return tuple(part for part in layout if part[1].is_floating_point)


def _nbytes(part: Shape) -> int:
    count = 1
    for size in part[0]:
        count *= size
    return count * part[1].itemsize


def _offsets(layout: Layout) -> tuple[list[int], int]:
    """Where each part starts in the packed buffer, and the buffer's size."""
    offsets, end = [], 0
    for part in layout:
        offsets.append(end)
        end += -(-_nbytes(part) // _ALIGN) * _ALIGN
    return offsets, end


def _wire(layout: Layout) -> Shape:
    """What one message of ``layout`` is on the wire: the tensor itself, or packed bytes."""
    if len(layout) == 1:
        return layout[0]
    return (_offsets(layout)[1],), torch.uint8


def _pack(tensors: tuple[torch.Tensor, ...], device: torch.device) -> torch.Tensor:
    if len(tensors) == 1:
        return tensors[0]
    offsets, size = _offsets(layout_of(tensors))
    buffer = torch.zeros(size, dtype=torch.uint8, device=device)
    for tensor, start in zip(tensors, offsets, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        buffer[start:start + nbytes].copy_(tensor.detach().contiguous().view(-1)
                                           .view(torch.uint8))
    return buffer


def _unpack(buffer: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, ...]:
    if len(layout) == 1:
        return (buffer,)
    offsets, _ = _offsets(layout)
    return tuple(buffer[start:start + _nbytes(part)].view(part[1]).view(part[0])
                 for part, start in zip(layout, offsets, strict=True))


class StageLinks:
    """This rank's messages to and from the neighbouring stages' ranks along the pipeline
    dim, and the layouts announced on them.

    Sends are queued as the actions make them and started in batches, by the post
    instructions of the step's program (:mod:`~devmesh.layout.pipeline_program`): after
    each action, its sends together with the receives the next actions wait for (two
    actions ahead on gloo, fused with the last send before them on NCCL). Receives are
    posted in each peer's order of sending
    (:class:`~devmesh.layout.pipeline_messages.ReceiveOrder`) with one tag, so they match on
    order alone, as NCCL matches them."""

    def __init__(self, mesh: DeviceMesh, dim: int, schedule: Schedule) -> None:
        self.mesh, self.dim, self.schedule = mesh, dim, schedule
        self.device = comm.mesh_device(mesh)  # NCCL carries only the device's tensors
        index = self.index = mesh.get_coordinate()[dim]
        self.backend = "gloo" if self.device.type == "cpu" else "nccl"
        self._orders = {True: ReceiveOrder(schedule, index),
                        False: ReceiveOrder(forward_only(schedule), index)}
        self.order = self._orders[True]
        self.received: dict[int, Layout | None] = {}  # stage -> its input, as announced here
        self.announced: dict[int, Layout | None] = {}  # stage -> its input, as this rank said
        # the same for the previous step: the receives posted in advance expect these
        self.received_before: dict[int, Layout | None] = {}
        self.announced_before: dict[int, Layout | None] = {}
        self.sends: list[comm.Pending] = []
        self._fillers: list[comm.Pending] = []  # receives the sender filled with zeros
        self._posted: dict[Message, comm.Pending] = {}
        self._queue: list[tuple[str, torch.Tensor, int, Message | None]] = []
        self.watch: Watch | None = None  # this step's: a timeout names the stuck rank
        # between two stages on this rank (the turn of a V): (kind, receiving stage,
        # micro-batch) -> the tensors handed over in memory, and each such stage's input
        # layout this step (for the zeros of a gradient not computed)
        self._handed: dict[tuple[str, int, int], tuple[torch.Tensor, ...] | None] = {}
        self._handed_layouts: dict[int, Layout] = {}

    def start_step(self, training: bool = True) -> None:
        """Announce every layout again (each step may bring a new micro-batch shape); the
        step's program posts the receives (:meth:`post`)."""
        self.watch = comm.exchange_watch("pipeline step", self.mesh, self.dim)
        self._handed.clear()  # what a failed step left
        self._handed_layouts.clear()
        self.received_before, self.received = self.received, {}
        self.announced_before, self.announced = self.announced, {}
        self.order = self._orders[training]
        self.order.restart()

    def post(self, receives: tuple[Message, ...]) -> None:
        """A post instruction of the step's program: start the queued sends together with
        the receives ``receives`` needs (each peer's earlier messages first, as far as the
        layouts announced so far allow), in one batch."""
        self._post_due(list(receives), wait=False)
        self.flush()

    def _state(self, message: Message) -> str:
        """What this rank knows of ``message``'s layout (see ``ReceiveOrder``)."""
        if message.kind == "header":
            return READY
        if message.kind == "activation":
            if message.stage in self.received:
                return READY if self.received[message.stage] is not None else SKIP
            speculate = (self.order.is_first(message)
                         and self.received_before.get(message.stage) is not None)
            return SPECULATE if speculate else UNKNOWN
        if message.stage + 1 not in self.announced:
            return UNKNOWN
        layout = self.announced[message.stage + 1]
        return READY if layout is not None and gradient_layout(layout) else SKIP

    def _wire_of(self, message: Message) -> Shape:
        if message.kind == "header":
            return _HEADER_WIRE
        if message.kind == "activation":
            layout = self.received.get(message.stage) or self.received_before[message.stage]
            return _wire(layout)
        return _wire(gradient_layout(self.announced[message.stage + 1]))

    def _post_due(self, wanted: list[Message], wait: bool) -> None:
        """Queue the receives that ``wanted`` needs, in order; with ``wait``, read the headers
        on the way (blocking) until every wanted message has its receive."""
        while True:
            posts, header = self.order.due(wanted, self._state)
            for message in posts:
                sender = self.order.sender[message]
                wire = self._wire_of(message)
                buffer = torch.empty(wire[0], dtype=wire[1], device=self.device)
                self._queue.append(("recv", buffer, sender, message))
            if header is None or not wait:
                return
            self.flush()
            self._read_header(header.stage)

    def _read_header(self, stage: int) -> None:
        fields = self._posted.pop(Message("header", stage)).wait().tolist()
        new = None if fields[0] == _FAILED else _parse(fields)
        self.received[stage] = new
        before = self.received_before.get(stage)
        if self.order.header_read(stage, shape_held=before is not None and before == new):
            # the sender filled the receive posted in the old layout; the data comes next
            first = Message("activation", stage, self.order.first_activation[stage])
            self._fillers.append(self._posted.pop(first))

    def flush(self) -> None:
        """Start the queued sends and receives as one batch."""
        if not self._queue:
            return
        queue, self._queue = self._queue, []
        pending = comm.batch_p2p([(kind, tensor, peer) for kind, tensor, peer, _ in queue],
                                 self.mesh, self.dim, self.watch)
        for (kind, _, _, message), started in zip(queue, pending, strict=True):
            if kind == "send":
                self.sends.append(started)
            else:
                self._posted[message] = started

    def _send(self, tensor: torch.Tensor, stage: int) -> None:
        self._queue.append(("send", tensor.contiguous(), self.schedule.rank_of(stage), None))

    def _receive(self, message: Message) -> torch.Tensor:
        self._post_due([message], wait=True)
        self.flush()
        return self._posted.pop(message).wait()

    # -- forward ----------------------------------------------------------------------------
    def send_activation(self, out: tuple[torch.Tensor, ...] | None, stage: int,
                        microbatch: int) -> str | None:
        """Send ``stage - 1``'s output tensors for ``microbatch`` to ``stage`` (``None``: the
        sender failed; zeros of the announced layout go instead). Returns what is wrong with
        ``out`` if it does not fit the announced layout or cannot cross a boundary (zeros go
        then)."""
        if self._local(stage):  # the turn of a V: no message
            self._handed[("activation", stage, microbatch)] = out
            if out is not None:
                self._handed_layouts[stage] = layout_of(out)
            return None
        problem = _unsendable(out, stage) if out is not None else None
        if problem:
            out = None
        if stage not in self.announced:
            fields = [_FAILED] + [0] * (_HEADER - 1)
            if out is not None:
                fields[0] = len(out)
                for i, t in enumerate(out):
                    start = 1 + i * _PART
                    fields[start:start + 2 + t.ndim] = [t.ndim, _DTYPES.index(t.dtype), *t.shape]
            self._send(torch.tensor(fields, dtype=torch.int64, device=self.device), stage)
            new = None if out is None else layout_of(out)
            self.announced[stage] = new
            before = self.announced_before.get(stage)
            if before is not None and before != new:  # fill the receive posted in advance
                self._send(self._zeros(_wire(before)), stage)
        announced = self.announced[stage]
        if announced is None:
            return problem
        if out is not None and layout_of(out) != announced:
            problem = (f"stage {stage - 1}'s output for micro-batch {microbatch} is "
                       f"{describe(layout_of(out))}, but it was {describe(announced)} for "
                       "the step's first micro-batch: every micro-batch of a step must give "
                       "the same shapes (pad data-dependent sizes)")
            out = None
        wire = _pack(out, self.device) if out is not None else self._zeros(_wire(announced))
        self._send(wire, stage)
        return problem

    def recv_activation(self, stage: int, microbatch: int) -> tuple[torch.Tensor, ...] | None:
        """``stage``'s input tensors for ``microbatch``; ``None`` if the previous stage failed
        before it could announce a layout (no data comes then)."""
        if self._local(stage - 1):
            return self._handed.pop(("activation", stage, microbatch))
        message = Message("activation", stage, microbatch)
        self._post_due([message], wait=True)
        self.flush()
        layout = self.received[stage]
        if layout is None:
            return None
        return _unpack(self._posted.pop(message).wait(), layout)

    # -- backward ---------------------------------------------------------------------------
    def recv_gradient(self, stage: int, microbatch: int) -> tuple[torch.Tensor, ...] | None:
        """The gradients of ``stage``'s floating-point outputs for ``microbatch``, from
        ``stage + 1``; ``None`` if this rank announced a failure instead of that output."""
        if self._local(stage + 1):
            return self._handed.pop(("gradient", stage, microbatch))
        layout = self.announced.get(stage + 1)
        if layout is None:
            return None
        layout = gradient_layout(layout)
        if not layout:  # nothing differentiable crossed: no message
            return ()
        return _unpack(self._receive(Message("gradient", stage, microbatch)), layout)

    def send_gradient(self, grads: tuple[torch.Tensor | None, ...] | None, stage: int,
                      microbatch: int) -> None:
        """Send the gradients of ``stage``'s floating-point inputs back to ``stage - 1``
        (``None`` entries, or ``None`` for all: zeros, as when the sender failed; nothing if
        no input layout was announced, or no input is floating-point)."""
        if self._local(stage - 1):
            layout = self._handed_layouts.get(stage)
            self._handed[("gradient", stage - 1, microbatch)] = (
                None if grads is None or layout is None else
                tuple(g if g is not None else self._zeros(part)
                      for g, part in zip(grads, gradient_layout(layout), strict=True)))
            return
        layout = self.received.get(stage)
        if layout is None:
            return
        layout = gradient_layout(layout)
        if not layout:
            return
        grads = grads if grads is not None else (None,) * len(layout)
        parts = tuple(g if g is not None else self._zeros(part) for g, part in zip(grads, layout,
                                                                                   strict=True))
        self._send(_pack(parts, self.device), stage - 1)

    def _local(self, stage: int) -> bool:
        """Is ``stage`` on this rank (a neighbour of a stage here: what passes between the
        two is handed over in memory, not sent)?"""
        return self.schedule.rank_of(stage) == self.index

    def _zeros(self, shape: Shape) -> torch.Tensor:
        return torch.zeros(shape[0], dtype=shape[1], device=self.device)

    def wait_sends(self) -> None:
        """End of step: every send delivered, every filled receive done."""
        self.flush()
        for pending in self.sends + self._fillers:
            pending.wait()
        self.sends.clear()
        self._fillers.clear()


_HEADER_WIRE: Shape = ((_HEADER,), torch.int64)


def _parse(header: list[int]) -> Layout:
    parts = []
    for i in range(header[0]):
        ndim, code, *sizes = header[1 + i * _PART: 1 + (i + 1) * _PART]
        parts.append((tuple(sizes[:ndim]), _DTYPES[code]))
    return tuple(parts)


def describe(layout: Layout) -> str:
    """A layout in words, for error messages."""
    text = ", ".join(f"{shape} {dtype}" for shape, dtype in layout)
    return text if len(layout) == 1 else f"({text})"


def _unsendable(out: tuple[torch.Tensor, ...], stage: int) -> str | None:
    """Why ``out`` cannot cross the boundary into ``stage``, if it cannot."""
    if not out or len(out) > MAX_TENSORS:
        return (f"stage {stage - 1} returned {len(out)} tensors: a stage passes 1 to "
                f"{MAX_TENSORS} tensors to the next")
    for t in out:
        if t.ndim > _MAX_DIMS or t.dtype not in _DTYPES:
            return (f"stage {stage - 1}'s output ({tuple(t.shape)}, {t.dtype}) cannot cross a "
                    f"pipeline boundary: at most {_MAX_DIMS} dims, dtype one of "
                    f"{[str(d) for d in _DTYPES]}")
    return None
