"""Pipeline step time: devmesh's schedules vs torch.distributed.pipelining, and the measured
bubble vs the one the schedule predicts.

Same model (16 blocks of Linear(512, 512) -> ReLU, and a Linear head), same split (balanced
by parameter count), same schedule, 4 pipeline ranks over gloo (``--ranks``), 8 micro-batches
of 64, SGD; GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble (2 stages per rank),
zero-bubble V and DualPipeV (2 stages per rank in a V: torch's ``ScheduleZBVZeroBubble`` and
``ScheduleDualPipeV``) run by both, zero-bubble (ZB-H1, one stage per rank) by devmesh only
(torch has no such schedule). Prints the slowest rank's median step time, the ratio devmesh /
torch, the measured bubble (1 - compute time summed over ranks / (ranks x schedule time)) of devmesh and of torch (its stages' forward,
loss and backward timed as devmesh's runner times its own: the same machine's message costs
land in both), and next to devmesh's the schedule's prediction: "predicted" simulates the
schedule with the median measured cost of each action kind (as if every stage cost the
same), "replayed" with every action's own measured compute and the measured message time (a
ping-pong of one activation between ranks 0 and 1 before the run), "+runner" also charging each action its rank's measured runner time per action
(the step less compute, message waits and the end-of-step check: starting sends, posting
receives, the runner's Python). "+runner" against "measured" checks the schedule's model of
time; "predicted" against "+runner" shows what the per-message costs of this machine add.

    .venv/bin/python bench/pipeline.py [--steps 8] [--rounds 3] [--ranks 4] [--depth 16]
                                       [--default-malloc] [--schedules 1f1b,zbv-zero-bubble]
    .venv/bin/python bench/pipeline.py --breakdown [--ranks 2] [--depth 16]
    .venv/bin/python bench/pipeline.py --posting --ranks 2 --depth 64 --rounds 9 --steps 6

``--depth`` sets the number of blocks (default 16): each message between stages stays one
micro-batch's 64 x 512 activation while the compute per stage grows with it, so deeper
models show how much of the measured bubble is the per-message cost of gloo on this machine
rather than the schedule (on a GPU a stage computes for milliseconds per micro-batch while
an activation crosses NVLink in microseconds: the deep end is the realistic one).

``--posting`` runs interleaved 1F1B with devmesh's receives posted as on gloo and as on
NCCL, each round beside torch's: whether the posting order costs step time here.

``--breakdown`` runs devmesh's schedules only and splits each rank's step time into compute,
waiting for a message, sending, posting receives ahead, the end-of-step failure check and
the rest (the runner's own Python), with timers around the runner's message calls; and how
long one ``batch_isend_irecv`` call takes in a step (median and slowest) against the same
call with the ranks idle — gloo's threads share the cores with the ranks' compute.

With 4 ranks on a 2-core machine the ranks time-share the cores, so idle and compute time
blur; ``--ranks 2`` gives each rank a core and is the fair check of the predicted bubble.

glibc's malloc: by default the bench runs both libraries with glibc's thresholds for returning
memory to the system raised (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, set in the
environment the ranks inherit; ``--default-malloc`` leaves them alone). With the defaults, a
schedule that keeps more activations alive at once (zero-bubble keeps each micro-batch's graph
from ``I`` to ``W``) has its freed memory handed back and faulted in again, which slowed every
action of zero-bubble by 10-25 % here (forward included) and 1F1B not measurably; on a GPU
torch's caching allocator keeps freed blocks, and on CPU PyTorch's tuning guide recommends
jemalloc or tcmalloc for the same reason. The bench measures schedules, not glibc.

Each round launches devmesh's run and torch's run one after the other; the printed time is
the median over rounds (4 ranks share this machine's cores, so one run alone is noisy).
"ratio" is the median over rounds of each round's devmesh / torch (a round's two runs are back
to back, so the machine's speed drifting between rounds cancels): the whole training step
(schedule + optimizer step); "schedule only" the same ratio for the pipeline schedule alone
(``runner.step`` / ``schedule.step``), since on 2 cores the optimizer steps of ranks that
finish together contend for the CPU (devmesh's end-of-step failure check makes the ranks
finish together; on separate devices they would not contend).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

MICRO, BATCH = 8, 512


def build_model(depth: int = 16):
    import torch
    from torch import nn

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(depth)]
    return nn.Sequential(*blocks, nn.Linear(512, 10))


SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "interleaved-zero-bubble",
                  "zbv-zero-bubble", "dualpipe-v")
# the rest: one stage per rank
TWO_PER_RANK = ("interleaved-1f1b", "interleaved-zero-bubble", "zbv-zero-bubble", "dualpipe-v")


def my_stages(name: str, ranks: int, me: int) -> tuple[int, list[int]]:
    """Stages per rank, and this rank's stages (round the ranks, or in a V for
    zero-bubble V and DualPipeV), as devmesh's schedule places them."""
    from devmesh.layout.schedule import build_schedule

    virtual = 2 if name in TWO_PER_RANK else 1
    plan = build_schedule(name, ranks, MICRO, virtual)
    return virtual, [s for s in range(plan.stages) if plan.rank_of(s) == me]


def run(library: str, name: str, steps: int, ranks: int, depth: int = 16,
        posting: str | None = None):
    import logging

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    from devmesh import init_device_mesh
    from devmesh.layout.schedule import build_schedule
    from devmesh.parallel.pipeline import PipelineRunner, split_sequential

    mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=("pp",))
    me = mesh.get_coordinate()[0]
    virtual, mine = my_stages(name, ranks, me)
    stages_total = ranks * virtual
    parts = split_sequential(build_model(depth), stages_total)
    params = [p for s in mine for p in parts[s].parameters()]
    opt = torch.optim.SGD(params, lr=0.01)
    first, last = 0 in mine, stages_total - 1 in mine
    if library == "torch":
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import (
            Schedule1F1B,
            ScheduleDualPipeV,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
            ScheduleZBVZeroBubble,
        )

        stages = [PipelineStage(parts[s], s, stages_total, torch.device("cpu"),
                                group=mesh.get_group("pp")) for s in mine]
        if virtual > 1:
            kind = {"interleaved-1f1b": ScheduleInterleaved1F1B,
                    "interleaved-zero-bubble": ScheduleInterleavedZeroBubble,
                    "zbv-zero-bubble": ScheduleZBVZeroBubble,
                    "dualpipe-v": ScheduleDualPipeV}[name]
            schedule = kind(stages, MICRO, loss_fn=F.cross_entropy)
        else:
            kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
            schedule = kind(stages[0], MICRO, loss_fn=F.cross_entropy)

        torch_compute = _time_torch_compute(stages, schedule)

        def step(x, y):
            if first and last:  # in a V rank 0 holds the first and last stage
                schedule.step(x, target=y)
            elif first:
                schedule.step(x)
            elif last:
                schedule.step(target=y)
            else:
                schedule.step()
    else:
        plan = build_schedule(name, ranks, MICRO, virtual)
        runner = PipelineRunner({s: parts[s] for s in mine}, mesh, plan, F.cross_entropy)
        if posting is not None:  # "ahead" (gloo's default) or "fused" (NCCL's, on gloo)
            runner._links.policy = posting

        def step(x, y):
            runner.step(x if first else None, y if last else None)

        torch_compute = None
    latency = _message_latency(mesh) if library == "devmesh" else 0.0
    spent = _install_timers() if library == "devmesh" else {}
    times, schedule_times, computes, overheads = [], [], [], []
    for i in range(steps + 2):
        gen = torch.Generator().manual_seed(i)
        x, y = torch.randn(BATCH, 512, generator=gen), torch.randint(0, 10, (BATCH,),
                                                                     generator=gen)
        dist.barrier()
        if spent:
            spent.clear()
        if torch_compute is not None:
            torch_compute.clear()
        start = time.perf_counter()
        step(x, y)
        scheduled = time.perf_counter() - start
        opt.step()
        opt.zero_grad()
        elapsed = torch.tensor([time.perf_counter() - start, scheduled])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= 2:
            times.append(elapsed[0].item())
            schedule_times.append(elapsed[1].item())
            if torch_compute is not None:
                computes.append(sum(torch_compute))
            if library == "devmesh":
                computes.append(dict(runner.compute_seconds))
                # this rank's own work that is neither compute nor blocked on a message or
                # on the end-of-step check: the runner's Python and the sends it starts
                overheads.append(scheduled - sum(runner.compute_seconds.values())
                                 - spent["wait"] - spent["check"])
    result = {"time": statistics.median(times), "schedule": statistics.median(schedule_times),
              "latency": latency}
    if library == "torch":
        result["compute"] = statistics.median(computes)
    if library == "devmesh":
        result["compute"] = statistics.median(sum(c.values()) for c in computes)
        by_kind: dict[str, list[float]] = {}
        for c in computes:
            for action, seconds in c.items():
                by_kind.setdefault(action.kind, []).append(seconds)
        result["costs"] = {k: statistics.median(v) for k, v in by_kind.items()}
        result["actions"] = {a: statistics.median(c[a] for c in computes) for a in computes[0]}
        result["overhead"] = statistics.median(overheads) / len(computes[0])  # per action
    return result


def _idle_share(ranks_results: list[dict]) -> float:
    """The measured bubble of one run: 1 - compute summed over ranks / (ranks x the
    slowest rank's schedule time)."""
    return 1 - (sum(r["compute"] for r in ranks_results)
                / (len(ranks_results) * ranks_results[0]["schedule"]))


def _time_torch_compute(stages, schedule) -> list[float]:
    """Time torch's compute as devmesh's runner times its own (a stage's forward with the
    loss, its backward; messages excluded): the returned list gets each call's seconds."""
    spent: list[float] = []
    for stage in stages:
        _time_calls(stage, "forward_one_chunk", spent.append)
        _time_calls(stage, "backward_one_chunk", spent.append)
        _time_calls(stage, "backward_weight_one_chunk", spent.append)  # zero-bubble V's W
    _time_calls(schedule, "_maybe_compute_loss", spent.append)
    return spent


def _time_calls(owner, attr: str, record) -> None:
    """Replace ``owner.attr`` by a wrapper that calls ``record(seconds)`` after each call."""
    inner = getattr(owner, attr)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            record(time.perf_counter() - start)
    setattr(owner, attr, wrapper)


def _message_latency(mesh, rounds: int = 20) -> float:
    """One activation's one-way time between pipeline ranks 0 and 1 (median of ping-pongs
    with torch's send / recv), for the predicted bubble; 0 on the other ranks."""
    import torch
    import torch.distributed as dist

    me, group = mesh.get_coordinate()[0], mesh.get_group("pp")
    peer = dist.get_global_rank(group, 1 - me) if me < 2 else None
    message = torch.zeros(BATCH // MICRO, 512)
    trips = []
    for _ in range(rounds if peer is not None else 0):
        start = time.perf_counter()
        first, second = (dist.send, dist.recv) if me == 0 else (dist.recv, dist.send)
        first(message, peer, group=group)
        second(message, peer, group=group)
        trips.append(time.perf_counter() - start)
    dist.barrier()
    return statistics.median(trips) / 2 if trips else 0.0


_TIMED = {"recv_activation": "wait", "recv_gradient": "wait", "send_activation": "send",
          "send_gradient": "send", "wait_sends": "send", "advance": "post",
          "_raise_if_any_stage_failed": "check"}


def _install_timers():
    """Time the runner's message calls (:data:`_TIMED`) in this process: the returned
    counter sums the seconds per part until cleared."""
    import collections

    from devmesh.parallel.pipeline import PipelineRunner
    from devmesh.parallel.pipeline.messages import StageLinks

    spent: collections.Counter = collections.Counter()

    def adder(part: str):
        def add(seconds: float) -> None:
            spent[part] += seconds
        return add

    for attr, part in _TIMED.items():
        _time_calls(PipelineRunner if attr.startswith("_") else StageLinks, attr, adder(part))
    return spent


def breakdown(name: str, steps: int, ranks: int, depth: int = 16) -> dict[str, float]:
    """One rank's median step split by where the time went (see the module's doc)."""
    import logging

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    from devmesh import init_device_mesh
    from devmesh.layout.schedule import build_schedule
    from devmesh.parallel.pipeline import PipelineRunner, split_sequential

    spent = _install_timers()
    mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=("pp",))
    me = mesh.get_coordinate()[0]
    calls = _time_p2p_calls()
    alone = _p2p_call_alone(mesh, calls)
    virtual, mine = my_stages(name, ranks, me)
    parts = split_sequential(build_model(depth), ranks * virtual)
    runner = PipelineRunner({s: parts[s] for s in mine}, mesh,
                            build_schedule(name, ranks, MICRO, virtual), F.cross_entropy)
    rows = []
    for i in range(steps + 2):
        gen = torch.Generator().manual_seed(i)
        x, y = torch.randn(BATCH, 512, generator=gen), torch.randint(0, 10, (BATCH,),
                                                                     generator=gen)
        spent.clear()
        dist.barrier()
        calls.clear()
        start = time.perf_counter()
        runner.step(x if 0 in mine else None, y if ranks * virtual - 1 in mine else None)
        row = {"step": time.perf_counter() - start,
               "compute": sum(runner.compute_seconds.values()), **spent}
        row["other"] = row["step"] - sum(v for k, v in row.items() if k != "step")
        row["call"], row["slowest"] = statistics.median(calls), max(calls)
        rows.append(row)
    result = {k: statistics.median(r.get(k, 0.0) for r in rows[2:]) for k in rows[-1]}
    return {**result, "alone": alone}


def _time_p2p_calls() -> list[float]:
    """Record how long each ``batch_isend_irecv`` call (posting, not waiting) takes in this
    process; the returned list fills until cleared."""
    import torch.distributed as dist

    calls: list[float] = []
    _time_calls(dist, "batch_isend_irecv", calls.append)
    return calls


def _p2p_call_alone(mesh, calls: list[float], rounds: int = 50) -> float:
    """The median posting time of one activation's send and receive in one batch, with the
    ranks doing nothing else (rank ``r`` pairs with ``r ^ 1``): what a call costs when no
    compute competes with gloo's threads for the cores."""
    import torch
    import torch.distributed as dist

    me, group = mesh.get_coordinate()[0], mesh.get_group("pp")
    peer = me ^ 1
    if peer >= mesh.size():
        dist.barrier()
        return 0.0
    message, into = torch.zeros(BATCH // MICRO, 512), torch.empty(BATCH // MICRO, 512)
    calls.clear()
    for _ in range(rounds):
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, message, dist.get_global_rank(group, peer), group),
            dist.P2POp(dist.irecv, into, dist.get_global_rank(group, peer), group)])
        for work in works:
            work.wait()
    dist.barrier()
    return statistics.median(calls)


def print_breakdown(steps: int, ranks: int, depth: int,
                    names: tuple[str, ...] = SCHEDULE_NAMES) -> None:
    from devmesh.launching.launcher import launch

    columns = ("step", "compute", "wait", "send", "post", "check", "other", "call",
               "slowest")
    print(f"{ranks} pipeline ranks, devmesh only, median of {steps} steps, ms per step")
    print(f"{'schedule':<24}{'rank':>5}" + "".join(f"{c:>9}" for c in columns))
    alone = []
    for name in names:
        for rank, row in enumerate(launch(breakdown, ranks, name, steps, ranks, depth,
                                                   timeout=1800)):
            alone.append(row["alone"])
            print(f"{name:<24}{rank:>5}" + "".join(f"{row.get(c, 0.0) * 1e3:>9.2f}"
                                                   for c in columns))
    print(f"call: the median time to post one batch of messages (batch_isend_irecv) in a "
          f"step; slowest: the step's\nslowest such call; the same call with the ranks idle: "
          f"{statistics.median(a for a in alone if a) * 1e3:.2f} ms (a send and a receive "
          "of one activation)")
    print("wait: blocked in a receive; send: packing sends and waiting for them at the end; "
          "post: starting an\naction's sends and the next actions' receives (one batch); check: the end-of-step failure check "
          "(waits for the slowest rank);\nother: the runner's own Python around them")


def print_posting(steps: int, rounds: int, ranks: int, depth: int) -> None:
    """Interleaved 1F1B with gloo's receive posting ("ahead": the next two actions'
    receives) and with NCCL's ("fused": each receive with the last send before it, some
    moved earlier by the timing placement), each round beside torch's, back to back."""
    from devmesh.launching.launcher import launch

    name = "interleaved-1f1b"
    runs: dict[str, list[list[dict]]] = {"ahead": [], "fused": [], "torch": []}
    for _ in range(rounds):
        for kind, results in runs.items():
            library = "torch" if kind == "torch" else "devmesh"
            results.append(launch(run, ranks, library, name, steps, ranks, depth,
                                  None if kind == "torch" else kind, timeout=1800))
    print(f"{name} on {ranks} ranks, {depth} blocks: schedule time per round (ms), "
          "bubble, and devmesh / torch per round")
    for kind, results in runs.items():
        times = [r[0]["schedule"] * 1e3 for r in results]
        line = (f"{kind:<6} median {statistics.median(times):7.1f} ms  rounds "
                + " ".join(f"{t:6.1f}" for t in times)
                + f"  bubble {statistics.median(map(_idle_share, results)):.1%}")
        if kind != "torch":
            ratios = [r[0]["schedule"] / t[0]["schedule"] for r, t in zip(results,
                                                                          runs["torch"])]
            line += (f"  / torch median {statistics.median(ratios):.3f} (range "
                     f"{min(ratios):.2f}-{max(ratios):.2f})")
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=4,
                        help="pipeline ranks (stages); 2 gives each rank a core of its own here")
    parser.add_argument("--depth", type=int, default=16,
                        help="Linear(512, 512) blocks in the model: more compute per message")
    parser.add_argument("--schedules", default=",".join(SCHEDULE_NAMES),
                        help="comma-separated, of " + ", ".join(SCHEDULE_NAMES))
    parser.add_argument("--breakdown", action="store_true",
                        help="devmesh only: where each rank's step time goes")
    parser.add_argument("--posting", action="store_true",
                        help="interleaved only: gloo's receive posting against NCCL's, each "
                             "beside torch")
    parser.add_argument("--default-malloc", action="store_true",
                        help="keep glibc malloc's default thresholds (see the module's doc)")
    args = parser.parse_args()
    names = [n for n in args.schedules.split(",") if n]
    unknown = sorted(set(names) - set(SCHEDULE_NAMES))
    if unknown:
        parser.error(f"unknown schedules {unknown}: choose from {', '.join(SCHEDULE_NAMES)}")
    if not args.default_malloc:  # read by glibc at process start: the ranks inherit it
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 << 20))
        os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(256 << 20))
    if args.posting:
        print_posting(args.steps, args.rounds, args.ranks, args.depth)
        return
    if args.breakdown:
        print_breakdown(args.steps, args.ranks, args.depth, tuple(names))
        return
    from devmesh.launching.launcher import launch
    from devmesh.layout.schedule import build_schedule

    ranks = args.ranks
    print(f"{ranks} pipeline ranks (gloo), {args.depth} blocks, {MICRO} micro-batches of {BATCH // MICRO}, "
          f"median over {args.rounds} rounds of the slowest rank's median of {args.steps} "
          "steps; glibc malloc " + ("defaults" if args.default_malloc else
                                    "keeping freed memory (see --default-malloc)"))
    print(f"{'schedule':<24}{'devmesh':>10}{'torch':>10}{'ratio':>8}{'schedule only':>15}"
          f"{'bubble measured':>18}{'predicted':>11}{'replayed':>10}{'+runner':>10}"
          f"{'torch measured':>16}")
    latencies = []
    for name in names:
        rounds, theirs = [], []
        for _ in range(args.rounds):  # alternate, so that load changes hit both alike
            rounds.append(launch(run, ranks, "devmesh", name, args.steps, ranks, args.depth,
                                 timeout=1800))
            if name != "zero-bubble":  # torch's has no ZB-H1 with one stage per rank
                theirs.append(launch(run, ranks, "torch", name, args.steps, ranks, args.depth,
                                     timeout=1800))
        ours = sorted(rounds, key=lambda r: r[0]["time"])[len(rounds) // 2]  # median round
        step = ours[0]["time"]
        # idle share of the schedule itself (the optimizer step is outside the pipeline),
        # the median over rounds
        measured = statistics.median(map(_idle_share, rounds))
        # the same schedule with the costs each kind measured (median over ranks)
        costs = {k: statistics.median(r["costs"][k] for r in ours if k in r["costs"])
                 for k in ours[0]["costs"]}
        for r in ours:  # ranks without an action kind still need a cost for it
            costs.update({k: v for k, v in r["costs"].items() if k not in costs})
        virtual = 2 if name in TWO_PER_RANK else 1
        plan = build_schedule(name, ranks, MICRO, virtual)
        predicted = plan.bubble(costs)
        each_action = {a: t for r in ours for a, t in r["actions"].items()}
        replayed = plan.bubble(each_action, ours[0]["latency"])
        # the same with each action also taking its rank's runner overhead per action: the
        # ranks' compute over the schedule's simulated length
        with_runner = {a: t + r["overhead"] for r in ours for a, t in r["actions"].items()}
        makespan = max(t.end for t in plan.simulate(with_runner, ours[0]["latency"]))
        runner_replayed = 1 - sum(each_action.values()) / (ranks * makespan)
        latencies.append(ours[0]["latency"])
        torch_time = statistics.median(t[0]["time"] for t in theirs) if theirs else None
        torch_text = f"{torch_time * 1e3:>8.1f}ms" if theirs else f"{'-':>10}"

        def paired(key: str) -> float:  # each round's pair ran back to back: drift cancels
            return statistics.median(r[0][key] / t[0][key] for r, t in zip(rounds, theirs))
        ratio = f"{paired('time'):>8.2f}" if theirs else f"{'-':>8}"
        only = f"{paired('schedule'):>15.2f}" if theirs else f"{'-':>15}"
        torch_idle = (f"{statistics.median(map(_idle_share, theirs)):>16.1%}" if theirs
                      else f"{'-':>16}")
        print(f"{name:<24}{step * 1e3:>8.1f}ms{torch_text}{ratio}{only}{measured:>18.1%}"
              f"{predicted:>11.1%}{replayed:>10.1%}{runner_replayed:>10.1%}{torch_idle}")
    print("predicted: the schedule simulated with the median compute per action kind (stages "
          "alike);\nreplayed: with each action's own measured compute (stages as they are) "
          "and each message between\nranks taking the measured ping-pong time "
          f"({statistics.median(latencies) * 1e3:.2f} ms one way); +runner: also each action "
          "taking its rank's\nmeasured runner time per action (sends, posting receives, "
          "Python: the step less compute,\nwaits and the end check); torch measured: the "
          "same measured bubble of torch's schedule (its stages'\nforward, loss and backward "
          "timed alike)")

if __name__ == "__main__":
    main()
