"""DeviceMesh: a :class:`~devmesh.layout.MeshLayout` bound to this rank's process groups.

The API and semantics are those of ``torch.distributed.device_mesh`` so that code written
for torch runs with only its import changed. Where devmesh differs it says so:

* errors are devmesh's own types (subclasses of what torch raises) and say how to fix things;
* ranks that pass different meshes get an error naming them instead of a later hang;
* slicing accepts dimensions in any order (``mesh["tp", "dp"]``);
* ``repr`` shows the ranks and names (``DeviceMesh([0, 1, 2], mesh_dim_names=('tp',))``);
* a ``timeout=`` bounds every collective on the mesh's groups;
* every distinct rank list gets one process group, shared by all meshes and sub-meshes.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

from devmesh._torch_compat import (
    BackendOptions,
    fill_torch_mesh_state,
    register_dim_groups,
    register_flattened,
    restore_torch_mesh_state,
    torch_concatenate,
    torch_mesh_state_for_pickle,
    unwrap_fake_script_object,
)
from devmesh.distributed import env, groups
from devmesh._log import get_logger
from devmesh.errors import (
    DeviceTypeError,
    MeshFlattenNameError,
    MeshDimNameError,
    MeshNamesError,
    MeshRankError,
    MeshShapeError,
    MeshUsageError,  # noqa: F401 - re-exported
    WorldSizeMismatchError,
)
from devmesh.layout import Dim, MeshLayout, _check_names, _check_shape
from devmesh.layout.data_parallel import flattened_name

if TYPE_CHECKING:
    import datetime


__all__ = ["DeviceMesh", "init_device_mesh"]


def _as_rank_array(mesh: Any) -> np.ndarray:
    if isinstance(mesh, torch.Tensor):
        return mesh.detach().cpu().numpy()
    return np.asarray(mesh)


# torch's forms: a backend name, its options (``Backend.Options``), or a (name, options) pair
BackendChoice = Union[str, object, tuple]
BackendConfig = tuple  # (name or None, options or None); (None, None): the default group's


def _backend_config(where: str, value: object) -> BackendConfig:
    """One ``backend_override`` value as ``(name, options)``, as torch reads it."""
    if isinstance(value, BackendOptions):
        name, options = None, value
    elif isinstance(value, tuple) and len(value) == 2:
        name, options = value
    else:
        name, options = value, None
    if not (name is None or isinstance(name, str)) or not (
            options is None or isinstance(options, BackendOptions)):
        raise MeshShapeError(
            f"{where} = {value!r}: give a backend name ('gloo'), its options "
            "(e.g. ProcessGroupGloo._Options()), or a (name, options) pair")
    if name is not None and not dist.is_backend_available(name.lower()):
        raise MeshShapeError(f"{where} = {name!r} is not a backend this torch build has "
                             "(e.g. 'gloo', 'nccl')")
    return (None if name is None else name.lower(), options)


def _backends(override: Mapping[Dim, BackendChoice] | None, ndim: int,
              names: Sequence[str] | None) -> tuple[BackendConfig, ...]:
    """torch's ``backend_override`` as one ``(name, options)`` per dim, ``(None, None)`` for
    the default. Keys are dim indices or names, read as torch reads them (and refused with
    torch's phrases: a dim given twice, keys naming no dim)."""
    remaining = dict(override or {})
    names = tuple(names or ())
    chosen: list[BackendConfig] = []
    for d in range(ndim):
        name = names[d] if d < len(names) else None
        if name is not None and name in remaining:
            if d in remaining:
                raise MeshNamesError(
                    f"Found redundant dim index {d} and name {name} in backend_override: "
                    f"give dim {d}'s backend once")
            key = name
        elif d in remaining:
            key = d
        else:
            chosen.append((None, None))
            continue
        chosen.append(_backend_config(f"backend_override[{key!r}]", remaining.pop(key)))
    if remaining:
        raise MeshNamesError(
            f"Found invalid keys in backend_override: got {list(remaining)}, expected "
            f"integers in range [0, {ndim}) or one of {names}")
    return tuple(chosen)


def _describe_backends(configs: Sequence[BackendConfig]) -> str:
    """What ranks must agree on about the backends (options by type: their objects differ
    between processes)."""
    if not any(name or options for name, options in configs):
        return ""
    shown = [name if options is None else f"{name}+{type(options).__name__}"
             for name, options in configs]
    return f", backends={tuple(shown)}"


def _payload(device_type: str, layout: MeshLayout) -> str:
    """What ranks must agree on, short enough for an error message."""
    ranks = layout.rank_list()
    shown = (
        str(ranks)
        if len(ranks) <= 64
        else hashlib.sha1(layout.ranks.tobytes()).hexdigest()[:12]
    )
    return (
        f"device_type={device_type!r}, shape={layout.shape}, "
        f"mesh_dim_names={layout.names}, ranks={shown}"
    )


class DeviceMesh(TorchDeviceMesh):
    """An N-dimensional mesh of ranks with one process group per dimension for this rank.

    A devmesh mesh *is* a ``torch.distributed.device_mesh.DeviceMesh`` (a subclass whose
    torch-side bookkeeping — ``_layout``, ``_rank_map``, ``_dim_group_names``, the root mesh —
    describes the same ranks and process groups), so it goes wherever torch takes a mesh:
    ``DTensor.from_local``, ``distribute_tensor``, torch's ``fully_shard`` and
    ``parallelize_module``, functional collectives with ``group=(mesh, dim)``.

    Args:
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL).
        mesh: array-like or integer tensor of global ranks; its shape is the mesh shape. It may
            cover part of the world (every rank of the world must still construct it, as in
            torch; ranks outside it get ``get_coordinate() is None``).
        mesh_dim_names: one name per dimension, needed for slicing.
        timeout: seconds or ``timedelta`` bounding every collective on this mesh's groups and
            the check that all ranks passed the same mesh.

    Creating a mesh is a collective over the world: it initializes the default process group
    from torchrun's environment if needed, checks that all ranks agree, and creates (or
    reuses) one group per dimension containing this rank.
    """

    def __init__(
        self,
        device_type: str,
        mesh: Any,
        *,
        mesh_dim_names: Sequence[str] | None = None,
        timeout: float | datetime.timedelta | None = None,
        backend_override: Mapping[Dim, BackendChoice] | None = None,
        _init_backend: bool = True,
        _rank: int | None = None,
    ) -> None:
        _check_device_type(device_type)
        layout = MeshLayout(ranks=_as_rank_array(mesh), names=mesh_dim_names)
        timeout_td = groups.as_timedelta(timeout)
        backends = _backends(backend_override, layout.ndim, layout.names)
        if _init_backend:
            env.ensure_default_group(device_type, timeout=timeout_td)
            self._check_world_covers(layout)
            groups.publish_host()
            groups.check_agreement(
                "DeviceMesh creation",
                _payload(device_type, layout) + _describe_backends(backends),
                timeout=timeout_td,
            )
        self._setup(device_type, layout, root=None, dim_roots=None, timeout=timeout_td,
                    rank=_rank)
        self._backends = backends
        if _init_backend:
            self._create_groups()

    # -- construction internals ------------------------------------------------------------
    @classmethod
    def _build(
        cls,
        device_type: str,
        layout: MeshLayout,
        *,
        root: DeviceMesh | None = None,
        dim_roots: tuple[tuple[int, ...], ...] | None = None,
        timeout: datetime.timedelta | None = None,
    ) -> DeviceMesh:
        """The one private constructor behind slicing, flattening, unflattening and
        ``from_group``: no agreement check, no groups (the caller sets them)."""
        mesh = cls.__new__(cls)
        mesh._setup(device_type, layout, root=root, dim_roots=dim_roots, timeout=timeout)
        return mesh

    def _setup(
        self,
        device_type: str,
        layout: MeshLayout,
        *,
        root: DeviceMesh | None,
        dim_roots: tuple[tuple[int, ...], ...] | None,
        timeout: datetime.timedelta | None,
        rank: int | None = None,
    ) -> None:
        """``rank``: this process's rank, given only by torch's ``_rank=`` (a mesh built
        without process groups, e.g. to compute coordinates ahead of a launch)."""
        self._device_type = device_type
        self._mesh_layout = layout
        self._root = root if root is not None else self
        self._dim_roots = dim_roots or tuple((d,) for d in range(layout.ndim))
        self._timeout = timeout
        # per dim, backend_override's (name, options); (None, None): the default backend
        self._backends: tuple[BackendConfig, ...] = ((None, None),) * layout.ndim
        self._flattened: dict[str, tuple[int, ...]] = {}
        self._flattened_backends: dict[str, BackendConfig] = {}
        self._groups: tuple[ProcessGroup | None, ...] = (None,) * layout.ndim
        if rank is not None:
            self._rank = int(rank)
        else:
            self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._world = groups.generation() if dist.is_initialized() else -1
        self._coordinate = layout.coordinate_of(self._rank)
        if root is None:
            self._anchor = self._coordinate or (0,) * layout.ndim
        self._init_torch_state()

    def _init_torch_state(self) -> None:
        """Fill in what torch's own DeviceMesh code reads (:mod:`devmesh._torch_compat`)."""
        root = self._root
        fill_torch_mesh_state(self, root=root, ranks=root._mesh_layout.ranks,
                              root_shape=root._mesh_layout.shape, dim_roots=self._dim_roots,
                              names=self._mesh_layout.names, coordinate=self._coordinate)

    def _set_groups(self, dim_groups: Sequence[ProcessGroup]) -> None:
        self._groups = tuple(dim_groups)
        register_dim_groups(self, self._root, self._groups)

    @staticmethod
    def _check_world_covers(layout: MeshLayout) -> None:
        world = dist.get_world_size()
        top = int(layout.ranks.max())
        if top >= world:
            raise MeshRankError(
                f"the mesh contains rank {top} but the world has only {world} ranks "
                f"(0..{world - 1}); launch more processes or use ranks below {world}"
            )

    def _create_groups(self) -> None:
        created = []
        for d in range(self._mesh_layout.ndim):
            rows = self._mesh_layout.group_array(d).tolist()
            name, options = self._backends[d]
            created.append(
                groups.create_dim_groups(
                    rows, backend=name, options=options, timeout=self._timeout,
                    desc=f"mesh_{self._mesh_layout.dim_name(d)}"
                )
            )
        if self._coordinate is not None:
            self._set_groups(created)

    def _child(
        self,
        layout: MeshLayout,
        dim_roots: tuple[tuple[int, ...], ...],
    ) -> DeviceMesh:
        """A view of the root: same ranks, some dims; groups come from the cache."""
        child = DeviceMesh._build(self._device_type, layout, root=self._root,
                                  dim_roots=dim_roots, timeout=self._timeout)
        root = self._root
        # a dim of the root keeps its backend; a flattened one has its flatten's
        child._backends = tuple(
            root._backends[r[0]] if len(r) == 1
            else root._flattened_backends.get(layout.dim_name(d), (None, None))
            for d, r in enumerate(dim_roots))
        if child._coordinate is not None:
            child._set_groups([
                groups.get_group(layout.group_of(child._rank, d), backend=name,
                                 options=options, timeout=self._timeout)
                for d, (name, options) in enumerate(child._backends)
            ])
        return child

    def backend_of(self, mesh_dim: Dim) -> str | None:
        """The backend ``backend_override`` gave ``mesh_dim``'s groups (``None``: the default
        group's backend)."""
        return self._backends[self._mesh_layout.dim(mesh_dim)][0]

    def has_own_group(self, mesh_dim: Dim) -> bool:
        """Whether ``backend_override`` gave ``mesh_dim`` a backend or backend options of its
        own: its groups are then not the default ones over the same ranks."""
        return self._backends[self._mesh_layout.dim(mesh_dim)] != (None, None)

    # -- torch API: attributes -------------------------------------------------------------
    @property
    def device_type(self) -> str:
        return self._device_type

    @property
    def mesh(self) -> torch.Tensor:
        """The global ranks as an integer tensor of the mesh's shape."""
        return torch.tensor(self._mesh_layout.ranks, dtype=torch.int, device="cpu")

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        return self._mesh_layout.names

    @property
    def layout(self) -> MeshLayout:
        """The pure layout (shape, names, ranks) behind this mesh."""
        return self._mesh_layout

    @property
    def ndim(self) -> int:
        return self._mesh_layout.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        return self._mesh_layout.shape

    @property
    def timeout(self) -> datetime.timedelta | None:
        return self._timeout

    def size(self, mesh_dim: Dim | None = None) -> int:
        """Number of ranks in the mesh, or along ``mesh_dim``."""
        if mesh_dim is None:
            return self._mesh_layout.size
        return self._mesh_layout.shape[self._mesh_layout.dim(mesh_dim)]

    def get_rank(self) -> int:
        """This process's global rank."""
        return self._rank

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's coordinate in the mesh, or ``None`` if the mesh does not contain it."""
        return self._coordinate

    def _single_dim(self, mesh_dim: Dim | None, what: str) -> int:
        if mesh_dim is None:
            if self.ndim > 1:
                names = self.mesh_dim_names or tuple(range(self.ndim))
                raise MeshUsageError(
                    f"Found the DeviceMesh have {self.ndim} dimensions. Optional kwarg "
                    "`mesh_dim` needs to be specified when device_mesh.ndim > 1: "
                    f"{what} needs mesh_dim= one of {names}"
                )
            return 0
        return self._mesh_layout.dim(mesh_dim)

    def _flattened_view(self, mesh_dim: Dim | None) -> DeviceMesh | None:
        """The 1-D mesh of a flattened name (``"dp_cp"`` after ``mesh["dp", "cp"]._flatten()``)
        when ``mesh_dim`` is such a name and not one of this mesh's own dims."""
        if (isinstance(mesh_dim, str) and mesh_dim not in (self.mesh_dim_names or ())
                and mesh_dim in self._root._flattened):
            return self[mesh_dim]
        return None

    def _require_member(self, what: str) -> tuple[int, ...]:
        if self._coordinate is None:
            raise MeshRankError(
                f"{what}: rank {self._rank} is not part of {self!r}; only its ranks "
                f"{self._mesh_layout.rank_list()} have groups and coordinates in it"
            )
        return self._coordinate

    def coordinate_of(self, rank: int) -> tuple[int, ...] | None:
        """The coordinate ``rank`` has in *its* copy of this mesh: for a sub-mesh, the one
        sliced through ``rank`` (same dims, ``rank``'s other coordinates). Pure arithmetic;
        ``None`` if the root mesh does not contain ``rank``."""
        root = self._root
        coordinate = root._mesh_layout.coordinate_of(rank)
        if coordinate is None:
            return None
        out = []
        for roots in self._dim_roots:
            index = 0
            for d in roots:
                index = index * root._mesh_layout.shape[d] + coordinate[d]
            out.append(index)
        return tuple(out)

    def world_ranks(self) -> list[int]:
        """Every rank of the root mesh this mesh was sliced from."""
        return self._root._mesh_layout.rank_list()

    def get_local_rank(self, mesh_dim: Dim | None = None) -> int:
        """This rank's index along ``mesh_dim`` (its rank in that dimension's group)."""
        flattened = self._flattened_view(mesh_dim)
        if flattened is not None:
            return flattened.get_local_rank()
        dim = self._single_dim(mesh_dim, "get_local_rank()")
        return self._require_member("get_local_rank()")[dim]

    def get_group(self, mesh_dim: Dim | None = None) -> ProcessGroup:
        """The process group of this rank along ``mesh_dim`` (a dim's index or name, or a
        flattened name such as ``"dp_cp"``)."""
        flattened = self._flattened_view(mesh_dim)
        if flattened is not None:
            return flattened.get_group()
        dim = self._single_dim(mesh_dim, "get_group()")
        self._require_member("get_group()")
        group = self._groups[dim]
        if group is None:
            raise MeshUsageError(
                f"process groups not initialized! {self!r} has no process groups in this "
                "process: it was unpickled (groups do not travel between processes) or "
                "created with _init_backend=False"
            )
        return group

    def get_all_groups(self) -> list[ProcessGroup]:
        """This rank's process group along every dimension, in order."""
        return [self.get_group(d) for d in range(self.ndim)]

    def group_ranks(self, mesh_dim: Dim | None = None) -> tuple[int, ...]:
        """Global ranks of this rank's group along ``mesh_dim``, in mesh order."""
        dim = self._single_dim(mesh_dim, "group_ranks()")
        self._require_member("group_ranks()")
        return self._mesh_layout.group_of(self._rank, dim)

    # -- hosts -----------------------------------------------------------------------------
    def hosts(self) -> list:
        """The host (torchrun node rank) of every rank, laid out like :attr:`mesh`."""
        from devmesh.layout.topology import hosts_of

        return hosts_of(self._mesh_layout, groups.world_hosts()).tolist()

    def dims_crossing_hosts(self) -> list[str]:
        """Names of the mesh dims whose groups span more than one host."""
        from devmesh.layout.topology import crossing_dims

        return [self._mesh_layout.dim_name(d)
                for d in crossing_dims(self._mesh_layout, groups.world_hosts())]

    def visualize(self, to_file: str | None = None, *, outline: Dim | None = None) -> str:
        """Text picture of the mesh with its hosts; a PNG with ``to_file`` (groups of
        ``outline``, default the innermost dim, drawn as boxes)."""
        from devmesh.pictures.render import layout_text
        from devmesh.layout.topology import hosts_of

        host_of = groups.world_hosts()
        if to_file:
            from devmesh.pictures.render_png import layout_png

            layout_png(self._mesh_layout, to_file, host_of=host_of, outline=outline)
        hosts = hosts_of(self._mesh_layout, host_of)
        return layout_text(self._mesh_layout) + "\nhosts:\n" + "\n".join(
            "  " + str(row) for row in hosts.reshape(-1, self._mesh_layout.shape[-1]).tolist())

    # -- slicing ---------------------------------------------------------------------------
    def _valid_names(self) -> list[str]:
        covered = {d for roots in self._dim_roots for d in roots}
        extra = [
            name
            for name, roots in self._root._flattened.items()
            if set(roots) <= covered and name not in (self.mesh_dim_names or ())
        ]
        return list(self.mesh_dim_names or ()) + extra

    def _root_dims_of(self, name: str) -> tuple[int, ...]:
        names = self.mesh_dim_names or ()
        if name in names:
            return self._dim_roots[names.index(name)]
        roots = self._root._flattened.get(name)
        covered = {d for r in self._dim_roots for d in r}
        if roots is not None and set(roots) <= covered:
            return roots
        raise MeshDimNameError(
            f"Invalid mesh_dim_names ({name!r},) specified: cannot slice {name!r} from "
            f"{self!r}; valid names are "
            f"{', '.join(map(repr, self._valid_names()))}"
        )

    def __getitem__(self, mesh_dim_names: str | Sequence[str]) -> DeviceMesh:
        """Sub-mesh over one or several named dimensions (flattened names included).

        Unlike torch, the names may come in any order; the sub-mesh's dims follow it.
        """
        if not self.mesh_dim_names:
            raise MeshUsageError(
                "Cannot slice a DeviceMesh without mesh_dim_names! Create it with "
                "mesh_dim_names=(...), e.g. init_device_mesh('cpu', (2, 4), "
                "mesh_dim_names=('dp', 'tp'))"
            )
        names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
        if not names or not all(isinstance(n, str) for n in names):
            raise MeshDimNameError(f"slice a mesh by dimension names, got {mesh_dim_names!r}")
        if names == self.mesh_dim_names:
            return self
        _check_names(names, len(names))  # duplicates
        per_name = [self._root_dims_of(n) for n in names]
        flat = [d for roots in per_name for d in roots]
        if len(set(flat)) != len(flat):
            raise MeshDimNameError(
                f"cannot slice {names!r} from {self!r}: those names overlap (a flattened "
                "dimension and one of its parts)"
            )
        return self._root._view(tuple(per_name), names)

    def _view(self, per_dim: tuple[tuple[int, ...], ...], names: tuple[str, ...]
              ) -> DeviceMesh:
        """The sub-mesh of this root through this rank whose dim ``i`` is the root's dims
        ``per_dim[i]`` (several: flattened, major to minor), named ``names``."""
        root_layout = self._mesh_layout
        assert self._anchor is not None
        sub = root_layout.slice([d for roots in per_dim for d in roots],
                                coordinate=self._anchor)
        shape = tuple(math.prod(root_layout.shape[d] for d in roots) for roots in per_dim)
        layout = MeshLayout._trusted(sub.ranks.reshape(shape), names)
        return self._child(layout, per_dim)

    @staticmethod
    def _concatenate(device_mesh_list: Sequence[TorchDeviceMesh]) -> TorchDeviceMesh:
        """One mesh of the given sub-meshes' dims, in order, as torch's ``_concatenate``
        (how torch's FSDP over TP joins ``mesh["dp"]`` and ``mesh["tp"]``). Sub-meshes of
        one devmesh mesh give a devmesh mesh, equal to slicing their names together
        (``_concatenate([m["pp", "dp"], m["tp"]]) == m``); torch-built meshes go to torch's."""
        meshes = list(device_mesh_list)
        if not meshes or not all(isinstance(m, DeviceMesh) for m in meshes):
            return torch_concatenate(meshes)
        root = meshes[0]._root  # equal roots (two init_device_mesh calls) join, as torch's
        if any(m._root is not root and m._root != root for m in meshes):
            raise MeshUsageError(
                "Cannot concatenate DeviceMeshes derived from different device meshs: "
                f"{meshes!r} were sliced from different meshes; slice them from one")
        if any(not m.mesh_dim_names for m in meshes):
            raise MeshUsageError(f"cannot concatenate {meshes!r}: every mesh needs "
                                 "mesh_dim_names")
        per_dim = tuple(roots for m in meshes for roots in m._dim_roots)
        flat = [d for roots in per_dim for d in roots]
        if len(set(flat)) != len(flat):
            raise MeshUsageError(f"Cannot concatenate overlapping meshes: {meshes!r} share "
                                 "dimensions; give each dimension once")
        names = tuple(n for m in meshes for n in m.mesh_dim_names)  # type: ignore[union-attr]
        _check_names(names, len(names))
        return root._view(per_dim, names)

    # -- flatten / unflatten ---------------------------------------------------------------
    def _flatten(self, mesh_dim_name: str | None = None,
                 backend_override: BackendChoice | None = None) -> DeviceMesh:
        """Flatten all dims of this mesh into one, reachable later by name from the root.

        ``mesh_3d["dp", "cp"]._flatten()`` gives a 1-D mesh named ``"dp_cp"``, and
        ``mesh_3d["dp_cp"]`` slices it again without creating a group. ``backend_override``
        (a backend name, its options, or both as a pair) gives the flattened groups their
        own backend, as torch's.
        """
        if not self.mesh_dim_names:
            raise MeshUsageError(
                "Cannot flatten a DeviceMesh without mesh_dim_names: create it with "
                "mesh_dim_names=(...)"
            )
        name = mesh_dim_name or flattened_name(self.mesh_dim_names)
        if self.ndim == 1 and name in self.mesh_dim_names:
            return self
        roots = tuple(d for r in self._dim_roots for d in r)
        root = self._root
        existing = root._flattened.get(name)
        root_names = root.mesh_dim_names or ()
        if name in root_names and (root_names.index(name),) != roots:
            raise MeshFlattenNameError(
                f"{name} already exists for submesh of the {root!r}: it names a dimension "
                f"of that mesh; pass another mesh_dim_name to _flatten"
            )
        if existing is not None and existing != roots:
            raise MeshFlattenNameError(
                f"Flatten mesh with mesh_dim_name {name} has been created before, over other "
                f"dimensions of {root!r}; Please specify another valid mesh_dim_name"
            )
        if existing is None:
            config = (_backend_config("_flatten's backend_override", backend_override)
                      if backend_override is not None else (None, None))
            groups.check_agreement(
                "DeviceMesh flatten",
                f"flatten {_payload(self._device_type, root._mesh_layout)} dims {roots} as "
                f"{name!r}{_describe_backends([config])}",
                timeout=self._timeout,
            )
            rows = root._mesh_layout.group_array(roots).tolist()
            groups.create_dim_groups(rows, backend=config[0], options=config[1],
                                     timeout=self._timeout, desc=f"mesh_{name}")
            root._flattened[name] = roots
            root._flattened_backends[name] = config
        layout = MeshLayout._trusted(self._mesh_layout.ranks.reshape(-1), (name,))
        flat = self._child(layout, (roots,))
        register_flattened(root, name, flat)
        return flat

    flatten = _flatten

    def _unflatten(
        self, dim: Dim, mesh_sizes: Sequence[int], mesh_dim_names: Sequence[str],
        backend_override: Mapping[Dim, BackendChoice] | None = None,
    ) -> DeviceMesh:
        """Split ``dim`` into several named dims, as torchtitan builds its meshes.

        The result is a new mesh over the same ranks; groups of the new dims are created (or
        reused when another view already has them). ``backend_override`` gives new dims
        their own backend (keys: the new names, or indices among the new dims), as torch's
        (torchtitan gives a dim of size 1 the ``"fake"`` backend); the other dims keep
        theirs.
        """
        if isinstance(dim, int) and not isinstance(dim, bool) and not -self.ndim <= dim < self.ndim:
            raise MeshDimNameError(f"dim {dim} specified in unflatten is out of range {self.ndim}")
        sizes = _check_shape(mesh_sizes)
        if len(tuple(mesh_dim_names)) != len(sizes):
            raise MeshDimNameError(
                f"unflatten into sizes {sizes} needs {len(sizes)} names, got {tuple(mesh_dim_names)!r}"
            )
        names = self.mesh_dim_names
        if names is None:
            names = tuple(f"dim{i}" for i in range(self.ndim))
        named = self._mesh_layout.with_names(names)
        split = named.dim(dim)
        layout = named.unflatten(split, sizes, tuple(mesh_dim_names))
        new = _backends(backend_override, len(sizes), tuple(mesh_dim_names))
        backends = self._backends[:split] + new + self._backends[split + 1:]
        groups.check_agreement(
            "DeviceMesh unflatten",
            f"unflatten {_payload(self._device_type, self._mesh_layout)} into "
            f"{_payload(self._device_type, layout)}{_describe_backends(backends)}",
            timeout=self._timeout,
        )
        result = DeviceMesh._build(self._device_type, layout, timeout=self._timeout)
        result._backends = backends
        result._create_groups()
        return result

    unflatten = _unflatten

    # -- interop ---------------------------------------------------------------------------
    @staticmethod
    def from_group(
        group: ProcessGroup | Sequence[ProcessGroup],
        device_type: str,
        mesh: Any = None,
        *,
        mesh_dim_names: Sequence[str] | None = None,
    ) -> DeviceMesh:
        """A mesh over existing process groups (one per dimension), as in torch.

        One group: a 1-D mesh over its ranks (``mesh`` optional, must match). Several groups:
        ``mesh`` (the full rank array) is required, and group ``i`` must be this rank's group
        along dimension ``i``.
        """
        _check_device_type(device_type)
        if isinstance(group, ProcessGroup):
            ranks = dist.get_process_group_ranks(group)
            if mesh is not None and _as_rank_array(mesh).tolist() != ranks:
                raise MeshShapeError(
                    f"Invalid mesh {_as_rank_array(mesh).tolist()} for ProcessGroup with ranks "
                    f"{ranks}: the mesh must list the group's ranks in order; leave mesh out "
                    "for a 1-D mesh over the group"
                )
            group_list = [group]
            mesh = ranks
        else:
            group_list = list(group)
            if not group_list:
                raise MeshShapeError("from_group needs at least one ProcessGroup")
            if mesh is None:
                raise MeshShapeError(
                    "from_group with several groups needs mesh=, the full array of ranks "
                    "whose dimension i is spanned by group i"
                )
            array = _as_rank_array(mesh)
            if array.ndim != len(group_list):
                raise MeshShapeError(
                    "Expects mesh with ndim equal to number of ProcessGroups but got mesh "
                    f"{array.tolist()} and {len(group_list)} ProcessGroups: pass one group "
                    "per dimension of mesh"
                )
        layout = MeshLayout(ranks=_as_rank_array(mesh), names=mesh_dim_names)
        result = DeviceMesh._build(device_type, layout)
        if result._coordinate is not None:
            for d, pg in enumerate(group_list):
                expected = sorted(layout.group_of(result._rank, d))
                actual = sorted(dist.get_process_group_ranks(pg))
                if expected != actual:
                    raise MeshShapeError(
                        f"Invalid mesh {layout.rank_list()} for ProcessGroup with ranks "
                        f"{actual}: group {d} has ranks {actual}, but along dimension {d} of mesh "
                        f"{layout.rank_list()} this rank's group is {expected}"
                    )
                groups.register_group(pg)
            result._set_groups(group_list)
        return result

    @staticmethod
    def from_torch(torch_mesh: TorchDeviceMesh) -> DeviceMesh:
        """The devmesh view of a torch ``DeviceMesh``, over the same process groups (the mesh
        itself if it already is a devmesh mesh)."""
        if isinstance(torch_mesh, DeviceMesh):
            return torch_mesh
        groups_ = [torch_mesh.get_group(d) for d in range(torch_mesh.ndim)]
        mesh = DeviceMesh.from_group(
            groups_ if torch_mesh.ndim > 1 else groups_[0],
            torch_mesh.device_type,
            torch_mesh.mesh,
            mesh_dim_names=torch_mesh.mesh_dim_names,
        )
        return mesh

    def to_torch(self) -> DeviceMesh:
        """This mesh: a devmesh mesh already is a torch ``DeviceMesh``. Kept so that code
        written for devmesh 0.1 (``fully_shard(model, mesh=mesh.to_torch())``) runs on."""
        return self

    # -- value semantics -------------------------------------------------------------------
    def __getstate__(self) -> dict:
        """Pickle the layout, not the process groups (they belong to this process): a mesh
        returned from ``devmesh.launch`` can be inspected, not communicated on."""
        state = self.__dict__.copy()
        state["_groups"] = (None,) * self._mesh_layout.ndim
        torch_mesh_state_for_pickle(state)
        # backend options are process-local objects torch cannot pickle: their type stays
        state["_backends"] = tuple(_picklable(c) for c in self._backends)
        state["_flattened_backends"] = {k: _picklable(c)
                                        for k, c in self._flattened_backends.items()}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        restore_torch_mesh_state(self)

    def __deepcopy__(self, memo: dict) -> DeviceMesh:
        """A mesh names process groups of this process; copying a model (``copy.deepcopy``)
        shares its mesh rather than duplicating communicators."""
        return self

    def __eq__(self, other: object) -> bool:
        """Same device type and layout, in the same world. A torch-built mesh is never equal
        (it has its own process groups), nor is a mesh of an earlier world: torch caches
        DTensor plans by mesh value, and a stale hit would use groups that are gone.
        Under ``torch.compile`` torch hands over a mesh in a graph as a stand-in
        (``FakeScriptObject``) that passes ``isinstance`` but lacks devmesh's attributes: it
        is compared by the mesh it stands for."""
        other = _real_mesh(other)
        if not isinstance(other, DeviceMesh):
            return NotImplemented if not isinstance(other, TorchDeviceMesh) else False
        return (self._device_type == other._device_type
                and self._mesh_layout == other._mesh_layout
                and self._world == other._world)

    def __hash__(self) -> int:
        return hash((self._device_type, self._mesh_layout, self._world))

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self._mesh_layout.ranks.tolist()}{names})"


def _picklable(config: BackendConfig) -> BackendConfig:
    """A backend choice with its options named by type (torch cannot pickle them)."""
    name, options = config
    return (name, None if options is None else type(options).__name__)


def _real_mesh(obj: object) -> object:
    """The mesh a ``torch.compile`` stand-in (torch's ``FakeScriptObject``) wraps; anything
    else as it is."""
    return unwrap_fake_script_object(obj)


def _check_device_type(device_type: object) -> None:
    if not isinstance(device_type, str) or ":" in device_type:
        raise DeviceTypeError(
            f"Device type with index is not supported but got {device_type!r}. Pass a device "
            "type such as 'cpu' or 'cuda' (device.type for a torch.device); devmesh picks the "
            "device index from LOCAL_RANK"
        )


def _world_size_mismatch(device_type: str, shape: tuple[int, ...], size: int, world: int
                         ) -> WorldSizeMismatchError:
    hint = (f"launch {size} processes (e.g. `torchrun --nproc_per_node={size}` or "
            f"`devmesh run -n {size}`)")
    return WorldSizeMismatchError(
        f"init_device_mesh({device_type!r}, {shape}) needs {size} ranks but the world has "
        f"{world}: {hint}, or choose a shape whose sizes multiply to {world}. To use part "
        "of the world on purpose, build DeviceMesh(device_type, mesh=[...ranks...])"
    )


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Sequence[str] | None = None,
    timeout: float | datetime.timedelta | None = None,
    heavy_dims: Sequence[Dim] | Dim | None = None,
    strict: bool = False,
    backend_override: Mapping[Dim, BackendChoice] | None = None,
) -> DeviceMesh:
    """Create a mesh of ``mesh_shape`` over the whole world, as torch's ``init_device_mesh``.

    Initializes the default process group from torchrun's environment if needed (gloo for
    ``"cpu"``, NCCL for ``"cuda"`` with one GPU per local rank). A shape whose size is not the
    world size is an error that says how to fix it; to use part of the world on purpose,
    construct ``DeviceMesh(device_type, mesh=ranks)``. ``backend_override`` gives some dims
    their own backend, as torch's: keys are dim names or indices, values a backend name
    (``{"dp": "gloo"}``), its options (``ProcessGroupGloo._Options()``), or a
    ``(name, options)`` pair.

    On several hosts, a bandwidth-heavy dim (``heavy_dims``; default the innermost, where TP
    goes) whose groups would span hosts gives a :class:`~devmesh.layout.topology.TopologyWarning`, or
    a :class:`~devmesh.layout.topology.TopologyError` with ``strict=True``.
    """
    _check_device_type(device_type)
    shape = _check_shape(mesh_shape)
    names = _check_names(mesh_dim_names, len(shape))
    timeout_td = groups.as_timedelta(timeout)
    size = math.prod(shape)
    _backends(backend_override, len(shape), names)  # refused before any connection
    env.check_device(device_type)
    # before any process group: every rank reads the same WORLD_SIZE and raises alike, with
    # no connection made (ranks raising right after connecting tore their sockets down while
    # slower peers still connected: those got gloo's "Connection closed by peer" instead)
    launched = None if dist.is_initialized() else env.launched_world_size()
    if launched is not None and launched != size:
        raise _world_size_mismatch(device_type, shape, size, launched)
    env.ensure_default_group(device_type, expected_world_size=size, timeout=timeout_td)
    world = dist.get_world_size()
    if size != world:
        raise _world_size_mismatch(device_type, shape, size, world)
    created, reused = groups.created_count(), groups.reused_count()
    mesh = DeviceMesh(
        device_type,
        np.arange(size).reshape(shape),
        mesh_dim_names=names,
        timeout=timeout_td,
        backend_override=backend_override,
    )
    _check_topology(mesh, heavy_dims, strict)
    get_logger("mesh").info(
        "mesh %s built on %d ranks (%s, %s): %d process group(s) created, %d reused",
        dict(zip(names or range(len(shape)), shape, strict=True)), size, device_type,
        dist.get_backend(), groups.created_count() - created, groups.reused_count() - reused)
    return mesh


def _check_topology(mesh: DeviceMesh, heavy_dims, strict: bool) -> None:
    """Warn (or, strict, refuse) when a bandwidth-heavy dim crosses hosts."""
    import os
    import warnings

    from devmesh.layout.topology import TopologyError, TopologyWarning, check_heavy_dims

    world = dist.get_world_size()
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) >= world:
        return  # one host: nothing can cross
    problems = check_heavy_dims(mesh.layout, groups.world_hosts(), heavy_dims)
    if problems and strict:
        raise TopologyError("; ".join(problems))
    for message in problems:
        warnings.warn(message, TopologyWarning, stacklevel=3)
