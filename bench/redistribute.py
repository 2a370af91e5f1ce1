"""Redistribution: devmesh vs torch DTensor on 8 gloo ranks, in the same run.

Every transition redistributes the same tensor in both libraries on the same mesh (devmesh's
mesh *is* a torch mesh, so they share process groups): single-dim transitions, 2-D ones
including the swap ``[S(0),S(1)] -> [S(1),S(0)]``, the nested FSDP-over-TP ``full_tensor``
(torch: ``_StridedShard``), a 3-D mesh, uneven sizes and bf16, at 64 KB, 8 MB and 64 MB.
Prints the median over repeats of the slowest rank's time, devmesh / torch (the median of
each repeat's pair: the two run back to back, so the machine's drift cancels), collective
counts, the bytes a rank receives (devmesh: its plan, checked against ``comm_stats`` by
tests/test_sharded.py; torch: counted from its functional collectives), and the plan's
predicted time. "A/A" times torch's own call a second time in each repeat: its ratio to the
first is what this machine's noise alone makes of two identical runs, so a devmesh / torch
ratio inside that spread is a tie.

``--candidates`` also times every candidate plan devmesh considered, to compare the cost
model's ranking with the measured one.

    .venv/bin/python bench/redistribute.py [--repeats 5] [--sizes 64K,8M,64M] [--candidates]
        [--only "[S(0),S(1)]->R" --only swap]

Set DEVMESH_COST_MODEL to a ``devmesh bench -n 8 --mesh 2,4 --json`` file to plan with this
machine's measured constants.

glibc's malloc: as in bench/pipeline.py, the ranks of both libraries run with glibc's
thresholds for returning memory to the system raised (``--default-malloc`` leaves them
alone). With the defaults every 8 MB buffer is mapped and faulted in again at each call, and
which plan paid that depended on the order plans were timed in: a merged gather measured
67 ms timed among other candidates and 28 ms on its own, and torch's own call against itself
(A/A) spread 0.84-1.18; with the thresholds raised, 1.00-1.03.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
import warnings

SIZES = {"64K": (128, 128), "8M": (1024, 2048), "64M": (4096, 4096)}


def _cases(sizes):
    """(name, mesh shape, global shape, dtype name, src (dim map, partial), dst (...))."""
    out = []
    for size in sizes:
        shape = SIZES[size]
        out += [
            (f"S(0)->R on tp {size}", (2, 4), shape, "float32", ({0: "tp"}, None), ({}, None)),
            (f"P->R on tp {size}", (2, 4), shape, "float32", ({}, {"tp": "sum"}), ({}, None)),
            (f"P->S(0) on tp {size}", (2, 4), shape, "float32", ({}, {"tp": "sum"}),
             ({0: "tp"}, None)),
            (f"S(0)->S(1) on tp {size}", (2, 4), shape, "float32", ({0: "tp"}, None),
             ({1: "tp"}, None)),
            (f"[S(0),S(1)]->R {size}", (2, 4), shape, "float32", ({0: "dp", 1: "tp"}, None),
             ({}, None)),
            (f"[S(0),S(0)]->R {size}", (2, 4), shape, "float32", ({0: ("dp", "tp")}, None),
             ({}, None)),
            (f"swap {size}", (2, 4), shape, "float32", ({0: "dp", 1: "tp"}, None),
             ({0: "tp", 1: "dp"}, None)),
            (f"nested (tp,dp) full {size}", (2, 4), shape, "float32", ({0: ("tp", "dp")}, None),
             ({}, None)),
        ]
    out += [
        ("bf16 [S(0),S(1)]->R 4M", (2, 4), (1024, 2048), "bfloat16", ({0: "dp", 1: "tp"}, None),
         ({}, None)),
        ("bf16 swap 4M", (2, 4), (1024, 2048), "bfloat16", ({0: "dp", 1: "tp"}, None),
         ({0: "tp", 1: "dp"}, None)),
        ("uneven [S(0),S(1)]->R 8M", (2, 4), (1023, 2047), "float32", ({0: "dp", 1: "tp"}, None),
         ({}, None)),
        ("uneven swap 8M", (2, 4), (1023, 2047), "float32", ({0: "dp", 1: "tp"}, None),
         ({0: "tp", 1: "dp"}, None)),
        ("3-D [S0,S1,S2]->R 8M", (2, 2, 2), (256, 128, 64), "float32",
         ({0: "a", 1: "b", 2: "c"}, None), ({}, None)),
        ("3-D rotate 8M", (2, 2, 2), (256, 128, 64), "float32",
         ({0: "a", 1: "b", 2: "c"}, None), ({0: "b", 1: "c", 2: "a"}, None)),
        ("3-D [P,P,S0]->[S0,S1,S0] 8M", (2, 2, 2), (256, 128, 64), "float32",
         ({0: "c"}, {"a": "sum", "b": "sum"}), ({0: ("a", "c"), 1: "b"}, None)),
    ]
    return out


class _TorchWire:
    """Bytes a rank receives in torch's functional collectives (a dispatch mode, like
    ``CommDebugMode``), with the same algorithm factors as devmesh's plans."""

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        from devmesh.layout.cost import wire_bytes

        counter = self
        self.wire = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                name = func.__name__.split(".")[0].removesuffix("_out")
                if func.namespace == "_c10d_functional" and name in counter.COLLECTIVES:
                    result = kwargs.get("out", out)
                    counter.wire += counter.count(name, args, result, wire_bytes)
                return out

        self.mode = Mode()
        self.torch = torch

    COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce",
                   "all_to_all_single")

    def count(self, name, args, out, wire_bytes) -> int:
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group([a for a in args if isinstance(a, str)][-1])
        n = group.size()
        if name == "all_gather_into_tensor":
            return round(wire_bytes("all_gather", n, out.numel() * out.element_size()))
        if name == "reduce_scatter_tensor":
            return round(wire_bytes("reduce_scatter", n, args[0].numel() * args[0].element_size()))
        if name == "all_reduce":
            return round(wire_bytes("all_reduce", n, args[0].numel() * args[0].element_size()))
        if name == "all_to_all_single":
            mine = args[1][group.rank()] if args[1] else out.shape[0] // n
            per_row = out.numel() // max(out.shape[0], 1) * out.element_size()
            return (out.shape[0] - mine) * per_row
        raise NotImplementedError(f"torch issued {name}; count its bytes here")


def bench_rank(sizes, repeats: int, candidates: bool, only=()):
    import logging

    import torch
    import torch.distributed as dist

    from devmesh import comm_stats, init_device_mesh
    from devmesh.layout.plan import candidate_plans, plan_redistribute
    from devmesh.tensor import ShardedTensor, ShardingSpec
    from devmesh.tensor.redistribute import execute
    from torch.distributed.tensor.debug import CommDebugMode

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    meshes = {}

    def timed(*fns):
        """Each function's time in every repeat (this rank's). The functions alternate so
        that machine noise hits all alike, and their order flips every repeat: ranks leave a
        barrier at different moments, and whichever runs first after it absorbs that spread
        (timing one 8 MB all-gather against itself on 8 ranks, the one always run first
        took 1.05-1.12x the other; with the order flipping, 0.90-1.06x)."""
        for fn in fns:
            fn()  # warm-up: plan caches, lazy buffers
        times = [[] for _ in fns]
        for repeat in range(repeats):
            order = list(zip(fns, times))
            for fn, out in order if repeat % 2 == 0 else reversed(order):
                dist.barrier()
                start = time.perf_counter()
                fn()
                out.append(time.perf_counter() - start)
        return times

    meshes[(2, 4)] = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    for _ in range(20):  # warm the machine and the connections up
        dist.all_reduce(torch.ones(1 << 16))
    results = {}
    for name, mesh_shape, shape, dtype, (src_map, src_partial), (dst_map, dst_partial) in _cases(
            sizes):
        if only and not any(part in name for part in only):
            continue
        names = ("a", "b", "c") if len(mesh_shape) == 3 else ("dp", "tp")
        if mesh_shape not in meshes:
            meshes[mesh_shape] = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        mesh = meshes[mesh_shape]
        src = ShardingSpec.build(mesh_shape, shape, src_map, src_partial, mesh_dim_names=names)
        dst = ShardingSpec.build(mesh_shape, shape, dst_map, dst_partial, mesh_dim_names=names)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(getattr(torch, dtype))
        full = ShardedTensor(x, mesh, src.replicated())
        ours = full.redistribute(src) if not src.partial else _partial(full, src)
        theirs = ours.to_dtensor()
        target = ShardedTensor(x, mesh, dst.replicated()).redistribute(dst).to_dtensor().placements
        # torch timed twice: the spread of torch / torch is this run's noise floor
        t_ours, t_theirs, t_again = timed(
            lambda: ours.redistribute(dst),
            lambda: theirs.redistribute(theirs.device_mesh, target),
            lambda: theirs.redistribute(theirs.device_mesh, target))
        with comm_stats() as stats:
            result = ours.redistribute(dst)
        wire = _TorchWire()
        with CommDebugMode() as debug, wire.mode:
            expected = theirs.redistribute(theirs.device_mesh, target)
        assert torch.equal(result.to_local(), expected.to_local()), name
        plan = plan_redistribute(src, dst, x.element_size())
        row = {"ours": t_ours, "theirs": t_theirs, "again": t_again, "calls": stats.calls,
               "torch_calls": debug.get_total_counts(), "wire": plan.wire,
               "torch_wire": wire.wire, "predicted": plan.seconds, "strategy": plan.strategy}
        if candidates:
            plans = candidate_plans(src, dst, x.element_size())
            block = ours.to_local()
            measured = timed(*[lambda p=p: execute(block, mesh, p) for p in plans])
            row["candidates"] = [(p.strategy, p.seconds, m) for p, m in zip(plans, measured)]
        results[name] = row
    return results


def _partial(full, spec):
    """A partial-sum tensor whose sum is ``full``: the value on coordinate 0, zeros elsewhere."""
    import dataclasses

    import torch

    from devmesh.tensor import ShardedTensor

    replicated = full.redistribute(dataclasses.replace(spec, partial=()))
    coord = full.device_mesh.get_coordinate()
    local = replicated.to_local()
    if any(coord[m] != 0 for m, _ in spec.partial):
        local = torch.zeros_like(local)
    return ShardedTensor(local, full.device_mesh, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", default="64K,8M,64M",
                        help=f"tensor sizes for the 2-D transitions, from {','.join(SIZES)}")
    parser.add_argument("--only", action="append", default=[],
                        help="run the transitions whose name contains this (repeatable; "
                             "default: all)")
    parser.add_argument("--candidates", action="store_true",
                        help="also time every candidate plan (predicted vs measured ranking)")
    parser.add_argument("--default-malloc", action="store_true",
                        help="keep glibc malloc's default thresholds (see the module's doc)")
    args = parser.parse_args()
    if not args.default_malloc:  # read by glibc at process start: the ranks inherit it
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 << 20))
        os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(256 << 20))
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown size(s) {unknown}; choose from {', '.join(SIZES)}")

    from devmesh.launching.launcher import launch

    only = tuple(args.only)
    per_rank = launch(bench_rank, 8, sizes, args.repeats, args.candidates, only, timeout=3000)
    print(f"redistribute on 8 gloo ranks; median over {args.repeats} repeats of the slowest "
          "rank's time; ratio: median of each repeat's devmesh / torch pair (run back to "
          "back); wire = bytes one rank receives")
    print(f"{'transition':<32}{'devmesh':>10}{'torch':>10}{'ratio':>7}{'A/A':>6}{'colls':>6}"
          f"{'torch':>6}{'wire MB':>9}{'torch':>8}{'predicted':>11}  plan")
    ratios, controls = [], []
    for name, row in per_rank[0].items():
        ours = _slowest(per_rank, name, "ours")
        theirs = _slowest(per_rank, name, "theirs")
        # each repeat ran devmesh and torch back to back: the ratio of a repeat's pair
        # cancels the machine's drift between repeats
        ratio = statistics.median(o / t for o, t in zip(ours, theirs))
        again = _slowest(per_rank, name, "again")
        control = statistics.median(a / t for a, t in zip(again, theirs))
        controls.append(control)
        ours, theirs = statistics.median(ours), statistics.median(theirs)
        wire = max(r[name]["wire"] for r in per_rank)
        torch_wire = max(r[name]["torch_wire"] for r in per_rank)
        ratios.append(ratio)
        print(f"{name:<32}{ours * 1e3:>8.2f}ms{theirs * 1e3:>8.2f}ms{ratio:>7.2f}{control:>6.2f}"
              f"{row['calls']:>6}{row['torch_calls']:>6}{wire / 2**20:>9.2f}"
              f"{torch_wire / 2**20:>8.2f}{row['predicted'] * 1e3:>9.2f}ms  {row['strategy']}")
    print(f"devmesh / torch: median {statistics.median(ratios):.2f}, worst {max(ratios):.2f}, "
          f"geometric mean {math.exp(statistics.fmean(math.log(r) for r in ratios)):.2f}")
    print(f"A/A (torch's same call timed twice, the noise floor): from {min(controls):.2f} "
          f"to {max(controls):.2f}, median {statistics.median(controls):.2f}")
    if args.candidates:
        _print_candidates(per_rank)


def _slowest(per_rank, name: str, key: str) -> list[float]:
    """Per repeat, the slowest rank's time (a collective ends when its last rank does)."""
    return [max(times) for times in zip(*(r[name][key] for r in per_rank))]


def _print_candidates(per_rank) -> None:
    agree = 0
    rows = per_rank[0]
    print("\ncandidate plans: predicted vs measured (slowest rank, median)")
    for name in rows:
        plans = rows[name]["candidates"]
        measured = [statistics.median(map(max, zip(*(r[name]["candidates"][i][2]
                                                      for r in per_rank))))
                    for i in range(len(plans))]
        best_measured = min(range(len(plans)), key=lambda i: measured[i])
        agree += best_measured == 0
        print(f"{name}:")
        for i, (strategy, predicted, _) in enumerate(plans):
            mark = " <- chosen" if i == 0 else ""
            mark += " (fastest measured)" if i == best_measured else ""
            print(f"    {strategy:<24}{predicted * 1e3:>9.2f}ms predicted{measured[i] * 1e3:>9.2f}ms "
                  f"measured{mark}")
    print(f"the chosen plan was the fastest measured in {agree} of {len(rows)} transitions")


if __name__ == "__main__":
    main()
