"""A transformers model split into pipeline stages by the plan it declares.

transformers models declare how they pipeline (``model._pp_plan``: the config's
``base_model_pp_plan`` merged with the class's under the model's names): the input
embedding (``model.embed_tokens``, fed ``input_ids``), the decoder layers (a
``ModuleList``), and what follows them (``model.norm``, ``lm_head``). A stage here is the
model itself with what other stages run removed — a contiguous run of the layers, the
embedding on the first stage, the final norm and head on the last — so its parameters keep
the model's names (the stages' state dicts together are the model's) and its own forward
still runs: the first stage's from ``input_ids``, the others' from the previous stage's
hidden states (``inputs_embeds``); the last runs the whole model's forward (the head, a
final soft-capping) and returns the logits, the others their base model's hidden states.

Building a stage on a rank removes the rest from the model given (in place), so a rank never
holds another stage's layers past the split; a rank holding several stages (interleaved
schedules) builds each from a copy sharing the model's parameters (but for tied ones, of
which each stage holds its own copy). A parameter several stages hold (an embedding tied to the head) is recorded as a tie, which the pipeline runner
keeps one tensor (:mod:`devmesh.parallel.pipeline.tied`).
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from devmesh.errors import ParallelizeError
from devmesh.integrations.transformers import turn_off_caches
from devmesh.layout.schedule import stage_bounds
from devmesh.parallel.param import with_methods
from devmesh.parallel.pipeline.tied import Tie, record_ties

__all__ = ["PipelinePlan", "pipeline_plan", "transformers_stages", "PipelineStageOfModel",
           "REMOVED"]

REMOVED = "_devmesh_pipeline_removed"  #: on a stage: the names of the modules it lacks


@dataclass(frozen=True)
class PipelinePlan:
    """Where a model's pipeline parts are: ``first`` runs on the first stage only (the
    embedding), ``layers`` is split over the stages, ``last`` runs on the last only."""

    first: tuple[str, ...]
    layers: str
    last: tuple[str, ...]
    count: int  #: the decoder layers

    def bounds(self, stages: int) -> list[tuple[int, int]]:
        """The layers ``[start, end)`` of each stage: as even as they go, the earlier stages
        taking one more where they do not divide (the first holds the embedding, the last
        the head: neither gets fewer layers than the middle ones)."""
        if stages > self.count:
            raise ParallelizeError(
                f"{stages} pipeline stages need at least one decoder layer each; the model "
                f"has {self.count}: use a pp size (times the stages per rank) of at most "
                f"{self.count}")
        return stage_bounds(self.count, stages)


def pipeline_plan(model: nn.Module) -> PipelinePlan:
    """The model's declared pipeline plan, or a :class:`ParallelizeError` naming what to use
    instead."""
    declared = getattr(model, "_pp_plan", None) or {}
    names = dict(model.named_modules())
    layers = [n for n in declared if isinstance(names.get(n), nn.ModuleList)]
    if not declared or len(layers) != 1:
        raise ParallelizeError(
            f"{type(model).__name__} declares no pipeline plan (its _pp_plan, from the "
            "config's base_model_pp_plan, naming one ModuleList of layers): split it with "
            "devmesh.parallel.pipeline (split_sequential, pipeline) and build a "
            "PipelineRunner, then parallelize each stage on the other dims")
    missing = [n for n in declared if n not in names]
    if missing:
        raise ParallelizeError(f"{type(model).__name__}'s pipeline plan names {missing}, "
                               "which the model does not have")
    first = tuple(n for n, (inputs, _) in declared.items() if "input_ids" in inputs)
    last = tuple(n for n in declared if n not in first and n != layers[0])
    return PipelinePlan(first, layers[0], last, len(names[layers[0]]))


class PipelineStageOfModel:
    """What a pipeline stage adds to a transformers model's class (see the module's
    docstring): a forward from the previous stage's output to the next stage's input."""

    _devmesh_prefix = "PipelineStage"
    pipeline_first: bool
    pipeline_last: bool
    pipeline_layers: str  #: the name of the ``ModuleList`` of decoder layers

    def forward(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        key = "input_ids" if self.pipeline_first else "inputs_embeds"
        kwargs = {key: hidden, "use_cache": False, **kwargs}
        with self._first_layer_takes(hidden):
            if self.pipeline_last:  # the whole model's forward: its head, a soft-capping
                return super().forward(*args, **kwargs)[0]  # type: ignore[misc]
            base = getattr(self, self.base_model_prefix)  # type: ignore[attr-defined]
            return base(*args, **kwargs)[0]

    @contextlib.contextmanager
    def _first_layer_takes(self, hidden: torch.Tensor):
        """On a stage after the first, hand this stage's first layer the previous stage's
        output as it is. The base model's forward treats ``inputs_embeds`` as embeddings:
        some scale them before the layers (Granite's ``embedding_multiplier``, Gemma 2's
        normalizer), which the first stage did already. The shapes it derives from them
        (positions, masks) are the same. The hook is on whatever holds the layer's place
        now (a checkpointing wrapper: its recompute reruns from the input handed in)."""
        if self.pipeline_first:
            yield
            return
        layers = self.get_submodule(self.pipeline_layers)  # type: ignore[attr-defined]
        first = next(iter(layers._modules.values()))

        def given(_module, args, kwargs):
            if args:
                return (hidden, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": hidden}

        handle = first.register_forward_pre_hook(given, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()


def transformers_stages(model: nn.Module, stages: int, mine: Sequence[int]
                        ) -> dict[int, nn.Module]:
    """This rank's stages ``mine`` of ``model`` split into ``stages`` by its declared plan,
    as the model itself (one stage) or copies sharing its parameters (several), each with
    the other stages' parts removed and the ties between stages recorded."""
    plan = pipeline_plan(model)
    bounds = plan.bounds(stages)
    ties = _ties(model, plan, bounds)
    built: dict[int, nn.Module] = {}
    # copies share the parameters no two stages hold; a tied one gets a copy per stage,
    # which the runner keeps equal (one parameter cannot be sharded by two stages' units)
    tied = {id(model.get_parameter(name)) for tie in ties for _, name in tie.holders}
    shared = {id(p): p for p in model.parameters() if id(p) not in tied}
    for n, s in enumerate(sorted(mine)):
        stage = model if n == len(mine) - 1 else copy.deepcopy(model, memo=dict(shared))
        built[s] = _keep(stage, plan, s, stages, bounds[s])
    record_ties([built[s] for s in sorted(built)], ties)  # stages numbered globally
    return built


def _keep(model: nn.Module, plan: PipelinePlan, stage: int, stages: int,
          layers: tuple[int, int]) -> nn.Module:
    """``model`` reduced to stage ``stage``'s parts, its forward the stage's."""
    held = model.get_submodule(plan.layers)
    start, end = layers
    held._modules = OrderedDict((k, m) for k, m in held._modules.items()
                                if start <= int(k) < end)  # the model's own indices
    first, last = stage == 0, stage == stages - 1
    removed = []
    if not first:
        for name in plan.first:
            _set(model, name, None)
            removed.append(name)
    if not last:  # the base model still runs its final norm: an identity here
        for name in plan.last:
            parent = name.rpartition(".")[0]
            inside_base = parent == model.base_model_prefix
            _set(model, name, nn.Identity() if inside_base else None)
            removed.append(name)
    _own_layer_types(model, plan, start, end)
    with_methods(model, PipelineStageOfModel)
    model.pipeline_first, model.pipeline_last = first, last
    model.pipeline_layers = plan.layers
    setattr(model, REMOVED, tuple(removed))
    turn_off_caches(model)  # a cache would hold each micro-batch's keys and values
    return model


def _own_layer_types(model: nn.Module, plan: PipelinePlan, start: int, end: int) -> None:
    """Give the base model a config whose per-layer lists are the stage's: its forward
    reads ``config.layer_types[i]`` by the position of a layer in its run (Gemma's and
    Qwen's sliding and full attention layers), which on a later stage is not the layer's
    index in the model."""
    base = model.get_submodule(plan.layers.rpartition(".")[0])
    config = getattr(base, "config", None)
    types = getattr(config, "layer_types", None)
    if config is None or types is None or len(types) != plan.count:
        return
    config = copy.copy(config)
    config.layer_types = list(types[start:end])
    config.num_hidden_layers = end - start
    base.config = config


def _set(model: nn.Module, name: str, value: nn.Module | None) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, value)


def _ties(model: nn.Module, plan: PipelinePlan, bounds: list[tuple[int, int]]
          ) -> tuple[Tie, ...]:
    """The parameters held by several stages (by the whole model's names, stages numbered
    globally): a tied embedding and head, or a parameter outside the plan's parts, which
    every stage holds."""
    stages = len(bounds)

    def holders(name: str) -> list[int]:
        if name.startswith(plan.layers + "."):
            index = int(name[len(plan.layers) + 1:].split(".")[0])
            return [s for s, (a, b) in enumerate(bounds) if a <= index < b]
        if any(name.startswith(f + ".") for f in plan.first):
            return [0]
        if any(name.startswith(f + ".") for f in plan.last):
            return [stages - 1]
        return list(range(stages))

    seen: dict[int, list[tuple[int, str]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        for s in holders(name):
            seen.setdefault(id(param), []).append((s, name))
    return tuple(Tie(tuple(sorted(h))) for h in seen.values() if len({s for s, _ in h}) > 1)

