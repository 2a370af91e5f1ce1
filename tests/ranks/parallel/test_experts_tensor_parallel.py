"""``ExpertsTensorParallel``: stacked SwiGLU experts (gate and up packed in one weight, as
transformers stores them) split over tp, every expert a column/row pair, against the same
module in one process — outputs and the gradients of the weights, the tokens and the routing
weights (float64, relative to the largest value); the parts split unevenly as ``torch.chunk``; and what it cannot split,
refused by name on every rank. And ``HeadwiseParallel``: parameters with an entry per
attention head (gpt-oss's sinks) split with the heads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from devmesh import init_device_mesh
from helpers import caught

EXPERTS, HIDDEN, TOKENS, TOP = 4, 8, 10, 2


class StackedExperts(nn.Module):
    """Experts held stacked, ``(E, 2I, H)`` and ``(E, H, I)``, called with the tokens, each
    token's experts and their weights: transformers' experts as they compute."""

    def __init__(self, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 2 * intermediate, HIDDEN))
        self.down_proj = nn.Parameter(torch.randn(EXPERTS, HIDDEN, intermediate))
        if bias:  # gpt-oss's names: each weight's bias, (E, out)
            self.gate_up_proj_bias = nn.Parameter(torch.randn(EXPERTS, 2 * intermediate))
            self.down_proj_bias = nn.Parameter(torch.randn(EXPERTS, HIDDEN))

    def forward(self, x, index, weights):
        out = torch.zeros_like(x)
        biases = hasattr(self, "down_proj_bias")
        for e in range(EXPERTS):
            token, slot = torch.where(index == e)
            gate_up = F.linear(x[token], self.gate_up_proj[e],
                               self.gate_up_proj_bias[e] if biases else None)
            gate, up = gate_up.chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e],
                         self.down_proj_bias[e] if biases else None)
            out = out.index_add(0, token, y * weights[token, slot, None])
        return out


def _inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64, requires_grad=True)
    index = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP] for _ in range(TOKENS)])
    weights = torch.rand(TOKENS, TOP, generator=g, dtype=torch.float64, requires_grad=True)
    return x, index, weights


def split_experts(intermediate: int, bias: bool = False):
    from devmesh.parallel import ExpertsTensorParallel, parallelize_module, state_dict

    torch.manual_seed(0)
    ref = StackedExperts(intermediate, bias).double()
    torch.manual_seed(0)
    experts = StackedExperts(intermediate, bias).double()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    parallelize_module(experts, mesh, ExpertsTensorParallel())
    local = tuple(experts.gate_up_proj.shape)
    x, index, weights = _inputs()
    want = ref(x, index, weights)
    want.pow(2).sum().backward()
    want_grads = (x.grad.clone(), weights.grad.clone())
    x.grad = weights.grad = None
    got = experts(x, index, weights)
    got.pow(2).sum().backward()
    full = state_dict(experts, full=True)
    grads = {"gate_up_proj": experts.gate_up_proj.grad, "down_proj": experts.down_proj.grad}
    # this rank's features of every expert: gate's and up's, side by side
    rank = mesh.get_local_rank()
    step = -(-intermediate // 2)
    mine = slice(rank * step, min((rank + 1) * step, intermediate))
    gate_up = ref.gate_up_proj.grad
    want_block = torch.cat([gate_up[:, :intermediate][:, mine],
                            gate_up[:, intermediate:][:, mine]], dim=1)

    def error(a, b):  # relative to the largest value
        return ((a - b).abs().max() / b.abs().max()).item()

    bias_grads = 0.0
    if bias:  # gate/up's bias split as its columns; down's added once, its gradient whole
        gate_up = ref.gate_up_proj_bias.grad
        bias_grads = max(
            error(experts.gate_up_proj_bias.grad,
                  torch.cat([gate_up[:, :intermediate][:, mine],
                             gate_up[:, intermediate:][:, mine]], dim=1)),
            error(experts.down_proj_bias.grad, ref.down_proj_bias.grad))
    return {
        "bias grads": bias_grads,
        "local": local,
        "output": error(got, want),
        "input grads": max(error(x.grad, want_grads[0]), error(weights.grad, want_grads[1])),
        "weight grads": max(error(grads["gate_up_proj"], want_block),
                            error(grads["down_proj"], ref.down_proj.grad[:, :, mine])),
        "state": all(torch.equal(full[k], v) for k, v in ref.state_dict().items()),
    }


@pytest.mark.parametrize("bias", [False, True])
def test_experts_split_over_tp_compute_as_one_process(mesh_pool, bias):
    for rank, result in enumerate(mesh_pool.run(split_experts, 2, 6, bias)):
        assert result["local"] == (EXPERTS, 6, HIDDEN)  # 3 of gate's 6, 3 of up's
        assert result["state"]
        assert max(result["output"], result["input grads"], result["weight grads"],
                   result["bias grads"]) < 1e-12, (rank, result)


@pytest.mark.parametrize("bias", [False, True])
def test_experts_of_uneven_features_split_each_part_as_torch_chunk(mesh_pool, bias):
    results = mesh_pool.run(split_experts, 2, 5, bias)  # 5 features: 3 and 2 per rank
    assert [r["local"] for r in results] == [(EXPERTS, 6, HIDDEN), (EXPERTS, 4, HIDDEN)]
    for result in results:
        assert result["state"]
        assert max(result["output"], result["input grads"], result["weight grads"],
                   result["bias grads"]) < 1e-12


def refusals():
    from devmesh.parallel import ExpertsTensorParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    out = {}
    other = StackedExperts(4)
    other.scale = nn.Parameter(torch.ones(EXPERTS))  # not a weight's bias
    out["other"] = caught(lambda: parallelize_module(other, mesh, ExpertsTensorParallel()))
    shaped = StackedExperts(4)
    shaped.down_proj_bias = nn.Parameter(torch.randn(EXPERTS, HIDDEN + 1))
    out["bias shape"] = caught(lambda: parallelize_module(shaped, mesh,
                                                          ExpertsTensorParallel()))
    out["missing"] = caught(lambda: parallelize_module(
        StackedExperts(4), mesh, ExpertsTensorParallel(colwise={"w1": 1}, rowwise=("w2",))))
    odd = StackedExperts(4)
    odd.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 9, HIDDEN))
    out["parts"] = caught(lambda: parallelize_module(odd, mesh, ExpertsTensorParallel(
        colwise={"gate_up_proj": 2})))
    uneven = StackedExperts(5)
    parallelize_module(uneven, mesh, ExpertsTensorParallel())
    out["dtensor"] = caught(uneven.state_dict)
    return out


def test_what_experts_tensor_parallel_cannot_split_is_refused_by_name(mesh_pool):
    for result in mesh_pool.run(refusals, 2):
        assert "holds ['scale'] besides the split weights" in result["other"][1]
        assert "'down_proj_bias' has shape (4, 9), not (4, 8)" in result["bias shape"][1]
        assert "has no parameter ['w1', 'w2']" in result["missing"][1]
        assert "9 long, which is not 2 equal packed parts" in result["parts"][1]
        assert "has no torch DTensor form" in result["dtensor"][1]


def described():
    from devmesh.parallel import ExpertsTensorParallel, describe, fully_shard, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    experts = StackedExperts(6).double()
    parallelize_module(experts, mesh["tp"], ExpertsTensorParallel())
    fully_shard(experts, mesh=mesh["dp"])
    return describe(experts)


def test_describe_shows_a_packed_weight_in_its_own_shape(mesh_pool):
    table = mesh_pool.run(described, 4)[0]
    row = next(line for line in table.splitlines() if line.startswith("gate_up_proj"))
    # half the experts (FSDP), 3 of gate's features and 3 of up's (tp)
    assert "(4, 12, 8)" in row and "(2, 6, 8) on every rank" in row, table
    assert "of the view with dim 1 cut into its 2 packed parts" in row, table


class _Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, 6, bias=False)
        self.w3 = nn.Linear(HIDDEN, 6, bias=False)
        self.w2 = nn.Linear(6, HIDDEN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _MoEBlock(nn.Module):
    """Routed experts and a shared expert on a ``(batch, sequence, hidden)`` input."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = StackedExperts(6)
        self.shared = _Shared()

    def forward(self, x, index, weights):
        flat = x.reshape(-1, HIDDEN)
        return (self.experts(flat, index, weights) + self.shared(flat)).view(x.shape)


def partial_sums_reduced_once():
    """torchtitan's plan for a mixture of experts without ``ep``: the block's sequence
    gathered, the routed and shared experts' partial sums added and reduce-scattered back to
    the sequence once (``output_layouts=Partial()`` on both); against one process."""
    from devmesh.parallel import (ColwiseParallel, ExpertsTensorParallel,
                                  PrepareModuleInputOutput, RowwiseParallel, parallelize_module)
    from devmesh.tensor import Partial, Replicate, Shard

    torch.manual_seed(0)
    ref = _MoEBlock().double()
    block = _MoEBlock().double()
    block.load_state_dict(ref.state_dict())
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    parallelize_module(block, mesh, {
        "": PrepareModuleInputOutput(input_layouts=(Shard(1),),
                                     desired_input_layouts=(Replicate(),), use_local_input=True,
                                     output_layouts=(Partial(),),
                                     desired_output_layouts=(Shard(1),)),
        "experts": ExpertsTensorParallel(output_layouts=Partial()),
        "shared.w1": ColwiseParallel(), "shared.w3": ColwiseParallel(),
        "shared.w2": RowwiseParallel(output_layouts=Partial())})
    _, index, weights = _inputs()  # the first 8 tokens' routing: 2 sequences of 4
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, HIDDEN, generator=g, dtype=torch.float64, requires_grad=True)
    index, weights = index[:8], weights[:8].detach().requires_grad_(True)
    want = ref(x, index, weights)
    want.pow(2).sum().backward()
    rank = mesh.get_local_rank()
    mine = x.detach()[:, 2 * rank:2 * rank + 2].clone().requires_grad_(True)
    w = weights.detach().clone().requires_grad_(True)
    got = block(mine, index, w)
    got.pow(2).sum().backward()

    def error(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    return {
        "output": error(got, want[:, 2 * rank:2 * rank + 2]),
        "input grad": error(mine.grad, x.grad[:, 2 * rank:2 * rank + 2]),  # its positions'
        "shared w2 grad": error(block.shared.w2.weight.grad,
                                ref.shared.w2.weight.grad[:, 3 * rank:3 * rank + 3]),
    }


def test_partial_outputs_of_experts_and_shared_experts_reduce_once_as_one_process(mesh_pool):
    for result in mesh_pool.run(partial_sums_reduced_once, 2):
        assert max(result["output"], result["input grad"], result["shared w2 grad"]) < 1e-12, \
            result


def headwise_refusals():
    from devmesh.parallel import parallelize_module
    from devmesh.parallel.tensor_parallel import HeadwiseParallel

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    attention = nn.Module()
    attention.sinks = nn.Parameter(torch.randn(3))  # 3 heads: tp 2 splits no whole heads
    odd = caught(lambda: parallelize_module(attention, mesh, HeadwiseParallel()))
    missing = caught(lambda: parallelize_module(nn.Linear(2, 2), mesh, HeadwiseParallel()))
    attention.sinks = nn.Parameter(torch.arange(4.0))
    parallelize_module(attention, mesh, HeadwiseParallel())
    return odd, missing, attention.sinks.detach().clone()


def test_per_head_parameters_split_with_the_heads_or_are_refused_by_name(mesh_pool):
    """gpt-oss's attention sinks, one per head (the model trains as one process under tp
    with them: tests/ranks/models/test_transformers_models.py)."""
    for rank, (odd, missing, local) in enumerate(mesh_pool.run(headwise_refusals, 2)):
        assert "Module.sinks has 3 heads on dim 0, which tp=2 does not divide" in odd[1]
        assert "Linear has no parameter ['sinks']" in missing[1]
        assert local.tolist() == [2.0 * rank, 2.0 * rank + 1]  # this rank's heads
