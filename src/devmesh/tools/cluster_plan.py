"""``devmesh plan``: choose and check a mesh for a cluster before launching anything.

Given hosts x devices per host and parallel degrees, the mesh is laid out outermost to
innermost as ``pp, dp, shard, cp, tp`` (torchtitan's order): the heaviest traffic (TP, then
CP) on the innermost dims, which map to consecutive ranks and so to one host. The plan says
which dims cross hosts, flags plans that cannot work or will be slow (with the reason), and, for
a model size, estimates the bytes each dim sends per step per rank (ring algorithms: an
all-reduce sends ``2 (n-1)/n`` of its buffer, an all-gather or reduce-scatter ``(n-1)/n`` of the
full buffer). Pure arithmetic: instant for any cluster size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from devmesh.layout import MeshLayout
from devmesh.layout.data_parallel import (cp_beside_one_data_dim, cp_shards_parameters,
                                          ep_beside, flattened_name)
from devmesh.layout.topology import contiguous_hosts, crossing_dims

__all__ = ["ModelSize", "ClusterPlan", "plan_cluster", "ORDER"]

ORDER = ("pp", "dp", "shard", "cp", "tp")


@dataclass(frozen=True)
class ModelSize:
    """Sizes for the traffic estimate. ``batch`` is the global batch in sequences."""

    params: float
    hidden: int
    seq: int
    batch: int
    layers: int | None = None
    bytes_per_value: int = 2  # bf16 parameters, gradients and activations
    top_k: int = 2  # experts per token, when expert parallelism is planned

    @property
    def num_layers(self) -> int:
        return self.layers or max(1, round(self.params / (12 * self.hidden**2)))


@dataclass
class Traffic:
    dim: str
    degree: int
    crosses_hosts: bool
    what: str
    bytes_per_step: float


@dataclass
class ClusterPlan:
    hosts: int
    devices_per_host: int
    degrees: dict[str, int]
    layout: MeshLayout | None
    crossing: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    traffic: list[Traffic] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def __str__(self) -> str:
        from devmesh.pictures.render import layout_text

        world = self.hosts * self.devices_per_host
        lines = [f"cluster: {self.hosts} host(s) x {self.devices_per_host} device(s) = {world}"]
        lines.append("degrees: " + ", ".join(f"{k}={v}" for k, v in self.degrees.items()))
        if self.layout is not None:
            lines.append(layout_text(self.layout, max_groups=4, max_cells=8, max_blocks=2))
            for d in range(self.layout.ndim):
                name = self.layout.dim_name(d)
                where = "crosses hosts" if name in self.crossing else "within each host"
                lines.append(f"  {name:<6} size {self.layout.shape[d]:<5} {where}")
            if "ep" in self.degrees:
                where = "crosses hosts" if "ep" in self.crossing else "within each host"
                lines.append(f"  {'ep':<6} size {self.degrees['ep']:<5} {where} (the ranks of "
                             "shard, innermost first)")
        if self.traffic:
            lines.append("estimated traffic per rank per step:")
            width = max(6, *(len(t.dim) for t in self.traffic))  # shard_cp: flattened dims
            for t in self.traffic:
                link = "network" if t.crosses_hosts else "intra-host"
                lines.append(f"  {t.dim:<{width}} x{t.degree:<5} {link:<11} "
                             f"{_human(t.bytes_per_step):>10}  {t.what}")
        for message in self.errors:
            lines.append(f"ERROR: {message}")
        for message in self.warnings:
            lines.append(f"warning: {message}")
        lines.append("plan is valid" if self.ok else "plan is NOT valid")
        return "\n".join(lines)


def _human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.1f} TB"


def plan_cluster(hosts: int, devices_per_host: int, *, dp: int = 1, shard: int | None = None,
                 tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                 model: ModelSize | None = None) -> ClusterPlan:
    """Lay out the degrees on the cluster; ``shard=None`` takes the devices left over.
    ``ep`` (expert parallelism) is no dim of its own: as in torchtitan's "dp2ep" layout, it
    splits the ranks of ``shard`` (whose tokens differ), innermost first, so it must divide
    ``shard``; as ``parallelize`` places the dims, ``cp`` goes beside one data-parallel dim
    (``dp`` or ``shard``) and ``ep`` beside neither ``dp`` nor ``cp``."""
    world = hosts * devices_per_host
    given = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
    plan = ClusterPlan(hosts, devices_per_host, {}, None)
    for name, value in list(given.items()) + [("shard", shard if shard is not None else 1)]:
        if value < 1 or hosts < 1 or devices_per_host < 1:
            plan.errors.append(f"{name}={value}: degrees, hosts and devices must be positive")
            return plan
    if shard is None:
        rest = world // math.prod(given.values())
        if world % math.prod(given.values()):
            plan.errors.append(
                f"pp*dp*cp*tp = {math.prod(given.values())} does not divide the {world} devices"
            )
            return plan
        shard = rest
    degrees = {**given, "shard": shard}
    plan.degrees = {name: degrees[name] for name in ORDER}
    total = math.prod(plan.degrees.values())
    if total != world:
        plan.errors.append(
            f"the degrees multiply to {total} but the cluster has {world} devices; "
            f"change a degree (or leave --shard out to fill the rest)"
        )
        return plan
    if tp > devices_per_host:
        plan.errors.append(
            f"tp={tp} > {devices_per_host} devices per host: TP traffic would cross hosts; "
            f"use tp <= {devices_per_host}"
        )
    elif devices_per_host % tp:
        plan.errors.append(
            f"tp={tp} does not divide {devices_per_host} devices per host: some TP groups would "
            "straddle two hosts"
        )
    # the data-parallel dims as parallelize places them (and the dry run prices them)
    if cp > 1 and not cp_beside_one_data_dim(dp > 1, shard > 1):
        plan.errors.append(f"cp={cp} with dp={dp} and shard={shard}: context parallelism goes "
                           "beside one data-parallel dim, as parallelize places it: make dp "
                           "or shard 1")
        return plan
    if ep > 1 and not ep_beside(dp > 1, cp > 1):
        plan.errors.append(
            f"ep={ep} with dp={dp}: build the plan with shard instead of dp beside ep" if dp > 1
            else f"ep={ep} with cp={cp}: both borrow the data-parallel ranks, and parallelize "
            "places one of them: drop one")
        return plan
    if ep < 1 or shard % ep:
        plan.errors.append(f"ep={ep} must divide shard = {shard}: expert parallelism splits "
                           "the ranks whose tokens differ, FSDP's")
        return plan
    names = tuple(n for n in ORDER if plan.degrees[n] > 1) or ("dp",)
    shape = tuple(plan.degrees.get(n, 1) for n in names)
    plan.layout = MeshLayout(shape, names)
    hosts_of = contiguous_hosts(world, devices_per_host)
    crossing = crossing_dims(plan.layout, hosts_of)
    plan.crossing = [names[d] for d in crossing]
    if ep > 1:
        plan.degrees["ep"] = ep
        if _ep_crosses_hosts(plan.layout, ep, hosts_of):
            plan.crossing.append("ep")
    if "cp" in plan.crossing:
        plan.warnings.append("cp crosses hosts: ring attention traffic goes over the network; "
                             "keep cp * tp <= devices per host if you can")
    if ("shard" in plan.crossing and plan.degrees["dp"] == 1 and hosts > 1 and ep == 1
            and cp == 1):  # (HSDP goes beside neither ep nor cp)
        plan.warnings.append("FSDP shards across hosts: consider HSDP (--dp hosts, --shard "
                             "devices per host) to keep all-gathers inside hosts")
    if model is not None:
        plan.traffic = _traffic(plan, model)
    return plan


def _ep_crosses_hosts(layout: MeshLayout, ep: int, hosts_of) -> bool:
    """Whether an ``ep`` group — ``ep`` consecutive ranks of the ``shard`` dim, the other
    dims fixed — spans two hosts."""
    import numpy as np

    names = layout.names
    inner = [i for i, n in enumerate(names) if n == "shard"]
    ranks = np.moveaxis(layout.ranks, inner, list(range(layout.ndim - len(inner), layout.ndim)))
    rows = ranks.reshape(-1, ep)
    host = np.asarray(hosts_of)[rows]
    return bool((host != host[:, :1]).any())


#: What torchtitan's tensor-parallel plan (the dry run's,
#: :func:`devmesh.tools.dry_run.model.tp_plan`) sends over ``tp`` per layer and micro-batch,
#: forward and backward together: the sequence gathered into attention and into the
#: feed-forward and their outputs reduce-scattered back to it (sequence parallelism), the
#: reverse in backward, and the two norms' gradients summed. The dry run measures its
#: collectives and finds exactly these (tested), so both commands say one thing.
TP_COLLECTIVES_PER_LAYER = {"all_gather": 4, "reduce_scatter": 4, "all_reduce": 2}


def _tp_traffic_text() -> str:
    c = TP_COLLECTIVES_PER_LAYER
    return (f"per layer {c['all_gather']} all-gathers and {c['reduce_scatter']} "
            "reduce-scatters of the sequence-split activations (half forward, half backward), "
            f"{c['all_reduce']} all-reduces of norm gradients")


def _traffic(plan: ClusterPlan, model: ModelSize) -> list[Traffic]:
    d = plan.degrees
    b = model.bytes_per_value
    stage_params = model.params / (d["pp"] * d["tp"])
    local_batch = model.batch / (d["dp"] * d["shard"])
    layers = model.num_layers / d["pp"]
    act = local_batch * model.seq / d["cp"] * model.hidden * b
    ring = lambda n: (n - 1) / n  # noqa: E731
    rows = []

    def add(name: str, what: str, nbytes: float) -> None:
        if d[name] > 1:
            rows.append(Traffic(name, d[name], name in plan.crossing, what, nbytes))

    def group(names: list[str], what: str, nbytes) -> None:
        """A collective over the dims ``names`` flattened into one group."""
        size = math.prod(d[n] for n in names)
        rows.append(Traffic(flattened_name(names), size,
                            any(n in plan.crossing for n in names), what, nbytes(size)))

    # an all-gather or a reduce-scatter of the whole activation moves (n-1)/n of it
    # (the norms' gradients, a few KB, left out)
    moves = TP_COLLECTIVES_PER_LAYER["all_gather"] + TP_COLLECTIVES_PER_LAYER["reduce_scatter"]
    add("tp", _tp_traffic_text(), layers * moves * ring(d["tp"]) * act)
    # devmesh's ring: forward, K and V cp - 1 times; backward, K and V cp - 1 times and
    # their gradients cp times (the last home to the owner)
    add("cp", "ring attention: K and V pass around the ring, forward and backward",
        layers * (4 * (d["cp"] - 1) + 2 * d["cp"]) * act / d["tp"])
    if d.get("ep", 1) > 1:
        rows.append(Traffic(
            "ep", d["ep"], "ep" in plan.crossing,
            f"all-to-all of each token to its {model.top_k} experts and back, forward and "
            "backward, per MoE layer (every layer)",
            layers * 4 * model.top_k * ring(d["ep"]) * act))
    # cp's ranks are data ranks for the parameters: FSDP over shard x cp (or cp alone), or
    # DDP over dp x cp, as parallelize places them
    sharded = [n for n in ("shard", "cp") if d[n] > 1] if d["shard"] > 1 or (
        d["cp"] > 1 and cp_shards_parameters(d["dp"] > 1, d["shard"] > 1)) else []
    if sharded:
        group(sharded, "FSDP: all-gather parameters (forward, backward), reduce-scatter "
              "gradients", lambda n: 3 * ring(n) * stage_params * b)
    replicated = [n for n in ("dp", "cp") if d[n] > 1 and n not in sharded]
    if replicated:
        shards = math.prod(d[n] for n in sharded)
        group(replicated, "all-reduce of the gradient shard" if sharded else
              "DDP: all-reduce of the gradients",
              lambda n: 2 * ring(n) * stage_params / shards * b)
    add("pp", "activations to the next stage and gradients back", 2 * act)
    return rows
