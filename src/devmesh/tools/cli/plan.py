"""``devmesh plan``: a mesh for a cluster with estimated traffic, a pipeline schedule (its
messages, its per-rank programs), a dry run of a model on a mesh, or a search for the best mesh.
No process is started."""

from __future__ import annotations

import argparse
import math
import os
import sys

from devmesh.layout.data_parallel import MIN_TOKENS_PER_CP_RANK


def add(sub) -> None:
    """``devmesh plan``: a mesh for a cluster, with estimated traffic."""
    plan = sub.add_parser("plan", help="choose and check a mesh for a cluster, with estimated "
                                       "traffic per dim (no processes)")
    plan.add_argument("--hosts", type=int, default=None, help="required for a cluster plan")
    plan.add_argument("--devices-per-host", type=int, default=None,
                      help="required for a cluster plan")
    for name, default, text in (("dp", 1, "replicas (DDP, or HSDP's replicate dim)"),
                                ("tp", 1, "tensor parallel"), ("pp", 1, "pipeline stages"),
                                ("cp", 1, "context parallel"),
                                ("ep", 1, "expert parallel (splits shard's ranks)")):
        plan.add_argument(f"--{name}", type=int, default=default, help=text)
    plan.add_argument("--shard", "--fsdp", type=int, default=None,
                      help="FSDP shard degree (default: the devices left over)")
    plan.add_argument("--params", type=float, default=None, help="model parameters, e.g. 7e9")
    plan.add_argument("--hidden", type=int, default=None)
    plan.add_argument("--seq", type=int, default=None)
    plan.add_argument("--batch", type=int, default=None, help="global batch, in sequences")
    plan.add_argument("--top-k", type=int, default=2, help="experts per token, with --ep")
    plan.add_argument("--layers", type=int, default=None)
    plan.add_argument("--sbatch", default=None, metavar="FILE",
                      help="with --hosts: also write a Slurm batch script running the plan "
                           "(srun devmesh run, one task per node)")
    plan.add_argument("--train", default="",
                      help="with --sbatch: the training command, e.g. 'train.py --steps 100'")
    plan.add_argument("--time", default="01:00:00", help="with --sbatch: the job's time limit")
    plan.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                      help="with --sbatch: GPUs per node (cuda, --gpus-per-node) or CPU ranks "
                           "(cpu: no GPUs asked for)")
    plan.add_argument("--no-agent", action="store_true",
                      help="with --sbatch: one Slurm task per rank (srun devmesh run "
                           "--no-agent), not one devmesh run per node starting the node's ranks")
    plan.add_argument("--max-restarts", type=int, default=0,
                      help="with --sbatch: devmesh run's restarts after a failure (the "
                           "script also asks Slurm to requeue the job)")
    plan.add_argument("--schedule", default=None,
                      help="instead: print a pipeline schedule for --pp ranks (gpipe, 1f1b, "
                           "interleaved-1f1b, looped-bfs, zero-bubble, interleaved-zero-bubble, "
                           "zbv-zero-bubble, dualpipe-v) with its bubble, or check one written in a file "
                           "(one 'rank R: F0@0 B0@0 ...' line per rank, as printed); with "
                           "--model: the schedule the dry run plays (default 1f1b)")
    plan.add_argument("--microbatches", type=int, default=None,
                      help="micro-batches per step (with --schedule; default 2 x --pp)")
    plan.add_argument("--virtual", type=int, default=2,
                      help="stages per rank for interleaved-1f1b, looped-bfs and "
                           "interleaved-zero-bubble")
    plan.add_argument("--png", default=None, help="with --schedule: draw its timeline")
    plan.add_argument("--messages", choices=("gloo", "nccl"), default=None,
                      help="with --schedule: the batches of sends and receives each rank "
                           "starts on that backend, and for nccl whether it can deadlock")
    plan.add_argument("--program", choices=("gloo", "nccl"), default=None,
                      help="with --schedule: each rank's step as the runner plays it on that "
                           "backend (computes, the posts of messages between them, where each "
                           "stage's gradients are reduced), checked (--rank R: one rank's)")
    dry = plan.add_argument_group(
        "dry run of a model (one process, no devices: meta tensors, torch's fake process group)")
    dry.add_argument("--model", default=None,
                     help="a transformer: a preset (llama3-8b, llama3-70b, llama3-405b, tiny), "
                          "a JSON file of its fields, or PRESET:key=value,... (e.g. "
                          "llama3-8b:seq=4096,batch=512)")
    dry.add_argument("--mesh", default=None,
                     help="with --model: the mesh, outer to inner, e.g. pp=4,dp=32,tp=8 "
                          "(dp replicates; shard (or fsdp) shards; both: HSDP; cp: context "
                          "parallelism, ring attention)")
    dry.add_argument("--rank", type=int, default=None,
                     help="with --model: this rank only (default: one rank per pipeline stage)")
    dry.add_argument("--device-memory", default=None,
                     help="with --model: say whether each rank fits, e.g. 80GB or 80GiB")
    dry.add_argument("--allowance", default=None,
                     help="with --model: what a device holds besides the step's measured "
                          "peak: cache=PERCENT%% (the caching allocator's reserve over it; "
                          "default 20%%) and context=SIZE (outside torch's allocator: CUDA "
                          "context, NCCL buffers; default 0), e.g. cache=10%%,context=1GiB, "
                          "or none")
    dry.add_argument("--tflops", type=float, default=None,
                     help="with --model: the device's dense throughput, for a predicted step "
                          "time")
    dry.add_argument("--bandwidth", default=None,
                     help="with --tflops: bus bandwidth in GB/s, one number or per dims "
                          "(tp=300,dp=25)")
    dry.add_argument("--costs", default=None,
                     help="with --tflops: collectives measured by devmesh bench --json "
                          "(per mesh dims and collective: the time at each size measured, "
                          "the best bandwidth)")
    dry.add_argument("--latency", default=None,
                     help="with --tflops: what each hop costs besides its bytes, e.g. 20us "
                          "(a pipeline message is one hop, a collective over n ranks n-1)")
    dry.add_argument("--wait", default=None,
                     help="with --tflops: what each hop of a collective or message waits "
                          "besides, for peers arriving from compute at different moments, "
                          "e.g. 1ms where ranks share cores (default 0)")
    dry.add_argument("--block-overhead", default=None,
                     help="with --tflops: one block's forward and backward time on a "
                          "micro-batch besides its FLOPs (its operations' launches), e.g. "
                          "50us; paid per block and micro-batch")
    dry.add_argument("--copy-bandwidth", type=float, default=None,
                     help="with --tflops: GB/s at which a rank copies the bytes of its "
                          "data-parallel collectives besides sending them: FSDP's "
                          "all-gathers and reduce-scatters out of or into their flat buffer, "
                          "DDP's gradients into their bucket and back (default: free)")
    dry.add_argument("--ranks-per-device", type=float, default=1.0,
                     help="with --tflops: ranks sharing one device (8 CPU ranks on 2 cores: "
                          "4, --tflops then a rank's throughput while all compute); a "
                          "pipeline's idle ranks lend it to the busy ones")
    dry.add_argument("--activation-checkpointing", default="none", type=_checkpointing,
                     metavar="MODE",
                     help="with --model: the blocks' activation checkpointing, torchtitan's "
                          "modes: none, full, selective (keep matmuls' and attention's "
                          "outputs, recompute the rest) or K (every K-th block in full)")
    dry.add_argument("--replica-groups", type=int, default=None, metavar="G",
                     help="with --model --mesh: the mesh is one of G replica groups (devmesh "
                          "run --replica-groups G; --model's batch is one group's): add each "
                          "step's quorum, 4 round trips to the coordinator's store (priced at "
                          "--latency) and one all-reduce of each rank's gradients over the "
                          "groups (labelled replicas: --bandwidth replicas=...)")
    dry.add_argument("--json", action="store_true",
                     help="with --model --mesh (or --search): print every number of the "
                          "report (or the ranking) as JSON instead of text")
    dry.add_argument("--world", type=int, default=None,
                     help="with --model --search: the number of ranks to choose a mesh for")
    dry.add_argument("--search", action="store_true",
                     help="with --model --world: rank every mesh, schedule and micro-batch "
                          "count by predicted step time (needs --tflops and --bandwidth or "
                          "--costs); drops those over --device-memory; tp at most "
                          "--devices-per-host (default 8); cp where each rank keeps "
                          f"{MIN_TOKENS_PER_CP_RANK:,} tokens of a sequence or more")
    dry.add_argument("--top", type=int, default=5, help="with --search: candidates printed")
    dry.add_argument("--verify", type=int, default=5,
                     help="with --search: measure by the dry run down the closed form's "
                          "order until this many fit (at most 4 x as many), then up to this "
                          "many estimated a little too big that would beat them; rank them "
                          "again (0: none measured)")
    plan.set_defaults(handler=run)


def _checkpointing(text: str) -> str | int:
    """``--activation-checkpointing``: a mode's name, or K (every K-th block)."""
    return int(text) if text.isdigit() else text


def run(args: argparse.Namespace) -> int:
    from devmesh.tools.cluster_plan import ModelSize, plan_cluster

    if args.model is not None:
        return _cmd_dry_run(args)
    if args.schedule is not None:
        return _cmd_schedule(args)
    missing = [f"--{n.replace('_', '-')}" for n in ("hosts", "devices_per_host")
               if getattr(args, n) is None]
    if missing:
        print(f"devmesh plan: error: a cluster plan needs {' and '.join(missing)} (or use "
              "--schedule NAME --pp N for a pipeline schedule)", file=sys.stderr)
        return 2

    model = None
    if args.params is not None:
        missing = [n for n in ("hidden", "seq", "batch") if getattr(args, n) is None]
        if missing:
            print(f"devmesh plan: error: --params needs --{', --'.join(missing)} too",
                  file=sys.stderr)
            return 2
        model = ModelSize(args.params, args.hidden, args.seq, args.batch, args.layers,
                          top_k=args.top_k)
    plan = plan_cluster(args.hosts, args.devices_per_host, dp=args.dp, shard=args.shard,
                        tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, model=model)
    print(plan)
    if args.no_agent and args.sbatch is None:
        print("devmesh plan: error: --no-agent shapes the --sbatch script: give --sbatch FILE",
              file=sys.stderr)
        return 2
    if args.sbatch is not None:
        from devmesh.tools.sbatch import sbatch_script, write_sbatch

        try:
            text = sbatch_script(plan, args.train, time=args.time,
                                 max_restarts=args.max_restarts, device=args.device,
                                 task_per_rank=args.no_agent)
        except ValueError as exc:
            print(f"devmesh plan: error: {exc}", file=sys.stderr)
            return 2
        write_sbatch(args.sbatch, text)
        print(f"wrote {args.sbatch}: sbatch {args.sbatch}")
    return 0 if plan.ok else 1


def _cmd_schedule(args: argparse.Namespace) -> int:
    from devmesh.layout.schedule import SCHEDULES, ScheduleError, build_schedule, parse_schedule

    microbatches = args.microbatches if args.microbatches is not None else 2 * args.pp
    try:
        if args.schedule not in SCHEDULES and os.path.isfile(args.schedule):
            try:
                with open(args.schedule, encoding="utf-8") as file:  # text, never unpickled
                    text = file.read()
            except (OSError, UnicodeDecodeError) as exc:
                raise ScheduleError(f"cannot read {args.schedule} as text: {exc}") from None
            schedule = parse_schedule(text)
            if args.pp not in (1, schedule.ranks):
                raise ScheduleError(f"--pp {args.pp}, but {args.schedule} lists "
                                    f"{schedule.ranks} ranks")
        else:
            schedule = build_schedule(args.schedule, args.pp, microbatches, args.virtual)
        bubble = schedule.bubble()
        if args.program and args.rank is not None and not 0 <= args.rank < schedule.ranks:
            raise ScheduleError(f"--rank {args.rank}, but the schedule has {schedule.ranks} "
                                f"ranks (0 to {schedule.ranks - 1})")
    except ScheduleError as exc:
        print(f"devmesh plan: error: {exc}", file=sys.stderr)
        return 2
    print(schedule)
    print(f"bubble: {bubble:.1%} of rank-time idle (forward = 1, backward = 2, or 1 + 1 when "
          "split into input and weight gradients)")
    if args.messages:
        from devmesh.layout.pipeline_messages import message_plan

        print(message_plan(schedule, args.messages))
    if args.program:
        from devmesh.layout.pipeline_program import format_programs

        print(format_programs(schedule, args.program, args.rank))
    if args.png:
        from devmesh.pictures.schedule_png import draw_schedule

        draw_schedule(schedule, args.png)
        print(f"wrote {args.png}")
    return 0



def _cmd_dry_run(args: argparse.Namespace) -> int:
    """``devmesh plan --model CONFIG --mesh ...``: one rank per role measured in this
    process (devmesh.tools.dry_run)."""
    from devmesh.errors import DryRunError
    from devmesh.tools.dry_run import parse_mesh, ranks_to_report, read_config
    from devmesh.tools.dry_run.run import add_replica_groups, dry_run_by_blocks
    import json

    from devmesh.tools.dry_run.report import (format_reports, parse_allowance, parse_bytes,
                                              read_costs, reports_as_json)

    if args.search or (args.world is not None and args.mesh is None):
        return _cmd_search(args)
    try:
        if args.mesh is None:
            raise DryRunError("--model needs --mesh, e.g. --mesh pp=4,dp=32,tp=8 (or --world "
                              "N --search to choose one)")
        config = read_config(args.model)
        dims = parse_mesh(args.mesh)
        size = math.prod(dims.values())
        if args.world is not None and args.world != size:
            raise DryRunError(
                f"the mesh {args.mesh} is {size} ranks, the world {args.world}: give a mesh "
                f"of {args.world} ranks, drop --world to dry-run the mesh as it is, or "
                "--search (without --mesh) to choose one")
        schedule = args.schedule or "1f1b"
        pp = dims.get("pp", 1)
        microbatches = args.microbatches or (2 * pp if pp > 1 else 1)
        costs = read_costs(args.tflops, args.bandwidth, args.costs, args.latency,
                           args.ranks_per_device, args.block_overhead, args.copy_bandwidth,
                           args.wait)
        memory = parse_bytes(args.device_memory) if args.device_memory else None
        allowance = parse_allowance(args.allowance)
        ranks = [args.rank] if args.rank is not None else ranks_to_report(dims)
        # a long stage measured from runs of a few of its blocks: the same report, sooner
        reports = [dry_run_by_blocks(config, dims, rank=rank, schedule=schedule,
                                     microbatches=microbatches,
                                     checkpointing=args.activation_checkpointing)
                   for rank in ranks]
        if args.replica_groups is not None:  # the groups as one more, outermost dim
            for report in reports:
                add_replica_groups(report, args.replica_groups)
            dims = {"replicas": args.replica_groups, **dims}
        if args.json:
            print(json.dumps(reports_as_json(config, dims, reports, schedule=schedule,
                                             microbatches=microbatches, costs=costs,
                                             device_memory=memory, allowance=allowance),
                             indent=1))
        else:
            print(format_reports(config, dims, reports, schedule=schedule,
                                 microbatches=microbatches, costs=costs,
                                 device_memory=memory, allowance=allowance))
    except DryRunError as exc:
        print(f"devmesh plan: error: {exc}", file=sys.stderr)
        return 2
    fits = memory is None or all(allowance.device_bytes(r.most_bytes) <= memory
                                 for r in reports)
    return 0 if fits else 1



def _cmd_search(args: argparse.Namespace) -> int:
    """``devmesh plan --model CONFIG --world N --search``: the candidates ranked
    (devmesh.tools.dry_run.search)."""
    from devmesh.errors import DryRunError
    from devmesh.tools.dry_run import read_config
    from devmesh.tools.dry_run.report import parse_allowance, parse_bytes, read_costs
    from devmesh.tools.dry_run.search import format_search, search, search_as_json

    try:
        if not (args.search and args.world is not None):
            raise DryRunError("a mesh search needs both --world N (the ranks) and --search")
        if args.mesh is not None:
            raise DryRunError("--search chooses the mesh: drop --mesh (or drop --search and "
                              "--world to dry-run that mesh)")
        config = read_config(args.model)
        costs = read_costs(args.tflops, args.bandwidth, args.costs, args.latency,
                           args.ranks_per_device, args.block_overhead, args.copy_bandwidth,
                           args.wait)
        if costs is None:
            raise DryRunError("--search ranks meshes by predicted step time: give --tflops "
                              "and --bandwidth (e.g. --tflops 400 --bandwidth tp=300,25) or "
                              "--costs FILE from devmesh bench --json")
        memory = parse_bytes(args.device_memory) if args.device_memory else None
        if args.top < 1 or args.verify < 0:
            raise DryRunError("--top must be at least 1 and --verify at least 0")
        result = search(config, args.world, costs, device_memory=memory,
                        allowance=parse_allowance(args.allowance),
                        devices_per_host=args.devices_per_host or 8, verify=args.verify,
                        checkpointing=args.activation_checkpointing,
                        progress=lambda text: print(text, file=sys.stderr, flush=True))
    except DryRunError as exc:
        print(f"devmesh plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        import json

        print(json.dumps(search_as_json(result, top=args.top), indent=1))
    else:
        print(format_search(result, top=args.top))
    return 0 if result.ranked else 1
