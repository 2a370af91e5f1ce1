"""A dry run of one rank of a big job, in this one process: devmesh's own parallelisms applied
to the model as a real run applies them, one training step taken on the ``meta`` device under
torch's ``fake`` process group, and what the rank would hold and send, counted.

``fake`` answers every collective at once and ``meta`` tensors have shapes but no data, so a
step of a Llama-3-8B stage costs milliseconds; the collectives still go through devmesh's own
code (the FSDP unit's packed all-gather and reduce-scatter, the tensor-parallel styles' all-
reduces, DDP's buckets), and ``comm_stats`` counts each with its bytes and mesh dims, exactly
as it counts them in a real step. What a rank holds:

- parameters, gradients (float32 master copies, this rank's shards) and AdamW's two states;
- activations: the bytes autograd saves for backward in one micro-batch's forward of each of
  the rank's stages (counted by saved-tensor hooks, each storage once), at the moment of the
  schedule's step when the most of them are held: one stage's bytes times the micro-batches
  in flight (its activation liveness slots), or, where a rank runs several stages (interleaved
  and V-shaped schedules), the largest sum of every stage's micro-batches held at once;
- the peak: the most bytes alive at once over the whole step (:mod:`.live`), which adds to
  the parts what is held only for a moment (the loss's float32 logits and their gradient,
  FSDP's gathered units, a recomputed block, the collectives' buffers) and leaves out what is
  not held yet at that moment (gradients made later in backward), plus AdamW's states.

A pipeline's messages between stages are not sent through ``fake`` (a stage's receive needs
its peer's data); they are counted from the schedule: per micro-batch, the activation forward
and its gradient back across each boundary of this rank's stage, with their shapes.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from devmesh._torch_compat import fake_store, pytree, storage_key
from devmesh.errors import DryRunError
from devmesh.layout.data_parallel import (cp_beside_one_data_dim, cp_shards_parameters,
                                          ep_beside, flattened_name)
from devmesh.layout.liveness import activation_liveness
from devmesh.parallel.compute_dtype import is_compute_copy
from devmesh.parallel.saved_activation import SavedActivation
from devmesh.parallel.pipeline.grad_sync import StageGradSync
from devmesh.parallel.pipeline.layer_cuts import Cut, LayerCuts
from devmesh.parallel.pipeline.split_backward import SplitBackward
from devmesh.layout.schedule import SCHEDULES as ALL_SCHEDULES
from devmesh.layout.schedule import Action, Schedule, ScheduleError, build_schedule
from devmesh.tools.dry_run.live import LiveBytes
from devmesh.tools.dry_run.model import (MoEFeedForward, Transformer, TransformerConfig,
                                         stage_layers, tp_plan)

__all__ = ["DIM_ORDER", "RankReport", "dry_run", "dry_run_by_blocks", "parse_mesh",
           "ranks_to_report", "build_rank_model", "build_rank_stages", "activation_peak",
           "add_pipeline_messages", "add_replica_groups"]

# outer to inner: tensor parallelism inside a host
DIM_ORDER = ("pp", "dp", "shard", "ep", "cp", "tp")
_ALIASES = {"fsdp": "shard", "dp_shard": "shard", "dp_replicate": "dp"}
SCHEDULES = tuple(ALL_SCHEDULES)  # every built-in schedule devmesh's runner plays


def parse_mesh(text: str) -> dict[str, int]:
    """``"pp=4,dp=32,tp=8"`` as ``{"pp": 4, "dp": 32, "tp": 8}`` (``fsdp`` is ``shard``;
    ``cp``: context parallelism, each rank a part of every sequence; ``ep``: expert
    parallelism, each rank ``experts / ep`` of every layer's experts and its own tokens)."""
    dims: dict[str, int] = {}
    for item in text.split(","):
        name, _, size = item.strip().partition("=")
        name = _ALIASES.get(name, name)
        if name not in DIM_ORDER or not size.isdigit() or int(size) < 1:
            raise DryRunError(f"--mesh {text!r}: {item!r} is not NAME=SIZE with NAME one of "
                              f"{', '.join(DIM_ORDER)} (fsdp: shard) and SIZE a positive integer")
        if name in dims:
            raise DryRunError(f"--mesh {text!r} names {name} twice")
        dims[name] = int(size)
    return {name: dims[name] for name in DIM_ORDER if name in dims}


@dataclass
class RankReport:
    """What one rank holds and sends in one training step."""

    rank: int
    coordinate: dict[str, int]
    layers: tuple[int, int]
    parameters: int  # elements of this rank's shards
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes_per_microbatch: int
    microbatches_in_flight: int
    compute_dtype: str = "float32"
    #: FSDP's unsharded gradients (float32) summed over a pipeline's micro-batches: held
    #: from the stage's first backward of the step to its last, which reduce-scatters them
    accumulated_gradient_bytes: int = 0
    collectives: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    seconds: float = 0.0
    checkpointing: str | int = "none"  # the blocks' activation checkpointing
    #: where the rank runs several pipeline stages: each stage's layers, and the bytes one
    #: micro-batch's forward of it keeps (``activation_bytes_per_microbatch`` is the most of
    #: those, ``microbatches_in_flight`` the most micro-batch stages held at once)
    stage_layers: dict[int, tuple[int, int]] = field(default_factory=dict)
    stage_activation_bytes: dict[int, int] = field(default_factory=dict)
    #: the most activation bytes held at once over the step (several stages' micro-batches)
    activation_peak_bytes: int | None = None
    #: round trips to a replica-group coordinator's store per step (:func:`add_replica_groups`)
    store_round_trips: int = 0
    #: the most bytes alive at once in the step, measured (:class:`~.live.LiveBytes`), plus
    #: AdamW's states; ``None`` where estimated in closed form from the parts alone
    peak_bytes: int | None = None
    #: the most bytes alive at once within each moment of the step (an action, and where in
    #: the stage's blocks: :func:`_block_position`), without AdamW's states: what
    #: :func:`dry_run_by_blocks` extends a stage's peak from. Not part of the report proper
    moment_peaks: dict = field(default_factory=dict, compare=False, repr=False)
    #: when the peak comes, in words (:func:`describe_moment`); ``None`` where estimated
    peak_at: str | None = field(default=None, compare=False)

    @property
    def activation_bytes(self) -> int:
        if self.activation_peak_bytes is not None:
            return self.activation_peak_bytes
        return self.activation_bytes_per_microbatch * self.microbatches_in_flight

    @property
    def layer_ranges(self) -> list[tuple[int, int]]:
        """The (first, last) layers of each of the rank's stages."""
        return list(self.stage_layers.values()) or [self.layers]

    @property
    def total_bytes(self) -> int:
        """The parts added up: parameters, gradients, AdamW, activations, accumulated."""
        return (self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes
                + self.activation_bytes + self.accumulated_gradient_bytes)

    @property
    def most_bytes(self) -> int:
        """The measured peak where there is one, else the parts added up."""
        return self.peak_bytes if self.peak_bytes is not None else self.total_bytes

    def by_dim(self) -> dict[str, tuple[int, int]]:
        """Calls and bytes per mesh dim (summed over the kinds of collective)."""
        out: dict[str, list[int]] = {}
        for (_, dims), (calls, nbytes) in self.collectives.items():
            entry = out.setdefault(dims, [0, 0])
            entry[0] += calls
            entry[1] += nbytes
        return {dims: (calls, nbytes) for dims, (calls, nbytes) in out.items()}


def ranks_to_report(dims: dict[str, int]) -> list[int]:
    """One rank of each distinct role: the first rank of each pipeline stage (the other dims
    are symmetric: every data- and tensor-parallel rank of a stage holds and sends alike)."""
    pp = dims.get("pp", 1)
    stride = 1
    for name in DIM_ORDER[1:]:
        stride *= dims.get(name, 1)
    return [stage * stride for stage in range(pp)]


@contextlib.contextmanager
def _fake_world(rank: int, world: int) -> Iterator[None]:
    """torch's single-process ``fake`` process group as rank ``rank`` of ``world``."""
    if dist.is_initialized():
        raise DryRunError("a dry run needs a process with no process group: it starts "
                          "torch's fake one itself (run it outside torchrun / devmesh run)")
    saved = {k: os.environ.pop(k, None) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # torch wraps sys.excepthook to prefix "[rankN]:" at each init; a search's many fake
    # worlds would stack the prefixes on a traceback
    excepthook = sys.excepthook
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
        for key, value in saved.items():
            if value is not None:
                os.environ[key] = value


class _SavedBytes:
    """Bytes kept for backward while active (a probe forward's activations), each storage
    counted once, parameters (and views of them) not counted: what autograd saves (its
    saved-tensor hooks), and under activation checkpointing what a checkpointed block keeps
    instead — its inputs (:meth:`watch_inputs`) and, selective, its matmuls' and attention's
    outputs (:meth:`count`, called by the checkpoint's forward)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.active = False
        self._model: torch.nn.Module | None = None
        self._modules: list[torch.nn.Module] = []  # the model's, listed once per probe
        self._counted: set[int] = set()

    def reset(self) -> None:
        """Count afresh (the next stage's probe)."""
        self.bytes = 0
        self._counted = set()

    def count(self, t: torch.Tensor) -> None:
        if not self.active:
            return
        local = t
        if isinstance(t, DTensor):  # saved by torch's DTensor ops (the loss under tp)
            with torch.no_grad():
                local = t.to_local()
        key = storage_key(local)
        if key not in self._counted and key not in self._parameter_storages():
            self._counted.add(key)
            self.bytes += local.untyped_storage().nbytes()

    def pack(self, t: torch.Tensor) -> SavedActivation:
        """Count ``t`` and keep it as autograd would (detached: an operation's own output
        kept with its ``grad_fn`` would hold its node, and the node this hook and with it the
        model, its units and process groups, in a cycle through C++ that the garbage
        collector cannot see: a probe forward is never run backward)."""
        self.count(t)
        return SavedActivation(t)

    def watch_inputs(self, block: torch.nn.Module) -> None:
        """Count the tensors a checkpointed ``block`` is called with (it keeps them to run
        again in backward)."""
        def inputs(module, args, kwargs) -> None:
            for t in _torch_compat_tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    self.count(t)
        block.register_forward_pre_hook(inputs, with_kwargs=True)

    def _parameter_storages(self) -> set[int]:
        """The storages of what the modules hold now (a unit's gathered parameters while
        its forward runs), DTensor parameters by their local blocks."""
        assert self._model is not None
        # a parameter's compute-dtype copy (DDP and TP under mixed precision) is held by
        # autograd until backward: counted as the activation it is. Read from each module's
        # own slots, whose contents change as units gather and release; the modules do not
        # (walking the tree again at each new saved storage was a tenth of a search's time)
        return {storage_key(p.to_local() if isinstance(p, DTensor) else p)
                for module in self._modules for p in module._parameters.values()
                if p is not None and not is_compute_copy(p)}

    @contextlib.contextmanager
    def probing(self, model: torch.nn.Module) -> Iterator[None]:
        """Count what ``model``'s forward inside keeps."""
        self._model, self.active = model, True
        self._modules = list(model.modules())
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, SavedActivation.unpack):
                yield
        finally:
            self.active = False


def _torch_compat_tree_leaves(tree: object) -> list:
    return pytree.tree_flatten(tree)[0]


def dry_run(config: TransformerConfig, dims: dict[str, int], *, rank: int = 0,
            schedule: str = "1f1b", microbatches: int | None = None,
            device: str = "meta", blocks: int | None = None,
            checkpointing: str | int = "none", virtual: int = 2) -> RankReport:
    """One training step of global rank ``rank`` on a mesh of ``dims`` (outer to inner
    ``pp, dp, shard, cp, tp``; ``dp`` replicates: DDP, or HSDP beside ``shard``; ``cp``
    splits every sequence, its ranks data-parallel for the parameters), measured.
    ``device="cpu"`` runs the same step with real tensors in a real process group (the test
    that compares the two); the default runs on ``meta`` under a fake world of its own.
    ``blocks`` builds only that many of the stage's transformer blocks (its embedding and
    head kept): :func:`dry_run_by_blocks` extrapolates from two such runs.
    ``checkpointing``: the blocks' activation checkpointing, ``"none"``, ``"full"``,
    ``"selective"`` or every k-th block (:mod:`devmesh.parallel.activation_checkpointing`).
    ``schedule``: any of :data:`SCHEDULES`; ``virtual``: stages per rank of the looped ones
    (interleaved 1F1B, interleaved zero-bubble, looped BFS); the V-shaped ones (zero-bubble
    V, DualPipeV) run two. A rank's stages each get ``layers / stages`` of the layers."""
    _check_checkpointing(checkpointing)
    dims = {name: dims[name] for name in DIM_ORDER if dims.get(name, 1) > 1} or {"dp": 1}
    world = 1
    for size in dims.values():
        world *= size
    if not 0 <= rank < world:
        raise DryRunError(f"--rank {rank}: the mesh {dims} has ranks 0..{world - 1}")
    pp = dims.get("pp", 1)
    _check_experts(config, dims)
    data = dims.get("dp", 1) * dims.get("shard", 1) * dims.get("ep", 1)
    if config.batch % data:
        raise DryRunError(f"the batch of {config.batch} sequences does not split over "
                          f"{data} data-parallel ranks (dp x shard x ep): use a multiple of "
                          f"{data}")
    local = config.batch // data
    microbatches = microbatches or (2 * pp if pp > 1 else 1)
    if local % microbatches:
        raise DryRunError(f"{local} sequences per data-parallel rank do not split into "
                          f"{microbatches} micro-batches: --microbatches may be "
                          f"{', '.join(map(str, _divisors(local)))}")
    if pp > 1 and schedule not in SCHEDULES:
        raise DryRunError(f"--schedule {schedule!r}: the dry run plays {', '.join(SCHEDULES)}")
    if pp > 1:
        try:
            played = build_schedule(schedule, pp, microbatches, virtual)
        except ScheduleError as exc:
            raise DryRunError(f"--schedule {schedule}: {exc}") from None
        stages = played.stages
        if checkpointing == "selective" and played.splits_backward:
            raise DryRunError(
                f"--schedule {schedule} splits each backward in two (input gradients, then "
                "weight gradients), and torch's selective checkpointing allows one backward "
                "through a region: use --activation-checkpointing full (or K) with it, or a "
                "schedule without split backwards (1f1b, interleaved-1f1b, gpipe)")
        if stages > config.layers:
            raise DryRunError(f"--schedule {schedule} on pp {pp} makes {stages} stages, more "
                              f"than the model's {config.layers} layers: use fewer pipeline "
                              "ranks or a schedule of one stage per rank (1f1b, gpipe)")
    cp = dims.get("cp", 1)
    if cp > 1 and not cp_beside_one_data_dim("dp" in dims, "shard" in dims):
        raise DryRunError(f"--mesh {dims}: context parallelism goes beside one data-parallel "
                          "dim (dp or shard), as parallelize places it: drop dp or shard")
    if cp > 1 and config.seq % (2 * cp):
        fits = [c for c in _divisors(config.seq) if c > 1 and config.seq % (2 * c) == 0]
        raise DryRunError(f"cp {cp}: the sequence of {config.seq} tokens does not split into "
                          f"2 x cp = {2 * cp} equal chunks (a head and a tail per rank): "
                          + (f"cp may be {', '.join(map(str, fits))}" if fits else
                             "give the sequence an even length, or drop cp"))
    local_seq = config.seq // cp
    tp = dims.get("tp", 1)
    if config.heads % tp or config.kv_heads % tp or config.ffn_dim % tp or local_seq % tp:
        fits = [t for t in _divisors(config.heads)
                if config.kv_heads % t == 0 and config.ffn_dim % t == 0 and local_seq % t == 0]
        raise DryRunError(f"tp {tp} does not divide the heads ({config.heads}), kv heads "
                          f"({config.kv_heads}), ffn dim ({config.ffn_dim}) and sequence "
                          f"({local_seq} tokens per rank, which sequence parallelism splits) "
                          f"together: tp may be {', '.join(map(str, fits))}")
    start = time.perf_counter()
    world_context = _fake_world(rank, world) if device == "meta" else contextlib.nullcontext()
    with world_context:
        report = _step(config, dims, schedule, microbatches, local // microbatches, device,
                       blocks, checkpointing, virtual)
    report.seconds = time.perf_counter() - start
    return report


def _check_experts(config: TransformerConfig, dims: dict[str, int]) -> None:
    """``ep`` as ``parallelize`` places it: beside a shard dim or alone, not with ``dp`` or
    ``cp``; dividing the experts. With ``tp`` every expert is split over ``tp`` as well
    (torchtitan's plan, its expert tensor parallelism with ``ep``)."""
    ep = dims.get("ep", 1)
    if ep == 1:
        return
    if not config.experts:
        raise DryRunError(f"--mesh has ep {ep} but the model has no experts: drop ep, or give "
                          "the model experts (e.g. --model deepseek-v3, or experts=N)")
    if config.experts % ep:
        fits = [e for e in _divisors(config.experts) if e > 1]
        raise DryRunError(f"ep {ep} does not divide the {config.experts} experts: ep may be "
                          f"{', '.join(map(str, fits))}")
    if not ep_beside("dp" in dims, "cp" in dims):
        other, why = (("dp", "build the mesh with shard instead of dp beside ep") if "dp" in dims
                      else ("cp", "both borrow the data-parallel ranks; drop one"))
        raise DryRunError(f"--mesh {dims}: ep with {other}: {why}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_checkpointing(mode: str | int) -> None:
    from devmesh.errors import ParallelizeError
    from devmesh.parallel.activation_checkpointing import check_mode

    try:
        check_mode(mode, "--activation-checkpointing")
    except ParallelizeError as exc:
        raise DryRunError(str(exc)) from None


def dry_run_by_blocks(config: TransformerConfig, dims: dict[str, int], *, rank: int = 0,
                      schedule: str = "1f1b", microbatches: int | None = None,
                      checkpointing: str | int = "none") -> RankReport:
    """:func:`dry_run`'s report from two cheaper runs: the rank's stage built with four and
    with five of its blocks, extended to all of them. A stage's blocks are identical (same
    shapes, each its own FSDP unit, the same tensor-parallel plan), so every count the report
    holds (parameter, gradient, optimizer and activation bytes; each collective's calls and
    bytes) grows by the same amount per block: what the fifth block adds, times the blocks
    past the fourth.

    The step's peak is no such line: it is the highest of many moments, and which moment
    holds it changes with the blocks (with few, a block's recomputation in backward; with
    more, the head's logits over every block's saved input). What each moment holds does
    grow by the same amount per block, so the peak is extended moment by moment (an action
    of the schedule, and where in the blocks: before them, in the first, second, next-to-
    last or last block, after them) and the highest taken. The blocks between the second
    and the next-to-last each hold what those two do, plus or minus a block's worth per
    step along the stage: never more than the higher of the two. A stage of up to nine
    blocks, or holding both dense blocks and blocks of experts, is run as it is."""
    pp = dims.get("pp", 1)
    kwargs = dict(rank=rank, schedule=schedule, microbatches=microbatches,
                  checkpointing=checkpointing)
    if (isinstance(checkpointing, int) and checkpointing > 1) or (
            pp > 1 and schedule not in ("1f1b", "gpipe")):
        # every k-th block: the stage's blocks are not alike; several stages on the rank:
        # the peak of their activations held at once is no line in the blocks. Run whole
        return dry_run(config, dims, **kwargs)
    world = 1
    for name in DIM_ORDER:  # as dry_run reads the mesh, pp outermost
        world *= dims.get(name, 1)
    if not 0 <= rank < world:
        return dry_run(config, dims, **kwargs)  # which says what is wrong
    first, last = stage_layers(config, pp, rank // (world // pp))
    if last - first <= 9 or len({config.has_experts(i) for i in range(first, last)}) > 1:
        # (two runs of 4 and 5 blocks cost a run of 9; dense blocks and blocks of experts in
        # one stage are not alike)
        return dry_run(config, dims, **kwargs)
    one = dry_run(config, dims, blocks=4, **kwargs)
    two = dry_run(config, dims, blocks=5, **kwargs)
    more = last - first - 4

    def grown(a: int, b: int) -> int:
        return a + more * (b - a)

    collectives = {}
    for key in one.collectives.keys() | two.collectives.keys():
        (c1, b1), (c2, b2) = (one.collectives.get(key, (0, 0)), two.collectives.get(key, (0, 0)))
        collectives[key] = (grown(c1, c2), grown(b1, b2))
    parameters = grown(one.parameters, two.parameters)
    moments = {m: grown(peak, two.moment_peaks[m])  # in the step's order
               for m, peak in one.moment_peaks.items() if m in two.moment_peaks}
    return RankReport(
        rank=one.rank, coordinate=one.coordinate, layers=(first, last),
        parameters=parameters,
        parameter_bytes=grown(one.parameter_bytes, two.parameter_bytes),
        gradient_bytes=grown(one.gradient_bytes, two.gradient_bytes),
        optimizer_bytes=grown(one.optimizer_bytes, two.optimizer_bytes),
        accumulated_gradient_bytes=grown(one.accumulated_gradient_bytes,
                                         two.accumulated_gradient_bytes),
        activation_bytes_per_microbatch=grown(one.activation_bytes_per_microbatch,
                                              two.activation_bytes_per_microbatch),
        microbatches_in_flight=one.microbatches_in_flight, compute_dtype=one.compute_dtype,
        collectives=dict(sorted(collectives.items())), seconds=one.seconds + two.seconds,
        checkpointing=one.checkpointing, moment_peaks=moments,
        peak_at=describe_moment(max(moments, key=moments.__getitem__)),
        peak_bytes=max(moments.values()) + 2 * parameters * 4)


def _step(config: TransformerConfig, dims: dict[str, int], schedule_name: str,
          microbatches: int, mb_size: int, device: str, blocks: int | None = None,
          checkpointing: str | int = "none", virtual: int = 2) -> RankReport:
    from devmesh import comm_stats

    saved = _SavedBytes()
    pp = dims.get("pp", 1)
    schedule = build_schedule(schedule_name, pp, microbatches, virtual) if pp > 1 else None
    mesh, models = build_rank_stages(config, dims, schedule, device, blocks,
                                     checkpointing=checkpointing, saved=saved)
    names = tuple(dims)
    coordinate = dict(zip(names, mesh.get_coordinate() or ()))
    pp_rank = coordinate.get("pp", 0)
    total = schedule.stages if schedule is not None else 1
    bounds = {s: stage_layers(config, total, s) for s in models}
    every = [p for model in models.values() for p in model.parameters()]
    params = sum(p.numel() for p in every)
    param_bytes = sum(p.numel() * p.element_size() for p in every)
    activation_dtype = config.torch_dtype

    gen = torch.Generator().manual_seed(0)
    seq = config.seq // dims.get("cp", 1)  # this rank's part of each sequence

    def tokens() -> torch.Tensor:
        if device == "meta":
            return torch.empty(mb_size, seq, dtype=torch.int64, device=device)
        return torch.randint(0, config.vocab, (mb_size, seq), generator=gen)

    tp = dims.get("tp", 1)

    def hidden() -> torch.Tensor:  # the residual stream, split along the sequence over tp
        shape = (mb_size, seq // tp, config.dim)
        if device == "meta":
            h = torch.empty(shape, dtype=activation_dtype, device=device)
        else:
            h = torch.randn(shape, generator=gen).to(activation_dtype)
        return h.requires_grad_(True)

    if schedule is not None:
        actions = list(schedule.actions[pp_rank])
    else:
        actions = [Action(kind, 0, m) for m in range(microbatches) for kind in ("F", "B")]
    # each stage's data-parallel switches, set as the runner sets them: only a stage's
    # last B or W reduces, and a W's several autograd calls reduce once
    syncs = {s: StageGradSync(model) for s, model in models.items()}
    for sync in syncs.values():
        sync.start_step()
    units = [u for model in models.values()
             for u in (getattr(m, "_devmesh_fsdp", None) for m in model.modules()) if u]
    accumulated = 0  # the most unsharded gradients FSDP holds between backwards
    # the backward that reduces a stage's gradients: its last B or W (devmesh's replicate
    # and fully_shard reduce on the weight side)
    reducing = {a.stage: a for a in actions if a.kind in ("B", "W")}
    # a split backward (I, then W) as the runner plays it: the graph cut at the layers'
    # outputs in the forward, I's input gradients and the graph kept until W
    split = {(a.stage, a.microbatch) for a in actions if a.kind == "I"}
    cutters = {s: LayerCuts(models[s]) for s in {s for s, _ in split}}
    outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, list[Cut]]] = {}
    splits: dict[tuple[int, int], SplitBackward] = {}

    def loss(logits: torch.Tensor) -> torch.Tensor:
        # the logits: float32, split over the vocabulary under tp (loss parallelism)
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens().flatten())

    def forward(stage: int, cuts: LayerCuts | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, list[Cut]]:
        x = tokens() if stage == 0 else hidden()
        with cuts.recording() if cuts is not None else contextlib.nullcontext([]) as made:
            out = models[stage](x)
        return (loss(out) if bounds[stage][1] == config.layers else out), x, made

    # the head's logits stay split over tp: the loss and its backward run under torch's
    # loss_parallel(), as torchtitan's train step does
    has_head = any(last == config.layers for _, last in bounds.values())
    loss_context = _loss_parallel if tp > 1 and has_head else contextlib.nullcontext
    # the activations of one micro-batch of each stage, from a forward before the step (not
    # counted: saved-tensor hooks of one's own change what FSDP saves, so the step runs
    # without them)
    stage_bytes = {}
    for stage, model in models.items():
        saved.reset()
        with saved.probing(model), loss_context():
            probe, _, _ = forward(stage)
        del probe
        stage_bytes[stage] = saved.bytes
    live = LiveBytes()  # from here on: what the step holds at once, at its worst moment
    live.hold(t for model in models.values() for t in (*model.parameters(), *model.buffers()))
    hooks = [h for model in models.values() for h in _mark_block_moments(model, live)]
    try:
        with comm_stats(include_torch=True) as stats, loss_context(), live:
            for index, action in enumerate(actions):
                key = (action.stage, action.microbatch)
                # a forward starts before the blocks (the embedding), a backward after them
                # (the loss and the head)
                live.moment = (index, _action_words(action, microbatches, len(models) > 1),
                               "before" if action.kind == "F" else "after")
                if action.kind == "F":
                    out, x, cuts = forward(action.stage, cutters.get(action.stage)
                                           if key in split else None)
                    if bounds[action.stage][1] == config.layers:
                        out = out / microbatches
                    outputs[key] = out, x, cuts
                    continue
                sync = syncs[action.stage]
                if action.kind == "B":
                    out, _, _ = outputs.pop(key)
                    sync.before_backward(action is reducing[action.stage], [out])
                    out.backward(None if out.dim() == 0 else torch.ones_like(out))
                elif action.kind == "I":  # the input's gradient; the graph kept for W
                    out, x, cuts = outputs[key]
                    # the first stage's tokens need none: its I stops at its first cut
                    splits[key] = SplitBackward(
                        out, None if out.dim() == 0 else torch.ones_like(out),
                        [x] if action.stage > 0 else [], list(models[action.stage].parameters()),
                        cuts)
                    splits[key].input_grad()
                else:  # "W": the weight gradients; what the micro-batch held is freed
                    out, _, _ = outputs.pop(key)
                    sync.before_backward(action is reducing[action.stage], [out])
                    with sync.one_reduction():
                        splits.pop(key).weight_grads()
                accumulated = max(accumulated, sum(u.accumulated_gradient_bytes() for u in units))
    finally:  # the marks and cuts live on the models only for this step
        for hook in hooks:
            hook.remove()
        for cutter in cutters.values():
            cutter.remove()
        for sync in syncs.values():
            sync.end_step()
    collectives = {key: (calls, nbytes) for key, (calls, nbytes) in stats.records.items()}
    if schedule is not None:
        add_pipeline_messages(collectives, schedule, list(models), mb_size, config,
                              activation_dtype, tp, dims.get("cp", 1))
    in_flight = (activation_liveness(schedule, pp_rank=pp_rank, stage_indices=list(models),
                                     granularity="stage_microbatch").num_slots
                 if schedule is not None else 1)
    several = len(models) > 1
    return RankReport(
        rank=dist.get_rank(), coordinate=coordinate, layers=bounds[min(bounds)],
        parameters=params, parameter_bytes=param_bytes, gradient_bytes=param_bytes,
        optimizer_bytes=2 * params * 4,  # not made in the step: added to its peak
        activation_bytes_per_microbatch=max(stage_bytes.values()),
        microbatches_in_flight=in_flight, compute_dtype=str(activation_dtype).split(".")[-1],
        collectives=collectives, checkpointing=checkpointing,
        accumulated_gradient_bytes=accumulated,
        stage_layers=bounds if several else {},
        stage_activation_bytes=stage_bytes if several else {},
        activation_peak_bytes=activation_peak(actions, stage_bytes) if several else None,
        peak_bytes=live.peak + 2 * params * 4, moment_peaks=dict(live.peaks),
        peak_at=describe_moment(max(live.peaks, key=live.peaks.__getitem__)))


def _action_words(action: Action, microbatches: int, several: bool) -> str:
    """``action`` as a person reads it: "micro-batch 3's backward (stage 5)"."""
    kind = "forward" if action.kind == "F" else "backward"
    words = f"micro-batch {action.microbatch}'s {kind}" if microbatches > 1 else f"the {kind}"
    return words + (f" (stage {action.stage})" if several else "")


_WHERE = {"first": "in the first block", "second": "in the second block",
          "middle": "in a middle block", "penultimate": "in the next-to-last block",
          "last": "in the last block"}


def describe_moment(moment) -> str:
    """A moment of :class:`~devmesh.tools.dry_run.live.LiveBytes` as ``_step`` marks them
    (action index, the action in words, where in the blocks), in words."""
    if moment is None:
        return "before the step (its parameters and buffers)"
    _, action, where = moment
    backward = "backward" in action
    if where == "before":
        where = "after it leaves the blocks" if backward else "before the blocks"
    elif where == "after":
        where = "before it reaches the blocks" if backward else "after the blocks"
    else:
        where = _WHERE[where]
    return f"{action}, {where}"


def _block_position(k: int, blocks: int) -> str:
    """Block ``k`` of a stage of ``blocks``: the first two and the last two blocks each a
    position of their own, every other block ``"middle"``."""
    if k in (0, blocks - 1):
        return "first" if k == 0 else "last"
    if k in (1, blocks - 2):
        return "second" if k == 1 else "penultimate"
    return "middle"


def _mark_block_moments(model: Transformer, live: LiveBytes) -> list:
    """Keep ``live.moment``'s last part the position of the block (:func:`_block_position`)
    that runs: set as a block's forward starts (before FSDP's own hooks gather it), as the
    gradient of its output arrives in backward (its recomputation and backward follow), and
    back to ``"before"`` / ``"after"`` outside the blocks. Returns the hooks' handles."""
    blocks = list(model.layers.values())

    def at(where: str):
        def mark(*_) -> None:
            live.moment = (*live.moment[:2], where)
        return mark

    def grads_mark(tensors, where: str) -> None:
        for t in tensors if isinstance(tensors, (tuple, list)) else (tensors,):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(at(where))

    handles = []
    for k, block in enumerate(blocks):
        where = _block_position(k, len(blocks))

        def before(_module, args, where=where, first=k == 0) -> None:
            at(where)()
            if first:  # backward leaves the blocks with the gradient of the first's input
                grads_mark(args, "before")

        def after(_module, _args, out, where=where, last=k == len(blocks) - 1) -> None:
            grads_mark(out, where)
            if last:
                at("after")()

        handles.append(block.register_forward_pre_hook(before, prepend=True))
        handles.append(block.register_forward_hook(after, prepend=True))
    return handles


def activation_peak(actions: list[Action], stage_bytes: dict[int, int],
                    until_weights: dict[int, int] | None = None) -> int:
    """The most activation bytes a rank holds at once over ``actions``: a micro-batch's
    forward of a stage keeps ``stage_bytes[stage]`` until its backward releases them — or,
    split, until its ``I``, which keeps ``until_weights[stage]`` (default the same) for its
    ``W``: under activation checkpointing the blocks' recomputed activations."""
    until_weights = stage_bytes if until_weights is None else until_weights
    held = peak = 0
    for action in actions:
        if action.kind == "F":
            held += stage_bytes[action.stage]
        elif action.kind == "I":
            held += until_weights[action.stage] - stage_bytes[action.stage]
        elif action.kind == "B":
            held -= stage_bytes[action.stage]
        elif action.kind == "W":
            held -= until_weights[action.stage]
        peak = max(peak, held)
    return peak


def build_rank_model(config: TransformerConfig, dims: dict[str, int], device: str = "meta",
                     blocks: int | None = None, *, checkpointing: str | int = "none",
                     saved: _SavedBytes | None = None) -> tuple[object, Transformer]:
    """This rank's mesh and its part of the model, parallelized as a real run does, in
    torchtitan's order: its pipeline stage's layers (only the first ``blocks`` of them, if
    given), tensor parallelism over ``tp`` (torchtitan's plan), ring attention over ``cp``
    in each block, activation checkpointing of the blocks, then FSDP over ``shard`` (HSDP
    with ``dp``: each block a unit, then the root; parameters in float32, computing in the
    config's dtype) or, without ``shard``, DDP over ``dp`` — ``cp``'s ranks joining the data
    dim, as ``parallelize`` places them. ``saved``: the count of what the checkpointed blocks
    keep."""
    mesh = _rank_mesh(dims)
    stage = dict(zip(dims, mesh.get_coordinate() or ())).get("pp", 0)
    first, last = stage_layers(config, dims.get("pp", 1), stage)
    return mesh, _stage_model(config, dims, mesh, first, last, device, blocks,
                              checkpointing=checkpointing, saved=saved)


def build_rank_stages(config: TransformerConfig, dims: dict[str, int],
                      schedule: Schedule | None, device: str = "meta",
                      blocks: int | None = None, *, checkpointing: str | int = "none",
                      saved: _SavedBytes | None = None) -> tuple[object, dict[int, Transformer]]:
    """This rank's mesh and each of its pipeline stages under ``schedule`` (several for the
    interleaved and V-shaped schedules), each parallelized as :func:`build_rank_model`
    parallelizes one: by stage index."""
    if schedule is None:
        mesh, model = build_rank_model(config, dims, device, blocks,
                                       checkpointing=checkpointing, saved=saved)
        return mesh, {0: model}
    mesh = _rank_mesh(dims)
    rank = dict(zip(dims, mesh.get_coordinate() or ())).get("pp", 0)
    models = {}
    for stage in range(schedule.stages):
        if schedule.rank_of(stage) == rank:
            first, last = stage_layers(config, schedule.stages, stage)
            models[stage] = _stage_model(config, dims, mesh, first, last, device, blocks,
                                         checkpointing=checkpointing, saved=saved)
    return mesh, models


def _rank_mesh(dims: dict[str, int]):
    from devmesh import init_device_mesh

    return init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))


def _stage_model(config: TransformerConfig, dims: dict[str, int], mesh, first: int, last: int,
                 device: str, blocks: int | None, *, checkpointing: str | int,
                 saved: _SavedBytes | None) -> Transformer:
    """Layers ``first..last-1`` (only the first ``blocks`` of them, if given), parallelized
    over ``mesh`` as :func:`build_rank_model` says."""
    from devmesh.parallel import MixedPrecisionPolicy, fully_shard, parallelize_module, replicate
    from devmesh.parallel.activation_checkpointing import checkpoint_blocks
    from devmesh.parallel.compute_dtype import compute_in
    from devmesh.parallel.context_parallel import context_parallel
    from devmesh.parallel.expert_parallel import expert_parallel

    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(config, first, last if blocks is None else first + blocks,
                            head=last == config.layers)
    if "tp" in dims:
        parallelize_module(model, mesh["tp"], tp_plan(model))
    plain = list(model.layers.values())
    if "cp" in dims:  # on each block: a checkpointed block's recompute is routed too
        for block in plain:
            block.attention.routed = True
            context_parallel(block, mesh["cp"])
    experts = [m.experts for m in model.modules() if isinstance(m, MoEFeedForward)]
    if "ep" in dims:  # as parallelize: each rank's tokens reach every rank's experts
        data = mesh["shard", "ep"] if "shard" in dims else mesh["ep"]
        for module in experts:
            expert_parallel(module, mesh["ep"], data_mesh=data)
    held = checkpoint_blocks(model, plain, checkpointing,
                             on_saved=saved.count if saved is not None else None)
    if saved is not None:
        for block, wrapped in zip(plain, held, strict=True):
            if block is not wrapped:
                saved.watch_inputs(wrapped)
    compute = config.torch_dtype
    # computing in the config's dtype, the parameters (the optimizer's) and the gradients'
    # reduction in float32, under every strategy (torchtitan's defaults)
    policy = (MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
              if compute != torch.float32 else None)
    # the ranks of ep and cp hold their own tokens: data-parallel ranks for the parameters
    borrowed = "ep" if "ep" in dims else "cp" if "cp" in dims else None
    # cp alone shards the parameters over its ranks (torchtitan's FSDP over dp_shard x cp)
    over_cp = borrowed == "cp" and cp_shards_parameters("dp" in dims, "shard" in dims)
    if "shard" in dims or over_cp:
        data_mesh = (mesh["dp", "shard"] if "dp" in dims
                     else mesh["cp"] if over_cp
                     else _flattened(mesh, ("shard", borrowed)) if borrowed else mesh["shard"])
        # the experts over shard alone (split over ep already); the rest over shard and ep
        for module in experts if "ep" in dims else ():
            fully_shard(module, mesh=mesh["shard"], mp_policy=policy)
        for block in model.layers.values():
            fully_shard(block, mesh=data_mesh, mp_policy=policy)
        fully_shard(model, mesh=data_mesh, mp_policy=policy)
    elif "dp" in dims or borrowed:
        data = tuple(d for d in ("dp", borrowed) if d in dims)
        split = experts if "ep" in dims else []
        replicate(model, mesh=_flattened(mesh, data) if len(data) > 1 else mesh[data[0]],
                  mp_policy=policy, ignored_modules=split)
        if policy is not None:  # DDP leaves the split experts alone: they compute in it too
            for module in split:
                compute_in(module, policy)
    elif policy is not None:
        compute_in(model, policy)
    return model


def _flattened(mesh, names: tuple[str, ...]):
    return mesh[names]._flatten(flattened_name(names))


def _loss_parallel():
    from devmesh.parallel import loss_parallel

    return loss_parallel()


#: a replica group's rank, per step: its join, the quorum's answer, its vote, the decision
QUORUM_ROUND_TRIPS = 4


def add_replica_groups(report: RankReport, groups: int) -> None:
    """What being one of ``groups`` replica groups (``devmesh run --replica-groups``,
    :class:`~devmesh.fault.ReplicaGroups`) adds to a rank's step: the quorum's round trips to
    the coordinator's store, and one all-reduce of the rank's gradients (its shards, float32,
    packed into one buffer) with its counterparts in the other groups, labelled
    ``replicas``."""
    if groups < 1:
        raise DryRunError(f"--replica-groups {groups}: give the number of groups, at least 1")
    report.store_round_trips = QUORUM_ROUND_TRIPS
    if groups > 1:
        report.collectives[("all_reduce", "replicas")] = (1, report.gradient_bytes)


def add_pipeline_messages(collectives: dict, schedule, stage: int | list[int], mb_size: int,
                          config: TransformerConfig, dtype: torch.dtype, tp: int = 1,
                          cp: int = 1) -> None:
    """The messages this rank's stages (one, or a list) send and receive in one step, as
    devmesh's runner sends them: per micro-batch, one activation of ``(micro-batch,
    seq / cp / tp, dim)`` (the residual stream is split along the sequence between blocks)
    forward across each boundary to a stage on another rank and its gradient back, and
    before a step's first activation across a boundary a header announcing its shape.
    Between two stages of this rank (the turn of a V) nothing is sent."""
    from devmesh.parallel.pipeline.messages import HEADER_BYTES

    nbytes = (mb_size * (config.seq // cp // tp) * config.dim
              * torch.empty((), dtype=dtype).element_size())
    stages = [stage] if isinstance(stage, int) else list(stage)
    actions = schedule.actions[schedule.rank_of(stages[0])]
    counts = {"send": [0, 0], "recv": [0, 0]}
    for here in stages:
        forwards = sum(1 for a in actions if a.stage == here and a.kind == "F")
        backwards = sum(1 for a in actions if a.stage == here and a.kind in ("B", "I"))
        if here < schedule.stages - 1 and here + 1 not in stages:  # to the next, and back
            counts["send"][0] += forwards + 1
            counts["send"][1] += forwards * nbytes + HEADER_BYTES
            counts["recv"][0] += backwards
            counts["recv"][1] += backwards * nbytes
        if here > 0 and here - 1 not in stages:  # from the previous, and back to it
            counts["recv"][0] += forwards + 1
            counts["recv"][1] += forwards * nbytes + HEADER_BYTES
            counts["send"][0] += backwards
            counts["send"][1] += backwards * nbytes
    for kind, (calls, total) in counts.items():
        if calls:
            collectives[(kind, "pp")] = (calls, total)
