"""The dry run (devmesh.tools.dry_run, ``devmesh plan --model``): one rank of a job measured
on ``meta`` tensors under torch's fake process group, checked against the same step run for
real on 8 gloo ranks — the collectives per rank and mesh dim, and the bytes each rank holds."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from devmesh.tools.dry_run import TransformerConfig, dry_run

CONFIG = TransformerConfig(layers=4, dim=64, heads=8, kv_heads=8, ffn_dim=128, vocab=256,
                           seq=16, batch=16, dtype="float32")
# a mixture of experts after a dense first layer: 8 SwiGLU experts, top 2, one shared
MOE = replace(CONFIG, experts=8, top_k=2, expert_ffn_dim=32, shared_experts=1, dense_layers=1)

STRATEGIES = {
    "ddp": {"dp": 8},
    "fsdp": {"shard": 8},
    "hsdp": {"dp": 2, "shard": 4},
    "tp": {"tp": 8},
    "fsdp-tp": {"shard": 4, "tp": 2},
    "pp-fsdp-tp": {"pp": 2, "shard": 2, "tp": 2},
    # activation checkpointing (torchtitan's modes) under each kind of parallelism
    "ddp-full": ({"dp": 8}, "full"),
    "fsdp-tp-selective": ({"shard": 4, "tp": 2}, "selective"),
    "pp-fsdp-every-2": ({"pp": 2, "shard": 4}, 2),
    # bfloat16 compute over float32 parameters without FSDP (DDP's and TP's mixed precision)
    "ddp-bf16": ({"dp": 8}, "none", "bfloat16"),
    "tp-bf16": ({"tp": 8}, "none", "bfloat16"),
    # context parallelism: ring attention's messages over cp, its ranks data-parallel
    "fsdp-cp": {"shard": 4, "cp": 2},
    "ddp-cp-full": ({"dp": 4, "cp": 2}, "full"),
    "fsdp-cp-tp-selective": ({"shard": 2, "cp": 2, "tp": 2}, "selective"),
    "pp-fsdp-cp": {"pp": 2, "shard": 2, "cp": 2},
    # one stage per rank, each backward split into I and W, under FSDP and under DDP
    "pp-fsdp-zero-bubble": ({"pp": 2, "shard": 4}, "none", "float32", "zero-bubble"),
    "pp-ddp-zero-bubble": ({"pp": 2, "dp": 4}, "none", "float32", "zero-bubble"),
    # several stages per rank: looped (interleaved 1F1B) and in a V (zero-bubble V splits
    # backwards into I and W; DualPipeV mixes whole and split ones), 4 stages of one layer
    "pp-fsdp-tp-interleaved": ({"pp": 2, "shard": 2, "tp": 2}, "none", "float32",
                               "interleaved-1f1b"),
    "pp-fsdp-zbv": ({"pp": 2, "shard": 4}, "none", "float32", "zbv-zero-bubble"),
    "pp-ddp-dualpipe-v-full": ({"pp": 2, "dp": 4}, "full", "float32", "dualpipe-v"),
    # expert parallelism: the experts split over ep, tokens to them by all-to-all; the rest
    # data-parallel over ep too (DDP alone, FSDP over shard x ep beside the experts' shard)
    "moe-ep": ({"ep": 8}, "none", "float32", "1f1b", MOE),
    "moe-fsdp-ep-selective": ({"shard": 4, "ep": 2}, "selective", "float32", "1f1b", MOE),
    "moe-fsdp-ep-bf16": ({"shard": 2, "ep": 4}, "none", "bfloat16", "1f1b", MOE),
    "moe-pp-fsdp-ep": ({"pp": 2, "shard": 2, "ep": 2}, "none", "float32", "1f1b", MOE),
    "moe-fsdp": ({"shard": 8}, "none", "float32", "1f1b", MOE),
    # every expert split over tp instead (torchtitan's plan without ep), with sequence
    # parallelism around the block
    "moe-fsdp-tp": ({"shard": 4, "tp": 2}, "none", "float32", "1f1b", MOE),
    "moe-fsdp-tp-selective-bf16": ({"shard": 2, "tp": 4}, "selective", "bfloat16", "1f1b",
                                   MOE),
    # over ep and each over tp too (torchtitan's expert tensor parallelism)
    "moe-fsdp-ep-tp": ({"shard": 2, "ep": 2, "tp": 2}, "none", "float32", "1f1b", MOE),
}


# the real step's attention (CPU's fused kernel) saves other tensors than meta's, as the
# activations' bound above allows
PEAK_REL = 0.15


def _case(strategy):
    case = STRATEGIES[strategy]
    case = case if isinstance(case, tuple) else (case,)
    dims, checkpointing, dtype, schedule, config = case + (
        "none", "float32", "1f1b", CONFIG)[len(case) - 1:]
    return dims, checkpointing, replace(config, dtype=dtype), schedule


def real_step(dims, checkpointing="none", config=CONFIG, schedule="1f1b"):
    import os

    return dry_run(config, dims, rank=int(os.environ["RANK"]), device="cpu",
                   checkpointing=checkpointing, schedule=schedule)


def _models_alive() -> int:
    import gc

    from devmesh.tools.dry_run.model import Transformer

    gc.collect()
    return sum(Transformer in type(o).__mro__ for o in gc.get_objects())  # fully_shard subclasses


def models_left_by_a_real_step(dims, checkpointing, config):
    before = _models_alive()
    real_step(dims, checkpointing, config)
    return _models_alive() - before


@pytest.mark.parametrize("strategy", ["fsdp-tp", "ddp-full", "moe-fsdp-tp-selective-bf16"])
def test_a_dry_run_leaves_nothing_of_its_model_alive(mesh_pool, strategy):
    """What a dry run builds is gone when it returns, on ``meta`` and on real ranks: its
    probe forward, never run backward, must not hold the model (and with it the units, the
    mesh and, on real ranks, their process groups) in a cycle the collector cannot free."""
    dims, checkpointing, config, _ = _case(strategy)
    before = _models_alive()  # (other tests of this process may keep models of their own)
    dry_run(config, dims, rank=1, checkpointing=checkpointing)
    assert _models_alive() == before
    assert mesh_pool.run(models_left_by_a_real_step, 8, dims, checkpointing,
                         config) == [0] * 8


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_the_dry_run_counts_what_a_real_step_sends_and_holds(mesh_pool, strategy):
    """Every rank's collectives per kind and mesh dim — calls and bytes — and its parameter,
    gradient and optimizer bytes equal the real step's exactly; the pipeline's against
    devmesh's own runner running the step (its messages included)."""
    dims, checkpointing, config, schedule = _case(strategy)
    real = mesh_pool.run(real_step, 8, dims, checkpointing, config, schedule)
    runner = (mesh_pool.run(pipelined_step, 8, dims, checkpointing, schedule, config)
              if "pp" in dims else None)
    for rank, measured in enumerate(real):
        predicted = dry_run(config, dims, rank=rank, checkpointing=checkpointing,
                            schedule=schedule)
        assert predicted.compute_dtype == measured.compute_dtype == config.dtype
        assert predicted.coordinate == measured.coordinate
        assert predicted.collectives == measured.collectives, rank
        if runner is not None:
            assert predicted.collectives == runner[rank][0], rank
            # FSDP's unsharded float32 gradients held between the micro-batches' backwards
            assert predicted.accumulated_gradient_bytes == runner[rank][1], rank
            # the most alive at once as the runner plays the schedule (a split backward
            # keeps its micro-batch's graph from I until W)
            assert predicted.peak_bytes == pytest.approx(runner[rank][2], rel=PEAK_REL), rank
            assert (runner[rank][1] > 0) == ("shard" in dims), rank
        assert predicted.accumulated_gradient_bytes == measured.accumulated_gradient_bytes
        if "pp" in dims and schedule == "1f1b" and not config.experts:
            # the stage's tensor-parallel blocks, whole over shard, in float32
            d, kv, tp = config.dim, config.kv_heads * config.head_dim, dims.get("tp", 1)
            block = (2 * d * d + 2 * d * kv + 3 * d * config.ffn_dim) // tp + 2 * d
            whole = 2 * block + config.vocab * d // tp + d * predicted.coordinate["pp"]
            assert predicted.accumulated_gradient_bytes == 4 * whole, rank
        if "cp" in dims and checkpointing == "none" and "pp" not in dims:
            # ring attention, per block and micro-batch: keys and values passed cp - 1 times
            # forward and backward, and their gradients cp times back
            cp, tp = dims["cp"], dims.get("tp", 1)
            sequences = config.batch // (dims.get("dp", 1) * dims.get("shard", 1))
            kv = sequences * config.kv_heads // tp * config.seq // cp * config.head_dim * 4
            calls = config.layers * (2 * (cp - 1) * 2 + 2 * cp)
            assert predicted.collectives[("send", "cp")] == (calls, calls * kv), rank
        assert predicted.parameter_bytes == measured.parameter_bytes
        assert predicted.optimizer_bytes == measured.optimizer_bytes
        assert predicted.activation_bytes_per_microbatch == pytest.approx(
            measured.activation_bytes_per_microbatch, rel=0.15)
        # the most alive at once: on meta under the fake group as in the real step
        assert predicted.peak_bytes == pytest.approx(measured.peak_bytes, rel=PEAK_REL), rank


def pipelined_step(dims, checkpointing="none", schedule="1f1b", config=CONFIG):
    """The pipeline case run by devmesh's own runner (``schedule``, 4 micro-batches) on the
    stages the dry run builds: its collectives over the step, the most unsharded gradients
    FSDP held, and the most bytes alive at once in a second step (AdamW's states added, as
    the dry run adds them)."""
    import torch.nn.functional as F

    from devmesh import comm_stats
    from devmesh.layout.schedule import build_schedule
    from devmesh.parallel import loss_parallel
    from devmesh.parallel.pipeline import PipelineRunner
    from devmesh.tools.dry_run.live import LiveBytes
    from devmesh.tools.dry_run.run import build_rank_stages

    plan = build_schedule(schedule, 2, 4)
    mesh, models = build_rank_stages(config, dims, plan, "cpu", checkpointing=checkpointing)
    last = plan.stages - 1
    # the most unsharded gradients FSDP's units hold between the runner's backwards: each
    # unit's accumulated tensors, read after every reduction it makes or holds back
    units = [m._devmesh_fsdp for model in models.values() for m in model.modules()
             if getattr(m, "_devmesh_fsdp", None)]
    held = [0]

    def watched(unit):
        reduce = unit.reduce_grads

        def reduce_grads(grads):
            out = reduce(grads)
            held[0] = max(held[0], sum(sum(g.numel() * g.element_size()
                                               for g in u._accumulated or () if g is not None)
                                           for u in units))
            return out
        return reduce_grads

    for unit in units:
        unit.reduce_grads = watched(unit)
    runner = PipelineRunner(models, mesh, plan,
                            lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
    data = config.batch // (dims.get("shard", 1) * dims.get("dp", 1) * dims.get("ep", 1))
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, config.vocab, (data, config.seq // dims.get("cp", 1)), generator=gen)
    # the head's logits stay split over tp: the step runs under loss_parallel (torchtitan's
    # train context), and torch's collectives for it and for DTensor activations count too
    with comm_stats(include_torch=True) as stats, loss_parallel():
        runner.step(x if 0 in models else None, x if last in models else None)
    parameters = [p for model in models.values() for p in model.parameters()]
    for p in parameters:
        p.grad = None
    live = LiveBytes()
    live.hold(t for model in models.values() for t in (*model.parameters(), *model.buffers()))
    with live, loss_parallel():
        runner.step(x if 0 in models else None, x if last in models else None)
    peak = live.peak + 2 * 4 * sum(p.numel() for p in parameters)
    return {key: tuple(value) for key, value in stats.records.items()}, held[0], peak


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs",
                                  "zero-bubble", "interleaved-zero-bubble", "zbv-zero-bubble",
                                  "dualpipe-v"])
def test_the_activations_held_at_once_are_the_schedules_liveness_slots(name):
    """The peak of a rank's activations over a schedule: with every stage's micro-batch one
    unit, the most held at once is the activation liveness' slot count (torch's, for the
    rank's stages together); a heavier stage counts by its bytes. And the dry run's report
    of a rank of several stages: their layers, the peak, a stage's bytes per micro-batch."""
    from devmesh.layout.liveness import activation_liveness
    from devmesh.layout.schedule import build_schedule
    from devmesh.tools.dry_run.run import activation_peak

    schedule = build_schedule(name, 4, 8)
    for rank in range(4):
        stages = [s for s in range(schedule.stages) if schedule.rank_of(s) == rank]
        slots = activation_liveness(schedule, pp_rank=rank, stage_indices=stages,
                                    granularity="stage_microbatch").num_slots
        actions = list(schedule.actions[rank])
        assert activation_peak(actions, dict.fromkeys(stages, 1)) == slots, rank
        heavier = {s: 1 + 1000 * (s == stages[-1]) for s in stages}
        held = sum(1 for a in actions if a.kind == "F" and a.stage == stages[-1])
        assert 1000 * min(held, 1) < activation_peak(actions, heavier) <= 1001 * slots
    report = dry_run(CONFIG, {"pp": 2, "shard": 4}, schedule=name, rank=0, microbatches=4)
    if name in ("gpipe", "1f1b", "zero-bubble"):
        assert report.stage_layers == {} and report.activation_peak_bytes is None
    else:
        assert list(report.stage_layers.values()) == (
            [(0, 1), (2, 3)] if schedule.placement == "loop" else [(0, 1), (3, 4)])
        assert report.activation_bytes == report.activation_peak_bytes
        assert report.activation_bytes_per_microbatch == max(
            report.stage_activation_bytes.values())


@pytest.mark.parametrize("schedule, microbatches, says", [
    ("dualpipe-v", 2, "dualpipe-v needs at least as many micro-batches as stages"),
    ("interleaved-1f1b", 4, "makes 16 stages, more than the model's 4 layers"),
    ("sideways", 4, "the dry run plays gpipe, 1f1b, interleaved-1f1b"),
    ("zbv-zero-bubble", 4, "selective checkpointing allows one backward through a region"),
])
def test_a_schedule_the_job_cannot_play_is_refused_naming_why(schedule, microbatches, says):
    from devmesh.errors import DryRunError

    pp = 8 if "16 stages" in says else 2
    checkpointing = "selective" if "selective" in says else "none"
    with pytest.raises(DryRunError, match=says):
        dry_run(CONFIG, {"pp": pp, "dp": 2}, schedule=schedule, microbatches=microbatches,
                checkpointing=checkpointing)


@pytest.mark.parametrize("name, billions, moe_layers, first", [
    ("deepseek-v3", 672.15, 58, 3), ("llama4-scout", 107.77, 48, 0),
    ("llama4-maverick", 400.71, 24, 1), ("tiny-moe", 0.000274, 3, 1)])
def test_a_mixture_of_experts_preset_has_the_parameters_it_states(name, billions, moe_layers,
                                                                 first):
    """A preset's stated count is its model's, built on meta (DeepSeek-V3's 3 dense layers
    first, Maverick's experts in every second layer)."""
    from devmesh.tools.dry_run.model import PRESETS, MoEFeedForward, Transformer

    config = PRESETS[name]
    with torch.device("meta"):
        model = Transformer(config)
    assert sum(p.numel() for p in model.parameters()) == config.parameters()
    assert config.parameters() / 1e9 == pytest.approx(billions, abs=0.005)
    moe = [i for i, block in enumerate(model.layers.values())
           if isinstance(block.feed_forward, MoEFeedForward)]
    assert len(moe) == moe_layers and moe[0] == first


@pytest.mark.parametrize("mesh, says", [
    ({"ep": 2}, "the model has no experts"),
    ({"ep": 3, "shard": 2}, "ep 3 does not divide the 8 experts: ep may be 2, 4, 8"),
    ({"dp": 2, "ep": 4}, "ep with dp: build the mesh with shard instead of dp"),
    ({"shard": 2, "ep": 2, "cp": 2}, "ep with cp"),
])
def test_expert_parallelism_the_dry_run_cannot_place_is_refused_naming_why(mesh, says):
    from devmesh.errors import DryRunError

    config = CONFIG if "no experts" in says else MOE
    with pytest.raises(DryRunError, match=says):
        dry_run(replace(config, batch=48), mesh)


@pytest.mark.parametrize("dims", [{"dp": 8}, {"shard": 4, "tp": 2}, {"shard": 4, "cp": 2}],
                         ids=str)
def test_what_a_checkpointed_block_keeps_is_its_input_and_selectively_its_matmuls(dims):
    """Per block (a stage of two blocks against one): full checkpointing keeps the block's
    input alone; selective keeps its input and the outputs of every other one of its 7
    matmuls (the 1st, 3rd, 5th and 7th, as torchtitan's policy) and of the fused attention
    (its output and log-sum-exp) — under context parallelism nothing of the
    ring attention, which is recomputed from its inputs (its chunk pairs' scores, kept,
    made selective keep 3.3 times what no checkpointing keeps for Llama-3-8B); without
    checkpointing, more than both."""
    tp, cp = dims.get("tp", 1), dims.get("cp", 1)
    b = CONFIG.batch // (dims.get("dp", 1) * dims.get("shard", 1))
    s, d = CONFIG.seq // cp, CONFIG.dim
    kv, ffn = CONFIG.kv_heads * CONFIG.head_dim, CONFIG.ffn_dim

    def per_block(mode):
        one, two = (dry_run(CONFIG, dims, blocks=n, checkpointing=mode) for n in (1, 2))
        return two.activation_bytes_per_microbatch - one.activation_bytes_per_microbatch

    block_input = b * (s // tp) * d * 4  # the residual stream, split along the sequence
    # q, k, v, wo, w1, w3, w2 run in that order: q, v, w1 and w2 (its partial sums, before
    # the reduce-scatter) kept; k, wo and w3 recomputed
    matmuls = b * s * (d // tp + kv // tp + ffn // tp + d) * 4
    attention = b * s * d // tp * 4 + b * (CONFIG.heads // tp) * s * 4 if cp == 1 else 0
    assert per_block("full") == block_input
    assert per_block("selective") == block_input + matmuls + attention
    assert per_block("none") > per_block("selective")


def test_a_llama_3_8b_job_of_1024_ranks_is_planned_here(capsys):
    """pp 4 x dp 32 x tp 8 with the Llama-3-8B shape under torchtitan's plan: one rank per
    pipeline stage measured in this process. Each stage's parameters are its layers'
    (projections split 8 ways, norms whole) plus the embedding (split over the vocabulary)
    on the first and the head (likewise) and final norm on the last; every rank all-reduces
    its gradients over dp; over tp each block all-gathers the sequence into attention and
    the feed-forward and reduce-scatters their outputs back to it (and the reverse in
    backward); the pipeline carries the sequence-split residual stream."""
    from devmesh.tools.cluster_plan import TP_COLLECTIVES_PER_LAYER
    from devmesh.tools.dry_run import ranks_to_report, read_config

    config = read_config("llama3-8b")
    dims = {"pp": 4, "dp": 32, "tp": 8}
    reports = [dry_run(config, dims, rank=rank) for rank in ranks_to_report(dims)]
    assert [r.rank for r in reports] == [0, 256, 512, 768]
    d, kv, tp = config.dim, config.kv_heads * config.head_dim, 8
    block = (2 * d * d + 2 * d * kv + 3 * d * config.ffn_dim) // tp + 2 * d
    table = config.vocab * d // tp
    assert [r.parameters for r in reports] == [
        8 * block + table, 8 * block, 8 * block, 8 * block + table + d]
    assert reports[0].parameters == 283_836_416  # the "about 284M", not 743.5M
    assert [r.microbatches_in_flight for r in reports] == [4, 3, 2, 1]  # 1F1B's warm-up
    activation = 4 * (config.seq // tp) * d * 2  # 4 sequences per micro-batch, bfloat16
    for stage, r in enumerate(reports):
        assert r.parameter_bytes == 4 * r.parameters and r.optimizer_bytes == 8 * r.parameters
        assert r.collectives[("all_reduce", "dp")][0] >= 1
        # per layer and micro-batch: 2 gathers and 2 reduce-scatters forward, 2 of each back;
        # the embedding's output reduce-scattered (stage 0), the head's input gathered (3)
        # (per layer: what `devmesh plan --hosts` states, one number for both commands)
        per_layer = TP_COLLECTIVES_PER_LAYER
        ends = (stage == 0) + (stage == 3)
        for kind in ("all_gather", "reduce_scatter"):
            assert r.collectives[(kind, "tp")][0] == 8 * (8 * per_layer[kind] + ends)
        # the norms' gradients, 2 per layer; on the last stage the final norm's and the
        # loss's three (torch's loss_parallel: the max, the sum of exponentials, the target)
        assert r.collectives[("all_reduce", "tp")][0] == 8 * (
            8 * per_layer["all_reduce"] + 4 * (stage == 3))
        # 8 activations to the next stage (and a header announcing them), 8 gradients back
        onward, back = stage < 3, stage > 0
        assert r.collectives[("send", "pp")] == (
            8 * (onward + back) + onward, 8 * (onward + back) * activation + 648 * onward)
    assert max(r.seconds for r in reports) < 120
    print("1024-rank dry run: " + ", ".join(f"{r.seconds:.1f} s" for r in reports))


def test_devmesh_plan_model_prints_each_role_and_says_whether_it_fits(tmp_path, capsys):
    import subprocess
    import sys

    from devmesh.tools.cli import main

    bench = tmp_path / "bench.json"
    bench.write_text('{"collectives": [{"dim": "shard", "busbw_gbs": 50.0}, '
                     '{"dim": "tp", "busbw_gbs": 200.0}, {"dim": "pp", "busbw_gbs": 25.0}]}')
    done = subprocess.run(
        [sys.executable, "-m", "devmesh", "plan", "--model", "tiny:batch=32", "--mesh",
         "pp=2,fsdp=2,tp=2", "--device-memory", "512KiB", "--tflops", "10", "--costs",
         str(bench)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr  # the tiny model does not fit in 512 KiB
    out = done.stdout
    assert "mesh: pp 2 x shard 2 x tp 2 = 8 ranks; 1f1b, 4 micro-batches" in out
    assert "rank 0 (pp 0, shard 0, tp 0): layers 0..1" in out
    assert "rank 4 (pp 1, shard 0, tp 0): layers 2..3" in out
    assert out.count("does NOT fit in 512.00 KiB") == 2
    assert out.count("predicted step") == 2 and "comm tp" in out and "bubble" in out
    for args, words in ((["--mesh", "pp=2,xx=4"], "'xx=4' is not NAME=SIZE"),
                        (["--mesh", "tp=3"], "tp 3 does not divide the heads"),
                        (["--mesh", "tp=3"], "tp may be 1, 2"),
                        (["--mesh", "pp=2,dp=4", "--world", "16"],
                         "the mesh pp=2,dp=4 is 8 ranks, the world 16"),
                        (["--mesh", "pp=2", "--microbatches", "3"],
                         "--microbatches may be 1, 2"),
                        (["--mesh", "shard=3"], "does not split over 3 data-parallel ranks"),
                        (["--mesh", "shard=2", "--tflops", "1"], "no bandwidth for mesh dims "
                                                                 "'shard'")):
        # the command's own code, in this process (the launch of `python -m devmesh` and its
        # exit code are checked above)
        try:
            code = main(["plan", "--model", "tiny", *args])
        except SystemExit as exit:
            code = exit.code
        err = capsys.readouterr().err
        assert code == 2 and words in err, err
    # cp's chunks: only where there is cp (a sequence of odd length plans without it), and
    # the cp sizes named are ones that split the sequence
    for model, mesh, words in (("tiny:seq=12", "cp=4", "cp may be 2, 3, 6"),
                               ("tiny:seq=15", "cp=2", "give the sequence an even length")):
        assert main(["plan", "--model", model, "--mesh", mesh]) == 2
        assert words in capsys.readouterr().err
    assert main(["plan", "--model", "tiny:seq=15", "--mesh", "dp=2"]) == 0


def test_devmesh_plan_model_json_holds_every_number_the_report_has():
    """``--json``: per rank, what the dry run measured (the same numbers the text shows),
    whether it fits and the predicted parts, read back as they were computed."""
    import json
    import subprocess
    import sys

    from devmesh.tools.dry_run.report import Costs, predict

    args = ["--model", "tiny", "--mesh", "pp=2,shard=2,tp=2", "--activation-checkpointing",
            "selective", "--device-memory", "600KiB", "--tflops", "10", "--bandwidth", "10"]
    done = subprocess.run([sys.executable, "-m", "devmesh", "plan", *args, "--json"],
                          capture_output=True, text=True, timeout=300)
    data = json.loads(done.stdout)
    dims = {"pp": 2, "shard": 2, "tp": 2}
    assert data["mesh"] == dims and data["schedule"] == "1f1b" and data["microbatches"] == 4
    assert data["activation_checkpointing"] == "selective" and data["config"]["dim"] == 64
    costs = Costs(tflops=10, bandwidth={}, default=10.0)
    config = TransformerConfig(**data["config"])
    for entry, rank in zip(data["ranks"], (0, 4), strict=True):
        report = dry_run(config, dims, rank=rank, checkpointing="selective")
        for name in ("parameters", "parameter_bytes", "gradient_bytes", "optimizer_bytes",
                     "activation_bytes_per_microbatch", "microbatches_in_flight",
                     "activation_bytes", "total_bytes", "peak_bytes", "peak_at",
                     "compute_dtype"):
            assert entry[name] == getattr(report, name), name
        assert {(c["collective"], c["dims"]): (c["calls"], c["bytes"])
                for c in entry["collectives"]} == report.collectives
        # the device's figure: the peak and the default allowance, 20% allocator cache
        assert entry["device_bytes"] == round(report.peak_bytes * 1.2)
        assert entry["fits"] == (entry["device_bytes"] <= 600 * 1024)
        assert entry["predicted_seconds"] == pytest.approx(
            predict(config, dims, report, costs, "1f1b", 4))
    assert data["allowance"] == {"cache": 0.2, "context_bytes": 0}
    assert done.returncode == (0 if all(e["fits"] for e in data["ranks"]) else 1)


def test_devmesh_plan_states_what_replica_groups_add_to_a_step():
    """``--replica-groups G``: each rank's quorum — 4 round trips to the coordinator's store,
    priced at the latency — and one all-reduce of its gradient shards over the groups,
    priced at the bandwidth given for ``replicas``; the mesh shows the groups."""
    import json
    import subprocess
    import sys

    args = ["--model", "tiny", "--mesh", "shard=4", "--replica-groups", "3", "--tflops", "1",
            "--bandwidth", "10,replicas=0.5", "--latency", "1ms", "--json"]
    done = subprocess.run([sys.executable, "-m", "devmesh", "plan", *args],
                          capture_output=True, text=True, timeout=300)
    data = json.loads(done.stdout)
    assert data["mesh"] == {"replicas": 3, "shard": 4}, done.stderr
    (entry,) = data["ranks"]
    from devmesh.tools.dry_run.model import PRESETS

    alone = dry_run(PRESETS["tiny"], {"shard": 4})
    assert entry["store_round_trips"] == 4
    got = {(c["collective"], c["dims"]): (c["calls"], c["bytes"]) for c in entry["collectives"]}
    assert got == {**alone.collectives, ("all_reduce", "replicas"): (1, alone.gradient_bytes)}
    parts = entry["predicted_seconds"]
    assert parts["quorum"] == pytest.approx(4e-3)
    # a ring all-reduce over 3 groups: 2 hops, 2 x 2/3 of the bytes over 0.5 GB/s
    assert parts["comm replicas"] == pytest.approx(
        2e-3 + alone.gradient_bytes * 4 / 3 / 0.5e9, rel=1e-6)


def test_the_peak_is_the_most_bytes_alive_at_once():
    """Each storage counted once from the op that makes it until it is freed (views share
    it), on top of what the step starts with."""
    from devmesh.tools.dry_run.live import LiveBytes

    held = torch.empty(100, device="meta")  # 400 bytes
    live = LiveBytes()
    live.hold([held, held[:10]])
    with live:
        a = torch.empty(1000, device="meta")  # 4,000
        view = a[:500].view(10, 50)  # no new storage
        b = torch.ones(250, dtype=torch.float64, device="meta")  # 2,000
        del a  # the view keeps its storage
        c = b * 2  # 2,000: the peak, 8,400
        del view, b, c
        d = torch.empty(10, device="meta")  # 40
    assert live.peak == 400 + 4_000 + 2_000 + 2_000
    assert live.now == 400 + 40
    del d


def test_the_peak_of_a_tensor_parallel_head_holds_only_its_vocabulary_share():
    """Under tp the head's logits stay split over the vocabulary (loss parallelism): the step
    never holds a tensor of the whole vocabulary (the DTensor wrapping the head's output read
    its strides off an empty tensor of the global shape, which the peak counted)."""
    config = replace(CONFIG, vocab=2**16)
    report = dry_run(config, {"tp": 8})
    global_logits = config.batch * config.seq * config.vocab * 4
    assert report.peak_bytes < global_logits
    # the float32 logits' share and its gradients are there, at the start of backward
    assert report.peak_bytes > 2 * global_logits // 8
    assert report.peak_at == "the backward, before it reaches the blocks"


def test_the_peak_is_placed_where_it_comes_in_the_step():
    """``peak at``: the moment the step first holds its peak. Under DDP, the end of the one
    backward that syncs, the last micro-batch's: every gradient, and its copy in the
    all-reduce's buckets (under tensor parallelism the start of backward instead, the loss's
    logits: the test above)."""
    one = dry_run(replace(CONFIG, vocab=2**16), {"dp": 8})
    assert one.peak_at == "the backward, after it leaves the blocks", one.peak_at
    pipelined = dry_run(CONFIG, {"pp": 2, "dp": 4}, rank=0, microbatches=4)
    assert pipelined.peak_at == "micro-batch 3's backward, after it leaves the blocks", \
        pipelined.peak_at


def test_the_allowance_is_stated_and_can_be_changed():
    """``--allowance``: the caching allocator's reserve over the peak (20% by default) and
    bytes outside torch's allocator (0 by default); refused by name when malformed."""
    from devmesh.errors import DryRunError
    from devmesh.tools.dry_run.report import Allowance, parse_allowance

    assert parse_allowance(None) == Allowance(cache=0.2, context=0)
    assert parse_allowance("cache=10%,context=1GiB") == Allowance(cache=0.1, context=2**30)
    assert parse_allowance("context=512MiB") == Allowance(cache=0.2, context=2**29)
    assert parse_allowance("none").device_bytes(1000) == 1000
    assert Allowance().device_bytes(1000) == 1200
    for bad in ("cache=20", "cache=-5%", "fragmentation=5%", "context=lots"):
        with pytest.raises(DryRunError, match="is not cache=PERCENT%"):
            parse_allowance(bad)


@pytest.mark.parametrize("row", ["t1", "t5a"])
def test_a_published_jobs_memory_is_predicted_within_10_percent(row):
    """bench/published_jobs.py's rows against torchtitan's published peak memory: table 1
    (8B, FSDP 8) and table 5's 1F1B row (405B, PP 8 x FSDP 8 x TP 8), run as torchtitan then
    split its step, one micro-batch per stage (with 32 micro-batches of one sequence, the
    dry run held 0.76 of the published)."""
    import pathlib
    import subprocess
    import sys

    bench = pathlib.Path(__file__).parents[2] / "bench" / "published_jobs.py"
    done = subprocess.run([sys.executable, str(bench), "--only", row], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith(row + " "))
    memory_ratio = float(line.split()[3])
    assert 0.9 <= memory_ratio <= 1.1, line
