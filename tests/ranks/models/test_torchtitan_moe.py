"""torchtitan's own mixture of experts (the ``torchtitan`` package's Qwen3 with MoE layers:
its router, token reorderer and ``GroupedExperts``, called with the tokens sorted by expert
and each expert's count), a tiny random config in float64, under devmesh's ``parallelize``
on ``(dp_shard 2, ep 2)``: the experts split over ``ep`` as they are (no subclass, no copied
weights), trained as the model in one process on the whole batch."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed: pip install -e "
                    "'.[torchtitan]' runs this comparison")

VOCAB, SEQ, BATCH, STEPS = 64, 13, 8, 3


def _histc_on_cpu() -> None:
    """torchtitan's router counts each expert's tokens with ``torch.histc`` of their expert
    indices, which torch has no CPU kernel for on integers ("histogram_cpu" not implemented
    for 'Long'; CUDA's returns the counts in the indices' dtype): the same counts from the
    indices as floats (exact below 2**53), returned as CUDA returns them."""
    histc = torch.histc
    if getattr(histc, "_counts_integers", False):
        return

    def counted(input, *args, **kwargs):
        if input.is_floating_point() or input.is_complex():
            return histc(input, *args, **kwargs)
        return histc(input.double(), *args, **kwargs).to(input.dtype)

    counted._counts_integers = True
    torch.histc = counted


def make(moe: bool = True) -> torch.nn.Module:
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    from torchtitan.models.qwen3.model.model import Qwen3Model

    _histc_on_cpu()
    torch.manual_seed(0)
    model = Qwen3Model(Qwen3ModelArgs(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, head_dim=8,
        hidden_dim=48, max_seq_len=32, moe_enabled=moe, moe_inter_dim=24,
        # the experts' for-loop: torch._grouped_mm computes in bfloat16
        moe_args=MoEArgs(num_experts=4, top_k=2, use_grouped_mm=False,
                         num_shared_experts=1, score_func="softmax")))
    with torch.no_grad():
        model.init_weights()
    return model.double()


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def train_expert_parallel(split: str = "ep", moe: bool = True):
    import torch.distributed as dist

    from devmesh import init_device_mesh
    from devmesh.parallel import parallelize, state_dict

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", split))
    model = make(moe)
    # torchtitan's blocks, and its plan for Qwen3 (attention by heads, the q/k norms on the
    # local heads, the feed-forward or shared experts column/row, every routed expert a
    # column/row pair), which parallelize knows for torchtitan's Qwen3
    parallelize(model, mesh)
    split_module = model.layers["0"].moe.experts if moe else model.layers["0"].feed_forward
    local = {name: tuple(p.shape) for name, p in split_module.named_parameters()}
    # every rank has its own rows: the data ranks are dp_shard x ep (dp_shard alone: tp's
    # ranks share theirs)
    if split == "ep":
        index, per = mesh.get_coordinate()[0] * 2 + mesh.get_coordinate()[1], 2
    else:
        index, per = mesh.get_coordinate()[0], 4
    rows = slice(per * index, per * index + per)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = _loss(model, _batch(step)[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    ours = state_dict(model, full=True)

    ref = make(moe)  # one process, the whole batch; its loss on this rank's rows
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    row_losses = []
    for step in range(STEPS):
        with torch.no_grad():
            row_losses.append(_loss(ref, _batch(step)[rows]).item())
        _loss(ref, _batch(step)).backward()
        opt.step()
        opt.zero_grad()
    want = ref.state_dict()
    dist.barrier()
    return {
        "local": local,
        "keys": sorted(ours) == sorted(want),
        "losses": max(abs(a - b) for a, b in zip(losses, row_losses, strict=True)),
        "params": max((ours[k] - v).abs().max().item() for k, v in want.items()),
    }


def test_torchtitans_moe_experts_split_over_ep_train_as_one_process(mesh_pool):
    for result in mesh_pool.run(train_expert_parallel, 4):
        assert result["keys"], "state dict names differ"
        # 2 of the 4 experts on each ep rank, then FSDP over dp_shard splits them again
        assert result["local"] == {"w1": (1, 24, 32), "w2": (1, 32, 24), "w3": (1, 24, 32)}
        assert result["losses"] <= 1e-12 and result["params"] <= 1e-12, result


def test_torchtitans_moe_experts_split_over_tp_train_as_one_process(mesh_pool):
    for result in mesh_pool.run(train_expert_parallel, 4, "tp"):
        assert result["keys"], "state dict names differ"
        # every expert's hidden features halved over tp, then FSDP halves the experts
        assert result["local"] == {"w1": (2, 12, 32), "w2": (2, 32, 12), "w3": (2, 12, 32)}
        assert result["losses"] <= 1e-12 and result["params"] <= 1e-12, result


def test_torchtitans_dense_qwen3_split_over_tp_trains_as_one_process(mesh_pool):
    """Without experts, Qwen3's feed-forward is the column/row pair of parallelize's plan for
    torchtitan's Qwen3."""
    for result in mesh_pool.run(train_expert_parallel, 4, "tp", False):
        assert result["keys"], "state dict names differ"
        # the hidden features halved over tp, then FSDP halves dim 0 of each block
        assert result["local"] == {"w1.weight": (12, 32), "w2.weight": (16, 24),
                                   "w3.weight": (12, 32)}, result["local"]
        assert result["losses"] <= 1e-12 and result["params"] <= 1e-12, result
