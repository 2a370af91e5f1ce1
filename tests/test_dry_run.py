"""The dry run (devmesh.tools.dry_run, ``devmesh plan --model``): one rank of a job measured
on ``meta`` tensors under torch's fake process group, checked against the same step run for
real on 8 gloo ranks — the collectives per rank and mesh dim, and the bytes each rank holds."""

from __future__ import annotations

import pytest
import torch

from devmesh.tools.dry_run import TransformerConfig, dry_run

CONFIG = TransformerConfig(layers=4, dim=64, heads=8, kv_heads=8, ffn_dim=128, vocab=256,
                           seq=16, batch=16, dtype="float32")

STRATEGIES = {
    "ddp": {"dp": 8},
    "fsdp": {"shard": 8},
    "hsdp": {"dp": 2, "shard": 4},
    "tp": {"tp": 8},
    "fsdp-tp": {"shard": 4, "tp": 2},
    "pp-fsdp-tp": {"pp": 2, "shard": 2, "tp": 2},
}


def real_step(dims):
    import os

    return dry_run(CONFIG, dims, rank=int(os.environ["RANK"]), device="cpu")


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_the_dry_run_counts_what_a_real_step_sends_and_holds(mesh_pool, strategy):
    """Every rank's collectives per kind and mesh dim — calls and bytes — and its parameter,
    gradient and optimizer bytes equal the real step's exactly; the pipeline's against
    devmesh's own runner running the step (its messages included)."""
    dims = STRATEGIES[strategy]
    real = mesh_pool.run(real_step, 8, dims)
    runner = mesh_pool.run(pipelined_step, 8, dims) if "pp" in dims else None
    for rank, measured in enumerate(real):
        predicted = dry_run(CONFIG, dims, rank=rank)
        assert predicted.coordinate == measured.coordinate
        assert predicted.collectives == measured.collectives, rank
        if runner is not None:
            assert predicted.collectives == runner[rank], rank
        assert predicted.parameter_bytes == measured.parameter_bytes
        assert predicted.optimizer_bytes == measured.optimizer_bytes
        assert predicted.activation_bytes_per_microbatch == pytest.approx(
            measured.activation_bytes_per_microbatch, rel=0.15)


def pipelined_step(dims):
    """The pipeline case run by devmesh's own runner (1F1B, 4 micro-batches) on the stage
    the dry run builds: its collectives over the step."""
    import torch.nn.functional as F

    from devmesh import comm_stats
    from devmesh.layout.schedule import build_schedule
    from devmesh.parallel.pipeline import PipelineRunner
    from devmesh.tools.dry_run.run import build_rank_model

    mesh, model = build_rank_model(CONFIG, dims, "cpu")
    stage = mesh.get_coordinate()[0]
    runner = PipelineRunner({stage: model}, mesh, build_schedule("1f1b", 2, 4),
                            lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
    data = CONFIG.batch // dims["shard"]
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, CONFIG.vocab, (data, CONFIG.seq), generator=gen)
    with comm_stats() as stats:
        runner.step(x if stage == 0 else None, x if stage == 1 else None)
    return {key: tuple(value) for key, value in stats.records.items()}
