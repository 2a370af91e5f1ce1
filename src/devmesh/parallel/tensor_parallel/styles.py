"""Tensor-parallel styles, with torch's names, arguments and defaults.

* ``ColwiseParallel``: ``nn.Linear`` weight and bias split on dim 0 (output features), or
  ``nn.Embedding`` split on the embedding dim; input replicated (or ``Shard(seq)`` for sequence
  parallelism, gathered first), output sharded on the last dim (or ``output_layouts``).
* ``RowwiseParallel``: ``nn.Linear`` weight split on dim 1 (input features), bias replicated and
  added once after the reduction; ``nn.Embedding`` split on the vocabulary; input sharded on
  the last dim, output reduced to replicated (or reduce-scattered to ``Shard(seq)``, or
  with ``Partial()`` handed on unreduced, for a later reduction, as torch's allows).

Both also take transformers' ``Conv1D`` (GPT-2's projections: a linear layer whose weight is
stored transposed, ``(in, out)``), which torch's styles refuse: its weight is split on the
other dim, and its forward computes what ``nn.Linear``'s would.
* ``SequenceParallel``: norm/dropout layers run on the sequence shard with replicated
  parameters, whose gradients are summed over the TP group.
* ``ReplicatedWithGradSum``: replicated parameters of a module running on local features
  (a norm over the local heads), their gradients summed over the TP group.
* ``PrepareModuleInput`` / ``PrepareModuleOutput``: change activation layouts at a boundary.

Every style takes devmesh's or torch's placements and checks them when it is built. Styles
install forward hooks (or a forward that receives the module) holding only the style and the
mesh, never the module itself, so a parallelized module survives ``copy.deepcopy``. How
activations are converted, and their gradients kept right, is :mod:`.activations`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from devmesh import _torch_compat
from devmesh.errors import ParallelizeError, ShardingSpecError
from devmesh.mesh import DeviceMesh
from devmesh.parallel.placement import refuse_torch_fsdp_over_blocks
from devmesh.parallel.tensor_parallel import activations as A
from devmesh.parallel.swap import swap_parameter
from devmesh.parallel.tensor_parallel import functional as PF
from devmesh.tensor import Partial, Placement, Replicate, Shard, as_placement
from devmesh.layout.spec import chunk_bounds

__all__ = [
    "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
    "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "Distribute",
    "ReplicatedWithGradSum", "HeadwiseParallel", "Split",
]

Distribute = Callable[..., None]
"""``distribute(module, name, placement, parts=1)`` replaces ``module.<name>`` (and every
tied alias of it) by this rank's block of it; ``parts`` > 1: the placement's dim is that
many equal parts packed end to end, each split (a fused gate/up or q/k/v weight)."""

Split = tuple[str, Placement, int]
"""One parameter a style distributes: its name on the module, its placement, and its packed
parts (1: not packed) — the arguments of a :data:`Distribute` call."""

# The functions below run in a module's forward and call collectives on devmesh's meshes:
# under torch.compile they run eagerly, between compiled regions, rather than be traced
_eager = _torch_compat.eager


def _placement(value: object, what: str) -> Placement:
    try:
        return as_placement(value)
    except ShardingSpecError as exc:
        raise ParallelizeError(f"{what}: {exc}") from None


def _optional(value: object, what: str) -> Placement | None:
    return None if value is None else _placement(value, what)


def _one(value: object, what: str) -> Placement | None:
    """Torch's styles accept one placement or a 1-tuple of it (a 1-D mesh)."""
    if isinstance(value, (tuple, list)):
        if len(value) != 1:
            raise ParallelizeError(f"{what}: a 1-D tensor-parallel mesh takes one placement, "
                                   f"got {tuple(value)!r}")
        value = value[0]
    return _optional(value, what)


class ParallelStyle:
    """How one module is parallelized over a 1-D (tensor-parallel) mesh."""

    distributes_parameters = False

    def check(self, module: nn.Module, name: str) -> None:
        """Raise if this style cannot apply to ``module`` (called for every entry of a plan
        before any module is changed)."""

    def sharded_parameters(self, module: nn.Module) -> tuple[str, ...]:
        """The names of ``module``'s parameters this style splits (rather than replicates):
        a parameter tied to another module must be split there too."""
        return ()

    def splits(self, module: nn.Module) -> list[Split] | None:
        """The parameters :meth:`apply` distributes, and how: known before it runs, the
        source rank sends each rank only its own blocks of them. ``None`` (a style of one's
        own that distributes as it goes): its parameters are sent whole, and each rank
        splits its copy."""
        return None

    def apply(self, module: nn.Module, mesh: DeviceMesh, distribute: Distribute) -> nn.Module:
        raise NotImplementedError  # pragma: no cover


def _distribute_splits(style: ParallelStyle, module: nn.Module, distribute: Distribute) -> None:
    """``distribute`` each parameter of ``style.splits(module)``, as planned."""
    for name, placement, parts in style.splits(module) or ():
        distribute(module, name, placement, parts=parts)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


def _conv1d_class(module: nn.Module) -> type | None:
    """transformers' ``Conv1D`` among the module's classes (``x @ weight + bias`` with the
    weight stored ``(in, out)``), recognized without importing transformers."""
    return next((c for c in type(module).__mro__ if c.__name__ == "Conv1D"
                 and c.__module__ == "transformers.pytorch_utils"), None)


def _in_out_features(module: nn.Module) -> tuple[int, int]:
    """A linear layer's (input, output) features: ``nn.Linear``'s or ``Conv1D``'s."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.nx, module.nf  # Conv1D


def _check_linear_or_embedding(style: ParallelStyle, module: nn.Module, name: str) -> None:
    if _conv1d_class(module) is not None:
        return
    if isinstance(module, nn.Embedding):
        if module.max_norm is not None or module.sparse:
            raise ParallelizeError(
                f"{type(style).__name__} on {name!r}: an nn.Embedding with max_norm or "
                "sparse=True cannot be split (the norm and sparse gradient need whole rows)"
            )
        return
    if not isinstance(module, nn.Linear):
        raise ParallelizeError(
            f"{type(style).__name__} applies to nn.Linear, nn.Embedding and transformers' "
            f"Conv1D, but {name!r} is a {type(module).__name__}"
        )


def _ids(ids, have: Placement, mesh: DeviceMesh) -> torch.Tensor:
    """Token ids (no gradient) replicated on every rank."""
    return A.convert(ids, have, Replicate(), mesh, use_local_output=True)


# -- ColwiseParallel ------------------------------------------------------------------------
class ColwiseParallel(ParallelStyle):
    distributes_parameters = True

    def __init__(self, *, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True) -> None:
        self.input_layouts = _one(input_layouts, "ColwiseParallel input_layouts") or Replicate()
        self.output_layouts = _one(output_layouts, "ColwiseParallel output_layouts") or Shard(-1)
        self.use_local_output = use_local_output
        if isinstance(self.output_layouts, Partial):
            raise ParallelizeError("ColwiseParallel output_layouts must be Shard(d) or "
                                   "Replicate(): its output is complete, not a partial sum")

    def check(self, module: nn.Module, name: str) -> None:
        _check_linear_or_embedding(self, module, name)

    def sharded_parameters(self, module: nn.Module) -> tuple[str, ...]:
        return ("weight",) if isinstance(module, nn.Embedding) else ("weight", "bias")

    def splits(self, module: nn.Module) -> list[Split]:
        if isinstance(module, nn.Embedding):
            return [("weight", Shard(1), 1)]
        if _conv1d_class(module) is not None:  # the weight stored (in, out)
            return [("weight", Shard(1), 1), ("bias", Shard(0), 1)]
        return [("weight", Shard(0), 1), ("bias", Shard(0), 1)]

    def apply(self, module: nn.Module, mesh: DeviceMesh, distribute: Distribute) -> nn.Module:
        conv1d = _conv1d_class(module) is not None
        features = (module.embedding_dim if isinstance(module, nn.Embedding)
                    else module.nf if conv1d else module.out_features)
        _distribute_splits(self, module, distribute)
        if conv1d:  # Conv1D's own forward shapes its output by nf: this rank's columns
            module.nf = module.weight.shape[1]
        module.register_forward_pre_hook(functools.partial(_colwise_input, self, mesh))
        module.register_forward_hook(functools.partial(_colwise_output, self, mesh, features))
        return module


@_eager
def _colwise_input(style: ColwiseParallel, mesh: DeviceMesh, module: nn.Module, args):
    refuse_torch_fsdp_over_blocks(module)
    if not args:
        return None
    if isinstance(module, nn.Embedding):
        x = _ids(args[0], style.input_layouts, mesh)
    else:
        x = A.replicated_input(args[0], style.input_layouts, mesh)
    return (x, *args[1:])


@_eager
def _colwise_output(style: ColwiseParallel, mesh: DeviceMesh, features: int,
                    module: nn.Module, args, y):
    return A.finish_output(y, Shard(-1), style.output_layouts, mesh, style.use_local_output,
                           extent=(-1, features))


# -- RowwiseParallel ------------------------------------------------------------------------
class RowwiseParallel(ParallelStyle):
    distributes_parameters = True

    def __init__(self, *, input_layouts: Placement | None = None,
                 output_layouts: Placement | None = None, use_local_output: bool = True) -> None:
        self.input_layouts = _one(input_layouts, "RowwiseParallel input_layouts") or Shard(-1)
        self.output_layouts = _one(output_layouts, "RowwiseParallel output_layouts") or Replicate()
        self.use_local_output = use_local_output
        if isinstance(self.output_layouts, Partial) and self.output_layouts.reduce_op != "sum":
            raise ParallelizeError("RowwiseParallel output_layouts=Partial() hands on the "
                                   "partial sums unreduced: Partial('sum'), not "
                                   f"{self.output_layouts}")

    def check(self, module: nn.Module, name: str) -> None:
        _check_linear_or_embedding(self, module, name)
        if isinstance(module, nn.Embedding):
            _check_embedding_subclass(module, name)
        if isinstance(self.output_layouts, Partial) and getattr(module, "bias", None) is not None:
            raise ParallelizeError(
                f"RowwiseParallel(output_layouts=Partial()) on {name!r}: its output is this "
                "rank's partial sum, reduced later, and its bias would be added on every rank "
                "before that; use output_layouts=Replicate() or Shard(d), or a layer without "
                "bias")
        if not isinstance(module, nn.Embedding):
            base = _conv1d_class(module) or nn.Linear
            if type(module).forward is not base.forward:
                base_name = "nn.Linear" if base is nn.Linear else base.__name__
                raise ParallelizeError(
                    f"RowwiseParallel on {name!r}: {type(module).__name__} overrides "
                    f"{base_name}.forward, and its own computation would run on each "
                    "rank's partial sums before they are reduced; split a plain "
                    f"{base_name} inside it, or leave it replicated")

    def sharded_parameters(self, module: nn.Module) -> tuple[str, ...]:
        return ("weight",)

    def splits(self, module: nn.Module) -> list[Split]:
        if isinstance(module, nn.Embedding):
            return [("weight", Shard(0), 1)]
        # the bias is added once, after the reduction: whole on every rank
        return [("weight", Shard(0 if _conv1d_class(module) else 1), 1),
                ("bias", Replicate(), 1)]

    def apply(self, module: nn.Module, mesh: DeviceMesh, distribute: Distribute) -> nn.Module:
        _distribute_splits(self, module, distribute)
        if isinstance(module, nn.Embedding):
            start = chunk_bounds(module.num_embeddings, mesh.size(), mesh.get_local_rank())[0]
            # hooks around the module's own forward: a subclass's (Gemma's scaled embedding)
            # still runs; the output hook runs before any hook registered earlier
            ids_name = next(iter(inspect.signature(module.forward).parameters), "input")
            module.register_forward_pre_hook(
                functools.partial(_rowwise_embedding_input, self, mesh, start, ids_name),
                with_kwargs=True)
            module.register_forward_hook(functools.partial(_rowwise_embedding_output, self, mesh),
                                         prepend=True, always_call=True)
        else:  # the forward is replaced: the bias is added once, after the reduction
            module.forward = functools.partial(_rowwise_linear, self, mesh, module)
        return module

    def reduce(self, y: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """The partial sums of this rank's slice, reduced into ``output_layouts`` (handed on
        as they are under ``Partial()``, for a later reduction: torch's style allows it)."""
        out = self.output_layouts
        if isinstance(out, Partial):
            return y
        if isinstance(out, Shard):
            return PF.reduce_scatter_from_parallel(y, mesh, out.dim)
        return PF.reduce_from_parallel(y, mesh)


@_eager
def _rowwise_linear(style: RowwiseParallel, mesh: DeviceMesh, module: nn.Module, x):
    refuse_torch_fsdp_over_blocks(module)
    x = A.sharded_input(x, style.input_layouts, Shard(-1), mesh,
                        extent=(-1, _in_out_features(module)[0]))
    weight = module.weight
    partial = F.linear(x, weight) if isinstance(module, nn.Linear) else x.matmul(weight)
    y = style.reduce(partial, mesh)
    bias = module.bias
    if bias is not None:
        # a sequence shard of the output: each rank's bias gradient covers its positions only
        y = y + (PF.copy_to_parallel(bias, mesh) if isinstance(style.output_layouts, Shard)
                 else bias)
    out = style.output_layouts
    return A.finish_output(y, out, out, mesh, style.use_local_output)


def _check_embedding_subclass(module: nn.Embedding, name: str) -> None:
    """A subclass's forward runs on each rank's rows, other ranks' positions zeroed after
    it: exact when it maps each position's vector alone (a scale, a norm) — not with
    parameters of its own, whose gradients would cover this rank's positions only."""
    if type(module).forward is nn.Embedding.forward:
        return
    own = [n for n, _ in module.named_parameters() if n != "weight"]
    if own:
        raise ParallelizeError(
            f"RowwiseParallel on {name!r}: {type(module).__name__} overrides "
            f"nn.Embedding.forward and holds parameters {own} besides the table; their "
            "gradients would cover only the positions whose ids fall in this rank's rows. "
            "Split a plain nn.Embedding and apply the rest outside it")


_EMBEDDING_SAVED = "_devmesh_rowwise_embedding_saved"


@_eager
def _rowwise_embedding_input(style: RowwiseParallel, mesh: DeviceMesh, start: int,
                             ids_name: str, module: nn.Embedding, args, kwargs):
    """The ids, replicated, as this rank's rows: ids of other ranks' rows look up row 0 (or
    an extra zero row where a row's frequency scales its gradient, or there are no rows);
    their outputs are zeroed before the reduction."""
    refuse_torch_fsdp_over_blocks(module)
    by_keyword = not args
    ids = _ids(kwargs[ids_name] if by_keyword else args[0], style.input_layouts, mesh)
    weight = module.weight
    rows = weight.shape[0]
    local = ids - start
    outside = (local < 0) | (local >= rows)
    pad = module.padding_idx
    saved = {"padding_idx": pad, "outside": outside}
    module.padding_idx = pad - start if pad is not None and start <= pad < start + rows else None
    if module.scale_grad_by_freq or rows == 0:
        # other ranks' ids must not count toward the frequency of a row of this rank's
        saved["weight"] = weight
        swap_parameter(module, "weight", torch.cat([weight, weight.new_zeros(1, weight.shape[1])]))
        local = local.masked_fill(outside, rows)
    else:
        local = local.masked_fill(outside, 0)
    module.__dict__[_EMBEDDING_SAVED] = saved
    if by_keyword:
        return args, {**kwargs, ids_name: local}
    return (local, *args[1:]), kwargs


@_eager
def _rowwise_embedding_output(style: RowwiseParallel, mesh: DeviceMesh, module: nn.Embedding,
                              args, y):
    saved = module.__dict__.pop(_EMBEDDING_SAVED, None)
    if saved is None:  # the forward failed before the input hook ran
        return y
    module.padding_idx = saved["padding_idx"]
    if "weight" in saved:
        swap_parameter(module, "weight", saved["weight"])
    outside = saved["outside"]
    if not isinstance(y, torch.Tensor):
        return y  # the forward raised (this hook always runs), or returned no tensor
    if tuple(y.shape[:-1]) != tuple(outside.shape):
        raise ParallelizeError(
            f"RowwiseParallel: {type(module).__name__}'s forward returned shape "
            f"{tuple(y.shape)} for ids of shape {tuple(outside.shape)}; a split embedding "
            "needs one vector per id, last (each rank zeroes the ids it does not hold)")
    y = style.reduce(y.masked_fill(outside.unsqueeze(-1), 0.0), mesh)
    out = style.output_layouts
    return A.finish_output(y, out, out, mesh, style.use_local_output)


# -- SequenceParallel -----------------------------------------------------------------------
class SequenceParallel(ParallelStyle):
    """Run a norm/dropout layer on the local sequence shard (``Shard(sequence_dim)``) with
    replicated parameters; their gradients (partial: each rank saw its positions) are summed
    over the TP group in backward, before they are accumulated."""

    distributes_parameters = True

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def splits(self, module: nn.Module) -> list[Split]:
        return [(name, Replicate(), 1) for name in module._parameters]

    def apply(self, module: nn.Module, mesh: DeviceMesh, distribute: Distribute) -> nn.Module:
        _distribute_splits(self, module, distribute)
        module.register_forward_pre_hook(functools.partial(_sequence_input, self, mesh))
        module.register_forward_hook(functools.partial(_sequence_output, self, mesh),
                                     always_call=True)
        return module


_SAVED = "_devmesh_sequence_parallel_saved"


def _sum_gradients_in_forward(module: nn.Module, mesh: DeviceMesh) -> None:
    """For this forward, the module's trainable parameters are copies whose gradients are
    summed over the TP group in backward (each rank's forward saw its share only)."""
    saved = {}
    for name, param in module._parameters.items():
        if param is not None and param.requires_grad:
            saved[name] = param
            swap_parameter(module, name, PF.copy_to_parallel(param, mesh))
    setattr(module, _SAVED, saved)


def _restore_parameters(module: nn.Module) -> None:
    for name, param in getattr(module, _SAVED, {}).items():
        swap_parameter(module, name, param)
    setattr(module, _SAVED, {})


@_eager
def _sequence_input(style: SequenceParallel, mesh: DeviceMesh, module: nn.Module, args):
    seq = Shard(style.sequence_dim)
    _sum_gradients_in_forward(module, mesh)
    if not args:
        return None
    return (A.sharded_input(args[0], seq, seq, mesh), *args[1:])


@_eager
def _sequence_output(style: SequenceParallel, mesh: DeviceMesh, module: nn.Module, args, y):
    _restore_parameters(module)
    seq = Shard(style.sequence_dim)
    if not isinstance(y, torch.Tensor):
        return y
    return A.finish_output(y, seq, seq, mesh, style.use_local_output)


class ReplicatedWithGradSum(ParallelStyle):
    """Replicated parameters of a module that runs on this rank's share of the features
    (a norm over the local attention heads: Qwen3's and Gemma 3's ``q_norm`` / ``k_norm``,
    transformers' ``replicated_with_grad_allreduce``): inputs and outputs pass as they are,
    and the parameters' gradients are summed over the TP group in backward."""

    distributes_parameters = True

    def splits(self, module: nn.Module) -> list[Split]:
        return [(name, Replicate(), 1) for name in module._parameters]

    def apply(self, module: nn.Module, mesh: DeviceMesh, distribute: Distribute) -> nn.Module:
        _distribute_splits(self, module, distribute)
        module.register_forward_pre_hook(functools.partial(_grad_sum_input, mesh))
        module.register_forward_hook(_grad_sum_output, always_call=True)
        return module


@_eager
def _grad_sum_input(mesh: DeviceMesh, module: nn.Module, args) -> None:
    _sum_gradients_in_forward(module, mesh)


@_eager
def _grad_sum_output(module: nn.Module, args, y) -> None:
    _restore_parameters(module)


class HeadwiseParallel(ParallelStyle):
    """A module's own parameters that hold one entry per attention head (gpt-oss's
    ``sinks``, ``(heads,)``), split with the heads along ``dim``: the module runs on the
    local heads its column-wise projections produced, so each rank uses its own entries
    only, and their gradients are its own (no sum over the TP group). Inputs and outputs
    pass as they are. ``tp`` must divide the heads; an uneven split is refused."""

    distributes_parameters = True

    def __init__(self, names: tuple[str, ...] = ("sinks",), *, dim: int = 0) -> None:
        self.names = tuple(names)
        self.dim = dim

    def check(self, module: nn.Module, name: str) -> None:
        own = dict(module.named_parameters(recurse=False))
        missing = [n for n in self.names if n not in own]
        if missing:
            raise ParallelizeError(
                f"HeadwiseParallel on {name!r}: {type(module).__name__} has no parameter "
                f"{missing} (it has {sorted(own)}); name its per-head parameters")
        flat = [n for n in self.names if own[n].ndim <= self.dim]
        if flat:
            raise ParallelizeError(f"HeadwiseParallel on {name!r}: {flat} have no dim "
                                   f"{self.dim} to split by heads")

    def sharded_parameters(self, module: nn.Module) -> tuple[str, ...]:
        return self.names

    def splits(self, module: nn.Module) -> list[Split]:
        return [(name, Shard(self.dim), 1) for name in self.names]

    def apply(self, module: nn.Module, mesh: DeviceMesh, distribute: Distribute) -> nn.Module:
        for name in self.names:
            heads = module._parameters[name].shape[self.dim]
            if heads % mesh.size():
                raise ParallelizeError(
                    f"HeadwiseParallel: {type(module).__name__}.{name} has {heads} heads on "
                    f"dim {self.dim}, which tp={mesh.size()} does not divide: the column-"
                    "wise projections split whole heads")
        _distribute_splits(self, module, distribute)
        return module


# -- PrepareModuleInput / PrepareModuleOutput -----------------------------------------------
def _layout_tuple(value, what: str) -> tuple[Placement | None, ...] | None:
    if value is None:
        return None
    values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    return tuple(_optional(v, what) for v in values)


def _layout_dict(value, what: str) -> dict[str, Placement | None]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ParallelizeError(f"{what} must map keyword names to placements, got {value!r}")
    return {k: _optional(v, f"{what}[{k!r}]") for k, v in value.items()}


class PrepareModuleInput(ParallelStyle):
    """Convert a module's inputs (positional and keyword) from ``input_layouts`` to
    ``desired_input_layouts`` before it runs, as torch's style of the same name. With
    ``use_local_output=False`` (torch's default) the module receives DTensors."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None,
                 input_kwarg_layouts=None, desired_input_kwarg_layouts=None,
                 use_local_output: bool = False) -> None:
        self.input_layouts = _layout_tuple(input_layouts, "PrepareModuleInput input_layouts")
        self.desired_input_layouts = _layout_tuple(
            desired_input_layouts, "PrepareModuleInput desired_input_layouts")
        if (self.input_layouts is None) != (self.desired_input_layouts is None) or (
                self.input_layouts is not None
                and len(self.input_layouts) != len(self.desired_input_layouts or ())):
            raise ParallelizeError(
                "PrepareModuleInput: input_layouts and desired_input_layouts must have the "
                f"same length, got {input_layouts!r} and {desired_input_layouts!r}"
            )
        self.input_kwarg_layouts = _layout_dict(input_kwarg_layouts,
                                                "PrepareModuleInput input_kwarg_layouts")
        self.desired_input_kwarg_layouts = _layout_dict(
            desired_input_kwarg_layouts, "PrepareModuleInput desired_input_kwarg_layouts")
        if set(self.input_kwarg_layouts) != set(self.desired_input_kwarg_layouts):
            raise ParallelizeError(
                "PrepareModuleInput: input_kwarg_layouts and desired_input_kwarg_layouts "
                f"must name the same keywords, got {sorted(self.input_kwarg_layouts)} and "
                f"{sorted(self.desired_input_kwarg_layouts)}"
            )
        self.use_local_output = use_local_output

    def apply(self, module: nn.Module, mesh: DeviceMesh, distribute: Distribute) -> nn.Module:
        module.register_forward_pre_hook(functools.partial(_prepare_input, self, mesh),
                                         with_kwargs=True)
        return module

    def convert(self, x, have: Placement | None, want: Placement | None, mesh: DeviceMesh):
        if have is None:
            return x
        return A.convert(x, have, want or have, mesh, use_local_output=self.use_local_output)


@_eager
def _prepare_input(style: PrepareModuleInput, mesh: DeviceMesh, module: nn.Module, args,
                   kwargs):
    args = list(args)
    if style.input_layouts is not None:
        if len(args) < len(style.input_layouts):
            raise ParallelizeError(
                f"PrepareModuleInput expects {len(style.input_layouts)} positional inputs for "
                f"{type(module).__name__}, got {len(args)}"
            )
        for i, (have, want) in enumerate(zip(style.input_layouts,
                                             style.desired_input_layouts or (), strict=True)):
            args[i] = style.convert(args[i], have, want, mesh)
    for key, have in style.input_kwarg_layouts.items():
        if key in kwargs:
            kwargs[key] = style.convert(kwargs[key], have,
                                        style.desired_input_kwarg_layouts[key], mesh)
    return tuple(args), kwargs


class PrepareModuleOutput(ParallelStyle):
    """Convert a module's outputs from ``output_layouts`` to ``desired_output_layouts``."""

    def __init__(self, *, output_layouts, desired_output_layouts,
                 use_local_output: bool = True) -> None:
        self.output_layouts = _layout_tuple(output_layouts, "PrepareModuleOutput output_layouts")
        self.desired_output_layouts = _layout_tuple(
            desired_output_layouts, "PrepareModuleOutput desired_output_layouts")
        if len(self.output_layouts or ()) != len(self.desired_output_layouts or ()):
            raise ParallelizeError(
                "PrepareModuleOutput: output_layouts and desired_output_layouts must have "
                f"the same length, got {output_layouts!r} and {desired_output_layouts!r}"
            )
        self.use_local_output = use_local_output

    def apply(self, module: nn.Module, mesh: DeviceMesh, distribute: Distribute) -> nn.Module:
        module.register_forward_hook(functools.partial(_prepare_output, self, mesh))
        return module


@_eager
def _prepare_output(style: PrepareModuleOutput, mesh: DeviceMesh, module: nn.Module, args,
                    outputs):
    single = not isinstance(outputs, tuple)
    items = [outputs] if single else list(outputs)
    layouts = list(zip(style.output_layouts or (), style.desired_output_layouts or (), strict=True))
    if len(items) != len(layouts):
        raise ParallelizeError(
            f"PrepareModuleOutput was given {len(layouts)} output layouts but "
            f"{type(module).__name__} returned {len(items)} outputs"
        )
    converted = [x if have is None else
                 A.convert(x, have, want or have, mesh, use_local_output=style.use_local_output)
                 for x, (have, want) in zip(items, layouts, strict=True)]
    return converted[0] if single else tuple(converted)


class PrepareModuleInputOutput(ParallelStyle):
    """:class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one module, as torch's
    style of the same name (its arguments: ``use_local_input`` is the input side's
    ``use_local_output``)."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None,
                 input_kwarg_layouts=None, desired_input_kwarg_layouts=None,
                 use_local_input: bool = False, output_layouts, desired_output_layouts,
                 use_local_output: bool = True) -> None:
        self.prepare_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input)
        self.prepare_output = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output)

    def apply(self, module: nn.Module, mesh: DeviceMesh, distribute: Distribute) -> nn.Module:
        self.prepare_input.apply(module, mesh, distribute)
        return self.prepare_output.apply(module, mesh, distribute)
