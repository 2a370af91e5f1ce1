"""torchtitan's own Llama 3 model (the ``torchtitan`` package, a tiny random config, float64)
under devmesh's parallelisms — ``parallelize(model, mesh)``, which applies torchtitan's
tensor-parallel plan in devmesh's styles and shards its blocks, over devmesh's mesh — against torchtitan's own ``apply_tp`` and
``apply_fsdp`` (torch's tensor parallelism and FSDP2) over torch's mesh of the same shape,
and both against the model trained in one process on the whole batch."""

from __future__ import annotations

import pytest
import torch

# torchtitan is an extra of its own, which the test command installs (pip install -e
# '.[test,docs,torchtitan]'); the ranks import it, collection only checks it
pytest.importorskip("torchtitan", reason="torchtitan is not installed: pip install -e "
                    "'.[torchtitan]' runs this comparison")

VOCAB, SEQ, BATCH, STEPS = 64, 13, 4, 3  # 12 input tokens: sequence parallelism splits them


def make() -> torch.nn.Module:
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    torch.manual_seed(0)
    model = Transformer(TransformerModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                             vocab_size=VOCAB, max_seq_len=32))
    with torch.no_grad():
        model.init_weights()
    return model.double()


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def _train(model: torch.nn.Module, rows: slice, scale: float = 1.0) -> list[float]:
    """``STEPS`` AdamW steps on ``rows`` of each batch; ``scale``: of the loss backpropagated
    (torchtitan's FSDP sums the ranks' gradients: its trainer divides the loss instead)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ),
                            generator=torch.Generator().manual_seed(step))[rows]
        loss = _loss(model, ids)
        (loss * scale).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_both(checkpointing: str):
    """devmesh's FSDP x TP and torchtitan's own (torch's) on (dp_shard 2, tp 2): the losses
    on each rank's rows and the trained parameters, each against one process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torchtitan.models.llama3.infra.parallelize import apply_fsdp, apply_tp

    from devmesh import init_device_mesh
    from devmesh.parallel import parallelize, state_dict

    dims = ("dp_shard", "tp")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=dims)
    ours = make()
    # torchtitan's plan and blocks, which parallelize knows for torchtitan's Llama 3
    parallelize(ours, mesh, activation_checkpointing=checkpointing)
    dp = mesh["dp_shard"].get_local_rank()
    rows = slice(2 * dp, 2 * dp + 2)
    our_losses = _train(ours, rows)
    our_state = state_dict(ours, full=True)

    theirs = make()
    tmesh = torch_mesh("cpu", (2, 2), mesh_dim_names=dims)
    apply_tp(theirs, tmesh["tp"], loss_parallel=False, enable_float8_tensorwise_tp=False)
    if checkpointing == "full":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        for name, block in list(theirs.layers.named_children()):
            theirs.layers.register_module(name, checkpoint_wrapper(block,
                                                                   preserve_rng_state=False))
    apply_fsdp(theirs, tmesh["dp_shard"], param_dtype=torch.float64,
               reduce_dtype=torch.float64, pp_enabled=False)
    their_losses = _train(theirs, rows, scale=1 / tmesh["dp_shard"].size())
    their_state = {k.replace("_checkpoint_wrapped_module.", ""):
                   v.full_tensor() if hasattr(v, "full_tensor") else v
                   for k, v in theirs.state_dict().items()}

    # one process on the whole batch; its loss on this rank's rows before each step
    ref = make()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    row_losses = []
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        with torch.no_grad():
            row_losses.append(_loss(ref, ids[rows]).item())
        _loss(ref, ids).backward()
        opt.step()
        opt.zero_grad()
    want = ref.state_dict()
    dist.barrier()
    return {
        "keys": sorted(our_state) == sorted(want) == sorted(their_state),
        "ours": max(abs(a - b) for a, b in zip(our_losses, row_losses, strict=True)),
        "theirs": max(abs(a - b) for a, b in zip(their_losses, row_losses, strict=True)),
        "apart": max(abs(a - b) for a, b in zip(our_losses, their_losses, strict=True)),
        "our_params": max((our_state[k] - v).abs().max().item() for k, v in want.items()),
        "their_params": max((their_state[k] - v).abs().max().item() for k, v in want.items()),
        "params_apart": max((our_state[k] - v).abs().max().item()
                            for k, v in their_state.items()),
    }


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_torchtitans_llama_under_devmesh_fsdp_and_tp_trains_as_torch_and_one_process(
        mesh_pool, checkpointing):
    for result in mesh_pool.run(train_both, 4, checkpointing):
        assert result["keys"], "state dict names differ"
        # devmesh and torchtitan's own FSDP2 + TP agree (the same split, the same sums)
        assert result["apart"] <= 1e-12 and result["params_apart"] <= 1e-12, result
        # against one process: torchtitan's rotary embedding computes in float32
        # (xq.float()), where a split that sums a float64 value in another order can round
        # it one float32 step apart (6e-8), which three AdamW steps carry into the weights
        for key in ("ours", "theirs"):
            assert result[key] <= 1e-9, result
        for key in ("our_params", "their_params"):
            assert result[key] <= 1e-5, result
