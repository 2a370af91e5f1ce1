"""Hugging Face transformers' models as they declare themselves: their tensor-parallel plan
(``model._tp_plan``: the class's ``_tp_plan`` and the config's ``base_model_tp_plan`` merged
under the model's module names by ``post_init``) as devmesh styles, and their blocks
(``_no_split_modules``: the decoder layers) as the units to shard and checkpoint.

transformers is not imported here: a model is read through the attributes every
``PreTrainedModel`` has, so this module costs nothing to a script without transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from torch import nn

from devmesh.errors import ParallelizeError
from devmesh.parallel.tensor_parallel import (
    ColwiseParallel,
    ParallelStyle,
    ReplicatedWithGradSum,
    RowwiseParallel,
)
from devmesh.tensor import Replicate

__all__ = ["is_transformers_model", "tensor_parallel_plan", "blocks_of", "STYLES"]

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
    for one segment, as transformers and ``parallelize_module`` read it), without the
    entries for the modules named in ``leave_out`` and theirs (experts split over ``ep``
    instead). A style devmesh does not compute is refused by name, listing those it does."""
    declared: Mapping[str, str] = getattr(model, "_tp_plan", None) or {}
    if not declared:
        raise ParallelizeError(
            f"{type(model).__name__} declares no tensor-parallel plan (its _tp_plan and its "
            "config's base_model_tp_plan are empty): pass tp_plan={module name: style} "
            "(devmesh.parallel's ColwiseParallel, RowwiseParallel, ...)")
    plan: dict[str, ParallelStyle] = {}
    unknown = {}
    for name, style in declared.items():
        if any(_within(name, module) for module in leave_out):
            continue
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


def _within(pattern: str, module: str) -> bool:
    """Whether the plan's entry ``pattern`` (``*`` for one segment) names ``module`` or a
    module inside it."""
    have, want = pattern.split("."), module.split(".")
    return len(have) >= len(want) and all(
        a == "*" or a == b for a, b in zip(have, want, strict=False))

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
