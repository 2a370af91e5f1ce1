"""torch's traced pipelines on devmesh's runner: ``pipeline(model, mb_args, split_spec=...)``
and ``pipe.build_stage(...)``, as torch's tutorial writes them, run by devmesh's schedules::

    from devmesh.parallel.pipeline import pipeline, SplitPoint, ScheduleGPipe  # were torch's

    pipe = pipeline(model, mb_args=(x_microbatch,), split_spec={"layers.4": SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, device, group)       # torch's stage, taken as it is
    ScheduleGPipe(stage, n_microbatches, loss_fn=loss_fn).step(x)

The tracing and splitting are torch's own (``pipeline``, ``Pipe``, ``SplitPoint`` and
``pipe_split`` here *are* torch's): devmesh does not trace models itself. What devmesh adds is
the route between the stages. torch's split graph lets a stage take values from any earlier
stage — a skip connection over several stages, an embedding reused at the top, a root input
(a mask, a scale) used late — and torch's stages send each value straight to its user.
devmesh's runner passes messages from a stage to the next only (the schedules' send and
receive pairs are neighbours), so each stage's ``GraphModule`` is rewritten, in place, to
take everything still needed from the stage before it and to hand on, besides its own
results, what the later stages will need. The rewritten stage computes what torch's does
with the same parameter objects under the same names (``stage.submod.state_dict()`` reads as
torch's); the first stage takes the traced model's own arguments (positional, and keywords by
name). A value crossing several boundaries costs a message at each. The ``Pipe``'s own
forward (``pipe(x)``, which calls the stages the old way) no longer runs once a stage was
built from it.

Ties: torch's tracer gives each stage its own copy of a parameter the model uses in several
places (an input embedding tied to the output head: the first stage's embedding, the last
stage's head, even a third, unused copy), so torch's traced stages train the copies apart,
silently. devmesh's :func:`pipeline` is torch's with the model's ties remembered (the
names of each parameter); :func:`build_stage` records which stages hold a copy under which
name (every rank traced the whole model, so all the stage modules are here), and
the runner keeps the copies one tensor — gradients summed, values equal — as for
:func:`~devmesh.parallel.pipeline.split_sequential`'s stages
(:mod:`~devmesh.parallel.pipeline.tied`). The copies stay separate objects, as torch made
them: an optimizer over all of a rank's stages' parameters steps each once. A pipe traced by
torch's own ``pipeline`` carries no names: its copies train apart, as under torch.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.pipelining import Pipe, SplitPoint, pipe_split
from torch.distributed.pipelining import pipeline as _torch_pipeline

from devmesh import _torch_compat
from devmesh.parallel.pipeline.split import PipelineError
from devmesh.parallel.pipeline.stage import PipelineStage
from devmesh.parallel.pipeline.tied import Tie, record_ties

__all__ = ["pipeline", "Pipe", "SplitPoint", "pipe_split", "build_stage", "StageRoute",
           "stage_routes", "route_stage", "as_devmesh_stage"]

_ROUTED = "_devmesh_route"  # set on a stage module once rewritten: (stage index, takes)
_TIED = "_devmesh_tensor_names"  # on pipe.split_gm, by pipeline(): each tensor's names


def pipeline(module: nn.Module, mb_args: tuple, mb_kwargs: dict | None = None,
             split_spec: dict[str, SplitPoint] | None = None, split_policy=None) -> Pipe:
    """torch's ``pipeline`` (the same arguments, the same ``Pipe``), remembering which of
    ``module``'s parameter names are one tensor, for :func:`build_stage` to keep them one
    (torch's tracer copies a tied parameter into every stage that uses it)."""
    groups: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    pipe = _torch_pipeline(module, mb_args, mb_kwargs, split_spec, split_policy)
    setattr(pipe.split_gm, _TIED, tuple(tuple(g) for g in groups.values()))
    return pipe


@dataclass(frozen=True)
class StageRoute:
    """What one stage of a traced pipeline receives and passes on, as nodes of the split
    graph (``pipe.split_gm.graph``): ``takes`` in the order the stage's forward takes them
    (the first stage: the traced model's inputs), ``gives`` in the order it returns them
    (``None`` for the last stage: it returns its module's own output)."""

    index: int
    call: fx.Node
    takes: tuple[fx.Node, ...]
    gives: tuple[fx.Node, ...] | None


def stage_routes(graph: fx.Graph) -> list[StageRoute]:
    """Every stage's route through the split graph ``graph``: a value made by stage ``i``
    (or a root input, "stage -1") and used by stage ``j`` crosses each boundary between
    them, carried by the stages in between."""
    calls = [node for node in graph.nodes if node.op == "call_module"]
    if not calls:
        raise PipelineError("the traced pipeline has no stages (no submodule calls in "
                            "pipe.split_gm.graph)")
    stage_of = {call: i for i, call in enumerate(calls)}
    made_by: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            made_by[node] = -1
        elif node in stage_of:
            made_by[node] = stage_of[node]
            if node.kwargs:
                raise PipelineError(f"stage {stage_of[node]} of the traced pipeline is called "
                                    f"with keywords {sorted(node.kwargs)}; devmesh passes a "
                                    "stage's inputs by position")
        elif (node.op == "call_function" and node.target is operator.getitem
              and node.args[0] in made_by):
            made_by[node] = made_by[node.args[0]]
    last_use: dict[fx.Node, int] = {}
    for call in calls:
        for value in call.all_input_nodes:
            if value not in made_by:
                raise PipelineError(f"stage {stage_of[call]} of the traced pipeline takes "
                                    f"{value.name} ({value.op} {value.target}), computed "
                                    "between the stages: devmesh routes stage outputs and the "
                                    "model's inputs only")
            last_use[value] = stage_of[call]
    output = next(node for node in graph.nodes if node.op == "output")
    foreign = [v.name for v in output.all_input_nodes if made_by.get(v) != len(calls) - 1]
    if foreign:
        raise PipelineError(f"the traced model's output includes {foreign}, not computed by "
                            "its last stage: devmesh's last stage returns its own output "
                            "(return those values through the last stage's computation)")
    values = [node for node in graph.nodes if node in last_use]  # in graph order

    def crossing(boundary: int) -> tuple[fx.Node, ...]:  # between stages boundary, +1
        return tuple(v for v in values if made_by[v] <= boundary < last_use[v])

    roots = tuple(node for node in graph.nodes if node.op == "placeholder")
    return [StageRoute(i, call, roots if i == 0 else crossing(i - 1),
                       crossing(i) if i < len(calls) - 1 else None)
            for i, call in enumerate(calls)]


def route_stage(stage_module: fx.GraphModule, route: StageRoute) -> None:
    """Rewrite ``stage_module`` in place to take ``route.takes`` and return ``route.gives``
    (the last stage: its own output): the stage's nodes are copied into a new graph whose
    inputs are the values received, so the module keeps its parameters, submodules and
    hooks. A module already rewritten for this route is left as it is."""
    takes = tuple(node.name for node in route.takes)
    done = getattr(stage_module, _ROUTED, None)
    if done is not None:
        if done != (route.index, takes):
            raise PipelineError(f"this stage module was already built as stage {done[0]} of a "
                                f"traced pipeline; it cannot also be stage {route.index}")
        return
    graph = fx.Graph()
    env: dict[fx.Node, object] = {v: graph.placeholder(v.name) for v in route.takes}
    inner = [node for node in stage_module.graph.nodes if node.op == "placeholder"]
    if len(inner) != len(route.call.args) or not all(
            isinstance(a, fx.Node) for a in route.call.args):
        raise PipelineError(f"stage {route.index}'s module takes {len(inner)} inputs where the "
                            f"split graph passes {route.call.args}: not a stage module of "
                            "this pipeline")
    result = graph.graph_copy(stage_module.graph,
                              {p: env[a] for p, a in zip(inner, route.call.args, strict=True)})
    codegen = stage_module.graph._codegen
    out_spec = getattr(getattr(codegen, "pytree_info", None), "out_spec", None)
    if out_spec is not None:  # torch.export's flat outputs, back to the stage's structure
        flat = list(result) if isinstance(result, (tuple, list)) else [result]
        result = _torch_compat.pytree.tree_unflatten(flat, out_spec)
    env[route.call] = result
    for node in route.call.graph.nodes:  # the stage's outputs taken apart, in graph order
        if (node.op == "call_function" and node.target is operator.getitem
                and node.args[0] in env and node not in env):
            whole, index = env[node.args[0]], node.args[1]
            env[node] = (whole[index] if isinstance(whole, (tuple, list))
                         else graph.call_function(operator.getitem, (whole, index)))
    graph.output(result if route.gives is None else tuple(env[v] for v in route.gives))
    graph.lint()
    with _own_class(stage_module):
        stage_module.graph = graph  # recompiles
    setattr(stage_module, _ROUTED, (route.index, takes))
    if route.index == 0:
        traced = {v.name: tuple(v.meta["val"].shape) for v in route.takes
                  if isinstance(v.meta.get("val"), torch.Tensor)}
        stage_module.register_forward_pre_hook(_InputCheck(traced), with_kwargs=True)


class _InputCheck:
    """The first stage's inputs against the shapes they were traced with: torch.export
    fixes every shape in the graph (a view to ``[2, 8, 2, 8]``), so a micro-batch of another
    size fails deep inside with a reshape error; refused here by name, as torch's stage
    refuses it."""

    def __init__(self, traced: dict[str, tuple[int, ...]]) -> None:
        self.traced = traced

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        names = list(self.traced)
        if len(args) > len(names):
            raise PipelineError(
                f"the traced pipeline's first stage takes {len(names)} inputs ({names}), got "
                f"{len(args)} positional ones: pass the inputs the model was traced with")
        # fewer positional inputs than names: the rest come as keywords
        given = {**dict(zip(names[:len(args)], args, strict=True)), **kwargs}
        for name, value in given.items():
            shape = self.traced.get(name)
            if (shape is not None and isinstance(value, torch.Tensor)
                    and tuple(value.shape) != shape):
                raise PipelineError(
                    f"the traced pipeline's input {name!r} has shape {tuple(value.shape)} in "
                    f"this micro-batch, but was traced with {shape} (pipeline's mb_args and "
                    "mb_kwargs: one micro-batch); torch.export fixed that shape in every "
                    "stage: trace with one micro-batch of the shape you train with (the batch "
                    "divided by n_microbatches along dim 0)")


@contextlib.contextmanager
def _own_class(module: fx.GraphModule) -> Iterator[None]:
    """``module`` under its own GraphModule class while torch recompiles it. ``fully_shard``
    (devmesh's and torch's) gives a module a subclass of its class; torch's ``recompile``
    patches ``__call__`` on whatever class it finds, and on such a subclass the patched call
    finds itself again (endless recursion at the next call)."""
    made = type(module)
    module.__class__ = next(c for c in made.__mro__ if "_wrapped_call" in vars(c))
    try:
        yield
    finally:
        module.__class__ = made


def build_stage(stage_module: nn.Module, stage_index: int, pipe_info,
                device: torch.device | str, group=None):
    """A devmesh :class:`~devmesh.parallel.pipeline.PipelineStage` for stage
    ``stage_index`` of a traced pipeline (``pipe.get_stage_module(i)``, ``pipe.info()``),
    as torch's ``build_stage``; devmesh's schedules also take the stage torch's
    ``pipe.build_stage`` returns. Rewrites the stage module in place (see the module's doc)
    and records the parameters tied across stages."""
    if pipe_info.has_loss_and_backward:
        raise PipelineError("the traced model computes its own loss: devmesh's schedules take "
                            "the loss as loss_fn; trace the model without it")
    routes = stage_routes(pipe_info.graph)
    if len(routes) != pipe_info.num_stages or not 0 <= stage_index < len(routes):
        raise PipelineError(f"stage_index {stage_index} is not one of the traced pipeline's "
                            f"{len(routes)} stages (0..{len(routes) - 1})")
    if not isinstance(stage_module, fx.GraphModule):
        raise PipelineError(f"build_stage takes a traced stage module "
                            f"(pipe.get_stage_module(i), a GraphModule), not "
                            f"{type(stage_module).__name__}; for a module of your own, use "
                            "PipelineStage(module, stage_index, num_stages, device)")
    device = torch.device(device)
    _move_device_arguments(stage_module, device)
    split = pipe_info.graph.owning_module
    if split is not None and getattr(stage_module, _ROUTED, None) is None:
        modules = [split.get_submodule(r.call.target) for r in routes]
        record_ties(modules, _ties(modules, getattr(split, _TIED, None)))
    route_stage(stage_module, routes[stage_index])
    return PipelineStage(stage_module, stage_index, len(routes), device, group=group)


def _ties(stage_modules: list[nn.Module], tensors: tuple[tuple[str, ...], ...] | None
          ) -> tuple[Tie, ...]:
    """The stages' copies of one tensor of the traced model, by name: the stage modules keep
    the model's parameter names, and ``tensors`` lists the names of each of the model's
    parameters (several for an alias), as :func:`pipeline` recorded them. ``None`` (a pipe
    from torch's own ``pipeline``): no ties, as under torch.

    Not by object identity, nor by the names alone: which copies torch's tracer shares as
    one object, and even under which of a parameter's names a stage module holds it, vary
    from process to process (measured: a parameter aliased under two names was one object in
    two stage modules on one rank and two on the other, in 2 runs of 6, and a stage held
    it under one name or both) — the pipeline ranks then disagreed on their ties and hung
    exchanging them. The model's own names are the same on every rank."""
    if tensors is None:
        return ()
    canonical = {name: min(names) for names in tensors for name in names}
    groups: dict[str, list[tuple[int, str]]] = {}
    for index, module in enumerate(stage_modules):
        for name, _ in module.named_parameters(remove_duplicate=False):
            groups.setdefault(canonical.get(name, name), []).append((index, name))
    return tuple(Tie(tuple(groups[key])) for key in sorted(groups) if len(groups[key]) > 1)


def _move_device_arguments(stage_module: fx.GraphModule, device: torch.device) -> None:
    """The device torch's tracer burned into factory calls (``torch.ones(..., device=)``),
    set to this stage's, as torch's ``build_stage`` does."""

    with _own_class(stage_module):
        _torch_compat.modify_graph_op_device(stage_module, device)


def as_devmesh_stage(stage: Any) -> PipelineStage:
    """``stage`` as devmesh's :class:`PipelineStage`: devmesh's own as it is; torch's
    ``PipelineStage`` (built by hand) and the stage torch's ``pipe.build_stage`` returns
    (traced, routed here) taken over with their module, index,
    device and group, so code that builds torch's stages runs on devmesh's schedules."""
    if isinstance(stage, PipelineStage):
        return stage
    stage_base, traced_stage = _torch_compat.pipeline_stage_types()
    if isinstance(stage, traced_stage):  # traced: the route between stages is rewritten
        ours = build_stage(stage.submod, stage.stage_index, stage.pipe_info, stage.device,
                           stage.group)
    elif isinstance(stage, stage_base):
        ours = PipelineStage(stage.submod, stage.stage_index, stage.num_stages, stage.device,
                             group=stage.group, dw_builder=stage.dw_builder)
    else:
        ours = None
    if ours is not None:
        for factory in _torch_compat.stage_forward_contexts(stage):  # torch 2.15's contexts
            ours.register_forward_context(factory)
        return ours
    raise PipelineError(f"a schedule takes PipelineStage objects (devmesh's or torch's), not "
                        f"{type(stage).__name__}: wrap the module in PipelineStage(module, "
                        "stage_index, num_stages, device)")
