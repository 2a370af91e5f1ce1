"""What ``devmesh plan --model`` prints: per rank, the memory it holds and the collectives of
one step; with costs (a device throughput and link bandwidths, or ``devmesh bench --json``
from the target cluster), the predicted step time and its parts.

The time model is deliberately simple and says so: compute is the step's matmul and
attention FLOPs at the stated throughput; each collective takes its bytes times the ring
factor of its kind over the bus bandwidth stated for its mesh dims or measured for that
collective over them, plus a stated latency per hop (a collective over n ranks makes
n - 1) — or, where its time was measured at several buffer sizes over as many ranks
(``devmesh bench --json`` rows), that time at its size — plus a stated wait per hop for peers
that come from compute at different moments; not overlapped with compute (an upper bound);
a pipeline adds its schedule's bubble.
Each block also takes a stated fixed time per micro-batch besides its FLOPs (its operations'
launches or dispatches), which many small micro-batches pay many times; and a rank copies the
bytes of its data-parallel collectives besides sending them, at a stated copy bandwidth: FSDP
each byte its all-gathers and reduce-scatters carry, out of or into the collective's flat
buffer (once), DDP each gradient into its bucket and back out of it (twice).
Where several ranks share one device (``ranks_per_device``: CPU ranks on fewer cores), an
idle stage's device time goes to the busy ranks, so the bubble costs only the share of the
step in which too few ranks are busy to fill the devices.
"""

from __future__ import annotations

import bisect
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

from devmesh.errors import DryRunError
from devmesh.layout.schedule import build_schedule
from devmesh.tools.commbench import FACTORS
from devmesh.tools.dry_run.model import TransformerConfig
from devmesh.tools.dry_run.run import RankReport

__all__ = ["Costs", "read_costs", "parse_seconds", "schedule_bubble", "step_flops",
           "buffer_copies", "predict", "format_reports", "parse_bytes", "Allowance",
           "parse_allowance"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str) -> int:
    """``"80GB"`` (powers of 10), ``"80GiB"`` (powers of 2) or a plain number of bytes."""
    number = text.rstrip("BbKkMmGgTtIi")
    unit = text[len(number):].upper()
    try:
        return int(float(number) * _UNITS[unit])
    except (KeyError, ValueError):
        raise DryRunError(f"{text!r} is not a size: write e.g. 80GB or 80GiB") from None


@dataclass(frozen=True)
class Allowance:
    """What a device holds besides the step's measured peak (the most bytes its tensors
    take at once), stated rather than measured:

    - ``cache``: the caching allocator's reserve over that peak, as a fraction — freed
      blocks it keeps for reuse and the fragments between them. torch's
      ``max_memory_reserved``, which torchtitan reports, is the peak times ``1 + cache``;
    - ``context``: bytes outside torch's allocator — the CUDA context, NCCL's buffers —
      which ``nvidia-smi`` shows and torch's counts do not (0 by default: the figure is
      torch's reserved memory).
    """

    cache: float = 0.2
    context: int = 0

    def device_bytes(self, peak: int) -> int:
        return round(peak * (1 + self.cache)) + self.context

    def describe(self) -> str:
        """`` + 20% allocator cache``, as the report appends it to what it allows for."""
        parts = [f"{self.cache:.0%} allocator cache"] if self.cache else []
        if self.context:
            parts.append(f"{_gib(self.context)} context")
        return "".join(f" + {part}" for part in parts) or ", no allowance"


def parse_allowance(text: str | None) -> Allowance:
    """``--allowance``: ``cache=20%,context=1GiB`` (either part; the other keeps its
    default), or ``none``; not given, the defaults."""
    if not text:
        return Allowance()
    if text.strip().lower() == "none":
        return Allowance(cache=0.0, context=0)
    values: dict[str, float | int] = {}
    for item in text.split(","):
        name, _, value = item.strip().partition("=")
        try:
            if name == "cache" and value.endswith("%") and float(value[:-1]) >= 0:
                values["cache"] = float(value[:-1]) / 100
                continue
            if name == "context":
                values["context"] = parse_bytes(value)
                continue
        except (ValueError, DryRunError):
            pass
        raise DryRunError(f"--allowance {text!r}: {item!r} is not cache=PERCENT% (the "
                          "allocator's reserve over the peak, e.g. cache=20%) or "
                          "context=SIZE (outside torch's allocator, e.g. context=1GiB); "
                          "or give none")
    return Allowance(**values)


@dataclass(frozen=True)
class Costs:
    """A device's dense throughput (TFLOP/s) and bus bandwidths (GB/s) by mesh dims, with
    ``default`` for dims not listed, and a fixed ``latency`` (seconds) per hop besides the
    bytes: a pipeline's message is one hop, a collective over n ranks n - 1 (a ring's).
    ``by_collective`` holds the bandwidth of one kind of collective, measured apart, over
    mesh dims (or ``"*"``: any): ``devmesh bench`` measures each, and on gloo an all-gather
    moves its bytes several times slower than an all-reduce. ``ranks_per_device`` above 1
    says that ranks share devices (8 CPU ranks on 2 cores: 4) and ``tflops`` is a rank's
    throughput while all of them compute. ``block_overhead`` (seconds) is what one block's
    forward and backward take on one micro-batch besides their FLOPs (the launches or
    dispatches of its operations): a step pays it per block of the rank and micro-batch.
    ``copy_bandwidth`` (GB/s) is the rate at which a rank copies the bytes of its
    data-parallel collectives besides the collective (None: free): FSDP each all-gather's and
    reduce-scatter's (their unsharded size) out of or into the collective's flat buffer, DDP
    each all-reduced gradient into its bucket and back (:func:`buffer_copies`).
    ``curves`` holds one call's measured seconds at several buffer sizes, by (mesh dims or
    ``"*"``: any, collective, ranks): sizes matter beyond the bus bandwidth (a small
    collective is all latency, and past the caches bandwidth falls by half), so where a
    collective was measured over as many ranks its curve replaces bandwidth and latency.
    ``wait`` (seconds per hop) is what a collective or message waits besides, for peers
    arriving from compute at different moments: 0 where each rank has its own device,
    several milliseconds where ranks share cores (measured back to back, a collective's
    ranks arrive together)."""

    tflops: float
    bandwidth: dict[str, float]
    default: float | None = None
    latency: float = 0.0
    ranks_per_device: float = 1.0
    by_collective: dict[tuple[str, str], float] = field(default_factory=dict)
    block_overhead: float = 0.0
    copy_bandwidth: float | None = None
    curves: dict[tuple[str, str, int], tuple[tuple[int, float], ...]] = field(
        default_factory=dict)
    wait: float = 0.0

    def call_seconds(self, dims: str, kind: str, ranks: int, nbytes: float) -> float | None:
        """One ``kind`` call's measured seconds at ``nbytes`` (its buffer, as devmesh's
        communication accounting counts it) over ``ranks`` ranks of ``dims``, or None where
        no curve of two sizes or more was measured (one size cannot say how time grows with
        bytes: bandwidth and latency then): linear in bytes between the measured sizes around
        it, along the last two beyond the largest, the smallest's time below it. A size
        measured twice keeps its best time; times are made non-decreasing in size (the noise
        of one measurement must not make a larger buffer cheaper)."""
        points = self.curves.get((dims, kind, ranks)) or self.curves.get(("*", kind, ranks))
        best: dict[int, float] = {}
        for size, seconds in points or ():
            best[size] = min(seconds, best.get(size, seconds))
        if len(best) < 2:
            return None
        sizes, times = [], []
        for size, seconds in sorted(best.items()):
            sizes.append(size)
            times.append(max(seconds, times[-1]) if times else seconds)
        if nbytes <= sizes[0]:
            return times[0]
        index = min(bisect.bisect_left(sizes, nbytes), len(sizes) - 1)
        (b0, t0), (b1, t1) = (sizes[index - 1], times[index - 1]), (sizes[index], times[index])
        return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)

    def _slowest_part(self, dims: str) -> float | None:
        """Over dims flattened or grouped together (``shard_cp``), with a bandwidth stated
        for each part: the slowest part's (a ring over them all crosses its links)."""
        parts = label_dims(dims)
        if len(parts) < 2 or any(p not in self.bandwidth for p in parts):
            return None
        return min(self.bandwidth[p] for p in parts)

    def bus_bandwidth(self, dims: str, kind: str | None = None) -> float:
        """The bandwidth of ``kind`` over ``dims``: measured for that collective over those
        dims, else stated for the dims, else measured for that collective, else the default."""
        for value in (self.by_collective.get((dims, kind)), self.bandwidth.get(dims),
                      self._slowest_part(dims), self.by_collective.get(("*", kind)),
                      self.default):
            if value is not None:
                return value
        raise DryRunError(f"no bandwidth for mesh dims {dims!r}: give --bandwidth "
                          f"{dims}=GBps (or one number for every dim), or measure it "
                          "with devmesh bench --json on the target cluster")


def parse_seconds(text: str) -> float:
    """``"20us"``, ``"0.5ms"``, ``"1s"`` or a plain number of seconds, not negative."""
    for unit, scale in (("us", 1e-6), ("ms", 1e-3), ("s", 1.0), ("", 1.0)):
        if text.endswith(unit):
            try:
                seconds = float(text[:len(text) - len(unit)]) * scale
            except ValueError:
                break
            if not seconds >= 0:  # also NaN: it would take time off every step
                raise DryRunError(f"{text!r}: a time cannot be negative")
            return seconds
    raise DryRunError(f"{text!r} is not a time: write e.g. 20us, 0.5ms or 0.00002")


def read_costs(tflops: float | None, bandwidth: str | None, bench_json: str | None,
               latency: str | None = None, ranks_per_device: float = 1.0,
               block_overhead: str | None = None, copy_bandwidth: float | None = None,
               wait: str | None = None) -> Costs | None:
    """The costs the user gave: ``--tflops``, ``--bandwidth 300`` or ``tp=300,dp=25``,
    ``--costs FILE`` (``devmesh bench --json``: each collective's time per dim at every size
    it measured, its best bus bandwidth there, and a dim's best for its messages),
    ``--bandwidth`` over it for the dims it names, ``--latency`` per hop (a message; a
    collective over n ranks makes n - 1), ``--ranks-per-device``, ``--block-overhead`` (per
    block and micro-batch), ``--copy-bandwidth`` (GB/s) and ``--wait`` per hop."""
    if not ranks_per_device >= 1:  # also NaN
        raise DryRunError(f"--ranks-per-device {ranks_per_device:g}: give how many ranks "
                          "share one device, 1 or more (8 CPU ranks on 2 cores: 4)")
    if copy_bandwidth is not None and not copy_bandwidth > 0:  # also NaN
        raise DryRunError(f"--copy-bandwidth {copy_bandwidth:g}: give the rate at which a "
                          "rank copies FSDP's gathered and scattered bytes, in GB/s, above 0")
    if (tflops is None and bandwidth is None and bench_json is None and latency is None
            and block_overhead is None and copy_bandwidth is None and wait is None):
        return None
    if tflops is None:
        raise DryRunError("a predicted step time needs --tflops (the device's dense "
                          "throughput, TFLOP/s) besides the bandwidths")
    by_dims: dict[str, float] = {}
    by_collective: dict[tuple[str, str], float] = {}
    curves: dict[tuple[str, str, int], tuple[tuple[int, float], ...]] = {}
    default = None
    if bench_json:
        try:
            rows = json.loads(Path(bench_json).read_text())["collectives"]
            for row in rows:  # each collective's best; a dim's best for the others
                by_dims[row["dim"]] = max(by_dims.get(row["dim"], 0.0), row["busbw_gbs"])
                if "op" in row:
                    key = (row["dim"], row["op"])
                    by_collective[key] = max(by_collective.get(key, 0.0), row["busbw_gbs"])
                if {"op", "ranks", "bytes", "time_us"} <= row.keys():
                    nbytes, seconds = int(row["bytes"]), float(row["time_us"]) * 1e-6
                    if not (nbytes > 0 and 0 < seconds < float("inf")):  # also NaN
                        raise ValueError(f"row {row} has no positive size and time")
                    curve = (row["dim"], row["op"], int(row["ranks"]))
                    curves[curve] = (*curves.get(curve, ()), (nbytes, seconds))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DryRunError(f"--costs {bench_json}: not a devmesh bench --json file "
                              f"({exc})") from None
    if bandwidth:
        for item in bandwidth.split(","):
            name, _, value = item.rpartition("=")
            try:
                if name:
                    by_dims[name] = float(value)
                    for key in [k for k in by_collective if k[0] == name]:
                        del by_collective[key]  # the user's word over the measurement
                    for key in [k for k in curves if k[0] == name]:
                        del curves[key]
                else:
                    default = float(value)
            except ValueError:
                raise DryRunError(f"--bandwidth {bandwidth!r}: write GB/s as a number, or "
                                  "DIMS=GBps, comma-separated") from None
    return Costs(tflops, by_dims, default, parse_seconds(latency) if latency else 0.0,
                 ranks_per_device, by_collective,
                 parse_seconds(block_overhead) if block_overhead else 0.0, copy_bandwidth,
                 curves, parse_seconds(wait) if wait else 0.0)


def step_flops(config: TransformerConfig, report: RankReport, dims: dict[str, int]) -> float:
    """The FLOPs one rank computes in a step: forward and backward (3x forward) of its
    layers' matmuls (split by tp; a mixture of experts' router and the experts each token
    goes to) and causal attention, and the output head on the last stage, over its share of
    the batch; the forward again of each block checkpointed in full, and of the matmuls
    selective checkpointing recomputes."""
    tp = dims.get("tp", 1)
    data = dims.get("dp", 1) * dims.get("shard", 1) * dims.get("ep", 1)
    # context parallelism: a rank computes seq / cp of each sequence's tokens, each of them
    # attending over the whole sequence (the ring brings the rest)
    tokens = config.batch // data * config.seq // dims.get("cp", 1)
    kv = config.kv_heads * config.head_dim
    attention = 2 * config.seq * config.dim / tp  # QK^T and AV, causal: half of 4 s d

    def layer(i: int) -> float:  # one token's forward FLOPs in layer i
        matmul = (2 * config.dim * config.dim + 2 * config.dim * kv
                  + config.feed_forward_parameters(i, active=True)) / tp
        return 2 * matmul + attention

    ranges = report.layer_ranges  # several where the rank runs several stages
    per_token = sum(layer(i) for first, last in ranges for i in range(first, last))
    # a block checkpointed in full runs its forward again in backward; selective keeps its
    # attention's outputs and every other matmul's, recomputing the others: in a SwiGLU
    # block wk, wo and w3 (a third of the feed-forward's; likewise taken for experts)
    mode = report.checkpointing
    if mode == "selective":
        extra = sum(2 * (config.dim * kv + config.dim * config.dim
                         + config.feed_forward_parameters(i, active=True) / 3) / tp
                    for first, last in ranges for i in range(first, last))
    else:
        every = 1 if mode == "full" else mode if isinstance(mode, int) else 0
        extra = sum(layer(i) for first, last in ranges
                    for i in (range(first, last, every) if every else ()))
    if any(last == config.layers for _, last in ranges):
        per_token += 2 * config.dim * config.vocab
    return (3 * per_token + extra) * tokens


def label_dims(label: str) -> list[str]:
    """The mesh dims a collective's label names: ``"dp+shard"`` (a group over several dims)
    and ``"shard_cp"`` (a dim flattened from several, as FSDP over ``shard`` and ``cp``)
    both name two."""
    return [name for part in label.split("+") for name in part.split("_")]


def _ranks_of(dims_label: str, dims: dict[str, int]) -> int:
    n = 1
    for name in label_dims(dims_label):
        n *= dims.get(name, 1)
    return n


def buffer_copies(kind: str, label: str, dims: dict[str, int]) -> int:
    """How many times a rank copies a collective's bytes besides the collective, as the
    dry run's parallelisms do: FSDP's all-gather copies the gathered bytes out of its flat
    buffer and its reduce-scatter the gradients into one (once each); DDP (``dp`` or ``cp``
    without ``shard``: :func:`~devmesh.tools.dry_run.run.build_rank_model` replicates over
    them) packs each gradient into its bucket before the all-reduce and copies it back after
    (twice). Sequence parallelism's all-gathers and reduce-scatters over ``tp`` reorder their
    blocks of the sequence (once each, as FSDP's); tensor parallelism's all-reduces and
    HSDP's (over ``dp``, of the reduce-scattered shard in place) copy nothing."""
    if kind in ("all_gather", "reduce_scatter"):
        return 1
    if label == "replicas":  # replica groups pack the gradients and read them back
        return 2
    if kind == "all_reduce" and "shard" not in dims and set(label_dims(label)) <= {"dp", "cp"}:
        return 2  # DDP over dp, cp or both flattened
    return 0


@functools.lru_cache(maxsize=256)
def schedule_bubble(schedule: str, pp: int, microbatches: int) -> float:
    """The idle share of the schedule's rank-time (kept: a search asks it once per stage)."""
    return build_schedule(schedule, pp, microbatches).bubble()


def predict(config: TransformerConfig, dims: dict[str, int], report: RankReport,
            costs: Costs, schedule: str, microbatches: int) -> dict[str, float]:
    """The step's predicted seconds by part: ``compute``, ``overhead`` (with a
    ``block_overhead``), one entry per mesh dims' communication, ``bubble`` (a pipeline's
    idle time), and ``step`` (their sum)."""
    parts = {"compute": step_flops(config, report, dims) / (costs.tflops * 1e12)}
    if costs.block_overhead:  # every block of the rank, forward and backward, per micro-batch
        blocks = sum(last - first for first, last in report.layer_ranges)
        parts["overhead"] = costs.block_overhead * blocks * microbatches
    for (kind, label), (calls, nbytes) in sorted(report.collectives.items()):
        ranks = _ranks_of(label, dims)
        # a collective over n ranks passes n - 1 hops of a ring (as the redistribution
        # planner's cost model counts them); a pipeline's message one
        factor, hops = (FACTORS[kind](ranks), ranks - 1) if kind in FACTORS else (1.0, 1)
        key = f"comm {label}"
        # its calls taken as alike: the step's bytes of this kind over these dims, shared
        measured = costs.call_seconds(label, kind, ranks, nbytes / calls) if calls else None
        seconds = (calls * measured if measured is not None else
                   calls * hops * costs.latency
                   + nbytes * factor / (costs.bus_bandwidth(label, kind) * 1e9))
        parts[key] = parts.get(key, 0.0) + seconds + calls * hops * costs.wait
        if costs.copy_bandwidth:
            parts[key] += buffer_copies(kind, label, dims) * nbytes / (costs.copy_bandwidth * 1e9)
    if report.store_round_trips:  # a replica group's quorum, at the coordinator's store
        parts["quorum"] = report.store_round_trips * (costs.latency + costs.wait)
    busy = sum(parts.values())
    pp = dims.get("pp", 1)
    bubble = schedule_bubble(schedule, pp, microbatches) if pp > 1 else 0.0
    # ranks busy a (1 - bubble) share of the step; while that share fills the devices
    # (1 / ranks_per_device of the ranks do), an idle rank's device runs the busy ones faster
    # and the step takes its busy time; below it, the devices themselves idle
    idle = max(0.0, 1 / costs.ranks_per_device - (1 - bubble)) if costs.ranks_per_device > 1 \
        else bubble
    parts["bubble"] = busy * idle / (1 - bubble)
    parts["step"] = busy + parts["bubble"]
    return parts


def _gib(nbytes: float) -> str:
    """A size in the largest binary unit under which it is at least 1."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.2f} {unit}"
    return f"{nbytes:,.0f} B"


def _seconds(seconds: float) -> str:
    return f"{seconds:,.2f} s" if seconds >= 1 else f"{seconds * 1e3:,.3g} ms"


def _checkpointing(mode: str | int) -> str:
    return f"every {mode} blocks, in full" if isinstance(mode, int) and mode > 1 else (
        "full" if mode == 1 else str(mode))


def reports_as_json(config: TransformerConfig, dims: dict[str, int],
                    reports: list[RankReport], *, schedule: str, microbatches: int,
                    costs: Costs | None = None, device_memory: int | None = None,
                    allowance: Allowance = Allowance()) -> dict:
    """Every number :func:`format_reports` prints, as a JSON-ready dict (bytes as integers,
    predicted parts in seconds)."""
    ranks = []
    for report in reports:
        entry = {
            "rank": report.rank, "coordinate": report.coordinate,
            "layers": list(report.layers), "parameters": report.parameters,
            "parameter_bytes": report.parameter_bytes, "gradient_bytes": report.gradient_bytes,
            "optimizer_bytes": report.optimizer_bytes,
            "accumulated_gradient_bytes": report.accumulated_gradient_bytes,
            "activation_bytes_per_microbatch": report.activation_bytes_per_microbatch,
            "microbatches_in_flight": report.microbatches_in_flight,
            "activation_bytes": report.activation_bytes, "total_bytes": report.total_bytes,
            "peak_bytes": report.most_bytes, "peak_at": report.peak_at,
            "device_bytes": allowance.device_bytes(report.most_bytes),
            "store_round_trips": report.store_round_trips,
            "stages": [{"stage": stage, "layers": list(report.stage_layers[stage]),
                        "activation_bytes_per_microbatch": nbytes}
                       for stage, nbytes in report.stage_activation_bytes.items()],
            "compute_dtype": report.compute_dtype, "seconds": report.seconds,
            "collectives": [{"collective": kind, "dims": label, "calls": calls,
                             "bytes": nbytes}
                            for (kind, label), (calls, nbytes) in
                            sorted(report.collectives.items())],
        }
        if device_memory is not None:
            entry["fits"] = allowance.device_bytes(report.most_bytes) <= device_memory
        if costs is not None:
            entry["predicted_seconds"] = predict(config, dims, report, costs, schedule,
                                                 microbatches)
        ranks.append(entry)
    return {"config": {f: getattr(config, f) for f in (
                "layers", "dim", "heads", "kv_heads", "ffn_dim", "vocab", "seq", "batch",
                "dtype")},
            "parameters_total": config.parameters(), "mesh": dims,
            "schedule": schedule if dims.get("pp", 1) > 1 else None,
            "microbatches": microbatches,
            "activation_checkpointing": reports[0].checkpointing if reports else "none",
            "device_memory": device_memory,
            "allowance": {"cache": allowance.cache, "context_bytes": allowance.context},
            "ranks": ranks}


def format_reports(config: TransformerConfig, dims: dict[str, int], reports: list[RankReport],
                   *, schedule: str, microbatches: int, costs: Costs | None = None,
                   device_memory: int | None = None, allowance: Allowance = Allowance()
                   ) -> str:
    world = 1
    for size in dims.values():
        world *= size
    mesh = " x ".join(f"{name} {size}" for name, size in dims.items())
    lines = [f"dry run: {config.describe()}",
             f"mesh: {mesh} = {world} ranks"
             + (f"; {schedule}, {microbatches} micro-batches" if dims.get("pp", 1) > 1 else "")
             + (f"; activation checkpointing: {_checkpointing(reports[0].checkpointing)}"
                if reports and reports[0].checkpointing != "none" else "")]
    for report in reports:
        where = ", ".join(f"{k} {v}" for k, v in report.coordinate.items())
        lines.append("")
        held = (", ".join(f"stage {stage} (layers {first}..{last - 1})"
                          for stage, (first, last) in report.stage_layers.items())
                if report.stage_layers else
                f"layers {report.layers[0]}..{report.layers[1] - 1}")
        lines.append(f"rank {report.rank} ({where}): {held}, {report.parameters:,} parameters "
                     f"here (measured in {report.seconds:.1f} s)")
        lines.append(f"  parameters {_gib(report.parameter_bytes):>14}   (float32)")
        lines.append(f"  gradients  {_gib(report.gradient_bytes):>14}")
        lines.append(f"  AdamW      {_gib(report.optimizer_bytes):>14}   (2 states)")
        if report.accumulated_gradient_bytes:
            lines.append(f"  accumulated{_gib(report.accumulated_gradient_bytes):>14}   "
                         "(FSDP's unsharded float32 gradients, between micro-batches)")
        if report.stage_activation_bytes:
            each = ", ".join(f"stage {stage} {_gib(nbytes)}"
                             for stage, nbytes in report.stage_activation_bytes.items())
            lines.append(f"  activations{_gib(report.activation_bytes):>14}   "
                         f"(the most held at once: {report.microbatches_in_flight} micro-batch "
                         f"stages in flight; per micro-batch {each}; {report.compute_dtype})")
        else:
            lines.append(f"  activations{_gib(report.activation_bytes):>14}   "
                         f"({_gib(report.activation_bytes_per_microbatch)} per micro-batch x "
                         f"{report.microbatches_in_flight} in flight, {report.compute_dtype})")
        device = allowance.device_bytes(report.most_bytes)
        verdict = ""
        if device_memory is not None:
            verdict = ("   fits" if device <= device_memory else
                       f"   does NOT fit in {_gib(device_memory)}")
        lines.append(f"  total      {_gib(report.total_bytes):>14}   (the parts added up)")
        if report.peak_bytes is not None:
            lines.append(f"  peak       {_gib(report.peak_bytes):>14}   (the most alive at once "
                         "in the step, with AdamW's states)")
            if report.peak_at:
                lines.append(f"  peak at    {'':>14}   {report.peak_at}")
        what = "peak" if report.peak_bytes is not None else "total"
        lines.append(f"  device     {_gib(device):>14}   ({what}{allowance.describe()})"
                     f"{verdict}")
        if report.store_round_trips:
            lines.append(f"  quorum: {report.store_round_trips} round trips to the replica "
                         "coordinator's store per step")
        lines.append(f"  {'collective':<16}{'mesh dims':<14}{'calls':>7}{'bytes':>18}")
        for (kind, label), (calls, nbytes) in sorted(report.collectives.items()):
            lines.append(f"  {kind:<16}{label:<14}{calls:>7}{nbytes:>18,}")
        if costs is not None:
            parts = predict(config, dims, report, costs, schedule, microbatches)
            shown = ", ".join(f"{name} {_seconds(seconds)}" for name, seconds in
                              parts.items() if name != "step" and seconds > 0)
            lines.append(f"  predicted step {_seconds(parts['step'])}: {shown}")
    return "\n".join(lines)
