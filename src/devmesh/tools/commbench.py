"""``devmesh bench``: collective bandwidth per mesh dim, as nccl-tests reports it.

For every dim of the mesh, every collective and every message size: the slowest rank's median
time, the algorithm bandwidth (data size / time) and the bus bandwidth (algorithm bandwidth x
the collective's factor: ``2 (n-1)/n`` for all-reduce, ``(n-1)/n`` for all-gather,
reduce-scatter and all-to-all), which is comparable with the link speed. A local memcpy of the
same size is measured too, as the machine's ceiling. Results go to a table, CSV, JSON and a PNG.
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass

from devmesh._files import atomic_write, pyplot, save_figure

__all__ = ["BenchRow", "bench_rank", "parse_size", "write_outputs", "format_table"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}


@dataclass
class BenchRow:
    dim: str
    ranks: int
    op: str
    bytes: int
    time_us: float
    algbw_gbs: float
    busbw_gbs: float


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536: bytes, with an optional K, M or G suffix (powers of 1024)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    raw = text
    text = text.strip().upper().removesuffix("B")
    scale = 1
    if text and text[-1] in units:
        text, scale = text[:-1], units[text[-1]]
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"size {raw!r} is not a number of bytes with an optional K, M or G "
                         "suffix (e.g. 4K, 1M, 8M)") from None
    if value <= 0 or value * scale < 1:
        raise ValueError(f"size {raw!r} must be at least 1 byte")
    return int(value * scale)


def bench_rank(mesh_shape, names, sizes, ops=OPS, iters: int = 5) -> tuple[list[BenchRow], list]:
    """Runs on every rank; returns (rows, memcpy rows) with the slowest rank's times."""

    import torch
    import torch.distributed as dist

    from devmesh.distributed import comm
    from devmesh.mesh import init_device_mesh

    shape = tuple(mesh_shape) if mesh_shape else (int(os.environ["WORLD_SIZE"]),)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    rows = []
    # every dim alone, and (on a multi-dim mesh) all dims flattened: the planner's merged
    # collectives run over flattened groups, and the cost model fits latency per hop from both
    groups = [(d,) for d in range(mesh.ndim)] + ([tuple(range(mesh.ndim))] if mesh.ndim > 1 else [])
    for dims in groups:
        n = math.prod(mesh.shape[d] for d in dims)
        if n == 1:
            continue
        for op in ops:
            for size in sizes:
                elems = max(n, size // 4 // n * n)
                buf = torch.ones(elems)
                if op == "all_reduce":
                    fn = lambda: comm.all_reduce(buf, mesh, dims)  # noqa: E731
                elif op == "all_gather":
                    part = buf[: elems // n].clone()
                    fn = lambda: comm.all_gather(part, mesh, dims)  # noqa: E731
                elif op == "reduce_scatter":
                    stacked = buf.view(n, -1)
                    fn = lambda: comm.reduce_scatter(stacked, mesh, dims)  # noqa: E731
                else:
                    chunks = list(buf.view(n, -1).unbind(0))
                    shapes = [c.shape for c in chunks]
                    fn = lambda: comm.all_to_all(chunks, mesh, dims, shapes)  # noqa: E731
                fn()
                times = []
                for _ in range(iters):
                    dist.barrier()
                    start = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - start)
                t = torch.tensor([statistics.median(times)], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                seconds = float(t.item())
                nbytes = elems * 4
                algbw = nbytes / seconds / 1e9
                rows.append(BenchRow("+".join(mesh.layout.dim_name(d) for d in dims), n, op, nbytes, seconds * 1e6,
                                     algbw, algbw * FACTORS[op](n)))
    memcpy = []
    for size in sizes:
        src = torch.ones(max(1, size // 4))
        dst = torch.empty_like(src)
        dst.copy_(src)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        memcpy.append((src.numel() * 4, seconds * 1e6, src.numel() * 4 / seconds / 1e9))
    return rows, memcpy


def format_table(rows: list[BenchRow], memcpy: list) -> str:
    lines = [f"{'dim':<8}{'ranks':>6}  {'collective':<15}{'bytes':>12}{'time (us)':>12}"
             f"{'algbw GB/s':>12}{'busbw GB/s':>12}"]
    for r in rows:
        lines.append(f"{r.dim:<8}{r.ranks:>6}  {r.op:<15}{r.bytes:>12,}{r.time_us:>12.1f}"
                     f"{r.algbw_gbs:>12.3f}{r.busbw_gbs:>12.3f}")
    lines.append("local memcpy (one rank, the machine's ceiling):")
    for nbytes, us, gbs in memcpy:
        lines.append(f"  {nbytes:>12,} bytes {us:>10.1f} us {gbs:>8.2f} GB/s")
    return "\n".join(lines)


def write_outputs(rows: list[BenchRow], memcpy: list, *, csv_path: str | None = None,
                  json_path: str | None = None, png_path: str | None = None) -> None:
    if csv_path:
        def write_csv(f):
            writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0]).keys()))
            writer.writeheader()
            writer.writerows(asdict(r) for r in rows)

        atomic_write(csv_path, write_csv)
    if json_path:
        atomic_write(json_path, lambda f: json.dump(
            {"collectives": [asdict(r) for r in rows],
             "memcpy": [{"bytes": b, "time_us": t, "gbs": g} for b, t, g in memcpy]}, f, indent=1))
    if png_path:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(8, 5))
        for key in sorted({(r.dim, r.op) for r in rows}):
            points = [r for r in rows if (r.dim, r.op) == key]
            ax.plot([r.bytes for r in points], [r.busbw_gbs for r in points], marker="o",
                    label=f"{key[1]} over {key[0]}")
        ax.plot([b for b, _, _ in memcpy], [g for _, _, g in memcpy], "k--", label="local memcpy")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.legend(fontsize=8)
        ax.set_title("collective bus bandwidth per mesh dim")
        fig.tight_layout()
        save_figure(fig, png_path)
