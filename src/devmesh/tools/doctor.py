"""``devmesh doctor``: check a launch end to end and say what to fix.

Runs on every rank (under torchrun, ``devmesh run``, or ``devmesh doctor -n N`` which launches
local ranks itself). Checks, in order: the launcher's environment, the backend, GPUs against
local ranks, the process group (every rank connected), the host layout, that every rank
agrees on the mesh, and one small all-reduce on
every group of every dim, each bounded by ``timeout``. Every rank posts its findings to the
store; rank 0 prints one report and names the ranks and groups that failed — including ranks
that never reported.
"""

from __future__ import annotations

import datetime
import json
import re
import socket
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field

from devmesh.layout import format_ranks

__all__ = ["Finding", "run_checks", "format_report"]


@dataclass
class Finding:
    check: str
    ok: bool
    detail: str


@dataclass
class RankReport:
    rank: int
    host: str
    findings: list[Finding] = field(default_factory=list)


def _check(report: RankReport, name: str, fn) -> object:
    try:
        value, detail = fn()
        report.findings.append(Finding(name, True, detail))
        return value
    except Exception as exc:  # noqa: BLE001 - every failure becomes a finding
        report.findings.append(Finding(name, False, f"{type(exc).__name__}: {exc}"))
        return None


def run_checks(mesh_shape: tuple[int, ...] | None = None, names: tuple[str, ...] | None = None,
               device_type: str = "cpu", timeout: float = 30.0) -> list[RankReport] | None:
    """Run every check on this rank. Returns all ranks' reports on rank 0, None elsewhere."""
    from devmesh.distributed import env
    from devmesh.mesh import init_device_mesh

    launch = env.read_launch_env()  # a missing launcher is reported by the CLI itself
    report = RankReport(launch.rank, socket.gethostname())
    _check_setup(report, launch, device_type)
    # the process group first, on its own: the reports travel through its store, and a mesh
    # that does not fit the world is refused before any group is made (so it could not)
    _check(report, "process group", lambda: (
        env.ensure_default_group(device_type, timeout=datetime.timedelta(seconds=timeout)),
        _every_rank_connected()))
    if not report.findings[-1].ok:
        return _collect(report, launch.world_size, timeout)
    shape = mesh_shape or (launch.world_size,)
    mesh = _check(report, "mesh agreement", lambda: (
        init_device_mesh(device_type, shape, mesh_dim_names=names, timeout=timeout),
        f"every rank built {shape} with names {names}"))
    if mesh is not None:
        _check(report, "host layout", lambda: (None, _host_layout(mesh)))
        for d in range(mesh.ndim):
            _check(report, f"collective on dim {mesh.layout.dim_name(d)!r}",
                   lambda d=d: (None, _all_reduce_over(mesh, d, timeout)))
    return _collect(report, launch.world_size, timeout)


def _every_rank_connected() -> str:
    """One barrier: every rank finished connecting before any goes on (and may fail)."""
    import torch.distributed as dist

    dist.barrier()
    return f"{dist.get_world_size()} ranks connected ({dist.get_backend()})"


def _check_setup(report: RankReport, launch, device_type: str) -> None:
    """The launch environment, the backend and the devices."""
    import torch
    import torch.distributed as dist

    from devmesh.distributed import env

    report.findings.append(Finding(
        "launch environment", True,
        f"rank {launch.rank} of {launch.world_size}, local rank {launch.local_rank} of "
        f"{launch.local_world_size}, host index {launch.group_rank}, master "
        f"{launch.master_addr}:{launch.master_port}"))

    def backend():
        name = env.backend_for(device_type)
        available = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available()}[name]
        if not available:
            raise RuntimeError(f"backend {name} is not available in this torch build "
                               f"({torch.__version__})")
        return None, f"{name} available (torch {torch.__version__})"

    _check(report, "backend", backend)
    _check(report, "devices", lambda: (env.check_device(device_type, launch.local_world_size),
                                       f"{device_type} usable by {launch.local_world_size} "
                                       "local ranks"))


def _host_layout(mesh) -> str:
    from devmesh.distributed import groups

    hosts = groups.world_hosts()
    per_host = {int(h): int((hosts == h).sum()) for h in sorted(set(hosts.tolist()))}
    crossing = mesh.dims_crossing_hosts()
    return (f"{len(per_host)} host(s), ranks per host {per_host}; dims crossing hosts: "
            f"{crossing or 'none'}")


def _all_reduce_over(mesh, d: int, timeout: float) -> str:
    """One all-reduce over this rank's group of dim ``d``, given ``timeout`` seconds."""
    import torch
    import torch.distributed as dist

    ranks = mesh.group_ranks(d)
    value = torch.ones(1)
    work = dist.all_reduce(value, group=mesh.get_group(d), async_op=True)
    deadline = time.monotonic() + timeout
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"all-reduce over group {list(ranks)} did not finish within "
                               f"{timeout:g} s")
        time.sleep(0.001)
    work.wait()
    if int(value.item()) != len(ranks):
        raise RuntimeError(f"all-reduce over {list(ranks)} gave {value.item()}, expected "
                           f"{len(ranks)}")
    return f"all-reduce over group {list(ranks)} ok"


def _collect(report: RankReport, world_size: int, timeout: float) -> list[RankReport] | None:
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        return [report] if report.rank == 0 else None
    from devmesh import _torch_compat

    store = _torch_compat.default_store()
    store.set(f"devmesh/doctor/{report.rank}", json.dumps(asdict(report)))
    if report.rank != 0:
        return None
    reports = []
    store.set_timeout(datetime.timedelta(seconds=timeout))
    for r in range(world_size):
        try:
            raw = json.loads(store.get(f"devmesh/doctor/{r}"))
            reports.append(RankReport(raw["rank"], raw["host"],
                                      [Finding(**f) for f in raw["findings"]]))
        except Exception:  # noqa: BLE001
            reports.append(RankReport(r, "?", [Finding("report", False,
                                                       f"rank {r} did not report within "
                                                       f"{timeout:g} s (crashed or hung?)")]))
    return reports


def _without_rank(detail: str) -> str:
    """``"[rank 3] X"`` -> ``"X"``: the same error on several ranks is one line."""
    return re.sub(r"\[rank \d+\] ", "", detail)


def format_report(reports: list[RankReport]) -> tuple[str, bool]:
    """The report as text, and whether everything passed: one line per check (collectives:
    how many groups of each dim were checked, over all ranks), each failure once with the
    ranks it happened on, then the summary."""
    order: list[str] = []
    outcomes: dict[str, list[tuple[int, Finding]]] = {}
    for r in reports:
        for f in r.findings:
            if f.check not in outcomes:
                order.append(f.check)
            outcomes.setdefault(f.check, []).append((r.rank, f))
    lines = []
    for check in order:
        found = outcomes[check]
        passed = [f for _, f in found if f.ok]
        failures: dict[str, list[int]] = defaultdict(list)
        for rank, f in found:
            if not f.ok:
                failures[_without_rank(f.detail)].append(rank)
        if passed:
            if check.startswith("collective on dim"):
                groups = sorted({f.detail for f in passed})
                shown = groups[0] if len(groups) == 1 else f"{groups[0]} (and {len(groups) - 1} more)"
                lines.append(f"ok    {check}: {len(groups)} group(s) checked: {shown}")
            else:
                first_rank = next(rank for rank, f in found if f.ok)
                lines.append(f"ok    {check}: {passed[0].detail}"
                             + (f"  [rank {first_rank}'s; ok on {len(passed)} ranks]"
                                if len(passed) > 1 else ""))
        for detail, ranks in failures.items():
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"
            lines.append(f"FAIL  {check} ({who}): {detail}")
    failed = sum(1 for line in lines if line.startswith("FAIL"))  # as many as printed
    failing = sorted({r for found in outcomes.values() for r, f in found if not f.ok})
    if len(reports) > 1:
        per_rank_ok = [r.rank for r in reports if all(f.ok for f in r.findings)]
        lines.append(f"ranks with every check passing: {len(per_rank_ok)} of {len(reports)}")
    on = ("" if not failing else f" (on rank {failing[0]})" if len(failing) == 1
          else f" (on ranks {format_ranks(failing)})")
    lines.append("all checks passed" if not failed else
                 f"{failed} check{'s' if failed > 1 else ''} failed{on}: fix the first "
                 "FAIL above and run again")
    return "\n".join(lines), not failed
