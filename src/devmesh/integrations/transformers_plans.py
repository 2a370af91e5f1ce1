"""devmesh's tensor-parallel plans for transformers architectures whose own plan leaves
their blocks whole: GPT-2 declares none, gpt-oss only its head. With one of these,
``parallelize(model, mesh)`` splits such a model over ``tp`` as it splits Llama by
Llama's own plan, with no ``tp_plan=`` to write.

A plan is written for the base model (``GPT2Model``, ``GptOssModel``), plus the entries of
the head around it (``lm_head``): :func:`plan_for` puts the base model's entries under the
model's ``base_model_prefix`` when it is given the model with a head, as transformers'
``post_init`` does with a declared plan. Each plan is checked against one process by the
model tests (every parallelism of ``parallelize`` over them).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from devmesh.parallel.tensor_parallel import (
    ColwiseParallel,
    ExpertsTensorParallel,
    HeadwiseParallel,
    ParallelStyle,
    RowwiseParallel,
)
from devmesh.tensor import Replicate

__all__ = ["PLANS", "plan_for"]

Entries = dict[str, ParallelStyle]


def gpt2() -> tuple[Entries, Entries]:
    """The MLP's ``Conv1D`` pair split (column, row); the attention's packed q/k/v
    projection split by columns with its output gathered (GPT-2 cuts it into q, k and v by
    the config's width, not by what a rank holds, as transformers' plans treat a fused
    projection: Phi-3's ``qkv_proj``), the output projection split on its input; the tied
    embedding and head split on the vocabulary."""
    return ({"wte": RowwiseParallel(input_layouts=Replicate()),
             "h.*.attn.c_attn": ColwiseParallel(output_layouts=Replicate()),
             "h.*.attn.c_proj": RowwiseParallel(input_layouts=Replicate()),
             "h.*.mlp.c_fc": ColwiseParallel(),
             "h.*.mlp.c_proj": RowwiseParallel()},
            {"lm_head": ColwiseParallel(output_layouts=Replicate())})


def gpt_oss() -> tuple[Entries, Entries]:
    """The attention split by heads (q, k, v by columns, o by rows, the per-head ``sinks``
    with the heads) and every expert over tp: ``gate_up_proj`` ``(E, in, out)`` with gate
    and up interleaved by column, so contiguous blocks of columns hold whole gate/up pairs
    (one part); the biases go with their weights. The head as gpt-oss's own plan has it."""
    attention = "layers.*.self_attn"
    return ({**{f"{attention}.{p}_proj": ColwiseParallel() for p in "qkv"},
             f"{attention}.o_proj": RowwiseParallel(),
             attention: HeadwiseParallel(("sinks",)),
             "layers.*.mlp.experts": ExpertsTensorParallel(
                 colwise={"gate_up_proj": 1}, rowwise=("down_proj",), transposed=True)},
            {"lm_head": ColwiseParallel(output_layouts=Replicate())})


#: ``config.model_type`` -> the plan's (base model's entries, the head's entries)
PLANS: dict[str, Callable[[], tuple[Entries, Entries]]] = {"gpt2": gpt2, "gpt_oss": gpt_oss}


def plan_for(model: nn.Module) -> Entries | None:
    """devmesh's plan for ``model``'s architecture under ``model``'s own module names, or
    ``None`` for an architecture it has none for."""
    make = PLANS.get(getattr(getattr(model, "config", None), "model_type", None))
    if make is None:
        return None
    base, head = make()
    prefix = getattr(model, "base_model_prefix", "")
    inner = getattr(model, prefix, None) if prefix else None
    if not isinstance(inner, nn.Module) or inner is model:  # the base model itself
        return base
    return {**{f"{prefix}.{name}": style for name, style in base.items()}, **head}
