"""What a redistribution step costs: bytes on the wire, bytes copied locally, and time.

Pure, so the planner can compare candidate plans without a mesh. The time model is the
textbook one for ring and pairwise collectives (as in nccl-tests' bus bandwidth):

    collective seconds = (n - 1) * latency[op] + bytes received / (bandwidth[op] * f(size))
    copy seconds       = bytes copied / (copy_bandwidth * f(size))

where ``n`` is the group size. Bytes received per rank are ``(n-1)/n`` of the gathered output
(all-gather), of the input (reduce-scatter, all-to-all) and ``2 (n-1)/n`` of it (all-reduce):
the algorithm factors ``devmesh bench`` applies. Counting the hops is what makes one all-gather
over 8 ranks cost more than a gather over 2 followed by one over 4 of the same bytes, and
counting copies is what makes a merged gather that must be reordered afterwards lose to two
gathers that land in place. Bandwidth depends on the buffer size where it was measured at
several (``size_factor``): past the caches it falls by up to half here, and one constant
predicted 64 MB redistributions at less than half their time.

The constants come from ``devmesh bench --json`` (:meth:`CostModel.from_bench`, or the file
named by ``DEVMESH_COST_MODEL``); without a measurement, :data:`DEFAULT_COST_MODEL` holds
values fitted on a 2-core CPU machine with 8 gloo ranks.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["CostModel", "DEFAULT_COST_MODEL", "wire_bytes", "cost_model", "set_cost_model"]

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def wire_bytes(op: str, group_size: int, nbytes: int) -> float:
    """Bytes one rank receives in ``op`` over ``group_size`` ranks, where ``nbytes`` is the
    collective's buffer as :mod:`devmesh.distributed.comm` counts it (the gathered output,
    the reduce-scatter input, the all-reduce tensor, the all-to-all input)."""
    n = group_size
    if n <= 1:
        return 0.0
    factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
    return factor * nbytes


@dataclass(frozen=True)
class CostModel:
    """Per-collective latency (seconds per hop) and bandwidth (bytes/s received per rank),
    and the bandwidth of a local copy (bytes/s). Frozen and hashable: plans are cached by it."""

    latency: tuple[tuple[str, float], ...]
    bandwidth: tuple[tuple[str, float], ...]
    copy_bandwidth: float
    source: str = "default"
    # (bytes, factor) points: every bandwidth, collective and copy, times the factor at that
    # many bytes (a collective's buffer, a copy's size). Bandwidth falls once buffers outgrow
    # the caches — here a 64 MB all-gather moves bytes at half its 8 MB rate — which one
    # constant cannot say. One factor for all, not a curve per collective: curves per op
    # fitted here ranked a 64 MB all-to-all above an all-gather that ran 1.5x faster (the
    # copies around it fall too), so the planner chose worse; a shared factor keeps the
    # constants' ranking and corrects the time. Interpolated in log bytes, the nearest point
    # outside them.
    size_factor: tuple[tuple[int, float], ...] = ()
    # (op, group size, latency per hop, bandwidth): constants fitted for one group size,
    # used for it instead of the op's. Where ranks share cores (or groups differ in links),
    # time does not follow the hops and bytes of the textbook: here an 8 MB all-gather took
    # 15, 22 and 18 ms over 2, 4 and 8 ranks, so one merged gather over 8 ranks beat a
    # gather over 4 then one over 2 (26 vs 45 ms), which the op's constants ranked the
    # other way. Group sizes not listed use the op's constants.
    groups: tuple[tuple[str, int, float, float], ...] = ()
    # (bytes, factor) points for local copies alone (empty: ``size_factor``). A copy falls
    # off the caches harder than a collective: one process's memcpy ran at 14.8 GB/s for
    # 8 MB and 3.0 GB/s for 32 MB here, and with 8 ranks sharing 2 cores a 64 MB reorder
    # copy took ~150 ms (0.4 GB/s), so a merged gather that must reorder 64 MB lost to two
    # gathers landing in place (606 vs 450 ms) while the shared factor predicted it faster.
    copy_size_factor: tuple[tuple[int, float], ...] = ()

    def constants(self, op: str, group_size: int) -> tuple[float, float]:
        """Latency per hop and bandwidth of ``op`` over ``group_size`` ranks."""
        for name, n, latency, bandwidth in self.groups:
            if name == op and n == group_size:
                return latency, bandwidth
        return dict(self.latency)[op], dict(self.bandwidth)[op]

    def collective_seconds(self, op: str, group_size: int, wire: float) -> float:
        """Predicted time of one collective over ``group_size`` ranks in which a rank
        receives ``wire`` bytes from the others (:func:`wire_bytes`)."""
        if group_size <= 1:
            return 0.0
        nbytes = wire / wire_bytes(op, group_size, 1)  # the collective's buffer
        latency, bandwidth = self.constants(op, group_size)
        return (group_size - 1) * latency + wire / (bandwidth * self.factor(nbytes))

    def factor(self, nbytes: float, points: tuple[tuple[int, float], ...] | None = None
               ) -> float:
        """How much of its bandwidth a transfer of ``nbytes`` gets (1: all), on the curve
        ``points`` (default: ``size_factor``)."""
        points = self.size_factor if points is None else points
        if not points:
            return 1.0
        if nbytes <= points[0][0]:
            return points[0][1]
        for (b0, f0), (b1, f1) in zip(points, points[1:]):
            if nbytes <= b1:
                share = math.log(nbytes / b0) / math.log(b1 / b0)
                return f0 * (f1 / f0) ** share  # geometric: bandwidth varies by factors
        return points[-1][1]

    def copy_seconds(self, nbytes: int) -> float:
        curve = self.copy_size_factor or self.size_factor
        return nbytes / (self.copy_bandwidth * self.factor(nbytes, curve)) if nbytes else 0.0

    @classmethod
    def fit(cls, rows: Iterable[Mapping], memcpy: Iterable[Mapping] = (),
            source: str = "measured") -> CostModel:
        """Least-squares latency and bandwidth per collective from ``devmesh bench`` rows
        (``op``, ``ranks``, ``bytes``, ``time_us``): time = (n-1) * latency + wire / bw;
        the same per (collective, group size) where two sizes up to 8 MB were measured
        (``groups``), and the size factor against those."""
        latency, bandwidth = dict(DEFAULT_COST_MODEL.latency), dict(DEFAULT_COST_MODEL.bandwidth)
        rows = list(rows)
        by_op: dict[str, list[tuple[float, float, float]]] = {}
        for row in rows:
            n = int(row["ranks"])
            by_op.setdefault(row["op"], []).append(
                (n - 1, wire_bytes(row["op"], n, int(row["bytes"])), float(row["time_us"]) * 1e-6))
        for op, points in by_op.items():
            solved = _least_squares(points)
            if solved is not None:
                latency[op], bandwidth[op] = solved
        groups = _fit_groups(rows)
        by_size = _size_factor(rows, latency, bandwidth, groups)
        copy_bandwidth = DEFAULT_COST_MODEL.copy_bandwidth
        # the largest copy measured: redistribution copies are large, and small ones fit
        # in cache and would flatter the machine
        timed = [(int(r["bytes"]), float(r["time_us"]) * 1e-6) for r in memcpy
                 if float(r["time_us"]) > 0]
        if timed:
            nbytes, seconds = max(timed)
            copy_bandwidth = nbytes / seconds
        return cls(tuple(sorted(latency.items())), tuple(sorted(bandwidth.items())),
                   copy_bandwidth, source, by_size, groups)

    @classmethod
    def from_bench(cls, path: str) -> CostModel:
        """The model fitted to a ``devmesh bench --json PATH`` file."""
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict) or not isinstance(data.get("collectives"), list):
            raise ValueError(f"{path} is not a `devmesh bench --json` file (no 'collectives' "
                             "list); write one with `devmesh bench -n 8 --mesh 2,4 --json PATH`")
        return cls.fit(data["collectives"], data.get("memcpy", []), source=path)

    def __str__(self) -> str:
        lat = ", ".join(f"{op} {s * 1e6:.0f} us" for op, s in self.latency)
        bw = ", ".join(f"{op} {b / 1e9:.2f} GB/s" for op, b in self.bandwidth)
        factors = ", ".join(f"{f:.2f} at {_size(n)}" for n, f in self.size_factor)
        groups = ", ".join(f"{op} over {n}: {a * 1e6:.0f} us, {b / 1e9:.2f} GB/s"
                           for op, n, a, b in self.groups)
        return (f"cost model ({self.source}): latency per hop {lat}; bandwidth {bw}; "
                f"copy {self.copy_bandwidth / 1e9:.1f} GB/s"
                + (f"; bandwidth times {factors}" if factors else "")
                + (f"; by group size: {groups}" if groups else ""))


def _size(nbytes: int) -> str:
    for unit, shift in (("MB", 20), ("KB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):g} {unit}"
    return f"{nbytes} B"


_GROUP_FIT_LIMIT = 8 << 20  # bytes: beyond, the size factor describes the fall-off


def _fit_groups(rows: list[Mapping]) -> tuple[tuple[str, int, float, float], ...]:
    """Latency per hop and bandwidth per (op, group size), fitted on buffers up to 8 MB
    (beyond, the size factor takes over), where at least two sizes were measured."""
    points: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    for row in rows:
        op, n, nbytes = row["op"], int(row["ranks"]), int(row["bytes"])
        if n > 1 and nbytes <= _GROUP_FIT_LIMIT:
            points.setdefault((op, n), []).append(
                (n - 1, wire_bytes(op, n, nbytes), float(row["time_us"]) * 1e-6))
    groups = []
    for (op, n), measured in sorted(points.items()):
        if len({w for _, w, _ in measured}) < 2:
            continue
        solved = _least_squares(measured)
        if solved is not None:
            groups.append((op, n, solved[0], solved[1]))
    return tuple(groups)


def _size_factor(rows: Iterable[Mapping], latency: Mapping[str, float],
                 bandwidth: Mapping[str, float],
                 groups: tuple[tuple[str, int, float, float], ...] = ()
                 ) -> tuple[tuple[int, float], ...]:
    """Per buffer size, the share of the fitted bandwidth the collectives got: for each op,
    the bandwidth that best explains its times at that size over every group size once the
    hops' latency is taken off (least squares in relative error), over the constant for its
    op and group size (``groups``, else the op's); the geometric mean over ops. Buffers under 1 MB, and times mostly latency, tell little
    about bandwidth and give no point."""
    fitted = {(op, n): (lat, bw) for op, n, lat, bw in groups}
    sums: dict[tuple[str, int], list[float]] = {}
    for row in rows:
        op, n, nbytes = row["op"], int(row["ranks"]), int(row["bytes"])
        if op not in bandwidth:
            continue
        hop, bw = fitted.get((op, n), (latency.get(op, 0.0), bandwidth[op]))
        seconds = float(row["time_us"]) * 1e-6
        transfer = seconds - (n - 1) * hop
        if n <= 1 or nbytes < 1 << 20 or seconds <= 0 or transfer < 0.5 * seconds:
            continue
        # the rate this row achieved, over the rate its constants promise
        w = wire_bytes(op, n, nbytes) / seconds / bw
        acc = sums.setdefault((op, nbytes), [0.0, 0.0])
        acc[0] += w * w
        acc[1] += w * transfer / seconds
    logs: dict[int, list[float]] = {}
    for (op, nbytes), (ww, wt) in sums.items():
        if wt > 0:
            logs.setdefault(nbytes, []).append(math.log(ww / wt))
    points = tuple((nbytes, math.exp(sum(v) / len(v))) for nbytes, v in sorted(logs.items()))
    return points if len(points) > 1 else ()


def _least_squares(points: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """Solve t = h * a + w * b for (a >= 0, 1/b > 0) over (hops, wire, time) points, in
    relative error (each point scaled by 1/t), so small messages weigh as much as large."""
    points = [(h / t, w / t, 1.0) for h, w, t in points if t > 0]
    shh = sum(h * h for h, _, _ in points)
    sww = sum(w * w for _, w, _ in points)
    shw = sum(h * w for h, w, _ in points)
    sht = sum(h * t for h, _, t in points)
    swt = sum(w * t for _, w, t in points)
    det = shh * sww - shw * shw
    if det <= 0:
        return None
    a = (sht * sww - swt * shw) / det
    b = (shh * swt - shw * sht) / det
    if b <= 0:
        return None
    return max(a, 0.0), 1.0 / b


# Fitted (CostModel.from_bench) to `devmesh bench -n 8 --mesh 2,4 --sizes 64K,1M,8M,32M --json`
# on the 2-core development machine: 8 gloo ranks time-sharing 2 cores, so a hop costs
# milliseconds (a context switch) and bandwidth is a few hundred MB/s. Only the ratios matter
# for choosing a plan; measure your machine for predictions in seconds.
DEFAULT_COST_MODEL = CostModel(
    latency=(("all_gather", 1.5e-3), ("all_reduce", 2.3e-3), ("all_to_all", 0.6e-3),
             ("reduce_scatter", 2.0e-3)),
    bandwidth=(("all_gather", 0.30e9), ("all_reduce", 0.63e9), ("all_to_all", 0.30e9),
               ("reduce_scatter", 0.18e9)),
    copy_bandwidth=2.6e9,
    # beyond 8 MB the constants above fall as measured with `devmesh bench -n 8 --mesh 2,4
    # --sizes 64K,1M,8M,64M` on the same machine (the geometric mean over the collectives of
    # their 64 MB / 8 MB bandwidth: all-gather 0.47, all-reduce 0.94, all-to-all 0.66,
    # reduce-scatter 0.81); up to 8 MB unchanged
    size_factor=((8 << 20, 1.0), (64 << 20, 0.7)),
    # per group size (mesh (2, 4): 2 and 4 are its dims, 8 both), fitted the same way on the
    # median of three runs of `devmesh bench -n 8 --mesh 2,4 --sizes 64K,1M,8M,64M --iters 9`
    # (session 14): an 8-rank group moves bytes 2.5x as fast as a 2- or 4-rank one here
    groups=(("all_gather", 2, 1.37e-3, 0.32e9), ("all_gather", 4, 1.53e-3, 0.36e9),
            ("all_gather", 8, 1.46e-3, 0.91e9), ("all_reduce", 2, 2.90e-3, 0.45e9),
            ("all_reduce", 4, 2.89e-3, 0.70e9), ("all_reduce", 8, 2.17e-3, 1.27e9),
            ("all_to_all", 2, 1.74e-3, 0.22e9), ("all_to_all", 4, 0.92e-3, 0.39e9),
            ("all_to_all", 8, 0.61e-3, 0.33e9), ("reduce_scatter", 2, 2.98e-3, 0.17e9),
            ("reduce_scatter", 4, 2.86e-3, 0.23e9), ("reduce_scatter", 8, 2.66e-3, 0.40e9)),
    copy_size_factor=((8 << 20, 1.0), (64 << 20, 0.16)),
)

_chosen: list[CostModel] = []


def cost_model() -> CostModel:
    """The model plans are chosen with: :func:`set_cost_model`'s, else the file named by
    ``DEVMESH_COST_MODEL`` (a ``devmesh bench --json`` output), else the default. Every rank
    must use the same model, or ranks could choose different plans."""
    if not _chosen:
        path = os.environ.get("DEVMESH_COST_MODEL")
        _chosen.append(CostModel.from_bench(path) if path else DEFAULT_COST_MODEL)
    return _chosen[0]


def set_cost_model(model: CostModel | None) -> None:
    """Use ``model`` for every later plan (``None``: back to the environment / default)."""
    _chosen.clear()
    if model is not None:
        _chosen.append(model)
