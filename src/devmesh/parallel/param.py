"""Where a parameter's shard lies: a ShardingSpec attached to a plain ``nn.Parameter``.

Parallelized modules keep ordinary ``nn.Parameter``s holding this rank's block, so
``torch.optim`` works on them unchanged. The mesh and spec ride along as an attribute; helpers
that need the global picture (state dicts, gradient clipping, ``describe``) read it. When TP and
FSDP compose, the spec lives on one mesh that spans both (a slice of their common root), and
the weight's dim 0 is split by ``("tp", "dp")`` — TP's pieces, each split by FSDP.
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from devmesh import _torch_compat
from devmesh.distributed.env import read_launch_env
from devmesh.errors import DevmeshError, ParallelizeError  # noqa: F401 - re-exported
from devmesh.mesh import DeviceMesh, init_device_mesh
from devmesh.tensor import ShardedTensor, ShardingSpec

__all__ = ["with_methods", "GradientSyncControl", "ParamLayout", "ShardedParameter",
           "get_layout", "set_layout", "sharded_parameter", "laid_out_parameters",
           "layout_of", "local_of", "shaped_like", "is_dtensor",
           "local_block", "as_sharded", "combined_mesh", "describe_tensors"]

_ATTR = "_devmesh_layout"
# every live parameter given a layout in this process: a gradient handed to torch's
# get_total_norm without its parameter is found here (devmesh.parallel.grads)
_laid_out: weakref.WeakSet = weakref.WeakSet()


@dataclass(frozen=True)
class ParamLayout:
    """Where a parameter's blocks lie: ``spec`` on ``mesh``, over the parameter itself or
    over a reshaped view of it (``shape``).

    The view serves two kinds of parameter whose blocks are not boxes of the parameter's own
    shape: a 0-d parameter, which FSDP shards as one element (spec ``(1,)``, shape ``()``),
    and a *packed* one — several equal parts laid end to end on one dim (a SwiGLU expert's
    ``gate_up_proj``, ``(E, 2I, H)``; a fused q/k/v projection), each part split over the
    mesh, so a rank holds its piece of every part side by side. Its spec splits the view
    with that dim cut into ``(parts, part size)`` (``(E, 2, I, H)``, split on dim 2), where
    the rank's block is a box again; the parameter holds that block reshaped to its own
    number of dims (``(E, 2 * I/tp, H)``: gate then up, as the module computes)."""

    mesh: DeviceMesh
    spec: ShardingSpec
    #: the parameter's own full shape where the spec describes a view of it (see above)
    shape: tuple[int, ...] | None = None

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The full parameter's shape, as single-process training has it."""
        return tuple(self.spec.global_shape) if self.shape is None else self.shape

    @property
    def packed(self) -> tuple[int, int] | None:
        """``(dim, parts)`` of a packed parameter: its dim made of ``parts`` equal parts."""
        if not self.shape:  # whole, or a 0-d parameter
            return None
        view = self.spec.global_shape
        dim = next(d for d in range(len(self.shape)) if view[d] != self.shape[d])
        return dim, view[dim]

    def spec_block(self, block: torch.Tensor) -> torch.Tensor:
        """``block`` (this rank's block of the parameter, or of a tensor laid out like it:
        its gradient, an optimizer state) in the spec's shape, sharing its memory."""
        if self.shape is None:
            return block
        return block.reshape(self.spec.local_shape(self.mesh.get_coordinate()))


def get_layout(param: torch.Tensor) -> ParamLayout | None:
    return getattr(param, _ATTR, None)


def layout_of(tensor: torch.Tensor) -> ParamLayout | None:
    """How ``tensor`` is laid out: a parameter devmesh laid out, or a torch DTensor (its
    layout read from its placements: torch's tensor parallelism alone); ``None`` if whole."""
    layout = get_layout(tensor)
    if layout is None and is_dtensor(tensor):
        block = ShardedTensor.from_dtensor(tensor.detach())
        layout = ParamLayout(block.device_mesh, block.spec)
    return layout


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's block of ``tensor``, sharing its memory: a DTensor's local tensor, any
    other tensor itself (detached)."""
    return tensor.detach().to_local() if is_dtensor(tensor) else tensor.detach()


def shaped_like(param: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """``block`` (this rank's block of a tensor laid out as ``param``) in ``param``'s form: a
    DTensor for a DTensor parameter (its optimizer state must be one), else the block."""
    if not is_dtensor(param):
        return block
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(block, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def is_dtensor(tensor: torch.Tensor) -> bool:
    # a DTensor exists only once torch.distributed.tensor is imported: no import here
    distributed_tensor = sys.modules.get("torch.distributed.tensor")
    return distributed_tensor is not None and isinstance(tensor, distributed_tensor.DTensor)


def set_layout(param: torch.Tensor, mesh: DeviceMesh, spec: ShardingSpec,
               shape: tuple[int, ...] | None = None) -> None:
    setattr(param, _ATTR, ParamLayout(mesh, spec, shape))
    _laid_out.add(param)


def laid_out_parameters() -> list[torch.Tensor]:
    """The live parameters of this process that carry a devmesh layout (those laid out here
    and their deep copies)."""
    return [p for p in list(_laid_out) if get_layout(p) is not None]


class ShardedParameter(nn.Parameter):
    """An ``nn.Parameter`` holding this rank's block of a distributed parameter.

    It is a plain parameter in every way the optimizer and autograd see; the subclass exists
    only because ``nn.Parameter.__deepcopy__`` drops Python attributes, and the layout must
    survive ``copy.deepcopy(model)`` (pickling keeps attributes already)."""

    def __deepcopy__(self, memo: dict) -> ShardedParameter:
        if id(self) in memo:
            return memo[id(self)]
        result = ShardedParameter(self.data.clone(memory_format=torch.preserve_format),
                                  self.requires_grad)
        memo[id(self)] = result
        result.__dict__.update(copy.deepcopy(self.__dict__, memo))
        if get_layout(result) is not None:
            _laid_out.add(result)
        return result


def sharded_parameter(local: torch.Tensor, requires_grad: bool, mesh: DeviceMesh,
                      spec: ShardingSpec, shape: tuple[int, ...] | None = None
                      ) -> ShardedParameter:
    """A new parameter holding ``local`` (this rank's block of ``spec``; ``shape``: the full
    parameter's shape where it differs from the spec's, see :class:`ParamLayout`)."""
    param = ShardedParameter(local, requires_grad=requires_grad)
    set_layout(param, mesh, spec, shape)
    return param


def split_layout(param: torch.Tensor | None) -> ParamLayout | None:
    """The layout of ``param`` if it is split on its mesh (not whole on every rank, and not a
    0-d parameter, which FSDP keeps as one element on one rank)."""
    layout = get_layout(param) if param is not None else None
    if layout is None or layout.shape == ():
        return None
    return layout if any(layout.spec.dim_map) else None


def as_dtensor(block: torch.Tensor, param: torch.Tensor):
    """``block`` (this rank's block of a tensor laid out as ``param``, e.g. the parameter or
    an optimizer state of it) as a torch DTensor, sharing its storage."""
    layout = get_layout(param)
    assert layout is not None
    if layout.packed is not None:
        return _packed_dtensor(block.detach(), layout)
    return ShardedTensor(layout.spec_block(block.detach()), layout.mesh,
                         layout.spec).to_dtensor()


def _packed_dtensor(block: torch.Tensor, layout: ParamLayout):
    """A packed parameter's block as a torch DTensor of the parameter's own shape: its
    packed dim's mesh dim becomes ``_StridedShard(dim, split_factor=parts)`` — torch's
    placement for "each of ``parts`` pieces split over the mesh dim", which is what a
    packed dim is. Only what that placement describes is converted: one mesh dim splitting
    the parts, evenly; a packed dim also split by FSDP (or unevenly) is refused by name."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as TorchShard

    dim, parts = layout.packed
    spec = layout.spec
    splitting = spec.dim_map[dim + 1]
    if (spec.dim_map[dim] or len(splitting) != 1
            or spec.global_shape[dim + 1] % spec.mesh_shape[splitting[0]]):
        raise ParallelizeError(
            f"a packed parameter of shape {layout.full_shape} laid out as {spec} has no "
            "torch DTensor form: a DTensor describes a packed dim split evenly by one mesh "
            "dim. Take its full tensor instead (devmesh.parallel.state_dict(model, "
            "full=True)), or save it with devmesh's checkpoints")
    # the same split as if the dim were not packed: each mesh dim's placement, that one's
    # then made the strided placement of the parts
    own = ShardingSpec(spec.mesh_shape, layout.full_shape,
                       spec.dim_map[:dim] + (splitting,) + spec.dim_map[dim + 2:],
                       spec.partial, spec.mesh_dim_names)
    local = block.reshape(own.local_shape(layout.mesh.get_coordinate()))
    placements = list(ShardedTensor(local, layout.mesh, own).to_dtensor().placements)
    assert placements[splitting[0]] == TorchShard(dim)
    placements[splitting[0]] = _torch_compat.strided_shard_type()(dim, split_factor=parts)
    shape = layout.full_shape
    stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    return DTensor.from_local(local, layout.mesh, placements, run_check=False, shape=shape,
                              stride=stride)


def block_of(value: torch.Tensor, param: torch.Tensor, name: str) -> torch.Tensor:
    """This rank's block of ``value`` for ``param`` (laid out on a mesh): a tensor of the
    block's shape as it is; a DTensor laid out as ``param`` is (``model.state_dict()`` of a
    model like this one), its local tensor; any other DTensor is gathered — a collective on
    its mesh, which loading runs on every rank — and, like a full tensor, cut."""
    from torch.distributed.tensor import DTensor

    layout = get_layout(param)
    assert layout is not None
    if isinstance(value, DTensor):
        try:
            mine = ShardedTensor.from_dtensor(value)
            if mine.spec == layout.spec and mine.device_mesh == layout.mesh:
                return mine.to_local()
        except DevmeshError:
            pass  # a layout devmesh does not describe: take the whole
        value = value.full_tensor()
    if value.shape == param.shape:
        return value
    if tuple(value.shape) != layout.full_shape:
        raise ParallelizeError(
            f"{name} is sharded by devmesh: pass its full tensor (shape {layout.full_shape}) "
            f"or this rank's block (shape {tuple(param.shape)}), not shape "
            f"{tuple(value.shape)}")
    return local_block(param, value.reshape(layout.spec.global_shape)).reshape(param.shape)


def local_block(param: torch.Tensor, full: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """This rank's block of ``full``, a tensor laid out like ``param`` (its global shape;
    ``param`` laid out by devmesh, or a torch DTensor)."""
    layout = layout_of(param)
    if layout is None:
        return full
    expected = tuple(layout.spec.global_shape)
    if tuple(full.shape) != expected:
        raise ParallelizeError(f"{name} has shape {tuple(full.shape)}, the model's full "
                               f"parameter is {expected}")
    for d, (start, size) in enumerate(layout.spec.local_bounds(layout.mesh.get_coordinate())):
        full = full.narrow(d, start, size)
    return full


def as_sharded(param: torch.Tensor) -> ShardedTensor | None:
    """The parameter (or its gradient's owner) as a ShardedTensor, if it is laid out on a mesh."""
    layout = get_layout(param)
    if layout is None:
        return None
    return ShardedTensor(layout.spec_block(param.detach()), layout.mesh, layout.spec)


def describe_tensors(module: torch.nn.Module) -> str:
    """Names, shapes and dtypes of a module's parameters and buffers: what every replica
    (or every rank sharding the module) must agree on before its first collective."""
    def shape(p: torch.Tensor) -> tuple[int, ...]:  # global: local blocks may differ
        layout = get_layout(p)
        return tuple(layout.spec.global_shape) if layout else tuple(p.shape)

    params = [f"{n} {shape(p)} {p.dtype}" for n, p in module.named_parameters()]
    buffers = [f"{n} {tuple(b.shape)} {b.dtype}" for n, b in module.named_buffers()]
    return (f"{len(params)} parameters, {len(buffers)} buffers: "
            + "; ".join(params + buffers))


def combined_mesh(a: DeviceMesh, b: DeviceMesh) -> DeviceMesh:
    """The slice of the common root spanning the dims of ``a`` and of ``b`` (in root order),
    each by its own name: a flattened dim is one dim there, as it is to the parallelism that
    splits over it (its blocks follow ``torch.chunk`` over the flattened size, which nested
    splits over its parts would not).

    The roots need not be one object: equal roots (the same layout and names, made by two
    ``init_device_mesh`` calls, as ``from_pretrained`` makes its own) compose, as torch's
    FSDP accepts them; ``a``'s root is the one the combined mesh is sliced from."""
    if a._root is not b._root and a._root != b._root:
        raise ParallelizeError(
            f"cannot compose parallelisms on {a!r} and {b!r}: they must be slices of one "
            f"mesh or of equal meshes (same shape, ranks and dim names), but they come from "
            f"{a._root!r} and {b._root!r}; slice both from one mesh, e.g. mesh['tp'] and "
            "mesh['dp'] of init_device_mesh(..., ('dp', 'tp'))"
        )
    root = a._root
    names = root.mesh_dim_names
    if names is None:
        raise ParallelizeError("composing parallelisms needs a mesh with mesh_dim_names")
    dims: dict[str, tuple[int, ...]] = {}
    for m in (a, b):  # a flattened dim ("dp_shard_cp", torchtitan's) stays one dim
        for name, roots in zip(m.mesh_dim_names or (), m._dim_roots, strict=True):
            dims[name] = roots
    covered = [d for roots in dims.values() for d in roots]
    if len(covered) != len(set(covered)):
        raise ParallelizeError(
            f"cannot compose parallelisms on {a!r} and {b!r}: their dims overlap "
            f"({', '.join(dims)}); give each parallelism its own dims of the mesh")
    wanted = tuple(sorted(dims, key=lambda name: dims[name][0]))
    return root if wanted == names else root[wanted]


_MIXED: dict[tuple[type, type], type] = {}


def with_methods(module: nn.Module, mixin: type) -> None:
    """Give ``module`` the methods of ``mixin`` by changing its class to a subclass of both
    (``FSDPLinear`` for a Linear), as torch's FSDP2 does: ``isinstance(m, nn.Linear)`` still
    holds and the module's own methods are untouched. The class is named after the mixin
    (its ``_devmesh_prefix``, else its name without ``Module``) and the module's class; a
    module so changed still pickles (``torch.save(model)``), as its class is made again
    from the same recipe when loaded."""
    if not isinstance(module, mixin):
        module.__class__ = _mixed_class(type(module), mixin)


def _mixed_class(cls: type, mixin: type) -> type:
    key = (cls, mixin)
    if key not in _MIXED:
        prefix = mixin.__dict__.get("_devmesh_prefix", mixin.__name__.removesuffix("Module"))
        recipe = cls.__dict__.get("_devmesh_recipe", (cls,)) + (mixin,)
        _MIXED[key] = type(f"{prefix}{cls.__name__}", (mixin, cls),
                           {"__module__": cls.__module__, "_devmesh_recipe": recipe,
                            "__reduce_ex__": _reduce_mixed})
    return _MIXED[key]


def _reduce_mixed(module: nn.Module, protocol: int):
    """Pickle a module whose class ``with_methods`` made: by its recipe (the original class
    and the mixins), since the made class cannot be found by name."""
    _, _, *rest = object.__reduce_ex__(module, max(protocol, 2))
    return (_new_mixed, (type(module).__dict__["_devmesh_recipe"],), *rest)


def _new_mixed(recipe: tuple[type, ...]) -> nn.Module:
    cls = recipe[0]
    for mixin in recipe[1:]:
        cls = _mixed_class(cls, mixin)
    return cls.__new__(cls)


class GradientSyncControl:
    """``no_sync()`` for a module whose class defines ``set_requires_gradient_sync``: DDP's
    context for accumulating gradients without communication."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)


def world_mesh() -> DeviceMesh:
    """torch's default data-parallel mesh: every rank of the world on one dim (starting the
    default process group from the launcher's environment if none runs yet, as torch's
    ``init_device_mesh`` does; without a launcher that raises the error saying how to
    launch)."""
    if dist.is_initialized():
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        return init_device_mesh(device, (dist.get_world_size(),))
    world_size = read_launch_env().world_size
    return init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (world_size,))
