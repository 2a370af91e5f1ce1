"""The mesh search (devmesh.tools.dry_run.search, ``devmesh plan --model --world --search``):
its closed form equals the dry run on every kind of candidate, the dry run from runs of a few
of a stage's blocks equals the whole stage's, and the search drops what does not fit and ranks the
rest by predicted step time, the best measured by the dry run."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from devmesh.errors import DryRunError
from devmesh.tools.dry_run import dry_run, read_config
from devmesh.tools.dry_run.report import Allowance, Costs, predict
from devmesh.tools.dry_run.run import dry_run_by_blocks
from devmesh.tools.dry_run.search import (ESTIMATE_ABOVE_MEASURED, Candidate, _Calibration,
                                          candidates, estimate, measure, search)

# 7 layers: pipeline stages of unequal blocks; bfloat16: every strategy computes in it
CONFIG = read_config("tiny:layers=7,batch=32,dtype=bfloat16")
COSTS = Costs(tflops=0.05, bandwidth={"tp": 4.0}, default=1.0, latency=2e-5)


# stages of ten blocks or more, measured from runs of four and five of them; the peak comes
# at another moment in a long stage than in a short one (where the old extension, from two and
# three blocks, held 16% too little: the first case)
LONG = read_config("tiny:layers=30,batch=32,dtype=bfloat16")


@pytest.mark.parametrize("dims, checkpointing, microbatches, schedule", [
    ({"shard": 2, "tp": 2}, "full", 1, "1f1b"), ({"shard": 2, "tp": 2}, "none", 4, "1f1b"),
    ({"dp": 4}, "selective", 2, "1f1b"), ({"pp": 2, "dp": 2, "shard": 2}, "selective", 4, "1f1b"),
    ({"pp": 3, "tp": 2}, "full", 4, "1f1b"), ({"pp": 2, "shard": 2, "cp": 2}, "full", 2, "1f1b"),
    # split backwards, each micro-batch's recomputed blocks held from its I until its W
    ({"pp": 2, "dp": 4}, "full", 4, "zero-bubble"),
], ids=str)
def test_a_long_stage_measured_from_four_and_five_blocks_equals_the_whole_stage(
        dims, checkpointing, microbatches, schedule):
    pp = dims.get("pp", 1)
    stride = 8 // pp if pp > 1 else 1
    for stage in range(pp):
        kwargs = dict(rank=stage * stride, microbatches=microbatches,
                      checkpointing=checkpointing, schedule=schedule)
        whole = dry_run(LONG, dims, **kwargs)
        parts = dry_run_by_blocks(LONG, dims, **kwargs)
        assert whole.layers[1] - whole.layers[0] >= 10
        whole.seconds = parts.seconds = 0.0
        assert parts == whole, (dims, stage)
        assert parts.peak_at == whole.peak_at, (dims, stage)


KINDS = [  # every data-parallel kind, with and without tp and pp, both schedules, accumulation
    Candidate(1, 8, 1, 1, "1f1b", 1), Candidate(1, 1, 8, 1, "1f1b", 2),
    Candidate(1, 2, 4, 1, "1f1b", 1), Candidate(1, 2, 1, 4, "1f1b", 4),
    Candidate(1, 2, 2, 2, "1f1b", 2), Candidate(2, 4, 1, 1, "1f1b", 4),
    Candidate(2, 1, 2, 2, "gpipe", 4), Candidate(2, 2, 2, 1, "1f1b", 8),
    Candidate(4, 1, 1, 2, "gpipe", 8), Candidate(4, 2, 1, 1, "1f1b", 4),
    # context parallelism: FSDP over shard x cp or cp alone, DDP over dp x cp, with tp and pp
    Candidate(1, 1, 4, 1, "1f1b", 2, cp=2), Candidate(1, 4, 1, 1, "1f1b", 1, cp=2),
    Candidate(2, 1, 2, 1, "1f1b", 4, cp=2), Candidate(1, 1, 1, 2, "1f1b", 2, cp=4),
    # interleaved 1F1B: two stages per rank (7 layers: stages of 2, 2, 2 and 1 blocks)
    Candidate(2, 2, 2, 1, "interleaved-1f1b", 4), Candidate(2, 4, 1, 1, "interleaved-1f1b", 8),
    Candidate(2, 1, 2, 2, "interleaved-1f1b", 4),
    # split backwards (I, then W): zero-bubble, and in a V (two stages per rank) zero-bubble
    # V and DualPipeV
    Candidate(2, 2, 2, 1, "zero-bubble", 4), Candidate(2, 4, 1, 1, "zbv-zero-bubble", 8),
    Candidate(2, 1, 2, 2, "dualpipe-v", 4),
]


def test_the_closed_form_equals_the_dry_run_on_every_kind_of_candidate():
    """What the search estimates for a stage (bytes held, every collective's calls and
    bytes, micro-batches in flight) is what the dry run measures, exactly."""
    assert_the_closed_form_equals_the_dry_run(CONFIG, KINDS)


EXACT = ("layers", "parameters", "parameter_bytes", "gradient_bytes", "optimizer_bytes",
         "accumulated_gradient_bytes", "activation_bytes_per_microbatch", "activation_bytes",
         "stage_layers", "stage_activation_bytes", "microbatches_in_flight", "compute_dtype",
         "collectives")


def assert_the_closed_form_equals_the_dry_run(config, kinds: list[Candidate]) -> None:
    """Every count of :data:`EXACT` the search estimates for each stage of each candidate
    is what the dry run measures."""
    calibration = _Calibration(config)
    for candidate in kinds:
        for stage, measured in enumerate(measure(config, candidate)):
            estimated = estimate(config, candidate, stage, calibration)
            for name in EXACT:
                assert getattr(estimated, name) == getattr(measured, name), (
                    candidate.describe(), stage, name)


# mixtures of experts: a dense first layer then experts in every layer (DeepSeek-V3's shape),
# and experts in every second layer (Llama 4 Maverick's); 8 experts, top 2, one shared
MOE_CONFIGS = {
    "dense-first": read_config("tiny-moe:layers=6,batch=32,dtype=bfloat16"),
    "every-second": read_config("tiny-moe:layers=6,batch=32,dtype=bfloat16,dense_layers=0,"
                                "moe_every=2"),
}
MOE_KINDS = [  # experts over ep beside FSDP or alone (DDP), with tp and pp; without ep
    Candidate(1, 1, 2, 1, "1f1b", 1, ep=4), Candidate(1, 1, 1, 1, "1f1b", 2, ep=8),
    Candidate(1, 1, 2, 2, "1f1b", 2, ep=2), Candidate(2, 1, 2, 1, "1f1b", 4, ep=2),
    Candidate(2, 1, 1, 2, "gpipe", 4, ep=2), Candidate(1, 1, 4, 1, "1f1b", 2, "full", ep=2),
    Candidate(1, 2, 2, 2, "1f1b", 2),
]


@pytest.mark.parametrize("config", MOE_CONFIGS, ids=str)
def test_the_closed_form_equals_the_dry_run_on_mixtures_of_experts(config):
    """Each kind of block counted as it is (the experts split over ep, sharded over shard
    alone, left out of DDP's buckets; stages holding dense blocks and blocks of experts
    both): the estimate is what the dry run measures, exactly."""
    assert_the_closed_form_equals_the_dry_run(MOE_CONFIGS[config], MOE_KINDS)


def test_the_candidates_of_a_mixture_of_experts_place_ep_as_parallelize_does():
    config = MOE_CONFIGS["dense-first"]
    found = candidates(config, 16)
    eps = {c.ep for c in found}
    assert eps == {1, 2, 4, 8}  # dividing the 8 experts and the data ranks
    for c in found:
        assert c.pp * c.dp * c.shard * c.ep * c.cp * c.tp == 16
        assert c.ep == 1 or (c.dp == 1 and c.cp == 1)  # beside shard or alone
        assert config.expert_hidden % c.tp == 0
        assert config.batch % (c.dp * c.shard * c.ep) == 0
    assert Candidate(1, 1, 2, 1, "1f1b", 1, ep=8) in found
    assert Candidate(1, 1, 2, 1, "1f1b", 1, ep=8).mesh == "shard=2,ep=8"
    # experts of 24 features: tp 2 and 4 split them (and the heads), tp 8 does not
    narrow = {c.tp for c in candidates(replace(config, expert_ffn_dim=12), 8)}
    assert narrow == {1, 2, 4}
    # no data ranks left beside tp 4 on 4 ranks: no ep
    assert {c.ep for c in candidates(config, 4) if c.tp == 4} == {1}


def test_a_search_over_a_mixture_of_experts_ranks_meshes_with_ep():
    """The search takes a mixture of experts: its candidates split the experts over ep or
    not, the best measured by the dry run; where the experts are most of the model and no
    tp splits them, a memory too small for every rank to hold all of them leaves only
    meshes with ep."""
    # experts of 256 features: most of the model
    config = read_config("tiny-moe:layers=2,batch=8,experts=16,expert_ffn_dim=256,"
                         "dense_layers=0")
    costs = Costs(tflops=0.05, bandwidth={"tp": 4.0}, default=1.0, latency=2e-5)
    free = search(config, 4, costs, verify=2, devices_per_host=1)
    assert {e.candidate.ep for e in free.ranked} == {1, 2, 4}
    assert [e.measured for e in free.ranked[:2]] == [True, True]
    without_ep = min(e.peak_bytes for e in free.ranked if e.candidate.ep == 1)
    tight = search(config, 4, costs, verify=2, devices_per_host=1,
                   device_memory=without_ep - 1)
    assert tight.ranked and all(e.candidate.ep > 1 for e in tight.ranked), [
        e.candidate.describe() for e in tight.ranked[:5]]


@pytest.mark.parametrize("candidate", [
    Candidate(1, 2, 2, 2, "1f1b", 2, "full"), Candidate(2, 1, 2, 2, "gpipe", 4, "selective"),
    Candidate(1, 8, 1, 1, "1f1b", 1, "selective"), Candidate(2, 4, 1, 1, "1f1b", 4, "full"),
    Candidate(1, 1, 2, 2, "1f1b", 2, "selective", cp=2),
    Candidate(2, 2, 1, 1, "gpipe", 4, "full", cp=2)],
    ids=lambda c: c.describe())
def test_the_closed_form_equals_the_dry_run_under_activation_checkpointing(candidate):
    calibration = _Calibration(CONFIG)
    for stage, measured in enumerate(measure(CONFIG, candidate)):
        estimated = estimate(CONFIG, candidate, stage, calibration)
        for name in ("parameters", "activation_bytes_per_microbatch", "microbatches_in_flight",
                     "collectives", "checkpointing", "accumulated_gradient_bytes"):
            assert getattr(estimated, name) == getattr(measured, name), (stage, name)


@pytest.mark.parametrize("candidate", [
    Candidate(4, 1, 1, 2, "zero-bubble", 4), Candidate(2, 2, 2, 1, "zero-bubble", 4),
    Candidate(2, 4, 1, 1, "zbv-zero-bubble", 8), Candidate(2, 1, 2, 2, "dualpipe-v", 4)],
    ids=lambda c: c.describe())
def test_a_split_backwards_estimated_peak_counts_what_it_keeps_for_w(candidate):
    """From its I until its W a micro-batch holds its activations and the gradients W
    starts from (each matmul's and norm's output gradient): the closed form's peak is
    within 12% of the dry run's on every stage (without those gradients, as much as 21% below)."""
    calibration = _Calibration(CONFIG)
    for stage, measured in enumerate(measure(CONFIG, candidate)):
        estimated = estimate(CONFIG, candidate, stage, calibration)
        assert estimated.peak_bytes == pytest.approx(measured.peak_bytes, rel=0.12), stage


def test_a_search_that_may_checkpoint_fits_where_none_does_and_pays_the_recompute():
    """Below the smallest estimated peak without checkpointing nothing fits by the closed
    form; allowed to checkpoint, the search ranks candidates that fit as measured, the best
    checkpointing; full recomputes its blocks' forward (a third more of their FLOPs),
    selective every other matmul (wk, wo and w3: fewer than full)."""
    plain = search(CONFIG, 4, COSTS, verify=0)
    limit = min(e.peak_bytes for e in plain.ranked) - 1
    assert not search(CONFIG, 4, COSTS, device_memory=limit, verify=0).ranked
    result = search(CONFIG, 4, COSTS, device_memory=limit, verify=2, checkpointing="any")
    # every mode with every candidate, but selective with none that splits backwards
    assert result.ranked and result.considered == len(
        candidates(CONFIG, 4, checkpointing=("none", "full", "selective")))
    assert 2 * plain.considered < result.considered < 3 * plain.considered
    assert result.ranked[0].measured and result.ranked[0].candidate.checkpointing != "none"
    assert all(e.peak_bytes <= limit for e in result.ranked)
    base = Candidate(1, 8, 1, 1, "1f1b", 1)
    compute = {}
    calibration = _Calibration(CONFIG)
    for mode in ("none", "full", "selective"):
        candidate = replace(base, checkpointing=mode)
        report = estimate(CONFIG, candidate, 0, calibration)
        compute[mode] = predict(CONFIG, candidate.dims, report, COSTS, "1f1b", 1)["compute"]
    assert compute["none"] < compute["selective"] < compute["full"] < compute["none"] * 4 / 3
    d, kv, ffn = CONFIG.dim, CONFIG.kv_heads * CONFIG.head_dim, CONFIG.ffn_dim
    tokens = CONFIG.batch // 8 * CONFIG.seq
    recomputed = CONFIG.layers * 2 * (d * kv + d * d + d * ffn) * tokens
    assert compute["selective"] - compute["none"] == pytest.approx(recomputed / 0.05e12)


def test_the_closed_form_fills_ddps_buckets_as_replicate_does():
    """A model of some 300 MB of gradients: DDP's 25 MiB buckets, counted in closed form,
    are the calls the dry run makes, on one stage and on both stages of a pipeline."""
    config = read_config("tiny:dim=1024,heads=8,kv_heads=4,ffn_dim=4096,vocab=8192,batch=8")
    calibration = _Calibration(config)
    for candidate in (Candidate(1, 4, 1, 1, "1f1b", 1), Candidate(2, 2, 1, 1, "1f1b", 2)):
        for stage, measured in enumerate(measure(config, candidate)):
            calls = measured.collectives[("all_reduce", "dp")][0]
            assert calls > 1
            assert estimate(config, candidate, stage, calibration).collectives == \
                measured.collectives, (candidate.describe(), stage)


def test_the_candidates_are_every_valid_shape():
    found = candidates(CONFIG, 8, min_cp_tokens=1)
    assert len(set(found)) == len(found)
    for c in found:
        assert c.pp * c.dp * c.shard * c.cp * c.tp == 8
        assert CONFIG.heads % c.tp == 0 and c.pp <= CONFIG.layers
        local = CONFIG.batch // (c.dp * c.shard)
        assert local % c.microbatches == 0 and (c.pp == 1 or c.microbatches >= c.pp)
        # cp: 2 x cp equal chunks of a sequence, tp splitting a rank's part, one data dim
        assert CONFIG.seq % (2 * c.cp) == 0 and CONFIG.seq // c.cp % c.tp == 0
        assert c.cp == 1 or c.dp == 1 or c.shard == 1
    shapes = {(c.pp, c.dp, c.shard, c.cp, c.tp) for c in found}
    assert (2, 1, 2, 1, 2) in shapes and (1, 2, 4, 1, 1) in shapes
    assert (8, 1, 1, 1, 1) not in shapes  # 7 layers
    assert {(1, 1, 4, 2, 1), (1, 4, 1, 2, 1), (1, 1, 1, 8, 1), (2, 1, 1, 2, 2)} <= shapes
    assert (1, 2, 2, 2, 1) not in shapes  # HSDP beside cp
    # a sequence of 8 tokens: cp 4 leaves each rank 2, which tp 2 splits and tp 4 does not;
    # cp 8 cannot give each rank a head and a tail chunk
    short = {(c.cp, c.tp) for c in candidates(replace(CONFIG, seq=8), 16, min_cp_tokens=1)}
    assert (4, 2) in short and (4, 4) not in short and not any(cp == 8 for cp, _ in short)
    assert {c.schedule for c in found if c.pp > 1} == {
        "1f1b", "gpipe", "interleaved-1f1b", "zero-bubble", "zbv-zero-bubble", "dualpipe-v"}
    # two stages per rank: none where the layers (7) are fewer than 2 x pp
    assert not [c for c in found if c.schedule in ("interleaved-1f1b", "zbv-zero-bubble",
                                                   "dualpipe-v") and 2 * c.pp > 7]
    # selective checkpointing allows one backward through a region: never with a schedule
    # that splits backwards, which a real run refuses
    modes = candidates(CONFIG, 8, checkpointing=("full", "selective"))
    split = ("zero-bubble", "zbv-zero-bubble", "dualpipe-v")
    assert {c.checkpointing for c in modes if c.schedule in split} == {"full"}
    assert {c.checkpointing for c in modes if c.schedule == "1f1b"} == {"full", "selective"}
    assert max(c.tp for c in candidates(CONFIG, 8, devices_per_host=2)) == 2
    # by default, cp only where each rank keeps 4,096 tokens of a sequence or more
    assert {c.cp for c in candidates(CONFIG, 8)} == {1}
    assert {c.cp for c in candidates(replace(CONFIG, seq=16384), 8)} == {1, 2, 4}


def test_the_search_drops_what_does_not_fit_and_ranks_the_rest():
    everything = search(CONFIG, 8, COSTS, verify=0)
    peaks = sorted(e.peak_bytes for e in everything.ranked)
    limit = peaks[len(peaks) // 2]  # half of them fit
    result = search(CONFIG, 8, COSTS, device_memory=limit, verify=3)
    assert len(result.ranked) + len(result.too_big) == result.considered == len(peaks)
    assert all(e.peak_bytes <= limit for e in result.ranked)
    assert all(e.peak_bytes > limit for e in result.too_big)
    # 3 that fit as measured, and any of the 3 more estimated too big that fit as measured
    measured = [e for e in result.ranked if e.measured]
    k = len(measured)
    assert 3 <= k <= 6 and result.ranked[:k] == measured
    steps = [e.step for e in result.ranked]
    assert steps[:k] == sorted(steps[:k]) and steps[k:] == sorted(steps[k:])
    best = result.ranked[0]
    # the best's numbers are the dry run's own, stage by stage (the slowest stage's parts)
    stride = 8 // best.candidate.pp
    whole = [dry_run(CONFIG, best.candidate.dims, rank=s * stride,
                     schedule=best.candidate.schedule,
                     microbatches=best.candidate.microbatches) for s in range(best.candidate.pp)]
    assert best.peak_bytes == max(Allowance().device_bytes(r.peak_bytes) for r in whole)
    assert best.step == pytest.approx(max(
        predict(CONFIG, best.candidate.dims, r, COSTS, best.candidate.schedule,
                best.candidate.microbatches)["step"] for r in whole), rel=1e-12)
    # nothing that fits was predicted faster than the best measured one by the closed form
    assert all(e.step >= best.step * (1 - 1e-9) for e in everything.ranked
               if e.peak_bytes <= limit and e.candidate not in {m.candidate for m in measured})


def test_a_candidate_estimated_too_big_is_measured_where_it_would_beat_the_best():
    """The closed form's peak runs above the measured one as well as below: the search
    also measures up to ``verify`` candidates estimated too big by less than
    ESTIMATE_ABOVE_MEASURED, each predicted faster than the best fit measured so far,
    nearest to fitting first; one that fits as measured is ranked by what was measured."""
    everything = search(CONFIG, 4, COSTS, verify=0)
    limit = min(e.peak_bytes for e in everything.ranked) - 1  # none fits by the estimate
    estimated = {e.candidate: e.peak_bytes for e in everything.ranked}
    result = search(CONFIG, 4, COSTS, device_memory=limit, verify=2)
    found = [e for e in result.ranked if estimated[e.candidate] > limit]
    assert found and all(e.measured and e.peak_bytes <= limit for e in found)
    assert all(estimated[e.candidate] <= ESTIMATE_ABOVE_MEASURED * limit for e in found)
    steps = [e.step for e in result.ranked]
    assert steps == sorted(steps)
    measured = [e for e in result.ranked + result.too_big if e.measured]
    assert len(measured) <= 4 * 2 + 2
    # nothing fits by the closed form and none may be measured: nothing is ranked
    assert not search(CONFIG, 4, COSTS, device_memory=limit, verify=0).ranked


def test_devmesh_plan_search_prints_the_best_and_why():
    done = subprocess.run(
        [sys.executable, "-m", "devmesh", "plan", "--model", "tiny:batch=8", "--world", "4",
         "--search", "--tflops", "0.05", "--bandwidth", "tp=4,1", "--latency", "20us",
         "--block-overhead", "50us", "--copy-bandwidth", "2", "--device-memory", "2MiB",
         "--top", "3", "--verify", "2"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "candidates for 4 ranks;" in out and "do not fit in 2.00 MiB" in out
    rows = [line for line in out.splitlines() if line.strip()[:2] in ("1 ", "2 ", "3 ")]
    assert len(rows) == 3 and "(closed form only)" in rows[2] and "closed" not in rows[0]
    assert all("overhead " in row for row in rows)  # the per-block time is a part of its own
    assert "per step faster than the best other mesh" in out
    # down the order until 2 fit (at most 8), then at most 2 estimated a little too big
    assert 2 <= done.stderr.count("measuring ") <= 4 * 2 + 2
    # the same ranking as JSON: every number printed, for a script to read
    done = subprocess.run(
        [sys.executable, "-m", "devmesh", "plan", "--model", "tiny:batch=8", "--world", "4",
         "--search", "--tflops", "0.05", "--bandwidth", "tp=4,1", "--latency", "20us",
         "--block-overhead", "50us", "--copy-bandwidth", "2", "--device-memory", "2MiB",
         "--top", "3", "--verify", "0", "--json"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["world"] == 4 and found["device_memory"] == 2 * 2**20
    assert found["too_big"] > 0 and len(found["ranked"]) == 3
    steps = [c["step_seconds"] for c in found["ranked"]]
    assert steps == sorted(steps) and all(c["peak_bytes"] <= 2 * 2**20 for c in found["ranked"])
    best = found["ranked"][0]
    assert best["mesh"] in found["why"] and best["parts_seconds"]["overhead"] > 0
    assert not any(c["measured"] for c in found["ranked"])  # --verify 0: closed form only


@pytest.mark.parametrize("args, words, code", [
    (["--world", "2", "--search", "--device-memory", "1KiB", "--tflops", "1", "--bandwidth",
      "1", "--verify", "0"], "none fits", 1),
    (["--world", "4", "--search"], "give --tflops", 2),
    (["--world", "4"], "needs both --world N", 2),
    (["--world", "4", "--search", "--mesh", "dp=4", "--tflops", "1"], "drop --mesh", 2),
    (["--world", "3", "--search", "--tflops", "1", "--bandwidth", "1"],
     "no mesh of 3 ranks suits the model", 2),
    (["--world", "4", "--search", "--tflops", "1", "--bandwidth", "1", "--latency", "soon"],
     "'soon' is not a time", 2),
    (["--world", "4", "--search", "--tflops", "1", "--bandwidth", "1", "--ranks-per-device",
      "0.5"], "share one device, 1 or more", 2),
    (["--world", "4", "--search", "--tflops", "1", "--bandwidth", "1", "--block-overhead",
      "fast"], "'fast' is not a time", 2),
    (["--world", "4", "--search", "--tflops", "1", "--bandwidth", "1", "--copy-bandwidth",
      "0"], "in GB/s, above 0", 2),
    (["--world", "4", "--search", "--tflops", "1", "--bandwidth", "1",
      "--block-overhead=-1ms"], "'-1ms': a time cannot be negative", 2),
], ids=["none-fits", "no-costs", "no-search", "mesh-too", "no-shape", "bad-latency",
        "bad-sharing", "bad-overhead", "bad-copy", "negative-overhead"])
def test_devmesh_plan_search_refuses_what_it_cannot_do(capsys, args, words, code):
    from devmesh.tools.cli import main

    assert main(["plan", "--model", "tiny:batch=8", *args]) == code
    captured = capsys.readouterr()
    assert words in (captured.out if code == 1 else captured.err)


def test_a_candidate_names_its_mesh_as_plan_mesh_takes_it():
    from devmesh.tools.dry_run import parse_mesh

    c = Candidate(2, 1, 4, 2, "gpipe", 8)
    assert c.mesh == "pp=2,shard=4,tp=2" and parse_mesh(c.mesh) == c.dims
    assert c.describe() == "pp=2,shard=4,tp=2 (gpipe x 8)"
    assert Candidate(1, 1, 1, 1, "1f1b", 1).dims == {"dp": 1}
    assert replace(c, pp=1, microbatches=2).describe() == "shard=4,tp=2 (2 micro-batches)"


def test_ranks_sharing_devices_pay_a_bubble_only_where_too_few_are_busy_to_fill_them():
    """On dedicated devices a pipeline idles its bubble's share of the step; where ranks share
    devices (8 CPU ranks on 2 cores), an idle rank's core runs the busy ones, so the bubble
    costs nothing while the busy share fills the cores, and the devices' own idle time
    beyond it."""
    from devmesh.tools.dry_run.report import schedule_bubble

    candidate = Candidate(pp=4, dp=2, shard=1, tp=1, schedule="gpipe", microbatches=1)
    report = estimate(CONFIG, candidate, 0, _Calibration(CONFIG))
    bubble = schedule_bubble("gpipe", 4, 1)
    assert bubble == pytest.approx(0.75)

    def parts(ranks_per_device: float) -> dict[str, float]:
        costs = replace(COSTS, ranks_per_device=ranks_per_device)
        return predict(CONFIG, candidate.dims, report, costs, "gpipe", 1)

    dedicated, busy = parts(1), parts(1)["step"] - parts(1)["bubble"]
    assert dedicated["bubble"] == pytest.approx(busy * 3)  # idle 3/4 of the step
    assert parts(4)["bubble"] == pytest.approx(0)  # a quarter of the ranks busy fill the cores
    # two ranks per device: the quarter of the ranks that is busy fills half of the devices
    assert parts(2)["bubble"] == pytest.approx(busy * (0.5 - 0.25) / 0.25)
    assert parts(2)["step"] == pytest.approx(2 * busy)
    # a step is never shorter than its busy time, nor longer than on dedicated devices
    for sharing in (1.5, 3, 8):
        assert busy <= parts(sharing)["step"] <= dedicated["step"]


def test_latency_is_paid_per_hop_a_collective_over_n_ranks_making_n_minus_1():
    """Each collective over n ranks pays n - 1 hops of latency (a ring's, as the
    redistribution planner counts them), each pipeline message one."""
    candidate = Candidate(pp=2, dp=1, shard=2, tp=2, schedule="1f1b", microbatches=2)
    report = estimate(CONFIG, candidate, 0, _Calibration(CONFIG))
    free = replace(COSTS, latency=0.0)
    with_latency = predict(CONFIG, candidate.dims, report, COSTS, "1f1b", 2)
    without = predict(CONFIG, candidate.dims, report, free, "1f1b", 2)
    hops = {"shard": 1, "tp": 1, "pp": 1}  # groups of 2 ranks; messages
    expected = {f"comm {label}": 0.0 for label in hops}
    for (kind, label), (calls, _) in report.collectives.items():
        expected[f"comm {label}"] += calls * hops[label] * COSTS.latency
    for key, extra in expected.items():
        assert with_latency[key] - without[key] == pytest.approx(extra, rel=1e-9), key
    wide = Candidate(pp=1, dp=1, shard=8, tp=1, schedule="1f1b", microbatches=1)
    report = estimate(CONFIG, wide, 0, _Calibration(CONFIG))
    calls = sum(c for (_, label), (c, _) in report.collectives.items() if label == "shard")
    gap = (predict(CONFIG, wide.dims, report, COSTS, "1f1b", 1)["comm shard"]
           - predict(CONFIG, wide.dims, report, free, "1f1b", 1)["comm shard"])
    assert gap == pytest.approx(calls * 7 * COSTS.latency, rel=1e-9)


def test_a_block_costs_a_fixed_time_per_micro_batch_besides_its_flops():
    """Each block's forward and backward take a fixed time per micro-batch besides their
    FLOPs (its operations' launches or dispatches): a rank pays it per block it holds and per
    micro-batch, so four micro-batches cost more than one of the same FLOPs."""
    from devmesh.tools.dry_run.report import read_costs

    costs = read_costs(0.05, "tp=4,1", None, "20us", block_overhead="1ms")
    assert costs.block_overhead == pytest.approx(1e-3)
    for candidate, blocks in ((Candidate(1, 4, 1, 1, "1f1b", 4), 7),  # every block
                              (Candidate(2, 2, 1, 1, "1f1b", 4), 4)):  # stage 0: blocks 0-3
        report = estimate(CONFIG, candidate, 0, _Calibration(CONFIG))
        with_overhead = predict(CONFIG, candidate.dims, report, costs, "1f1b", 4)
        without = predict(CONFIG, candidate.dims, report, COSTS, "1f1b", 4)
        assert with_overhead["overhead"] == pytest.approx(1e-3 * blocks * 4)
        assert "overhead" not in without  # not stated: not printed either
        assert with_overhead["compute"] == without["compute"]
        one = predict(CONFIG, candidate.dims, report, costs, "1f1b", 1)
        assert with_overhead["overhead"] - one["overhead"] == pytest.approx(1e-3 * blocks * 3)


def test_fsdps_gathered_and_scattered_bytes_are_copied_at_the_copy_bandwidth():
    """FSDP copies every byte its all-gathers and reduce-scatters carry (their unsharded
    size) into or out of the collective's flat buffer: with a copy bandwidth, those bytes
    cost that much more in their dims' part, and nothing else does."""
    from devmesh.tools.dry_run.report import read_costs

    copying = read_costs(0.05, "tp=4,1", None, "20us", copy_bandwidth=0.5)
    assert copying.copy_bandwidth == 0.5
    candidate = Candidate(pp=1, dp=2, shard=2, tp=2, schedule="1f1b", microbatches=2)
    report = estimate(CONFIG, candidate, 0, _Calibration(CONFIG))
    copied = {label: 0 for _, label in report.collectives}
    for (kind, label), (_, nbytes) in report.collectives.items():
        if kind in ("all_gather", "reduce_scatter"):
            copied[label] += nbytes
    # FSDP's over shard; sequence parallelism's over tp (its blocks of the sequence,
    # reordered); HSDP's all-reduce over dp copies nothing
    assert copied["shard"] > 0 and copied["tp"] > 0 and copied["dp"] == 0
    with_copies = predict(CONFIG, candidate.dims, report, copying, "1f1b", 2)
    free = predict(CONFIG, candidate.dims, report, COSTS, "1f1b", 2)
    for label, nbytes in copied.items():
        assert (with_copies[f"comm {label}"] - free[f"comm {label}"]
                == pytest.approx(nbytes / 0.5e9, rel=1e-9, abs=1e-15)), label
    assert with_copies["compute"] == free["compute"]


@pytest.mark.parametrize("dims, copied_twice", [
    (dict(pp=1, dp=4, shard=1, tp=2), "dp"),  # DDP over dp: gradients into buckets and back
    (dict(pp=1, dp=2, shard=2, tp=2), None),  # HSDP: the all-reduce over dp copies nothing
])
def test_ddps_gradients_are_copied_into_their_buckets_and_back(dims, copied_twice):
    """DDP packs every gradient into its bucket before the all-reduce and copies it back
    after: with a copy bandwidth its all-reduce over dp costs twice its bytes at that rate
    more; tensor parallelism's all-reduces and HSDP's over dp cost nothing more."""
    from devmesh.tools.dry_run.report import buffer_copies, read_costs

    copying = read_costs(0.05, "tp=4,1", None, "20us", copy_bandwidth=0.5)
    candidate = Candidate(**dims, schedule="1f1b", microbatches=2)
    report = estimate(CONFIG, candidate, 0, _Calibration(CONFIG))
    with_copies = predict(CONFIG, candidate.dims, report, copying, "1f1b", 2)
    free = predict(CONFIG, candidate.dims, report, COSTS, "1f1b", 2)
    reduced = {label: nbytes for (kind, label), (_, nbytes) in report.collectives.items()
               if kind == "all_reduce"}
    assert reduced.get("dp", 0) > 0 and reduced.get("tp", 0) > 0
    for label, nbytes in reduced.items():
        times = 2 if label == copied_twice else 0
        assert buffer_copies("all_reduce", label, candidate.dims) == times
        gathered = sum(n for (kind, lab), (_, n) in report.collectives.items()
                       if lab == label and kind in ("all_gather", "reduce_scatter"))
        assert (with_copies[f"comm {label}"] - free[f"comm {label}"]
                == pytest.approx((times * nbytes + gathered) / 0.5e9, rel=1e-9, abs=1e-15))


def test_each_collective_gets_its_own_measured_bandwidth(tmp_path):
    """``devmesh bench --json`` measures each collective per dim: a prediction from it gives
    each collective its own bus bandwidth (on gloo an all-gather is several times slower
    than an all-reduce), messages their dim's best, and --bandwidth overrides a dim."""
    from devmesh.tools.dry_run.report import read_costs

    bench = tmp_path / "bench.json"
    bench.write_text('{"collectives": ['
                     '{"dim": "shard", "op": "all_gather", "busbw_gbs": 0.5}, '
                     '{"dim": "shard", "op": "all_gather", "busbw_gbs": 0.25}, '
                     '{"dim": "shard", "op": "reduce_scatter", "busbw_gbs": 2.0}, '
                     '{"dim": "tp", "op": "all_reduce", "busbw_gbs": 8.0}]}')
    costs = read_costs(1.0, None, str(bench))
    assert costs.bus_bandwidth("shard", "all_gather") == 0.5  # the best of its rows
    assert costs.bus_bandwidth("shard", "reduce_scatter") == 2.0
    assert costs.bus_bandwidth("shard", "send") == 2.0  # not measured: the dim's best
    assert costs.bus_bandwidth("tp", "all_reduce") == 8.0
    stated = read_costs(1.0, "shard=3", str(bench))
    assert stated.bus_bandwidth("shard", "all_gather") == 3.0
    assert stated.bus_bandwidth("tp", "all_reduce") == 8.0

    candidate = Candidate(pp=1, dp=1, shard=8, tp=1, schedule="1f1b", microbatches=1)
    report = estimate(CONFIG, candidate, 0, _Calibration(CONFIG))
    gathered = report.collectives[("all_gather", "shard")][1]
    flat = replace(COSTS, bandwidth={}, default=1.0)
    slow_gathers = replace(flat, by_collective={("*", "all_gather"): 0.25})
    gap = (predict(CONFIG, candidate.dims, report, slow_gathers, "1f1b", 1)["comm shard"]
           - predict(CONFIG, candidate.dims, report, flat, "1f1b", 1)["comm shard"])
    assert gap == pytest.approx(gathered * 7 / 8 * (1 / 0.25 - 1 / 1.0) / 1e9, rel=1e-9)


def test_a_collective_measured_at_several_sizes_takes_its_curves_time_at_its_size():
    """Where a collective was measured at several buffer sizes over as many ranks, one call
    takes the measured time at its size (linear between the sizes around it, along the last
    two beyond, the smallest's below, never less for a larger buffer), the curve of its own
    dims before one measured over any; elsewhere bandwidth and latency as before."""
    mb = 2**20
    costs = replace(COSTS, curves={
        ("*", "all_reduce", 2): ((mb, 1e-3), (4 * mb, 2e-3), (16 * mb, 10e-3)),
        ("tp", "all_reduce", 2): ((mb, 5e-3), (mb, 4e-3), (2 * mb, 10e-3)),  # best of a size
        ("*", "all_gather", 2): ((mb, 3e-3), (4 * mb, 2e-3)),  # noise: not cheaper
        ("*", "reduce_scatter", 2): ((mb, 3e-3), (mb, 2e-3))})  # one size: no curve
    assert costs.call_seconds("dp", "all_reduce", 2, 2 * mb) == pytest.approx(1e-3 + 1e-3 / 3)
    assert costs.call_seconds("dp", "all_reduce", 2, mb / 2) == pytest.approx(1e-3)
    assert costs.call_seconds("dp", "all_reduce", 2, 32 * mb) == pytest.approx(
        2e-3 + 8e-3 * 28 / 12)
    assert costs.call_seconds("tp", "all_reduce", 2, 2 * mb) == pytest.approx(10e-3)
    assert costs.call_seconds("tp", "all_reduce", 2, 1.5 * mb) == pytest.approx(7e-3)
    assert costs.call_seconds("dp", "reduce_scatter", 2, 2 * mb) is None
    assert costs.call_seconds("dp", "all_gather", 2, 4 * mb) == pytest.approx(3e-3)
    assert costs.call_seconds("dp", "all_reduce", 4, mb) is None  # not over 4 ranks

    candidate = Candidate(pp=1, dp=4, shard=1, tp=2, schedule="1f1b", microbatches=2)
    report = estimate(CONFIG, candidate, 0, _Calibration(CONFIG))
    dp_calls, dp_bytes = report.collectives[("all_reduce", "dp")]
    parts = predict(CONFIG, candidate.dims, report, costs, "1f1b", 2)
    plain = predict(CONFIG, candidate.dims, report, COSTS, "1f1b", 2)
    # over tp: the all-reduces and all-gathers on their curves, the reduce-scatters (one
    # size measured) by bandwidth and latency: 1 hop of half the buffer at 4 GB/s
    expected = 0.0
    for (kind, label), (calls, nbytes) in report.collectives.items():
        if label == "tp":
            measured = costs.call_seconds("tp", kind, 2, nbytes / calls)
            assert (measured is None) == (kind == "reduce_scatter")
            expected += (calls * measured if measured is not None else
                         calls * COSTS.latency + nbytes / 2 / 4e9)
    assert parts["comm tp"] == pytest.approx(expected)
    assert parts["comm dp"] == plain["comm dp"] == pytest.approx(  # dp is 4: no curve
        dp_calls * 3 * COSTS.latency + dp_bytes * 2 * 3 / 4 / 1e9)


def test_every_hop_waits_the_stated_wait_besides_its_time():
    """``wait``: what each hop of a collective or message waits for peers coming from
    compute, added to its time however that time is got (curve or bandwidth)."""
    candidate = Candidate(pp=2, dp=2, shard=1, tp=2, schedule="1f1b", microbatches=4)
    report = estimate(CONFIG, candidate, 0, _Calibration(CONFIG))
    for costs in (COSTS, replace(COSTS, curves={("*", "all_reduce", 2): ((1, 1e-3), (2**30, 1.0))})):
        waiting = predict(CONFIG, candidate.dims, report, replace(costs, wait=1e-3), "1f1b", 4)
        free = predict(CONFIG, candidate.dims, report, costs, "1f1b", 4)
        hops = {label: 0 for _, label in report.collectives}
        for (kind, label), (calls, _) in report.collectives.items():
            hops[label] += calls * (1 if label == "pp" else candidate.dims[label] - 1)
        assert set(hops) == {"pp", "dp", "tp"}
        for label, count in hops.items():
            assert (waiting[f"comm {label}"] - free[f"comm {label}"]
                    == pytest.approx(count * 1e-3)), label
        assert waiting["compute"] == free["compute"]


def test_devmesh_bench_rows_give_each_dims_curves_and_a_stated_bandwidth_overrides_them(
        tmp_path):
    from devmesh.tools.dry_run.report import read_costs

    bench = tmp_path / "bench.json"
    bench.write_text('{"collectives": ['
                     '{"dim": "tp", "ranks": 2, "op": "all_reduce", "bytes": 4096, '
                     '"time_us": 100.0, "busbw_gbs": 0.04}, '
                     '{"dim": "tp", "ranks": 2, "op": "all_reduce", "bytes": 8192, '
                     '"time_us": 300.0, "busbw_gbs": 0.03}, '
                     '{"dim": "dp", "ranks": 4, "op": "all_gather", "bytes": 4096, '
                     '"time_us": 50.0, "busbw_gbs": 0.06}]}')
    costs = read_costs(1.0, None, str(bench), wait="1ms")
    assert costs.curves == {("tp", "all_reduce", 2): ((4096, pytest.approx(100e-6)),
                                                      (8192, pytest.approx(300e-6))),
                            ("dp", "all_gather", 4): ((4096, pytest.approx(50e-6)),)}
    assert costs.wait == 1e-3
    assert costs.call_seconds("tp", "all_reduce", 2, 6144) == pytest.approx(200e-6)
    stated = read_costs(1.0, "tp=3", str(bench))
    assert set(stated.curves) == {("dp", "all_gather", 4)} and stated.wait == 0.0
    with pytest.raises(Exception, match="cannot be negative"):
        read_costs(1.0, "1", None, wait="-1ms")
    for hostile in ('"bytes": 0, "time_us": 100.0', '"bytes": 4096, "time_us": -1.0',
                    '"bytes": 4096, "time_us": NaN'):
        bench.write_text('{"collectives": [{"dim": "tp", "ranks": 2, "op": "all_reduce", '
                         f'{hostile}, "busbw_gbs": 1.0}}]}}')
        with pytest.raises(DryRunError, match="not a devmesh bench --json file"):
            read_costs(1.0, None, str(bench))


@pytest.mark.parametrize("sharing", [1.0, 1.1, 4.0])
def test_ranks_sharing_devices_lend_a_lighter_stages_device_to_the_slowest(sharing):
    """Where ranks share devices, a lighter pipeline stage idle while the slowest works
    lends it its device: the step takes the stages' mean busy time, no less than the
    slowest stage's alone on a whole device (its busy time over the ranks per device), plus
    the bubble; ``lent`` says what the slowest gains. With a device per rank, the slowest
    stage's time."""
    from devmesh.tools.dry_run.search import _evaluate

    candidate = Candidate(pp=3, dp=1, shard=1, tp=1, schedule="1f1b", microbatches=6)
    calibration = _Calibration(CONFIG)
    reports = [estimate(CONFIG, candidate, stage, calibration) for stage in range(3)]
    costs = replace(COSTS, ranks_per_device=sharing)
    stages = [predict(CONFIG, candidate.dims, r, costs, "1f1b", 6) for r in reports]
    busy = [parts["step"] - parts["bubble"] for parts in stages]
    assert max(busy) > 1.2 * min(busy)  # 7 layers on 3 stages: unequal
    slowest = max(stages, key=lambda parts: parts["step"])
    evaluation = _evaluate(CONFIG, candidate, reports, costs, True)
    if sharing == 1.0:
        assert evaluation.parts == slowest
        return
    shared = max(sum(busy) / 3, max(busy) / sharing)
    assert evaluation.step == pytest.approx(shared + slowest["bubble"])
    assert evaluation.parts["lent"] == pytest.approx(shared - max(busy))
    assert evaluation.step == pytest.approx(sum(v for k, v in evaluation.parts.items()
                                                if k != "step"))
    # 1.1 ranks per device: the slowest alone on a device is the bound; 4: the mean
    assert (shared == max(busy) / sharing) == (sharing == 1.1)


def test_context_parallel_ranks_compute_their_part_and_pay_for_the_flattened_data_dim():
    """Under cp a rank computes seq / cp tokens of each sequence: shard=4,cp=2 computes what
    shard=8 does. FSDP's collectives over shard and cp flattened (``shard_cp``) are priced
    over its 8 ranks (7 hops of latency each) at the slowest of the two dims' bandwidths."""
    calibration = _Calibration(CONFIG)
    with_cp = Candidate(1, 1, 4, 1, "1f1b", 1, cp=2)
    plain = Candidate(1, 1, 8, 1, "1f1b", 1)
    costs = Costs(tflops=0.05, bandwidth={"shard": 4.0, "cp": 2.0}, latency=2e-5)
    report = estimate(CONFIG, with_cp, 0, calibration)
    parts = predict(CONFIG, with_cp.dims, report, costs, "1f1b", 1)
    plain_parts = predict(CONFIG, plain.dims, estimate(CONFIG, plain, 0, calibration),
                          costs, "1f1b", 1)
    assert parts["compute"] == pytest.approx(plain_parts["compute"])
    free = replace(costs, latency=0.0)
    calls = sum(c for (_, label), (c, _) in report.collectives.items() if label == "shard_cp")
    assert calls > 0
    gap = parts["comm shard_cp"] - predict(CONFIG, with_cp.dims, report, free, "1f1b",
                                           1)["comm shard_cp"]
    assert gap == pytest.approx(calls * 7 * costs.latency, rel=1e-9)
    slow = replace(free, bandwidth={"shard": 4.0, "cp": 1.0})
    assert predict(CONFIG, with_cp.dims, report, slow, "1f1b", 1)["comm shard_cp"] == \
        pytest.approx(2 * predict(CONFIG, with_cp.dims, report, free, "1f1b", 1)["comm shard_cp"])
