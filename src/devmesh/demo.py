"""``devmesh demo``: the seeds' meshes on 8 local CPU ranks, each group proven by an all-reduce.

Every rank builds the 2-D ``(2, 4)`` HSDP mesh of the tutorial and the 3-D ``(2, 2, 2)``
``(replicate, shard, tp)`` mesh of its custom-parallel example, slices the sub-meshes the
tutorial slices, and all-reduces its own rank over every dimension's group. The parent process
prints what each rank sees and checks every sum against the pure layout: a wrong group would
give a wrong sum.
"""

from __future__ import annotations

from typing import Any

MESHES: list[tuple[tuple[int, ...], tuple[str, ...]]] = [
    ((2, 4), ("replicate", "shard")),
    ((2, 2, 2), ("replicate", "shard", "tp")),
]


def _rank_view() -> list[dict[str, Any]]:
    """Runs on every rank: build each mesh, report coordinates, groups and all-reduce sums."""
    import torch
    import torch.distributed as dist

    from devmesh import init_device_mesh

    views = []
    for shape, names in MESHES:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        sums = {}
        for name in names:
            value = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(value, group=mesh.get_group(name))
            sums[name] = int(value.item())
        submeshes = {repr(name): repr(mesh[name]) for name in names}
        if len(names) == 3:
            submeshes["'replicate', 'shard'"] = repr(mesh["replicate", "shard"])
        views.append(
            {
                "rank": dist.get_rank(),
                "coordinate": mesh.get_coordinate(),
                "groups": {n: dist.get_process_group_ranks(mesh.get_group(n)) for n in names},
                "sums": sums,
                "submeshes": submeshes,
            }
        )
    return views


def run_demo(world_size: int = 8, plain: bool = False) -> int:
    """Launch the ranks, print each mesh and every rank's view; 0 if every group is right."""
    from rich.console import Console
    from rich.table import Table

    from devmesh.launcher import launch
    from devmesh.layout import MeshLayout
    from devmesh.render import layout_rich, layout_text

    console = Console(no_color=plain, highlight=not plain, width=120 if plain else None)
    console.print(f"Launching {world_size} local CPU ranks over gloo …")
    per_rank = launch(_rank_view, world_size)
    all_ok = True
    for index, (shape, names) in enumerate(MESHES):
        layout = MeshLayout(shape, names)
        console.rule(f"init_device_mesh('cpu', {shape}, mesh_dim_names={names})")
        if plain:
            console.out(layout_text(layout), highlight=False)
        else:
            for renderable in layout_rich(layout):
                console.print(renderable)
        table = Table(title="what every rank sees (sum = all-reduce of the ranks in its group)")
        table.add_column("rank", justify="right")
        table.add_column("coordinate")
        for name in names:
            table.add_column(f"{name} group")
            table.add_column("sum", justify="right")
        table.add_column("check")
        for views in per_rank:
            view = views[index]
            cells = [str(view["rank"]), str(view["coordinate"])]
            ok = True
            for name in names:
                expected = layout.group_of(view["rank"], name)
                ok &= list(expected) == view["groups"][name]
                ok &= sum(expected) == view["sums"][name]
                cells += [str(view["groups"][name]), str(view["sums"][name])]
            cells.append("ok" if ok else "WRONG")
            all_ok &= ok
            table.add_row(*cells)
        console.print(table)
        sample = per_rank[world_size - 1][index]
        console.print(f"sub-meshes on rank {world_size - 1}:")
        for key, text in sample["submeshes"].items():
            console.out(f"  mesh[{key}] = {text}", highlight=False)
    console.rule()
    if all_ok:
        console.print("Every group of every mesh summed exactly its ranks: the meshes are right.")
        return 0
    console.print("Some group summed the wrong ranks (see WRONG above).")
    return 1
