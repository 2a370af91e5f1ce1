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
    dims = STRATEGIES[strategy]
    real = mesh_pool.run(real_step, 8, dims)
    for rank, measured in enumerate(real):
        predicted = dry_run(CONFIG, dims, rank=rank)
        assert predicted.coordinate == measured.coordinate
        assert predicted.collectives == measured.collectives, rank
        assert predicted.parameter_bytes == measured.parameter_bytes
        assert predicted.optimizer_bytes == measured.optimizer_bytes
        assert predicted.activation_bytes_per_microbatch == pytest.approx(
            measured.activation_bytes_per_microbatch, rel=0.15)
