"""``parallelize_module(module, device_mesh, parallelize_plan)``: torch's entry point.

Every plan entry is matched and checked before any module changes, so a bad plan leaves the
model as it was. Parameters are replaced by :class:`~devmesh.parallel.param.ShardedParameter`
blocks (broadcast from ``src_data_rank`` first, as torch does); a parameter tied to several
modules (``output.weight = tok_embeddings.weight``) is replaced once, in every place it
appears, so it stays one parameter.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Mapping

import torch
from torch import nn

from devmesh import _torch_compat
from devmesh.distributed import comm, consensus
from devmesh.errors import ParallelizeError
from devmesh.mesh import DeviceMesh
from devmesh.parallel.conversion import KeepsLayouts
from devmesh.parallel.param import get_layout, sharded_parameter, with_methods
from devmesh.parallel.placement import place_parameter
from devmesh.parallel.tensor_parallel.source_values import SourceValues
from devmesh.parallel.tensor_parallel.styles import ParallelStyle
from devmesh.tensor import Placement, Replicate, Shard, ShardingSpec, distribute_tensor

__all__ = ["parallelize_module", "parameter_aliases"]

_APPLIED = "_devmesh_tp_style"
_REPLACED_BY = "_devmesh_replaced_by"


def parameter_aliases(root: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every place each parameter of ``root`` is registered: ``id(param) -> [(module, name)]``
    (more than one entry for tied parameters)."""
    aliases: dict[int, list[tuple[nn.Module, str]]] = {}
    seen: set[int] = set()
    for module in root.modules():
        if id(module) in seen:
            continue
        seen.add(id(module))
        for name, param in module._parameters.items():
            if param is not None:
                aliases.setdefault(id(param), []).append((module, name))
    return aliases


def _as_devmesh(mesh: object) -> DeviceMesh:
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

    if mesh is None:
        mesh = _torch_compat.current_torch_mesh()  # torch's `with mesh:` context
    if isinstance(mesh, DeviceMesh):
        return mesh
    if isinstance(mesh, TorchDeviceMesh):
        return DeviceMesh.from_torch(mesh)
    raise ParallelizeError(f"device_mesh must be a DeviceMesh, got {type(mesh).__name__}")


def _resolve_plan(module: nn.Module, plan) -> list[tuple[str, nn.Module, ParallelStyle]]:
    if isinstance(plan, ParallelStyle):
        return [("", module, plan)]
    if not isinstance(plan, Mapping):
        raise ParallelizeError(
            f"parallelize_plan must be a ParallelStyle or a dict of module name -> style, got "
            f"{type(plan).__name__}"
        )
    names = dict(module.named_modules())
    entries = []
    for pattern, style in plan.items():
        if not isinstance(style, ParallelStyle):
            hint = _torch_style_hint(style)
            raise ParallelizeError(
                f"parallelize_plan[{pattern!r}] is a {type(style).__name__}, not a devmesh "
                f"ParallelStyle{hint}"
            )
        if pattern == "":  # torch's key for the module itself
            entries.append(("", module, style))
            continue
        matches = [n for n in names if n and fnmatch.fnmatchcase(n, pattern)
                   and n.count(".") == pattern.count(".")]
        if not matches:
            raise ParallelizeError(
                f"parallelize_plan key {pattern!r} matches no submodule; submodules are "
                f"{', '.join(n for n in names if n)}"
            )
        entries += [(name, names[name], style) for name in matches]
    return entries


def _torch_style_hint(style: object) -> str:
    """Why a torch ``ParallelStyle`` is refused, and what to do instead."""
    from torch.distributed.tensor.parallel import ParallelStyle as TorchParallelStyle

    if not isinstance(style, TorchParallelStyle):
        return ""
    if type(style).__module__.startswith("torch.distributed"):
        return (" — that is torch's style; import the styles from devmesh.parallel with "
                "devmesh's parallelize_module")
    return (" — it subclasses torch's ParallelStyle, which makes torch DTensor parameters "
            "(devmesh's are plain blocks with a layout): apply it with torch's "
            "parallelize_module on the devmesh mesh (a torch DeviceMesh) — and torch's "
            "fully_shard or replicate over it, which take DTensor parameters — or write it as "
            "a devmesh style (devmesh.parallel.ParallelStyle)")


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: ParallelStyle | Mapping[str, ParallelStyle] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> nn.Module:
    """Apply tensor-parallel styles to ``module`` (or to submodules by name; ``*`` matches one
    path segment, as in torch) over the 1-D ``device_mesh`` (default: torch's current mesh
    from ``with mesh:``). Each split parameter takes rank ``src_data_rank``'s values: that
    rank sends every rank its own blocks, in buckets of about 8 MB rather than one
    collective per parameter as torch's; ``src_data_rank=None`` keeps each rank's own
    values instead."""
    mesh = _as_devmesh(device_mesh)
    if mesh.ndim != 1:
        raise ParallelizeError(
            f"parallelize_module needs a 1-D tensor-parallel mesh, got {mesh!r}; slice it, "
            "e.g. mesh['tp']"
        )
    if parallelize_plan is None:
        return module
    # a refusal on one rank is raised on every rank; then the ranks agree on the plan itself
    # (ranks splitting different modules would wait in each other's collectives)
    with consensus.refused_everywhere(comm.process_group(mesh, (0,)), "parallelize_module",
                                 ParallelizeError):
        entries = _resolve_plan(module, parallelize_plan)
        for name, target, style in entries:
            style.check(target, name or type(target).__name__)
            previous = getattr(target, _APPLIED, None)
            if style.distributes_parameters and previous is not None:
                raise ParallelizeError(
                    f"{type(previous).__name__} was already applied to "
                    f"{name or 'the module'!r}; applying {type(style).__name__} too would "
                    "split an already split weight. Each module takes one "
                    "parameter-distributing style")
    # one agreement for the whole plan: the styles, and the shapes and dtypes of the
    # parameters of the modules they split, so that splitting each of those needs no
    # agreement of its own (distribute_tensor's check: one collective per parameter)
    described, agreed, to_split = _plan_to_agree(entries)
    consensus.agree(mesh, (0,), "parallelize_module: every rank must apply the same plan "
                    "(its styles, and the shapes and dtypes of the parameters they split)",
                    described)
    aliases = parameter_aliases(module)
    # the source rank's values of the agreed parameters, in buckets (not one each); no list
    # of them stays here: each whole parameter is freed once its block replaces it (such a
    # list held the whole model beside its blocks until the last was split)
    sent = (SourceValues(_planned(entries, to_split, mesh), mesh, src_data_rank)
            if src_data_rank is not None else None)
    del to_split
    for name, target, style in entries:
        def distribute(owner: nn.Module, attr: str, placement: Placement,
                       where: str = name, parts: int = 1) -> None:
            _distribute(owner, attr, placement, mesh, aliases, src_data_rank, where,
                        checked=(id(owner), attr) in agreed, parts=parts, sent=sent)

        style.apply(target, mesh, distribute)
        if style.distributes_parameters:
            setattr(target, _APPLIED, style)
    aliases = parameter_aliases(module)  # the split blocks', in every place they now are
    for name, target, style in entries:
        _guard_unsplit_ties(target, name, style, aliases)
    # model.to_empty() / .to() keep the split parameters split (meta-device construction)
    with_methods(module, KeepsLayouts)
    return module


def _plan_to_agree(entries: list[tuple[str, nn.Module, ParallelStyle]]
                   ) -> tuple[str, set[tuple[int, str]], dict[int, nn.Parameter]]:
    """The plan as the ranks compare it (each style, and the shape and dtype of each
    parameter it splits), the ``(id(module), name)`` of those parameters, and the
    parameters themselves by id, in plan order."""
    agreed: set[tuple[int, str]] = set()
    to_split: dict[int, nn.Parameter] = {}
    described = []
    for name, target, style in entries:
        text = f"{name or '(the module)'}: {_describe_style(style)}"
        if style.distributes_parameters:
            # (a parameter split by an earlier call, a tie, agreed when it was split)
            own = [(attr, p) for attr, p in target._parameters.items()
                   if p is not None and get_layout(p) is None
                   and getattr(p, _REPLACED_BY, None) is None]
            text += "".join(f", {attr} {tuple(p.shape)} {p.dtype}" for attr, p in own)
            agreed.update((id(target), attr) for attr, _ in own)
            to_split.update((id(p), p) for _, p in own)
        described.append(text)
    return "; ".join(described), agreed, to_split


def _planned(entries: list[tuple[str, nn.Module, ParallelStyle]],
             to_split: dict[int, nn.Parameter], mesh: DeviceMesh
             ) -> list[tuple[nn.Parameter, ShardingSpec, tuple[int, ...]]]:
    """Each parameter to split, with the spec of the blocks its style cuts it into and the
    shape it is cut in, as the styles say before they run (``splits``); the parameters of
    a style that does not say, whole (a replicated spec). A tied parameter: as its first
    style splits it."""
    plans: dict[int, tuple[nn.Parameter, ShardingSpec, tuple[int, ...]]] = {}
    for name, target, style in entries:
        if not style.distributes_parameters:
            continue
        splits = {attr: (placement, parts)
                  for attr, placement, parts in style.splits(target) or ()}
        for attr, param in target._parameters.items():
            if param is None or id(param) not in to_split or id(param) in plans:
                continue
            shape = tuple(param.shape)
            if attr in splits:
                spec, view = _split_spec(shape, *splits[attr], mesh,
                                         f"{name or 'the module'}.{attr}")
            else:
                spec = ShardingSpec.from_placements([Replicate()], mesh.shape, shape,
                                                    mesh.mesh_dim_names)
                view = shape
            plans[id(param)] = (param, spec, view)
    return [plans[key] for key in to_split if key in plans]


def _guard_unsplit_ties(target: nn.Module, name: str, style: ParallelStyle,
                        aliases: dict[int, list[tuple[nn.Module, str]]]) -> None:
    """A module holding a parameter tied to one ``style`` split, without a style of its own
    (only the embedding of a tied embedding and head split), refuses its forward by name
    until a style splits it too (torch's plans split the head in a later call): it would
    compute with this rank's block as the whole weight."""
    for attr in style.sharded_parameters(target):
        new = target._parameters.get(attr)
        for owner, alias in aliases.get(id(new), []) if new is not None else []:
            if owner is target or getattr(owner, _APPLIED, None) is not None:
                continue
            if not getattr(owner, _GUARDED, False):
                owner.register_forward_pre_hook(functools.partial(
                    _refuse_unsplit_tie, alias, f"{name or 'the module'}.{attr}",
                    type(style).__name__))
                setattr(owner, _GUARDED, True)


_GUARDED = "_devmesh_guards_unsplit_tie"


def _refuse_unsplit_tie(attr: str, tied_to: str, style: str, module: nn.Module, args) -> None:
    if getattr(module, _APPLIED, None) is not None:
        return  # split since, by a later parallelize_module call
    raise ParallelizeError(
        f"{type(module).__name__}.{attr} is tied to {tied_to}, which {style} split over the "
        f"tensor-parallel mesh, but this {type(module).__name__} was given no style: it "
        "would compute with this rank's block as the whole weight. Split it the same way "
        "(RowwiseParallel on a tied embedding goes with ColwiseParallel on the output "
        "projection: both split the vocabulary), or untie the weights before "
        "parallelize_module")


def _describe_style(style: ParallelStyle) -> str:
    """The style as the ranks compare it: its repr (devmesh's styles show their layouts),
    or its class where the repr is an object's address, which differs between processes."""
    text = repr(style)
    return type(style).__qualname__ if " object at 0x" in text else text


def _distribute(module: nn.Module, attr: str, placement: Placement, mesh: DeviceMesh,
                aliases: dict[int, list[tuple[nn.Module, str]]], src_data_rank: int | None,
                where: str, checked: bool = False, parts: int = 1,
                sent: SourceValues | None = None) -> None:
    """Split ``module.attr`` (``checked``: its shape and dtype already agreed on every rank);
    ``parts`` > 1: the placement's dim is ``parts`` equal parts laid end to end (a packed
    weight), each split over the mesh (see :class:`~devmesh.parallel.param.ParamLayout`).
    ``sent`` holds the source rank's values of the agreed parameters, sent in buckets."""
    param = module._parameters.get(attr)
    if param is None:
        return
    replacement = getattr(param, _REPLACED_BY, None)
    if replacement is not None:  # tied to a parameter distributed by an earlier call
        place_parameter(module, attr, replacement)
        param = replacement
    layout = get_layout(param)
    full_shape = layout.full_shape if layout is not None else tuple(param.shape)
    spec, view = _split_spec(full_shape, placement, parts, mesh, f"{where}.{attr}")
    if layout is not None:
        if (layout.mesh == mesh and layout.spec == spec
                and layout.shape == (None if view == full_shape else full_shape)):
            return  # a tied alias, already distributed the same way
        raise ParallelizeError(
            f"{where + '.' if where else ''}{attr} is already distributed ({layout.spec} on "
            f"{layout.mesh!r}), and this style needs {spec}: a parameter tied to another "
            "module must be split the same way in both (e.g. RowwiseParallel on the embedding "
            "and ColwiseParallel on the tied output projection both split the vocabulary)"
        )
    local = _local_block(param, spec, view, mesh, src_data_rank, checked,
                         sent.take(param) if sent is not None else None)
    if view != full_shape:  # the parts side by side, as the module computes with them
        d = spec.shard_dim_of(0)  # the part's dim: its block of each part, beside (parts)
        local = local.reshape(local.shape[:d - 1] + (local.shape[d - 1] * local.shape[d],)
                              + local.shape[d + 1:])
    new = sharded_parameter(local, param.requires_grad, mesh, spec,
                            shape=None if view == full_shape else tuple(param.shape))
    for owner, name in aliases.get(id(param), [(module, attr)]):
        place_parameter(owner, name, new)
    place_parameter(module, attr, new)
    setattr(param, _REPLACED_BY, new)


def _split_spec(shape: tuple[int, ...], placement: Placement, parts: int, mesh: DeviceMesh,
                where: str) -> tuple[ShardingSpec, tuple[int, ...]]:
    """How a parameter of ``shape`` is split by ``placement``: the spec of its blocks, and
    the shape it is split in (``shape`` itself, or with the placement's dim cut into
    ``(parts, part size)`` for a packed parameter, each part split)."""
    view = shape
    if parts > 1:
        view = _packed_view(shape, placement, parts, where)
        placement = Shard(placement.dim % len(shape) + 1)
    return ShardingSpec.from_placements([placement], mesh.shape, view,
                                        mesh.mesh_dim_names), view


def _local_block(param: nn.Parameter, spec: ShardingSpec, view: tuple[int, ...],
                 mesh: DeviceMesh, src_data_rank: int | None, checked: bool,
                 sent: tuple[torch.Tensor, ShardingSpec] | None) -> torch.Tensor:
    """This rank's block of ``param`` (split in ``view``'s shape), a tensor of its own:
    the one the source sent (``sent``: this rank's block and the spec it was cut by, or the
    whole), else split here from the source's values (``src_data_rank``) or this rank's."""
    if sent is not None and sent[1] == spec:  # cut by the source as this style splits it
        return sent[0].clone()  # (out of the bucket's buffer, which goes once it is taken)
    if sent is not None and sent[1] != sent[1].replicated():
        raise ParallelizeError(  # pragma: no cover - a style whose splits() misleads
            f"a style's splits() planned {sent[1]} for a parameter its apply() splits as "
            f"{spec}; make splits() return what apply() distributes")
    whole = param.detach() if sent is None else sent[0]
    sharded = distribute_tensor(whole.reshape(view), mesh, spec,
                                src_rank=src_data_rank if sent is None else None,
                                check=not checked)
    local = sharded.to_local().contiguous()
    if local.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr():
        local = local.clone()  # not a view of the bucket or of the whole parameter
    return local


def _packed_view(shape: tuple[int, ...], placement: Placement, parts: int,
                 where: str) -> tuple[int, ...]:
    """``shape`` with the placement's dim cut into ``(parts, part size)``."""
    if not isinstance(placement, Shard):
        raise ParallelizeError(f"{where}: a packed parameter is split with Shard(d), "
                               f"not {placement}")
    d = placement.dim % len(shape)
    if shape[d] % parts:
        raise ParallelizeError(
            f"{where}: dim {d} of shape {shape} is {shape[d]} long, which is not {parts} "
            "equal packed parts")
    return shape[:d] + (parts, shape[d] // parts) + shape[d + 1:]
