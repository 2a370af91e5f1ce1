"""``devmesh plan --model CONFIG --world N --search``: the mesh to run a model on, chosen.

Every way of writing ``N`` ranks as ``pp x dp x shard x ep x cp x tp`` that the model allows
(tensor parallelism inside a host and dividing the heads and widths, no more stages than
layers, the batch splitting over the data ranks, context parallelism splitting each sequence
into ``2 x cp`` equal chunks beside one data-parallel dim, expert parallelism dividing the
experts beside a shard dim or alone), each with the pipeline schedules
and micro-batch counts that fit it, is a candidate. Each is estimated per pipeline stage in
closed form (below),
those whose largest rank does not fit the device's memory are dropped, and the rest are
ranked by predicted step time (:func:`~devmesh.tools.dry_run.report.predict`, the same model
``devmesh plan --model --mesh`` prints). The best few are then **measured by the dry run
itself** (:func:`~devmesh.tools.dry_run.run.dry_run_by_blocks`: devmesh's parallelisms on
``meta`` under the fake process group) and ranked again by what it measured; the closed form
only chooses which ones to measure (a few estimated a little too big among them: its peak
runs above the measured one as well as below).

The closed form, per rank of a stage with ``b`` blocks and ``m`` micro-batches:

- parameters: each tensor's tensor-parallel block, its first dim split in ``shard x cp``
  (or ``shard x ep``) rows rounded up (FSDP's shards: ``cp``'s and ``ep``'s ranks are data
  ranks for the parameters); a block's routed experts ``experts / ep`` of them, split over
  ``tp``, their first dim (the experts) in ``shard`` rows; gradients as many; AdamW two
  float32 states;
- activations per micro-batch: measured once per (tp, cp, ep, FSDP or not, stage kind,
  activation checkpointing, kind of block) on stages of one and two blocks and micro-batches
  of one and two sequences, each block and the rest of the stage a fixed part (weights cast
  to the compute dtype) and a part per sequence; a stage holding dense blocks and blocks of
  experts adds each kind's up;
- FSDP: every block a unit gathered in its forward and again in its backward per micro-batch
  (the stage's root unit, holding embedding or head, once per micro-batch), in the compute
  dtype, rounded up to ``shard`` rows; its float32 gradients reduce-scattered once per step;
  a block's experts beside ``ep`` a unit of their own over ``shard``;
  HSDP all-reduces the shards over ``dp``; DDP (over ``dp``, ``cp`` or both, or ``ep``,
  the experts left out) all-reduces the float32 gradients; with
  several micro-batches the stage's unsharded float32 gradients are held from its first
  backward to its last (FSDP accumulates them unsynchronized);
- tensor parallelism: the collectives of each kind one block and the rest of the stage
  send (torchtitan's plan: sequence gathers and reduce-scatters, the norms' and the loss's
  all-reduces), measured with the activations, times blocks, sequences and micro-batches;
  context parallelism's ring messages (each block's attention) and the experts'
  all-to-all likewise;
- the pipeline's messages, counted from the schedule as the dry run counts them;
- two stages per rank (interleaved 1F1B, zero-bubble V, DualPipeV): each estimated so and
  added up, its activations the most its stages' micro-batches hold at once (a split
  backward's until its ``W``), its accumulated gradients the most its stages hold between
  their first and last backwards at once;
- a split backward: from its ``I`` until its ``W`` a micro-batch holds the gradients ``W``
  starts from (each matmul's and norm's output gradient) and, under activation
  checkpointing, its recomputed activations (the stage's without checkpointing).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from devmesh.errors import DryRunError
from devmesh.layout.data_parallel import (MIN_TOKENS_PER_CP_RANK, cp_beside_one_data_dim,
                                          cp_shards_parameters, ep_beside, flattened_name)
from devmesh.layout.liveness import activation_liveness
from devmesh.layout.schedule import Schedule, ScheduleError, build_schedule
from devmesh.tools.dry_run.model import TransformerConfig, stage_layers
from devmesh.tools.dry_run.report import Allowance, Costs, _gib, predict
from devmesh.tools.dry_run.run import (DIM_ORDER, RankReport, activation_peak,
                                       add_pipeline_messages, dry_run, dry_run_by_blocks)

__all__ = ["Candidate", "Evaluation", "SearchResult", "candidates", "estimate", "measure",
           "search", "format_search", "search_as_json"]

#: the schedules tried; interleaved 1F1B, zero-bubble V and DualPipeV run two stages per rank
#: (when the layers allow); the zero-bubble ones and DualPipeV split backwards in two
SCHEDULE_NAMES = ("1f1b", "gpipe", "interleaved-1f1b", "zero-bubble", "zbv-zero-bubble",
                  "dualpipe-v")
MICROBATCH_FACTORS = (1, 2, 4)  # micro-batches per step: pp times these (pp 1: powers of 2)


@dataclass(frozen=True)
class Candidate:
    """One way to run the job: mesh degrees, and with a pipeline its schedule and
    micro-batch count (without one, ``microbatches`` is gradient accumulation)."""

    pp: int
    dp: int
    shard: int
    tp: int
    schedule: str
    microbatches: int
    checkpointing: str = "none"  # the blocks' activation checkpointing (none, full, selective)
    cp: int = 1  # context parallelism: each sequence split over cp ranks (ring attention)
    ep: int = 1  # expert parallelism: each rank experts / ep of every layer's, its own tokens

    @property
    def dims(self) -> dict[str, int]:
        sizes = {"pp": self.pp, "dp": self.dp, "shard": self.shard, "ep": self.ep,
                 "cp": self.cp, "tp": self.tp}
        return {name: sizes[name] for name in DIM_ORDER if sizes.get(name, 1) > 1} or {"dp": 1}

    @property
    def data_ranks(self) -> int:
        """The ranks holding different sequences: ``dp x shard x ep``."""
        return self.dp * self.shard * self.ep

    @property
    def stage_ranks(self) -> int:
        """The ranks of one pipeline stage (the stride between stages' first ranks)."""
        return self.data_ranks * self.cp * self.tp

    @property
    def mesh(self) -> str:
        return ",".join(f"{name}={size}" for name, size in self.dims.items())

    def describe(self) -> str:
        steps = (f"{self.schedule} x {self.microbatches}" if self.pp > 1 else
                 f"{self.microbatches} micro-batch" + ("es" if self.microbatches > 1 else ""))
        if self.checkpointing != "none":
            steps += f", {self.checkpointing} checkpointing"
        return f"{self.mesh} ({steps})"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


SEARCHED_CHECKPOINTING = ("none", "full", "selective")
#: the most the closed form's peak has run above the dry run's measured one (1.34 on the
#: tests' small models, 1.18-1.24 on Llama 3 405B's published pipeline): a candidate whose
#: estimate exceeds the device's memory by less may still fit, so the search measures it
ESTIMATE_ABOVE_MEASURED = 1.35


def candidates(config: TransformerConfig, world: int, *, devices_per_host: int = 8,
               checkpointing: tuple[str, ...] = ("none",),
               min_cp_tokens: int = MIN_TOKENS_PER_CP_RANK) -> list[Candidate]:
    """Every candidate for ``world`` ranks (see the module's docstring for the rules), with
    each of the ``checkpointing`` modes (among :data:`SEARCHED_CHECKPOINTING`: the modes
    whose blocks are alike, as the closed form needs); ``cp`` above 1 only where each rank
    keeps ``min_cp_tokens`` of a sequence or more."""
    for mode in checkpointing:
        if mode not in SEARCHED_CHECKPOINTING:
            raise DryRunError(f"--activation-checkpointing {mode!r} in a search: give "
                              f"{', '.join(SEARCHED_CHECKPOINTING)}, or several of them "
                              "comma-separated (any: all three) to let the search choose")
    if world < 1:
        raise DryRunError(f"--world {world}: give the number of ranks, a positive integer")
    found = []
    widths = (config.heads, config.kv_heads, config.ffn_dim) + (
        (config.expert_hidden,) if config.experts else ())  # experts split over tp too
    for tp, cp in ((t, c) for t in _divisors(world) for c in _divisors(world // t)):
        local_seq = config.seq // cp  # a rank's tokens of each sequence, split by tp's SP
        if tp > devices_per_host or (cp > 1 and (
                config.seq % (2 * cp) or local_seq < min_cp_tokens)) or any(
                n % tp for n in (*widths, local_seq)):
            continue
        for pp in _divisors(world // (tp * cp)):
            data = world // (tp * cp * pp)
            if pp > config.layers or config.batch % data:
                continue
            local = config.batch // data
            if pp > 1:
                counts = [pp * f for f in MICROBATCH_FACTORS if local % (pp * f) == 0]
                plays = [(n, m) for n in SCHEDULE_NAMES for m in counts
                         if _plays(n, pp, m, config.layers)]
            else:
                plays = [("1f1b", 2 ** k) for k in range(8) if local % 2 ** k == 0]
            # the data ranks as dp x shard x ep: ep (dividing the experts) beside a shard dim
            # or alone, with neither dp nor cp (as parallelize places it)
            splits = [(data // shard, shard, 1) for shard in _divisors(data)] + [
                (1, data // ep, ep) for ep in _divisors(math.gcd(data, config.experts))
                if config.experts and ep > 1 and ep_beside(False, cp > 1)]
            for dp, shard, ep in splits:
                if cp > 1 and not cp_beside_one_data_dim(dp > 1, shard > 1):
                    continue
                for schedule, m in plays:
                    for mode in checkpointing:
                        if mode == "selective" and pp > 1 and _schedule(
                                schedule, pp, m).splits_backward:
                            continue  # refused: one backward through a selective region
                        found.append(Candidate(pp, dp, shard, tp, schedule, m, mode, cp,
                                               ep))
    if not found:
        raise DryRunError(f"no mesh of {world} ranks suits the model: tp must divide heads "
                          f"({config.heads}), kv heads ({config.kv_heads}), ffn dim "
                          f"({config.ffn_dim}"
                          + (f", an expert's {config.expert_hidden}" if config.experts else "")
                          + ") and a rank's part of the sequence "
                          f"({config.seq} tokens over cp) and be at most "
                          "--devices-per-host "
                          f"{devices_per_host}; the batch ({config.batch}) must split over "
                          "dp x shard x ep")
    return found


@dataclass
class _PerSequence:
    """What a stage adds per micro-batch: saved activation bytes and the tensor-, context-
    and expert-parallel collectives of each kind over ``tp``, ``cp`` and ``ep`` (calls per
    block and for the rest of the stage), bytes as
    ``fixed + per sequence`` per block and for the rest — a block's weights cast to the
    compute dtype (kept for its backward) and the norms' gradients are as many bytes
    whatever the sequences; the activations grow with them."""

    activations: tuple[int, int, int, int]  # block fixed, block per sequence; rest ...
    calls: dict[tuple[str, str], tuple[int, int]]  # (kind, dims) -> (per block, rest)
    bytes: dict[tuple[str, str], tuple[int, int, int, int]]  # (kind, dims) -> block fixed,
    # block per sequence; rest ...


def _stage_per_microbatch(parts: dict[str, tuple[_PerSequence, int]], base: str,
                          sequences: int, microbatches: int
                          ) -> tuple[int, dict[tuple[str, str], tuple[int, int]]]:
    """A stage's activation bytes per micro-batch of ``sequences`` and its traffic per step
    over ``microbatches``, from each kind of block it holds (``kind -> (measured, count)``)
    and the rest of the stage as measured with blocks of kind ``base``."""
    rest = parts[base][0]
    _, _, rf, rs = rest.activations
    activations = rf + rs * sequences + sum(
        n * (measured.activations[0] + measured.activations[1] * sequences)
        for measured, n in parts.values())
    traffic = {}
    for key in {k for measured, _ in parts.values() for k in measured.calls}:
        calls = rest.calls.get(key, (0, 0))[1] + sum(
            n * measured.calls.get(key, (0, 0))[0] for measured, n in parts.values())
        rf, rs = rest.bytes.get(key, (0, 0, 0, 0))[2:]
        nbytes = rf + rs * sequences + sum(
            n * (bf + bs * sequences) for measured, n in parts.values()
            for bf, bs, _, _ in [measured.bytes.get(key, (0, 0, 0, 0))])
        if calls:
            traffic[key] = (microbatches * calls, microbatches * nbytes)
    return activations, traffic


def _block_kinds(config: TransformerConfig, first: int, last: int) -> dict[str, int]:
    """How many blocks of each kind layers ``first..last-1`` hold (kinds held only)."""
    moe = sum(map(config.has_experts, range(first, last)))
    return {kind: n for kind, n in (("dense", last - first - moe), ("moe", moe)) if n}


class _Calibration:
    """Activations and the traffic over ``tp``, ``cp`` and ``ep`` per micro-batch, measured
    by the dry run once per (tp, cp, ep, FSDP or not, stage kind, checkpointing, block kind)
    and kept: a stage of one block and of two, on a micro-batch of one sequence and of two,
    every block of the kind measured (the model made all dense or all experts). And what
    the step's peak holds besides those parts (:meth:`transient`), per block and for the
    rest of the stage, at a micro-batch size: the peak is the highest of several moments of
    the step, each growing otherwise with the sequences, so it is no line in them.

    Expert parallelism under FSDP is measured at the smallest ``ep`` the experts allow: a
    rank's tokens and what they send in the all-to-all are the same at any ``ep`` (the dry
    run's router balances the experts), and what differs, each rank's experts, is counted
    in closed form. Under DDP it is measured at the ``ep`` itself: each rank keeps its own
    experts cast to the compute dtype for the backward."""

    def __init__(self, config: TransformerConfig) -> None:
        self.config = config
        self._kept: dict[tuple, _PerSequence] = {}
        self._transient: dict[tuple, int] = {}
        self._per_block: dict[tuple, int] = {}

    def _key(self, tp: int, fsdp: bool, embedding: bool, head: bool, checkpointing: str,
             cp: int, ep: int, kind: str) -> tuple:
        # under DDP each rank casts its own experts to the compute dtype and keeps them for
        # the backward: as many as ep leaves it, so measured at that ep
        measured_ep = 1 if ep == 1 or kind == "dense" else ep if not fsdp else min(
            e for e in range(2, self.config.experts + 1) if self.config.experts % e == 0)
        return (tp, fsdp, embedding, head, checkpointing, cp, measured_ep, kind)

    def transient(self, tp: int, fsdp: bool, embedding: bool, head: bool,
                  checkpointing: str, cp: int, sequences: int, kinds: dict[str, int],
                  ep: int = 1) -> int:
        """What the peak of a stage of ``kinds`` blocks (a count per kind of block) holds
        besides its parameters, AdamW's states, activations and accumulated gradients, on
        micro-batches of ``sequences``: measured on a stage of two blocks (of the kind
        with experts, where it holds some) on such micro-batches, plus per block more what
        a third block of its kind adds on one sequence (the peak of a one-block stage comes
        at another moment: :func:`~devmesh.tools.dry_run.run.dry_run_by_blocks`)."""
        base = "moe" if "moe" in kinds else "dense"
        total = 0
        for kind, n in kinds.items():
            key = self._key(tp, fsdp, embedding, head, checkpointing, cp, ep, kind)
            if key not in self._per_block:
                two, three = (_transient(self._run(*key, blocks=b, sequences=1))
                              for b in (2, 3))
                self._per_block[key] = three - two
            total += (n - (2 if kind == base else 0)) * self._per_block[key]
        key = self._key(tp, fsdp, embedding, head, checkpointing, cp, ep, base)
        if (*key, sequences) not in self._transient:
            self._transient[(*key, sequences)] = _transient(
                self._run(*key, blocks=2, sequences=sequences))
        return self._transient[(*key, sequences)] + total

    def _variant(self, kind: str) -> TransformerConfig:
        """The model with every block of ``kind``."""
        if kind == "moe":
            return replace(self.config, dense_layers=0, moe_every=1)
        return replace(self.config, experts=0)

    def _run(self, tp: int, fsdp: bool, embedding: bool, head: bool, checkpointing: str,
             cp: int, ep: int, kind: str, *, blocks: int, sequences: int) -> RankReport:
        """A stage of this kind (a pipeline of 1, 2 or 3 stages, this one of them) of
        ``blocks`` blocks of ``kind`` on one micro-batch of ``sequences``, measured."""
        pp = 1 if embedding and head else 2 if embedding or head else 3
        stage = 0 if embedding else pp - 1 if head else 1
        shard = 2 if fsdp else 1
        dp = 2 if not fsdp and cp > 1 else 1  # DDP over dp x cp (cp alone shards)
        dims = {"pp": pp, "dp": dp, "shard": shard, "ep": ep, "cp": cp, "tp": tp}
        config = self._variant(kind)
        config = replace(config, layers=max(config.layers, 3 * pp),
                         batch=sequences * shard * dp * ep)
        return dry_run(config, dims, rank=stage * dp * shard * ep * cp * tp, schedule="gpipe",
                       microbatches=1, blocks=blocks, checkpointing=checkpointing)

    def __call__(self, tp: int, fsdp: bool, embedding: bool, head: bool,
                 checkpointing: str = "none", cp: int = 1, ep: int = 1,
                 kind: str = "dense") -> _PerSequence:
        key = self._key(tp, fsdp, embedding, head, checkpointing, cp, ep, kind)
        if key not in self._kept:
            self._kept[key] = self._measure(*key)
        return self._kept[key]

    def _measure(self, *key) -> _PerSequence:
        def run(blocks: int, sequences: int) -> RankReport:
            return self._run(*key, blocks=blocks, sequences=sequences)

        def per_sequence(report: RankReport) -> dict[tuple[str, str], tuple[int, int]]:
            # tp's collectives, the ring's messages and the experts' all-to-all (DDP's
            # all-reduce over cp or ep is not)
            return {key: value for key, value in report.collectives.items()
                    if key[1] == "tp" or key in (("send", "cp"), ("recv", "cp"),
                                                 ("all_to_all", "ep"))}

        # stages of one and two blocks, on micro-batches of one and two sequences
        runs = [run(1, 1), run(2, 1), run(1, 2), run(2, 2)]
        activations = _bilinear([r.activation_bytes_per_microbatch for r in runs])
        calls, nbytes = {}, {}
        t11, t21, t12, t22 = (per_sequence(r) for r in runs)
        for key in t11.keys() | t21.keys():
            (c1, b11), (c2, b21) = t11.get(key, (0, 0)), t21.get(key, (0, 0))
            b12, b22 = t12.get(key, (0, 0))[1], t22.get(key, (0, 0))[1]
            calls[key] = (c2 - c1, 2 * c1 - c2)
            nbytes[key] = _bilinear([b11, b21, b12, b22])
        return _PerSequence(activations, calls, nbytes)


@functools.lru_cache(maxsize=4)
def _calibration(config: TransformerConfig) -> _Calibration:
    """One calibration per model, kept for the searches that follow (what it measures
    depends on the model alone)."""
    return _Calibration(config)


def _transient(report: RankReport) -> int:
    """What ``report``'s measured peak holds besides its parameters, AdamW's states, its
    activations and accumulated gradients (its gradients too where the peak holds them)."""
    assert report.peak_bytes is not None
    return report.peak_bytes - (report.parameter_bytes + report.optimizer_bytes
                                + report.activation_bytes + report.accumulated_gradient_bytes)


def _bilinear(values: list[int]) -> tuple[int, int, int, int]:
    """``(block fixed, block per sequence, rest fixed, rest per sequence)`` of a count
    measured on (1 block, 1 sequence), (2, 1), (1, 2) and (2, 2)."""
    v11, v21, v12, v22 = values
    block_seq = (v22 - v12) - (v21 - v11)
    block_fixed = (v21 - v11) - block_seq
    rest_seq = (v12 - v11) - block_seq
    return block_fixed, block_seq, v11 - block_fixed - block_seq - rest_seq, rest_seq


def _stage_tensors(config: TransformerConfig, tp: int, embedding: bool, head: bool
                   ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(rows, columns) of one block's tensors and of the stage's other ones, as torchtitan's
    tensor-parallel plan leaves them on a rank (q/k/v and w1/w3 split by rows, wo and w2 by
    columns, embedding and head by the vocabulary, norms whole)."""
    d, kv, ffn = config.dim, config.kv_heads * config.head_dim, config.ffn_dim
    block = [(d // tp, d), (kv // tp, d), (kv // tp, d), (d, d // tp),
             (ffn // tp, d), (ffn // tp, d), (d, ffn // tp), (d, 1), (d, 1)]
    table = (math.ceil(config.vocab / tp), d)  # torch.chunk's rows: the first rank's
    rest = ([table] if embedding else []) + ([(d, 1), table] if head else [])
    return block, rest


def _moe_tensors(config: TransformerConfig, tp: int, ep: int
                 ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(rows, columns) of a mixture-of-experts block's tensors on a rank, in the order the
    module registers them: the block's own (norms, attention as in :func:`_stage_tensors`,
    the router whole, the shared experts split over ``tp`` as a dense feed-forward), and its
    routed experts' (``experts / ep`` of them, each split over ``tp``: w1 and w3 by their
    hidden features, w2 by its inputs; rows the experts, as FSDP splits them)."""
    if not config.experts:
        return [], []
    d, kv, hidden = config.dim, config.kv_heads * config.head_dim, config.expert_hidden
    shared = config.shared_experts * hidden // tp
    own = [(d, 1), (d // tp, d), (kv // tp, d), (kv // tp, d), (d, d // tp), (d, 1),
           (config.experts, d)]
    if shared:
        own += [(shared, d), (shared, d), (d, shared)]
    local = config.experts // ep
    experts = [(local, hidden // tp * d), (local, hidden // tp * d), (local, d * hidden // tp)]
    return own, experts


#: where a mixture-of-experts block registers its routed experts among its own tensors of
#: :func:`_moe_tensors`: after the router, before the shared experts
_EXPERTS_AT = 7


@functools.lru_cache(maxsize=64)
def _schedule(name: str, pp: int, microbatches: int) -> Schedule:
    return build_schedule(name, pp, microbatches)


def _plays(name: str, pp: int, microbatches: int, layers: int) -> bool:
    """Whether schedule ``name`` plays ``microbatches`` on ``pp`` ranks (DualPipeV needs as
    many as its stages) with no more stages than the model's layers."""
    try:
        return _schedule(name, pp, microbatches).stages <= layers
    except ScheduleError:
        return False


@functools.lru_cache(maxsize=4096)
def _in_flight(name: str, pp: int, microbatches: int, rank: int) -> int:
    """The most micro-batch stages pipeline rank ``rank`` holds activations of at once."""
    schedule = _schedule(name, pp, microbatches)
    stages = [s for s in range(schedule.stages) if schedule.rank_of(s) == rank]
    return activation_liveness(schedule, pp_rank=rank, stage_indices=stages,
                               granularity="stage_microbatch").num_slots


# one block's tensors of _stage_tensors in the order the module registers them: attention
# norm, wq, wk, wv, wo, feed-forward norm, w1, w3, w2
_REGISTRATION_ORDER = (7, 0, 1, 2, 3, 8, 4, 5, 6)


def _ddp_buckets(sizes: list[int], cap: int = 25 * 2**20) -> int:
    """How many buckets DDP's ``replicate`` (25 MiB cap) fills from gradients of ``sizes``
    bytes in registration order: from the last, each closed once it holds ``cap`` or more."""
    buckets, filled = 0, 0
    for size in reversed(sizes):
        filled += size
        if filled >= cap:
            buckets, filled = buckets + 1, 0
    return buckets + (filled > 0)


def estimate(config: TransformerConfig, candidate: Candidate, stage: int,
             calibration: _Calibration) -> RankReport:
    """The closed-form report of the first rank of pipeline rank ``stage`` (see the module
    docstring): its one stage, or under an interleaved schedule its two, added up."""
    pp, m = candidate.pp, candidate.microbatches
    mb_size = config.batch // candidate.data_ranks // m
    schedule = _schedule(candidate.schedule, pp, m) if pp > 1 else None
    total = schedule.stages if schedule is not None else 1
    mine = ([s for s in range(total) if schedule.rank_of(s) == stage]
            if schedule is not None else [0])
    parts = {s: _stage_estimate(config, candidate, stage_layers(config, total, s), mb_size,
                                calibration) for s in mine}
    collectives: dict[tuple[str, str], tuple[int, int]] = {}
    for part in parts.values():
        for key, (calls, nbytes) in part.collectives.items():
            have = collectives.get(key, (0, 0))
            collectives[key] = (have[0] + calls, have[1] + nbytes)
    params = sum(p.parameters for p in parts.values())
    activations = {s: p.activation_bytes_per_microbatch for s, p in parts.items()}
    in_flight, accumulated, peak = 1, parts[mine[0]].accumulated_gradient_bytes, None
    if schedule is not None:
        cp, tp = candidate.cp, candidate.tp
        add_pipeline_messages(collectives, schedule, mine if len(mine) > 1 else stage,
                              mb_size, config, config.torch_dtype, tp, cp)
        in_flight = _in_flight(candidate.schedule, pp, m, stage)
        if len(mine) > 1:
            actions = list(schedule.actions[stage])
            peak = activation_peak(actions, activations)
            accumulated = _accumulated_at_most(
                actions, {s: p.accumulated_gradient_bytes for s, p in parts.items()})
    several = len(mine) > 1
    first = parts[mine[0]]
    report = RankReport(
        rank=stage * candidate.stage_ranks,
        coordinate={}, layers=first.layers, parameters=params, parameter_bytes=4 * params,
        gradient_bytes=4 * params, optimizer_bytes=8 * params,
        activation_bytes_per_microbatch=max(activations.values()),
        microbatches_in_flight=in_flight, compute_dtype=config.dtype,
        collectives=collectives, checkpointing=candidate.checkpointing,
        accumulated_gradient_bytes=accumulated,
        stage_layers={s: p.layers for s, p in parts.items()} if several else {},
        stage_activation_bytes=activations if several else {},
        activation_peak_bytes=peak)
    # the worst moment of one of its stages (they come one after another)
    report.peak_bytes = (report.parameter_bytes + report.optimizer_bytes
                         + report.activation_bytes + report.accumulated_gradient_bytes
                         + max(p.peak_bytes or 0 for p in parts.values()))
    if schedule is not None and schedule.splits_backward:
        # from its I until its W a micro-batch keeps the gradients W starts from; and a
        # checkpointed one its recomputed blocks' activations (the stage's without
        # checkpointing) instead of the checkpoints
        held = dict(activations)
        if candidate.checkpointing != "none":
            plain = replace(candidate, checkpointing="none")
            held = {s: _stage_estimate(config, plain, stage_layers(config, total, s), mb_size,
                                       calibration).activation_bytes_per_microbatch
                    for s in mine}
        until_weights = {s: held[s] + _kept_for_weights(config, candidate,
                                                        stage_layers(config, total, s), mb_size)
                         for s in mine}
        report.peak_bytes += (activation_peak(list(schedule.actions[stage]), activations,
                                              until_weights) - report.activation_bytes)
    return report


def _kept_for_weights(config: TransformerConfig, candidate: Candidate, layers: tuple[int, int],
                      mb_size: int) -> int:
    """What a split backward's ``I`` keeps for its ``W`` besides the activations, per
    micro-batch: the gradient arriving where the weight side leaves the input path — each
    matmul's output (a column-split one's over the gathered sequence, a row-split one's
    before its reduce-scatter) and each norm's (over the rank's part of the sequence under
    tp); in a block of experts the router's, each token's ``top_k`` experts' (a balanced
    router, as the dry run's) and the shared experts'; the first stage's embedding output,
    where its ``I`` stops; the last stage's final norm and logits."""
    tp = candidate.tp
    tokens = mb_size * (config.seq // candidate.cp)
    d, kv = config.dim, config.kv_heads * config.head_dim
    norm = tokens // tp * d
    first, last = layers
    kept = 0
    for layer in range(first, last):
        kept += tokens * (d // tp + 2 * kv // tp + d) + 2 * norm  # attention and norms
        if config.has_experts(layer):
            hidden, shared = config.expert_hidden, config.shared_experts * config.expert_hidden
            kept += tokens * config.experts + tokens * config.top_k * (2 * hidden // tp + d)
            if shared:
                kept += tokens * (2 * shared // tp + d)
        else:
            kept += tokens * (2 * config.ffn_dim // tp + d)
    if first == 0:
        kept += norm
    if last == config.layers:
        kept += norm + tokens * math.ceil(config.vocab / tp)
    return kept * torch.empty(0, dtype=config.torch_dtype).element_size()


def _accumulated_at_most(actions: list, per_stage: dict[int, int]) -> int:
    """The most unsharded gradients FSDP holds after any backward of ``actions``: each
    stage's from its first backward until its last, which reduce-scatters them."""
    backwards = [(i, a.stage) for i, a in enumerate(actions) if a.kind in ("B", "I")]
    first = {s: min(i for i, t in backwards if t == s) for s in per_stage}
    last = {s: max(i for i, t in backwards if t == s) for s in per_stage}
    return max((sum(n for s, n in per_stage.items() if first[s] <= i < last[s])
                for i, _ in backwards), default=0)


def _fsdp(candidate: Candidate) -> bool:
    """Whether the candidate shards its parameters: over ``shard`` (and ``cp`` beside it),
    or over ``cp`` with no data-parallel dim (torchtitan's)."""
    return candidate.shard > 1 or candidate.cp > 1 and cp_shards_parameters(
        candidate.dp > 1, candidate.shard > 1)


def _stage_estimate(config: TransformerConfig, candidate: Candidate, layers: tuple[int, int],
                    mb_size: int, calibration: _Calibration) -> RankReport:
    """One pipeline stage's closed form (layers ``first..last-1``), without the pipeline's
    messages: what the stage's model holds and sends in a step."""
    shard, tp, m = candidate.shard, candidate.tp, candidate.microbatches
    cp, ep = candidate.cp, candidate.ep
    fsdp = _fsdp(candidate)
    first, last = layers
    blocks, embedding, head = last - first, first == 0, last == config.layers
    kinds = _block_kinds(config, first, last)
    dense_shapes, rest_shapes = _stage_tensors(config, tp, embedding, head)
    moe_shapes, expert_shapes = _moe_tensors(config, tp, ep)
    if ep == 1:  # the experts are the block's own parameters (its FSDP unit, DDP's buckets)
        moe_shapes = moe_shapes[:_EXPERTS_AT] + expert_shapes + moe_shapes[_EXPERTS_AT:]
        expert_shapes = []
    block_shapes = {"dense": dense_shapes, "moe": moe_shapes}
    n_dense, n_moe = kinds.get("dense", 0), kinds.get("moe", 0)
    # cp's and ep's ranks are data ranks for the parameters: FSDP over shard x cp flattened
    # (or cp alone), shard x ep (the experts over shard alone, split over ep already), or
    # DDP over dp x cp or ep (the experts left out), as parallelize and the dry run place
    # them
    shards = shard * cp * ep if fsdp else 1
    expert_shards = shard if fsdp else 1
    fsdp_dims = flattened_name([d for d, n in (("shard", shard), ("ep", ep), ("cp", cp))
                                if n > 1])
    ddp_dims = flattened_name([d for d, n in (("dp", candidate.dp), ("ep", ep), ("cp", cp))
                               if n > 1])

    def held(shapes: list[tuple[int, int]], over: int = shards) -> int:
        return sum(math.ceil(rows / over) * cols for rows, cols in shapes)

    def gathered(shapes: list[tuple[int, int]], over: int = shards) -> int:
        return over * held(shapes, over)

    in_blocks = [(block_shapes[kind], n) for kind, n in kinds.items()]
    dense_params = sum(n * held(shapes) for shapes, n in in_blocks) + held(rest_shapes)
    expert_params = n_moe * held(expert_shapes, expert_shards)
    params = dense_params + expert_params
    per = {kind: (calibration(tp, fsdp, embedding, head, candidate.checkpointing, cp, ep,
                              kind), n) for kind, n in kinds.items()}
    base = "moe" if n_moe else "dense"
    activations, collectives = _stage_per_microbatch(per, base, mb_size, m)
    compute = torch.empty((), dtype=config.torch_dtype).element_size()
    units = blocks + (1 if rest_shapes else 0)
    full_blocks = sum(n * gathered(shapes) for shapes, n in in_blocks)
    full_rest = gathered(rest_shapes)
    full_experts = gathered(expert_shapes, expert_shards)
    # each reduction carries a float32 flag per parameter (per shard in a reduce-scatter):
    # which parameters got a gradient
    flags = 4 * (sum(n * len(shapes) for shapes, n in in_blocks) + len(rest_shapes))
    expert_flags = 4 * n_moe * len(expert_shapes)
    if fsdp:
        collectives[("all_gather", fsdp_dims)] = (
            m * (2 * blocks + (1 if rest_shapes else 0)),
            m * (2 * full_blocks + full_rest) * compute)
        collectives[("reduce_scatter", fsdp_dims)] = (
            units, 4 * (full_blocks + full_rest) + shards * flags)
        if expert_shapes and n_moe:  # each block's experts a unit of their own, over shard
            collectives[("all_gather", "shard")] = (m * 2 * n_moe,
                                                    m * 2 * n_moe * full_experts * compute)
            collectives[("reduce_scatter", "shard")] = (
                n_moe, 4 * n_moe * full_experts + expert_shards * expert_flags)
        if candidate.dp > 1:
            collectives[("all_reduce", "dp")] = (units, 4 * params + flags)
    elif ddp_dims:
        order = (rest_shapes[:1] if embedding else []) + [
            shape for layer in range(first, last)
            for shape in (moe_shapes if config.has_experts(layer) else
                          [dense_shapes[i] for i in _REGISTRATION_ORDER])
        ] + (rest_shapes[-2:] if head else [])
        collectives[("all_reduce", ddp_dims)] = (_ddp_buckets([4 * r * c for r, c in order]),
                                                 4 * dense_params + flags)
    accumulated = 0
    if fsdp and m > 1:  # the stage's unsharded float32 gradients, between backwards
        accumulated = 4 * sum(rows * cols for shapes, n in in_blocks + [(rest_shapes, 1)]
                              + [(expert_shapes, n_moe)] for rows, cols in n * shapes)
    return RankReport(
        rank=0, coordinate={}, layers=(first, last), parameters=params,
        parameter_bytes=4 * params, gradient_bytes=4 * params, optimizer_bytes=8 * params,
        activation_bytes_per_microbatch=activations,
        microbatches_in_flight=1, compute_dtype=config.dtype, collectives=collectives,
        checkpointing=candidate.checkpointing, accumulated_gradient_bytes=accumulated,
        # here only what the peak holds besides the parts (:func:`estimate` adds them):
        # measured on one micro-batch, and over several the gradients (in ``.grad``, where
        # FSDP does not hold them unsharded) that the earlier micro-batches left
        peak_bytes=(calibration.transient(tp, fsdp, embedding, head, candidate.checkpointing,
                                          cp, mb_size, kinds, ep)
                    + (4 * params if m > 1 and not fsdp else 0)))


@dataclass
class Evaluation:
    """A candidate's stages (one report each), the slowest stage's predicted step parts, and
    whether the reports were measured by the dry run or estimated in closed form. Where ranks
    share devices, ``lent`` (negative) is what the slowest stage gains from the devices of
    lighter stages idle meanwhile."""

    candidate: Candidate
    reports: list[RankReport]
    parts: dict[str, float]
    measured: bool

    @property
    def step(self) -> float:
        return self.parts["step"]

    allowance: Allowance = field(default_factory=Allowance)

    @property
    def peak_bytes(self) -> int:
        """What the largest rank's device holds: its peak and the allowance."""
        return max(self.allowance.device_bytes(r.most_bytes) for r in self.reports)


def _evaluate(config: TransformerConfig, candidate: Candidate, reports: list[RankReport],
              costs: Costs, measured: bool, allowance: Allowance = Allowance()) -> Evaluation:
    by_stage = [predict(config, candidate.dims, r, costs, candidate.schedule,
                        candidate.microbatches) for r in reports]
    slowest = dict(max(by_stage, key=lambda parts: parts["step"]))
    if costs.ranks_per_device > 1 and len(by_stage) > 1:
        # ranks sharing devices: as in the bubble, a lighter stage idle while the slowest
        # works lends it its device, so the step takes the devices' work over their
        # capacity, the stages' mean busy time, and no less than the slowest stage's alone
        # on a whole device (docs/guide/look-and-plan.md)
        busy = [parts["step"] - parts["bubble"] for parts in by_stage]
        shared = max(sum(busy) / len(busy), max(busy) / costs.ranks_per_device)
        slowest["lent"] = shared - max(busy)
        slowest["step"] = shared + slowest["bubble"]
    return Evaluation(candidate, reports, slowest, measured, allowance)


def measure(config: TransformerConfig, candidate: Candidate) -> list[RankReport]:
    """The first rank of each pipeline stage, measured by the dry run (a long stage from runs
    of a few of its blocks: :func:`~devmesh.tools.dry_run.run.dry_run_by_blocks`)."""
    stride = candidate.stage_ranks
    return [dry_run_by_blocks(config, candidate.dims, rank=stage * stride,
                              schedule=candidate.schedule, microbatches=candidate.microbatches,
                              checkpointing=candidate.checkpointing)
            for stage in range(candidate.pp)]


@dataclass
class SearchResult:
    config: TransformerConfig
    world: int
    device_memory: int | None
    considered: int
    too_big: list[Evaluation]
    ranked: list[Evaluation]  # measured ones first, by predicted step time
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def search(config: TransformerConfig, world: int, costs: Costs, *,
           device_memory: int | None = None, devices_per_host: int = 8, verify: int = 5,
           progress: Callable[[str], None] | None = None,
           checkpointing: str | tuple[str, ...] = "none",
           min_cp_tokens: int = MIN_TOKENS_PER_CP_RANK,
           allowance: Allowance = Allowance()) -> SearchResult:
    """Rank the candidates for ``world`` ranks by predicted step time, dropping those that do
    not fit ``device_memory``; the best (by the closed form) are measured by the dry run, down
    the order until ``verify`` of them fit as measured (at most ``4 x verify`` measured), then
    up to ``verify`` of those estimated too big by less than :data:`ESTIMATE_ABOVE_MEASURED`
    that would beat the best fit measured so far (nearest to fitting first), and ranked again
    by what it measured. ``checkpointing``: the activation
    checkpointing modes to try (a name, several, or ``"any"``: every one the search takes).
    ``min_cp_tokens``: context parallelism is tried down to this many tokens per rank.
    ``allowance``: what a device holds besides a step's peak (a rank fits where its peak
    and the allowance do)."""
    import time

    start = time.perf_counter()
    calibration = _calibration(config)
    modes = _checkpointing_modes(checkpointing)
    found = candidates(config, world, devices_per_host=devices_per_host, checkpointing=modes,
                       min_cp_tokens=min_cp_tokens)
    estimated = [_evaluate(config, c, [estimate(config, c, s, calibration)
                                       for s in range(c.pp)], costs, measured=False,
                           allowance=allowance)
                 for c in found]

    def fits(e: Evaluation) -> bool:
        return device_memory is None or e.peak_bytes <= device_memory

    def measured(evaluation: Evaluation) -> Evaluation:
        if progress:
            progress(f"measuring {evaluation.candidate.describe()} by a dry run")
        return _evaluate(config, evaluation.candidate, measure(config, evaluation.candidate),
                         costs, measured=True, allowance=allowance)

    order = sorted((e for e in estimated if fits(e)), key=lambda e: (e.step, e.peak_bytes))
    # the closed form's peak is an estimate: measure down the order until ``verify`` fit as
    # measured (or 4 x verify were measured)
    checked, tried = [], 0
    for evaluation in order:
        if sum(fits(e) for e in checked) >= verify or tried >= 4 * verify:
            break
        checked.append(measured(evaluation))
        tried += 1
    # and it runs above the measured peak as well as below: up to ``verify`` more of those
    # estimated too big by less than it has run above, each predicted faster than the best
    # fit measured so far, nearest to fitting first
    near = sorted((e for e in estimated if not fits(e) and device_memory is not None
                   and e.peak_bytes <= ESTIMATE_ABOVE_MEASURED * device_memory),
                  key=lambda e: (e.peak_bytes, e.step))
    remeasured = set()
    for evaluation in near:
        if len(remeasured) >= verify:
            break
        if evaluation.step < min((e.step for e in checked if fits(e)), default=math.inf):
            checked.append(measured(evaluation))
            remeasured.add(id(evaluation))
    too_big = ([e for e in estimated if not fits(e) and id(e) not in remeasured]
               + [e for e in checked if not fits(e)])
    kept = sorted((e for e in checked if fits(e)), key=lambda e: (e.step, e.peak_bytes))
    ranked = kept + order[tried:]
    return SearchResult(config, world, device_memory, len(found), too_big, ranked,
                        time.perf_counter() - start)


def _checkpointing_modes(given: str | int | tuple[str, ...]) -> tuple[str, ...]:
    if isinstance(given, tuple):
        return given
    if given == "any":
        return SEARCHED_CHECKPOINTING
    return tuple(str(given).split(","))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def search_as_json(result: SearchResult, top: int = 5) -> dict:
    """What :func:`format_search` prints, as a JSON-ready dict: the search's counts and,
    best first, the ``top`` candidates (mesh, schedule, micro-batches, checkpointing, the
    predicted step and its parts in seconds, the largest rank's memory in bytes, whether the
    dry run measured it), and why the best wins."""
    ranked = [{"mesh": e.candidate.mesh, "dims": e.candidate.dims,
               "schedule": e.candidate.schedule if e.candidate.pp > 1 else None,
               "microbatches": e.candidate.microbatches,
               "checkpointing": e.candidate.checkpointing, "step_seconds": e.step,
               "parts_seconds": {n: v for n, v in e.parts.items() if n != "step"},
               "peak_bytes": e.peak_bytes, "measured": e.measured}
              for e in result.ranked[:top]]
    return {"model": result.config.describe(), "world": result.world,
            "device_memory": result.device_memory, "considered": result.considered,
            "too_big": len(result.too_big), "ranked_count": len(result.ranked),
            "seconds": result.seconds, "ranked": ranked,
            "smallest_too_big_bytes": (min(e.peak_bytes for e in result.too_big)
                                       if result.too_big else None),
            "why": _why(result.ranked) if result.ranked else None}


def format_search(result: SearchResult, top: int = 5) -> str:
    """The best ``top`` candidates with their breakdown, and why the best one wins."""
    lines = [f"search: {result.config.describe()}",
             f"{result.considered} candidates for {result.world} ranks; "
             + (f"{len(result.too_big)} do not fit in {_gib(result.device_memory)}; "
                if result.device_memory is not None else "no --device-memory: none dropped; ")
             + f"{len(result.ranked)} ranked by predicted step time "
             f"(searched in {result.seconds:.1f} s)"]
    if not result.ranked:
        smallest = min(result.too_big, key=lambda e: e.peak_bytes)
        lines.append(f"none fits: the smallest, {smallest.candidate.describe()}, needs "
                     f"{_gib(smallest.peak_bytes)} on its largest rank")
        return "\n".join(lines)
    lines.append("")
    lines.append(f"  {'#':>2}  {'mesh (schedule x micro-batches)':<40}{'step':>11}"
                 f"{'memory':>12}  parts of the slowest stage")
    for place, e in enumerate(result.ranked[:top], 1):
        parts = ", ".join(f"{name} {_ms(value)}" for name, value in e.parts.items()
                          if name != "step" and value != 0)
        lines.append(f"  {place:>2}  {e.candidate.describe():<40}{_ms(e.step):>11}"
                     f"{_gib(e.peak_bytes):>12}  {parts}"
                     + ("" if e.measured else "  (closed form only)"))
    lines.append("")
    lines.append(_why(result.ranked))
    return "\n".join(lines)


def _why(ranked: list[Evaluation]) -> str:
    """Why the best candidate wins: against the best one on another mesh, the parts of the
    step that differ most; against the same mesh's other schedules and micro-batch counts,
    time or memory."""
    best = ranked[0]
    lines = []
    others = [e for e in ranked[1:] if e.candidate.mesh != best.candidate.mesh]
    if others:
        other = others[0]
        names = (best.parts.keys() | other.parts.keys()) - {"step"}
        gaps = sorted(((other.parts.get(n, 0.0) - best.parts.get(n, 0.0), n) for n in names),
                      reverse=True)

        def change(name: str) -> str:
            return (f"{name} {_ms(other.parts.get(name, 0.0))} there, "
                    f"{_ms(best.parts.get(name, 0.0))} here")

        text = (f"why {best.candidate.mesh}: {_ms(other.step - best.step)} per step faster "
                f"than the best other mesh, {other.candidate.describe()}")
        visible = 0.05 * best.step  # differences under 5% of the step are not reasons
        saved = [change(name) for gap, name in gaps if gap > visible][:3]
        spent = [change(name) for gap, name in reversed(gaps) if gap < -visible][:2]
        if saved:
            text += f": less {'; '.join(saved)}"
        if spent:
            text += f"; more {'; '.join(spent)}"
        lines.append(text + ".")
    else:
        lines.append(f"{best.candidate.mesh} is the only mesh that fits.")
    same = [e for e in ranked[1:] if e.candidate.mesh == best.candidate.mesh]
    if same:
        runner = same[0]
        lines.append(f"why {best.candidate.describe()} on it: {runner.candidate.describe()} "
                     f"takes {_ms(runner.step)} per step and holds {_gib(runner.peak_bytes)}, "
                     f"this one {_ms(best.step)} and {_gib(best.peak_bytes)}.")
    return "\n".join(lines)
