"""Hugging Face transformers' models as they declare themselves: their tensor-parallel plan
(``model._tp_plan``: the class's ``_tp_plan`` and the config's ``base_model_tp_plan`` merged
under the model's module names by ``post_init``) as devmesh styles, and their blocks
(``_no_split_modules``: the decoder layers) as the units to shard and checkpoint.

transformers is not imported here: a model is read through the attributes every
``PreTrainedModel`` has, so this module costs nothing to a script without transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from devmesh.errors import ParallelizeError
from devmesh.integrations import transformers_plans
from devmesh.integrations.plan_entries import entries_for
from devmesh.mesh import DeviceMesh
from devmesh.parallel.context_parallel import sequence_positions, shard_sequence
from devmesh.parallel.tensor_parallel import (
    ColwiseParallel,
    ExpertsTensorParallel,
    ParallelStyle,
    ReplicatedWithGradSum,
    RowwiseParallel,
)
from devmesh.tensor import Replicate

__all__ = ["attention_window", "turn_off_caches", "is_transformers_model",
           "tensor_parallel_plan", "blocks_of", "STYLES", "context_parallel_batch"]

# transformers' style names (transformers.integrations.tensor_parallel's ParallelInterface)
# and the devmesh style that computes the same thing
STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise": RowwiseParallel,
    "rowwise_rep": RowwiseParallel,
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
    "replicated_with_grad_allreduce": ReplicatedWithGradSum,
}


def is_transformers_model(model: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (its class's module is transformers'), or a model
    that declares a plan as one does."""
    return hasattr(model, "_tp_plan") and hasattr(model, "config")


def tensor_parallel_plan(model: nn.Module, leave_out: Sequence[str] = ()
                         ) -> dict[str, ParallelStyle]:
    """The model's own tensor-parallel plan as devmesh styles, keyed by module name (``*``
    for one segment, as transformers and ``parallelize_module`` read it) — or, for an
    architecture whose own plan leaves its blocks whole (GPT-2, gpt-oss), devmesh's
    (:mod:`devmesh.integrations.transformers_plans`) — without the
    entries for the modules named in ``leave_out`` and theirs (experts split over ``ep``
    instead), and without those naming nothing the model has (a dense MLP's where every
    layer has experts; another pipeline stage's layers). A style devmesh does not compute
    is refused by name, listing those it does."""
    declared: Mapping[str, str] = getattr(model, "_tp_plan", None) or {}
    # an architecture whose own plan leaves its blocks whole (entries for the layers carry
    # a '*'), and for which devmesh has one: devmesh's
    own = None if any("*" in name for name in declared) else transformers_plans.plan_for(model)
    if not declared and own is None:
        raise ParallelizeError(
            f"{type(model).__name__} declares no tensor-parallel plan (its _tp_plan and its "
            "config's base_model_tp_plan are empty): pass tp_plan={module name: style} "
            "(devmesh.parallel's ColwiseParallel, RowwiseParallel, ...)")
    if own is not None:
        return entries_for(model, own, leave_out)
    plan: dict[str, ParallelStyle] = {}
    unknown = {}
    declared = entries_for(model, declared, leave_out)
    for name, style in declared.items():
        if style == "moe_tp_experts":
            plan[name] = _experts_style(name, declared)
            continue
        if _owner(name) in declared and declared[_owner(name)] == "moe_tp_experts":
            continue  # one of those experts' weights: split by their style
        make = STYLES.get(style)
        if make is None:
            unknown[name] = style
        else:
            plan[name] = make()
    if unknown:
        raise ParallelizeError(
            f"{type(model).__name__}'s tensor-parallel plan names styles devmesh does not "
            f"apply: {unknown}; devmesh applies {sorted(STYLES)}. Pass tp_plan= with "
            "devmesh styles for those modules, or a mesh without 'tp'"
            + ("; experts are split over an 'ep' dim instead (e.g. mesh dim names "
               "('dp_shard', 'ep', 'tp'))" if any("expert" in n for n in unknown) else ""))
    return plan


# how transformers splits a stacked expert weight under ``moe_tp_experts``: the dim its
# style names (colwise: dim -2, rowwise: dim -1, whatever the layout) and the number of parts
# packed in it (gate and up side by side)
_EXPERT_WEIGHTS = {"packed_colwise": (-2, 2), "colwise": (-2, 1), "rowwise": (-1, 1),
                   "packed_rowwise": (-1, 2)}


def _owner(name: str) -> str:
    return name.rpartition(".")[0]


def _experts_style(name: str, declared: Mapping[str, str]) -> ParallelStyle:
    """transformers' ``moe_tp_experts`` entry and its weights' entries (``<name>.<weight>``)
    as one :class:`ExpertsTensorParallel`."""
    splits: dict[str, tuple[int, int]] = {}
    for entry, style in declared.items():
        if _owner(entry) != name:
            continue
        how = _EXPERT_WEIGHTS.get(style)
        if how is None:
            raise ParallelizeError(
                f"the tensor-parallel plan splits expert weight {entry!r} as {style!r}; "
                f"devmesh splits stacked expert weights as {sorted(_EXPERT_WEIGHTS)}")
        splits[entry.rpartition(".")[2]] = how
    # a packed weight (gate and up) is split on its output dim: on dim -1, the experts are
    # stored (E, in, out) and multiplied as x @ W[e] (Llama 4's)
    transposed = any(dim == -1 and parts > 1 for dim, parts in splits.values())
    out_dim = -1 if transposed else -2
    colwise = {w: parts for w, (dim, parts) in splits.items() if dim == out_dim}
    rowwise = [w for w, (dim, _) in splits.items() if dim != out_dim]
    return ExpertsTensorParallel(colwise=colwise, rowwise=rowwise, transposed=transposed)


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (its ``_no_split_modules`` classes: the decoder layers),
    outermost first, in the order they are registered; each becomes an FSDP unit and an
    activation-checkpointed region."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if type(module).__name__ in names:
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found


def turn_off_caches(model: nn.Module) -> None:
    """Set ``use_cache=False`` on every config the model's modules read: a model's own and
    its parts' (a vision-language model's language model reads its ``text_config``). In
    training a key/value cache only holds memory, and a block recomputed in backward
    (activation checkpointing) or run again per micro-batch would append its keys and values
    to it a second time (transformers' own gradient checkpointing turns it off too)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False):
            config.use_cache = False


def attention_window(block: nn.Module) -> tuple[int | None, int | None]:
    """``(sliding_window, chunk_size)`` of a decoder layer's attention, as its config says:
    its entry in ``layer_types`` (``sliding_attention``, ``chunked_attention``,
    ``full_attention``), or, for a config without it, a ``sliding_window`` every layer
    uses (Mistral's). Context parallelism must know it: transformers builds the window's
    mask from the tokens a rank holds, and leaves it out where they are fewer than the
    window. Another kind of layer (linear attention, state spaces) is refused by name."""
    attention = next((m for m in block.modules()
                      if isinstance(getattr(m, "layer_idx", None), int)
                      and getattr(m, "config", None) is not None), None)
    if attention is None:
        return None, None
    config, index = attention.config, attention.layer_idx
    types = getattr(config, "layer_types", None)
    if types is not None and index < len(types):
        kind = types[index]
        if kind == "sliding_attention":
            return config.sliding_window, None
        if kind == "chunked_attention":
            return None, config.attention_chunk_size
        if kind != "full_attention":
            raise ParallelizeError(
                f"context parallelism splits softmax attention over the sequence, and layer "
                f"{index} of {type(block).__name__} is {kind!r}: build the mesh without "
                "'cp' for this model")
        return None, None
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        return window, None
    return None, None


def context_parallel_batch(input_ids: torch.Tensor, mesh: DeviceMesh, *,
                           labels: torch.Tensor | None = None, ignore_index: int = -100,
                           load_balance: bool = True) -> dict[str, torch.Tensor]:
    """This rank's share of a causal LM batch under context parallelism over the ``cp`` mesh
    ``mesh``, as keyword arguments of a transformers model's forward: its tokens
    (``input_ids``), their positions in the whole sequence (``position_ids``: rotary
    embeddings need them), and the loss's targets shifted over the *whole* sequence before
    it is split (``shift_labels``: shifting each rank's piece would lose the target of every
    piece's last token), with ``num_items_in_batch`` the whole sequence's count of targets
    divided by ``cp``; and an ``attention_mask`` of ones. No padding mask is taken: ring
    attention is causal over the whole sequence, so *right* padding is exact (give its
    targets ``ignore_index`` in ``labels``: no real token attends to a later pad), while
    *left* padding is not (real tokens would attend to the pads before them) — pad on the
    right, or pack sequences without padding.

    So each rank's ``loss`` is its targets' summed cross-entropy over ``1/cp`` of the
    batch's targets: averaged over ``cp`` (as data parallelism over ``cp`` averages the
    gradients), it is the whole batch's mean, however the ignored targets fall. ``labels``:
    the unshifted targets (default ``input_ids``), ``ignore_index`` where none."""
    labels = input_ids if labels is None else labels
    shifted = torch.nn.functional.pad(labels[..., 1:], (0, 1), value=ignore_index)
    count = (shifted != ignore_index).sum().to(torch.float64) / mesh.size()
    positions = sequence_positions(input_ids.shape[-1], mesh, load_balance=load_balance,
                                   device=input_ids.device)
    mine = shard_sequence(shifted, mesh, dim=-1, load_balance=load_balance)
    tokens = shard_sequence(input_ids, mesh, dim=-1, load_balance=load_balance)
    return {"input_ids": tokens, "position_ids": positions.expand(*input_ids.shape[:-1], -1),
            # every key a token: without a mask, transformers reads this rank's positions
            # (a head chunk and a tail) as packed sequences and masks across them
            "attention_mask": torch.ones_like(tokens),
            "labels": mine, "shift_labels": mine, "num_items_in_batch": count}
