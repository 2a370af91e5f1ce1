"""A transformers model's declared tensor-parallel plan read as devmesh styles: the experts'
``moe_tp_experts`` entry and its weights' entries become one ``ExpertsTensorParallel``; what
devmesh does not apply is refused by name. No model is built: the plan is read from the
attributes every ``PreTrainedModel`` has."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from devmesh.errors import ParallelizeError
from devmesh.integrations.transformers import tensor_parallel_plan
from devmesh.parallel import ColwiseParallel, ExpertsTensorParallel, RowwiseParallel


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(2, 4, 2))
        self.down_proj = nn.Parameter(torch.zeros(2, 2, 2))


def _layer(experts: bool) -> nn.Module:
    layer = nn.Module()
    layer.self_attn = nn.Module()
    layer.self_attn.q_proj = nn.Linear(2, 2)
    layer.self_attn.o_proj = nn.Linear(2, 2)
    layer.mlp = nn.Module()
    if experts:
        layer.mlp.experts = _Experts()
    else:
        layer.mlp.gate_proj = nn.Linear(2, 2)
    return layer


def declaring(plan: dict[str, str], experts=(True, False)) -> nn.Module:
    """A model shaped as transformers' (``layers.N.self_attn`` / ``layers.N.mlp``), each
    layer with experts or a dense MLP, declaring ``plan``."""
    model = nn.Module()
    model.layers = nn.ModuleList(_layer(e) for e in experts)
    model._tp_plan = plan
    model.config = object()
    return model


MIXTRAL = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
           "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
           "layers.*.mlp.experts.down_proj": "rowwise",
           "layers.*.mlp.experts": "moe_tp_experts"}


def test_a_mixture_of_experts_plan_splits_every_expert_as_one_style():
    plan = tensor_parallel_plan(declaring(MIXTRAL))
    assert sorted(plan) == ["layers.*.mlp.experts", "layers.*.self_attn.o_proj",
                            "layers.*.self_attn.q_proj"]
    experts = plan["layers.*.mlp.experts"]
    assert isinstance(experts, ExpertsTensorParallel)
    assert experts.colwise == {"gate_up_proj": 2} and experts.rowwise == ("down_proj",)
    assert isinstance(plan["layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["layers.*.self_attn.o_proj"], RowwiseParallel)


def test_experts_stored_in_by_out_are_split_on_the_dims_their_styles_name():
    """Llama 4's experts hold (E, in, out) and transformers splits them by dim: the packed
    gate/up on dim -1 (``packed_rowwise``), down on dim -2 (``colwise``). As math they are
    still a column/row pair: gate/up split on its outputs, down on its inputs."""
    plan = dict(MIXTRAL, **{"layers.*.mlp.experts.gate_up_proj": "packed_rowwise",
                            "layers.*.mlp.experts.down_proj": "colwise"})
    experts = tensor_parallel_plan(declaring(plan))["layers.*.mlp.experts"]
    assert experts.transposed
    assert experts.colwise == {"gate_up_proj": 2} and experts.rowwise == ("down_proj",)
    assert not tensor_parallel_plan(declaring(MIXTRAL))["layers.*.mlp.experts"].transposed


def test_experts_left_to_ep_leave_the_plan_with_their_weights():
    plan = tensor_parallel_plan(declaring(MIXTRAL), leave_out=["layers.0.mlp.experts"])
    assert "layers.*.mlp.experts" not in plan and len(plan) == 2


def test_entries_for_modules_the_model_lacks_are_left_out():
    plan = dict(MIXTRAL, **{"layers.*.mlp.gate_proj": "colwise"})
    # every layer with experts (no dense MLP): the dense MLP's entry names nothing
    assert "layers.*.mlp.gate_proj" not in tensor_parallel_plan(declaring(plan, (True, True)))
    # every layer dense: the experts' entries go, their weights' with them
    dense = tensor_parallel_plan(declaring(plan, (False, False)))
    assert sorted(dense) == ["layers.*.mlp.gate_proj", "layers.*.self_attn.o_proj",
                             "layers.*.self_attn.q_proj"]


def test_an_expert_weight_split_another_way_is_refused_by_name():
    plan = dict(MIXTRAL, **{"layers.*.mlp.experts.gate_up_proj": "local_colwise"})
    with pytest.raises(ParallelizeError, match="splits expert weight "
                       "'layers.*.mlp.experts.gate_up_proj' as 'local_colwise'"):
        tensor_parallel_plan(declaring(plan))


def test_a_style_devmesh_does_not_apply_is_refused_naming_those_it_does():
    with pytest.raises(ParallelizeError, match=r"names styles devmesh does not apply: "
                       r"\{'layers.\*.self_attn.o_proj': 'sequence_parallel_gather'\}"):
        tensor_parallel_plan(declaring({"layers.*.self_attn.o_proj":
                                        "sequence_parallel_gather"}))
