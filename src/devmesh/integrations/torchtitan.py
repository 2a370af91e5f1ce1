"""torchtitan's models as ``parallelize`` reads them: their tensor-parallel plans (torchtitan
applies them in its own ``parallelize`` functions; here in devmesh's styles) and their
blocks (``model.layers``), so that ``parallelize(model, mesh)`` takes a torchtitan Llama 3 or
Qwen3 as it takes a transformers model, in one call.

A model is recognized by its class's module (``torchtitan.models.<family>.model...``);
torchtitan is not imported here. Each plan is checked by the model tests: Llama 3's against
torchtitan's own ``apply_tp`` and ``apply_fsdp`` and one process, Qwen3's (dense and with
experts) against one process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from devmesh.integrations.plan_entries import entries_for
from devmesh.parallel.tensor_parallel import (
    ColwiseParallel,
    ExpertsTensorParallel,
    ParallelStyle,
    PrepareModuleInput,
    ReplicatedWithGradSum,
    RowwiseParallel,
    SequenceParallel,
)
from devmesh.tensor import Replicate, Shard

__all__ = ["family", "is_torchtitan_model", "tensor_parallel_plan", "blocks_of", "PLANS"]


def llama3() -> dict[str, ParallelStyle]:
    """torchtitan's Llama plan (its ``apply_tp`` without loss parallelism): the embedding
    rowwise with its output split over the sequence, the norms sequence-parallel, attention
    and feed-forward inputs gathered, their projections column- and rowwise (outputs split
    over the sequence again), the output gathered."""
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None)),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                    desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.feed_forward.w3": ColwiseParallel(),
    }


def qwen3() -> dict[str, ParallelStyle]:
    """Qwen3's blocks split as torchtitan splits them, the activations between them whole:
    attention by heads, the q/k norms on the local heads (their gradients summed over tp),
    the dense feed-forward and the shared experts column/row, every routed expert a
    column/row pair; the embedding rowwise and the output columnwise, gathered."""
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(),
        "layers.*.attention.q_norm": ReplicatedWithGradSum(),
        "layers.*.attention.k_norm": ReplicatedWithGradSum(),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(),
        "layers.*.moe.shared_experts.w1": ColwiseParallel(),
        "layers.*.moe.shared_experts.w3": ColwiseParallel(),
        "layers.*.moe.shared_experts.w2": RowwiseParallel(),
        "layers.*.moe.experts": ExpertsTensorParallel(colwise={"w1": 1, "w3": 1},
                                                      rowwise=("w2",)),
    }


#: torchtitan's model family (``torchtitan.models.<family>``) -> its plan
PLANS: dict[str, Callable[[], dict[str, ParallelStyle]]] = {"llama3": llama3, "qwen3": qwen3}


def family(model: nn.Module) -> str | None:
    """``llama3`` for ``torchtitan.models.llama3.model.model.Transformer``: the family of a
    torchtitan model, or ``None``."""
    parts = type(model).__module__.split(".")
    if len(parts) >= 3 and parts[:2] == ["torchtitan", "models"]:
        return parts[2]
    return None


def is_torchtitan_model(model: nn.Module) -> bool:
    """A torchtitan model of a family devmesh has a plan for."""
    return family(model) in PLANS


def tensor_parallel_plan(model: nn.Module, leave_out: Sequence[str] = ()
                         ) -> dict[str, ParallelStyle]:
    """The model's family's plan, without the entries naming nothing the model has (a dense
    feed-forward's where every layer has experts) or inside ``leave_out`` (experts split over
    ``ep`` instead)."""
    return entries_for(model, PLANS[family(model)](), leave_out)  # type: ignore[index]


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (``model.layers``, a ``ModuleDict``: a pipeline stage keeps
    its own), each an FSDP unit and a checkpointed region, as torchtitan's ``apply_fsdp``
    and ``apply_ac`` take them."""
    layers = getattr(model, "layers", None)
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else []


def heads(model: nn.Module) -> tuple[int, int] | None:
    """The query and key/value heads of the model's attention (``model_args``)."""
    args = getattr(model, "model_args", None)
    n = getattr(args, "n_heads", None)
    if not n:
        return None
    return n, getattr(args, "n_kv_heads", None) or n
