"""``devmesh demo``: digits training on 8 local CPU ranks, and the seeds' meshes proven.

The main demo (:func:`run_training_demo`) trains seed 003's network on scikit-learn's digits
with HSDP + TP on a ``(2, 2, 2)`` mesh, shows the mesh and how every parameter is sharded, and
checks the losses against single-process training on the same batches.

``devmesh demo --meshes`` (:func:`run_demo`):

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


def _print_layout(console, layout, plain: bool) -> None:
    from devmesh.pictures.render import layout_rich, layout_text

    if plain:
        console.out(layout_text(layout), highlight=False)
    else:
        for renderable in layout_rich(layout):
            console.print(renderable)


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

    from devmesh.launching.launcher import launch
    from devmesh.layout import MeshLayout

    console = Console(no_color=plain, highlight=not plain, width=120 if plain else None)
    console.print(f"Launching {world_size} local CPU ranks over gloo …")
    per_rank = launch(_rank_view, world_size)
    all_ok = True
    for index, (shape, names) in enumerate(MESHES):
        layout = MeshLayout(shape, names)
        console.rule(f"init_device_mesh('cpu', {shape}, mesh_dim_names={names})")
        _print_layout(console, layout, plain)
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


def run_pipeline_demo(plain: bool = False, epochs: int = 1, mesh_text: str | None = None) -> int:
    """Train digits pipelined — PP x FSDP x TP on (2, 2, 2) unless ``mesh_text`` says
    otherwise (``pp=2,dp=2,shard=2,tp=2``: PP x HSDP x TP on 16 ranks); 0 if it matches
    single-process training."""
    from rich.console import Console

    from devmesh.launching.launcher import launch
    from devmesh.layout import MeshLayout
    from devmesh.layout.schedule import build_schedule
    from devmesh.tools.apps.digits_pipeline import (
        DEFAULT_MESH,
        parse_pipeline_mesh,
        train_pipelined,
    )

    mesh_text = mesh_text or DEFAULT_MESH
    plan = parse_pipeline_mesh(mesh_text)
    console = Console(no_color=plain, highlight=not plain, width=120 if plain else None)
    console.rule(f"mesh {plan.shape} {plan.names}: {plan.describe()}")
    _print_layout(console, MeshLayout(plan.shape, plan.names), plain)
    console.out(str(build_schedule("1f1b", 2, 4)), highlight=False)
    console.print(f"Launching {plan.world_size} local CPU ranks over gloo; training on "
                  "scikit-learn's digits …")
    results = launch(train_pipelined, plan.world_size, mesh_text, epochs=epochs, timeout=900)
    console.rule("how each stage's parameters are sharded (describe(runner), the same on "
                 "every rank)")
    console.out(results[0].describe, highlight=False)
    result = results[0]
    gap = max(abs(a - b) for a, b in zip(result.losses, result.reference_losses, strict=True))
    matches = gap <= 1e-5 and (result.max_param_diff or 0.0) <= 1e-5
    for epoch, (accuracy, expected) in enumerate(zip(result.accuracies,
                                                     result.reference_accuracies, strict=True)):
        console.out(f"epoch {epoch + 1}: test accuracy {100 * accuracy:.1f}% (a forward-only "
                    f"pass through the pipeline, runner.evaluate; single process "
                    f"{100 * expected:.1f}%)", highlight=False)
    console.out(
        f"{len(result.losses)} steps, last loss {result.losses[-1]:.4f}: largest loss "
        f"difference vs single-process training {gap:.1e}, largest parameter difference "
        f"{result.max_param_diff:.1e}: "
        + ("the pipeline matches single-process training." if matches else "MISMATCH"),
        highlight=False)
    return 0 if matches else 1


def run_training_demo(plain: bool = False, epochs: int = 5, plot: str = "digits_loss.png",
                      mesh_text: str | None = None) -> int:
    """Train digits with HSDP + TP on (2, 2, 2), or on ``mesh_text`` (``dp=2,shard=2,tp=2``
    form); 0 if it matches single-process training."""
    from rich.console import Console

    from devmesh.tools.apps.digits import parse_mesh, plot_losses, train
    from devmesh.launching.launcher import launch
    from devmesh.layout import MeshLayout

    mesh_text = mesh_text or "dp=2,shard=2,tp=2"
    plan = parse_mesh(mesh_text)
    console = Console(no_color=plain, highlight=not plain, width=120 if plain else None)
    layout = MeshLayout(plan.shape, plan.names)
    console.rule(f"mesh {plan.shape}: {plan.describe()}")
    _print_layout(console, layout, plain)
    console.print(f"Launching {plan.world_size} local CPU ranks over gloo; training on "
                  "scikit-learn's digits (1,500 train / 297 test images) …")
    result = launch(train, plan.world_size, mesh_text, epochs=epochs, verify=True,
                    progress=not plain, timeout=900)[0]
    console.rule("how every parameter is sharded (rank 0's view)")
    console.out(result.describe, highlight=False)
    console.rule("results")
    for epoch, accuracy in enumerate(result.accuracies):
        console.out(f"epoch {epoch + 1}: test accuracy {100 * accuracy:.1f}%", highlight=False)
    gap = max(abs(a - b) for a, b in zip(result.losses, result.reference_losses, strict=True))
    if plot:
        plot_losses(result, plot)
        console.out(f"loss curve written to {plot}", highlight=False)
    matches = gap <= 1e-5 and (result.max_param_diff or 0.0) <= 1e-5
    console.out(
        f"{len(result.losses)} steps: largest loss difference vs single-process training "
        f"{gap:.1e}, largest parameter difference {result.max_param_diff:.1e}: "
        + ("the losses match single-process training." if matches else "MISMATCH"),
        highlight=False,
    )
    return 0 if matches else 1
