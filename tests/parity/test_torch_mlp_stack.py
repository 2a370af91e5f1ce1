"""torch's own 2-D (FSDP x TP) test model, ``MLPStack`` from ``torch.testing._internal
.common_fsdp``, parallelized by its own ``parallelize`` method with only torch's TP styles and
``fully_shard`` switched to devmesh's: uneven hidden sizes, ``ColwiseParallel`` /
``RowwiseParallel(use_local_output=False)`` (DTensor activations between the layers),
sequence parallelism on a LayerNorm and torch's composable activation ``checkpoint`` on every
unit. It failed in devmesh's FSDP (its saved-tensor hook touched the storage of a DTensor-like
activation); now it trains as single-process training does, as torch's FSDP2 + TP do."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from devmesh import init_device_mesh

STEPS = 3


def _model(sequence_parallel: bool):
    from torch.testing._internal.common_fsdp import MLPStack

    torch.manual_seed(0)
    return MLPStack(6, with_seq_parallel=sequence_parallel).double()


def _train(model, dp_rank: int = 0, dp_size: int = 1) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for step in range(STEPS):
        x = torch.randn(4, 8, 6, generator=torch.Generator().manual_seed(step),
                        dtype=torch.float64).chunk(dp_size)[dp_rank]
        out = model(x)
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        loss = out.pow(2).mean()
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def _parallel(sequence_parallel: bool):
    from torch.testing._internal import common_fsdp

    import devmesh.parallel as ours

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _model(sequence_parallel)
    with mock.patch.multiple(common_fsdp, parallelize_module=ours.parallelize_module,
                             ColwiseParallel=ours.ColwiseParallel,
                             RowwiseParallel=ours.RowwiseParallel,
                             SequenceParallel=ours.SequenceParallel,
                             fully_shard=ours.fully_shard):
        model.parallelize(mesh["tp"], mesh["dp"], use_activation_checkpointing=True)
    losses = _train(model, mesh["dp"].get_local_rank(), 2)
    return losses, ours.state_dict(model, full=True)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_torchs_mlp_stack_trains_as_single_process(mesh_pool, sequence_parallel):
    reference = _model(sequence_parallel)
    reference_losses = _train(reference)
    results = mesh_pool.run(_parallel, 4, sequence_parallel)
    # ranks 0 and 2 hold the two halves of the batch (dp index 0 and 1): their mean loss
    mean = [(a + b) / 2 for a, b in zip(results[0][0], results[2][0])]
    assert mean == pytest.approx(reference_losses, rel=1e-10)
    for _, full in results:
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(full[name], value, rtol=1e-10, atol=1e-10, msg=name)
