"""The mesh search (``devmesh plan --model --world --search``) checked against measured step
times: on 8 gloo ranks of this machine, its predicted order of candidate meshes against the
order their real training steps take.

1. The cost model is fitted here, on the same 8 ranks: each rank's throughput on one of the
   model's blocks, forward and backward on 8 sequences while all 8 ranks compute (its FLOPs
   over the time beyond a one-token micro-batch's, which is what a block costs per
   micro-batch besides its FLOPs); a small all-reduce between two ranks back to back (the
   latency per hop) and after a burst of compute (what a hop waits besides, as tensor
   parallelism's all-reduces come between matmuls); each collective a step makes
   (all-reduce, all-gather, reduce-scatter) back to back over groups of 2, 4 and 8 ranks at
   buffers of 64 KiB to 64 MiB (the curves a collective's time is read from, at its size);
   the bus bandwidth of each over the 8 ranks from two sizes per rank, 1 and 8 MiB (1 and
   32 MiB for the all-reduce; the median of the three for pipeline messages); the model
   fully sharded over the 8 ranks, its units' unshard and reshard against bare all-gathers
   of the same shards: the rate at which FSDP copies the gathered bytes besides the
   collective (its reduce-scatters' bytes, and DDP's gradients into their buckets and back,
   are costed at the same rate). The model knows that the 8 ranks share this machine's
   cores.
2. The search ranks every candidate for 8 ranks (no memory limit); ``--candidates`` of them,
   spread evenly over its ranking, are measured by the dry run (``verify``), and each is then
   run for real: devmesh's parallelisms on the same model, one training step (forward and
   backward of every micro-batch, the pipeline through devmesh's ``PipelineRunner``), timed
   ``--repeats`` times after a warm-up; a step's time is its slowest rank's.
3. Two candidates' measured times differ beyond the noise when their medians are further
   apart than the larger of their two spreads (max - min over the repeats); for every such
   pair, the search's order should agree. Printed: the agreement, Spearman's rank
   correlation, and each candidate's predicted and measured time.
4. The model's form apart from how well micro-benchmarks give its constants: for every pair
   apart beyond the noise, its five costs (throughput, bandwidth, latency, per block, FSDP's
   copies) fitted to the measured steps of the other candidates (non-negative least squares
   on the model's own terms, without curves or wait), and the pair's order checked.

    .venv/bin/python bench/plan_search.py [--model tiny:...] [--candidates 16] [--repeats 5]
        [--save FILE]   (the candidates and their measured steps, pickled: to try other
                         cost models on the same measurements)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace

MODEL = ("tiny:layers=8,dim=256,heads=8,kv_heads=4,ffn_dim=1024,vocab=2048,seq=64,batch=32,"
         "dtype=float32")


def _median_seconds(call, warmup: int = 3, repeats: int = 5, calls: int = 10) -> float:
    """One ``call``'s median time within ``calls`` back-to-back calls, over ``repeats``
    repeats, each started after a barrier (as a step makes them: a barrier before each call
    would time 8 ranks waking together on 2 cores)."""
    import torch.distributed as dist

    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def block_costs(model_text: str, sequences: int = 8) -> tuple[float, float]:
    """(FLOP/s, seconds per micro-batch besides them) of one of the model's blocks, forward
    and backward: the time of a one-token micro-batch is what a block costs besides its
    FLOPs (the dispatch of its operations), and ``sequences`` sequences take that plus
    their FLOPs (as the dry run counts them) at the rate the model's blocks reach, with
    their attention, norms and activations (here ~15% under a lone large matmul's)."""
    from types import SimpleNamespace

    import torch

    from devmesh.tools.dry_run import read_config
    from devmesh.tools.dry_run.model import Transformer
    from devmesh.tools.dry_run.report import step_flops

    config = read_config(model_text)
    block = next(iter(Transformer(config, 0, 1, head=False).layers.values()))
    one = torch.randn(1, 1, config.dim, requires_grad=True)
    many = torch.randn(sequences, config.seq, config.dim, requires_grad=True)
    overhead = _median_seconds(lambda: block(one).sum().backward())
    loaded = _median_seconds(lambda: block(many).sum().backward(), warmup=1, calls=3)
    one_block = SimpleNamespace(layers=(0, 1), layer_ranges=[(0, 1)], checkpointing="none")
    flops = step_flops(replace(config, batch=sequences), one_block, {})
    return flops / max(loaded - overhead, 1e-9), overhead


def fsdp_copy_bandwidth(model_text: str) -> float:
    """GB/s at which FSDP handles its gathered bytes on this rank besides the collective:
    the unsharded bytes of every unit of the model fully sharded over the 8 ranks, over the
    time its unshard and reshard take beyond bare all-gathers of the same shards."""
    import torch
    import torch.distributed as dist

    from devmesh.tools.dry_run import read_config
    from devmesh.tools.dry_run.run import build_rank_model

    mesh, model = build_rank_model(read_config(model_text), {"shard": 8}, "cpu")
    units = [*model.layers.values(), model]
    own = [sum(p.numel() for p in unit.parameters(recurse=unit is not model))
           for unit in units[:-1]]
    own.append(sum(p.numel() for p in model.parameters()) - sum(own))
    group, n = mesh.get_group(), dist.get_world_size()
    shards = [(torch.zeros(k), torch.zeros(k * n)) for k in own]

    def fsdp() -> None:
        for unit in units:
            unit.unshard()
            unit.reshard()

    def bare() -> None:
        for shard, gathered in shards:
            dist.all_gather_single(gathered, shard, group=group)

    extra = (_median_seconds(fsdp, warmup=1, calls=1)
             - _median_seconds(bare, warmup=1, calls=1))
    return 4 * n * sum(own) / max(extra, 1e-9) / 1e9


def latency_in_pairs() -> tuple[float, float]:
    """(back to back, after a burst of compute): the seconds of a small all-reduce between
    two ranks (one hop). Tensor parallelism's all-reduces and a pipeline's messages come
    between matmuls, where the peer, sharing a core with three other ranks, is seldom ready
    at once: here ~3 ms, against ~1.4 ms back to back."""
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([first, first + 1]) for first in range(0, n - 1, 2)]
    pair = pairs[min(rank // 2, len(pairs) - 1)]
    x, w, t = torch.randn(512, 256), torch.randn(256, 256), torch.zeros(256)

    def compute() -> None:  # ~10 ms here with all 8 ranks computing
        for _ in range(4):
            x @ w

    def then_reduce() -> None:
        compute()
        dist.all_reduce(t, group=pair)

    back_to_back = _median_seconds(lambda: dist.all_reduce(t, group=pair), repeats=15)
    # noisy (2.3 to 3.3 ms in four repeats here): the median of many repeats
    after = _median_seconds(then_reduce, repeats=15) - _median_seconds(compute, repeats=15)
    return back_to_back, after


CURVE_SIZES = tuple(1 << k for k in range(16, 27, 2))  # a collective's buffer: 64 KiB to 64 MiB


def collective_curves() -> dict[tuple[str, str, int], tuple[tuple[int, float], ...]]:
    """One call's seconds, back to back, of each collective a step makes, over groups of 2, 4
    and 8 ranks (every group at once, as a mesh dim's groups run), at each of
    ``CURVE_SIZES`` (the buffer as devmesh counts it: the gathered output, the scattered
    input, the reduced tensor). The candidates' collectives span these sizes: tensor
    parallelism's all-reduces of ~0.5 MB, FSDP's units of ~4 MB, DDP's buckets of 10-18 MB;
    bandwidth is not one number over them (an 8-rank all-gather moves its bytes at
    ~0.4 GB/s up to 16 MiB and half that at 64 MiB, past the caches)."""
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    curves: dict[tuple[str, str, int], tuple[tuple[int, float], ...]] = {}
    for size in (2, 4, 8):
        groups = [dist.new_group(list(range(first, first + size))) for first in range(0, n, size)]
        group = groups[rank // size]
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            points = []
            for nbytes in CURVE_SIZES:
                whole = torch.zeros(nbytes // 4)
                part = torch.zeros(nbytes // 4 // size)
                call = {"all_reduce": lambda: dist.all_reduce(whole, group=group),
                        "all_gather": lambda: dist.all_gather_single(whole, part, group=group),
                        "reduce_scatter": lambda: dist.reduce_scatter_single(part, whole,
                                                                             group=group)}[op]
                points.append((nbytes, _median_seconds(call, warmup=2, repeats=3, calls=5)))
            curves[("*", op, size)] = tuple(points)
    return curves


def fit_costs(model_text: str) -> tuple[float, dict[str, float], float, float, float, float,
                                       dict]:
    """(TFLOP/s per rank, bus GB/s by collective, seconds per hop back to back, a block's
    seconds per micro-batch besides its FLOPs, FSDP's copy GB/s, seconds a hop waits after
    compute besides, the collectives' curves), measured on this rank of 8."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")

    def seconds(op: str, numel: int) -> float:
        """A call's time within back-to-back calls of ``op`` on ``numel`` floats per rank."""
        n = dist.get_world_size()
        t = torch.zeros(numel)
        gathered = torch.zeros(numel * n if op != "all_reduce" else 0)
        return _median_seconds({"all_reduce": lambda: dist.all_reduce(t),
                                "all_gather": lambda: dist.all_gather_single(gathered, t),
                                "reduce_scatter": lambda: dist.reduce_scatter_single(t, gathered)
                                }[op])

    # bus bandwidth of each collective a step makes (on gloo an all-gather moves its bytes
    # several times slower than an all-reduce), from the time more bytes per rank add: 1 and
    # 8 MiB for a rank's part of a gather or of a scatter's input, 1 and 32 MiB for an
    # all-reduce (its time barely grows from 1 to 8 MiB, ~23 to ~30 ms on 8 ranks here, so
    # that difference is the noise's: it gave 0.3 to 1.8 GB/s from run to run); between two
    # small sizes the latency and the noise of 8 ranks on 2 cores swamp the bytes
    n = dist.get_world_size()
    rates = {}
    low = 1 << 18
    for op, wire, high in (("all_reduce", 2 * (n - 1) / n, 1 << 23),
                           ("all_gather", n - 1, 1 << 21),
                           ("reduce_scatter", n - 1, 1 << 21)):  # received per byte of its part
        extra = seconds(op, high) - seconds(op, low)
        rates[op] = wire * 4 * (high - low) / max(extra, 1e-9) / 1e9
    latency, after_compute = latency_in_pairs()
    curves = collective_curves()
    flops, overhead = block_costs(model_text)
    copy = fsdp_copy_bandwidth(model_text)
    dist.destroy_process_group()
    return (flops / 1e12, rates, latency, overhead, copy, max(0.0, after_compute - latency),
            curves)


def time_steps(model_text: str, meshes: list[tuple[dict, str, int, str]], repeats: int
               ) -> list[list[float]]:
    """This rank's time of each repeat of each candidate's step."""
    import os

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from devmesh.layout.schedule import build_schedule
    from devmesh.parallel import loss_parallel
    from devmesh.parallel.pipeline import PipelineRunner
    from devmesh.tools.dry_run import read_config
    from devmesh.tools.dry_run.run import build_rank_model, build_rank_stages

    config = read_config(model_text)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    out = []
    for dims, schedule, microbatches, checkpointing in meshes:
        data = dims.get("dp", 1) * dims.get("shard", 1)
        gen = torch.Generator().manual_seed(rank)
        tokens = torch.randint(0, config.vocab, (config.batch // data, config.seq), generator=gen)
        pp = dims.get("pp", 1)
        if pp > 1:  # the rank's stages: two of a looped or V-shaped schedule
            plan = build_schedule(schedule, pp, microbatches)
            mesh, stages = build_rank_stages(config, dims, plan, "cpu",
                                             checkpointing=checkpointing)
            runner = PipelineRunner(stages, mesh, plan,
                                    lambda y, t: F.cross_entropy(y.flatten(0, 1), t.flatten()))
            last = plan.stages - 1

            def step() -> None:
                runner.step(tokens if 0 in stages else None,
                            tokens if last in stages else None)
        else:
            mesh, model = build_rank_model(config, dims, "cpu", checkpointing=checkpointing)
            syncs = [m for m in (getattr(m, "set_requires_gradient_sync", None)
                                 for m in model.modules()) if m is not None]

            def step() -> None:
                for index, part in enumerate(tokens.chunk(microbatches)):
                    for switch in syncs:
                        switch(index == microbatches - 1)
                    loss = F.cross_entropy(model(part).flatten(0, 1), part.flatten())
                    (loss / microbatches).backward()
        times = []
        for repeat in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            # the head's logits stay split over tp (torchtitan's plan): the loss runs under
            # loss_parallel, as torchtitan's train context does
            with loss_parallel():
                step()
            dist.barrier()
            if repeat:
                times.append(time.perf_counter() - start)
        out.append(times)
    dist.destroy_process_group()
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values: list[float]) -> list[int]:
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0] * len(values)
        for place, index in enumerate(order):
            result[index] = place
        return result

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    if n < 2:  # too few to rank (--candidates 3 holds out one)
        return float("nan")
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--candidates", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--save", help="pickle the candidates and their measured times here")
    args = parser.parse_args()
    from devmesh.launching.launcher import launch
    from devmesh.tools.dry_run import read_config
    from devmesh.tools.dry_run.report import Costs
    from devmesh.tools.dry_run.search import measure, search
    from devmesh.tools.dry_run.search import _evaluate as evaluate

    fitted = launch(fit_costs, 8, args.model, timeout=600)
    tflops = statistics.median(f[0] for f in fitted)
    by_op = {op: statistics.median(f[1][op] for f in fitted) for op in fitted[0][1]}
    busbw = statistics.median(by_op.values())  # messages: between the collectives'
    latency = statistics.median(f[2] for f in fitted)
    overhead = statistics.median(f[3] for f in fitted)
    copy = statistics.median(f[4] for f in fitted)
    wait = statistics.median(f[5] for f in fitted)
    curves = {key: tuple((nbytes, statistics.median(f[6][key][i][1] for f in fitted))
                         for i, (nbytes, _) in enumerate(points))
              for key, points in fitted[0][6].items()}
    # 8 ranks on this machine's cores: a pipeline's idle stage lends its core to the others
    sharing = max(1.0, 8 / (os.cpu_count() or 1))
    measured_ops = {("*", op): rate for op, rate in by_op.items()}
    costs = Costs(tflops, {}, default=busbw, latency=latency, ranks_per_device=sharing,
                  by_collective=measured_ops, block_overhead=overhead, copy_bandwidth=copy,
                  curves=curves, wait=wait)
    rates = ", ".join(f"{op} {rate:.2f}" for op, rate in by_op.items())
    print(f"fitted on 8 ranks here: {tflops * 1e3:.1f} GFLOP/s per rank, bus GB/s {rates}, "
          f"{latency * 1e6:.0f} us per hop back to back and {wait * 1e6:.0f} us more after "
          f"compute, {overhead * 1e3:.1f} ms per block "
          f"and micro-batch besides its FLOPs, FSDP's copies {copy:.2f} GB/s; {sharing:g} "
          "ranks per core")
    config = read_config(args.model)
    start = time.perf_counter()
    result = search(config, 8, costs, verify=0)
    ranked = result.ranked
    step = max(1, len(ranked) // args.candidates)
    chosen = [evaluate(config, e.candidate, measure(config, e.candidate), costs, True)
              for e in ranked[::step][:args.candidates]]
    print(f"{result.considered} candidates; {len(chosen)} spread over the ranking measured by "
          f"the dry run ({time.perf_counter() - start:.0f} s)")
    meshes = [(e.candidate.dims, e.candidate.schedule, e.candidate.microbatches,
               e.candidate.checkpointing) for e in chosen]
    per_rank = launch(time_steps, 8, args.model, meshes, args.repeats, timeout=3600)
    measured = []
    for index in range(len(chosen)):
        steps = [max(rank[index][r] for rank in per_rank) for r in range(args.repeats)]
        measured.append((statistics.median(steps), max(steps) - min(steps)))
    if args.save:
        import pickle

        with open(args.save, "wb") as f:
            pickle.dump({"chosen": chosen, "measured": measured, "costs": costs,
                         "model": args.model}, f)
    print(f"{'candidate':<40}{'predicted':>12}{'measured':>12}{'spread':>10}")
    for e, (median, spread) in sorted(zip(chosen, measured), key=lambda x: x[0].step):
        print(f"{e.candidate.describe():<40}{e.step * 1e3:>10.1f}ms{median * 1e3:>10.1f}ms"
              f"{spread * 1e3:>8.1f}ms")
    clear, agree = agreement([e.step for e in chosen], measured)
    noise = statistics.median(s / m for m, s in measured)
    print(f"noise: a step's spread over {args.repeats} repeats is {noise:.0%} of its median "
          f"(median over candidates)")
    print(f"pairs measured apart beyond the noise: {clear} of "
          f"{len(chosen) * (len(chosen) - 1) // 2}; the search orders {agree} of them as "
          f"measured ({agree / max(clear, 1):.0%})")
    ratios = sorted(m / e.step for e, (m, _) in zip(chosen, measured))
    print(f"measured / predicted: median {statistics.median(ratios):.2f}, "
          f"{ratios[0]:.2f} to {ratios[-1]:.2f}")
    print(f"Spearman's rank correlation, predicted vs measured: "
          f"{spearman([e.step for e in chosen], [m for m, _ in measured]):.2f}")
    variants = {  # the same candidates and measurements, other models of this machine
        "no time per block and micro-batch besides the FLOPs": replace(costs, block_overhead=0.0),
        "FSDP's and DDP's copies free": replace(costs, copy_bandwidth=None),
        "neither": replace(costs, block_overhead=0.0, copy_bandwidth=None),
        "no wait after compute": replace(costs, wait=0.0),
        "bandwidth and latency instead of the measured curves": replace(costs, curves={}),
        "one bandwidth for every collective (their median), no curves":
            replace(costs, by_collective={}, curves={}),
        "each rank its own core": replace(costs, ranks_per_device=1.0),
    }
    for name, other in variants.items():
        steps = [evaluate(config, e.candidate, e.reports, other, True).step for e in chosen]
        clear, agree = agreement(steps, measured)
        print(f"  with {name}: {agree} of {clear} ({agree / max(clear, 1):.0%}), Spearman "
              f"{spearman(steps, [m for m, _ in measured]):.2f}")
    refit(config, chosen, measured, costs)


def agreement(predicted: list[float], measured: list[tuple[float, float]]) -> tuple[int, int]:
    """(pairs whose medians differ by more than the larger spread, of them those the
    prediction orders the same way)."""
    clear = agree = 0
    for i in range(len(predicted)):
        for j in range(i + 1, len(predicted)):
            (mi, si), (mj, sj) = measured[i], measured[j]
            if abs(mi - mj) > max(si, sj):
                clear += 1
                agree += (predicted[i] < predicted[j]) == (mi < mj)
    return clear, agree


def _terms(config, evaluation, costs) -> list[float]:
    """The predicted step's compute, bandwidth, latency, per-block and copy terms (bubble
    included), each for a unit cost: step = sum(term x cost)."""
    from devmesh.tools.dry_run.report import Costs
    from devmesh.tools.dry_run.search import _evaluate

    def step(basis: Costs) -> float:  # the stages combined as the search combines them
        return _evaluate(config, evaluation.candidate, evaluation.reports, basis, True).step

    huge, sharing = 1e30, costs.ranks_per_device
    return [step(Costs(1e-12, {}, default=huge, ranks_per_device=sharing)),  # FLOPs
            step(Costs(huge, {}, default=1e-9, ranks_per_device=sharing)),  # bytes
            step(Costs(huge, {}, default=huge, latency=1.0,
                       ranks_per_device=sharing)),  # hops: x seconds per hop
            step(Costs(huge, {}, default=huge, block_overhead=1.0,
                       ranks_per_device=sharing)),  # blocks x micro-batches
            step(Costs(huge, {}, default=huge, copy_bandwidth=1e-9,
                       ranks_per_device=sharing))]  # bytes FSDP copies


def _rate(weight: float) -> str:
    """A fitted seconds-per-unit weight as units per nanosecond (GFLOP/s, GB/s)."""
    return f"{1 / weight / 1e9:.2f}" if weight else "inf"


def refit(config, chosen, measured, costs) -> None:
    """Each pair apart beyond the noise, ordered by the costs fitted to the other
    candidates' measured steps."""
    import numpy as np
    from scipy.optimize import nnls

    terms = np.array([_terms(config, e, costs) for e in chosen])
    times = np.array([m for m, _ in measured])
    clear = agree = 0
    for a in range(len(chosen)):
        for b in range(a + 1, len(chosen)):
            if abs(times[a] - times[b]) <= max(measured[a][1], measured[b][1]):
                continue
            others = [i for i in range(len(chosen)) if i not in (a, b)]
            weights, _ = nnls(terms[others], times[others])
            clear += 1
            agree += (terms[a] @ weights < terms[b] @ weights) == (times[a] < times[b])
    weights, _ = nnls(terms, times)
    gflops, busbw = _rate(weights[0]), _rate(weights[1])  # the terms: FLOPs, bytes
    print(f"costs fitted to every candidate's measured step: {gflops} GFLOP/s, bus {busbw} "
          f"GB/s, {weights[2] * 1e6:.0f} us per hop, {weights[3] * 1e3:.1f} ms per block and "
          f"micro-batch, copies {_rate(weights[4])} GB/s; fitted to the others for each pair "
          f"apart beyond the noise, {agree} of {clear} pairs ordered as measured "
          f"({agree / max(clear, 1):.0%})")


if __name__ == "__main__":
    main()
