"""Planning a redistribution: any spec to any spec, the cheapest of several candidate plans.

Pure (specs in, steps out), so ``explain_redistribute`` shows the plan without a mesh. Each
candidate is a sequence of phases (:mod:`devmesh.layout.plan_phases`): all-to-alls for moved
splits, reductions of partial dims, all-gathers (merged into one collective, one per tensor
dim, or one per mesh dim), a direct all-to-all of overlapping pieces, local chunking. Every
step is annotated with the bytes it receives and copies (:mod:`devmesh.layout.traffic`) and
priced by the cost model (:mod:`devmesh.layout.cost`); the cheapest candidate wins, ties going
to fewer collectives. One collective is not automatically cheaper: a merged gather pays more
hops and, when pieces of several tensor dims arrive interleaved, a reorder copy.

Byte counts are one rank's collective buffer (see :mod:`devmesh.distributed.comm`), padded
blocks included; for evenly divisible shapes they are the theoretical minimum.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from devmesh.layout.cost import CostModel, cost_model
from devmesh.layout.plan_phases import STRATEGIES
from devmesh.layout.plan_step import COLLECTIVES, Step
from devmesh.layout.spec import ShardingSpec, ShardingSpecError
from devmesh.layout.traffic import with_traffic

__all__ = ["Step", "Plan", "plan_redistribute", "explain_redistribute", "candidate_plans",
           "COLLECTIVES"]


@dataclass(frozen=True)
class Plan:
    """The steps from ``src`` to ``dst``, the strategy that produced them, their predicted
    time under ``model``, and the runner-up candidate (for ``explain``)."""

    src: ShardingSpec
    dst: ShardingSpec
    steps: tuple[Step, ...]
    strategy: str = "merged gather"
    seconds: float = 0.0
    model: CostModel | None = field(default=None, compare=False, repr=False)
    runner_up: Plan | None = field(default=None, compare=False, repr=False)

    @property
    def collectives(self) -> int:
        return sum(step.is_collective for step in self.steps)

    @property
    def nbytes(self) -> int:
        return sum(step.nbytes for step in self.steps)

    @property
    def wire(self) -> int:
        """Bytes one rank receives from others, over all steps (worst rank per step)."""
        return sum(step.wire for step in self.steps)

    @property
    def copied(self) -> int:
        """Bytes the executor copies locally, over all steps (worst rank per step)."""
        return sum(step.copied for step in self.steps)

    def summary(self) -> str:
        return (f"{self.strategy}: {self.collectives} collective(s), {self.nbytes:,} bytes per "
                f"rank ({self.wire:,} received, {self.copied:,} copied), predicted "
                f"{self.seconds * 1e3:.2f} ms")

    def __str__(self) -> str:
        lines = [f"redistribute {self.src}", f"         to {self.dst}"]
        if not self.steps:
            lines.append("  nothing to do")
        lines += [f"  {i + 1}. {step.describe()}" for i, step in enumerate(self.steps)]
        lines.append(f"  {self.collectives} collective(s), {self.nbytes:,} bytes per rank")
        if self.steps:
            lines.append(f"  chosen: {self.summary()}")
            if self.runner_up is not None:
                steps = "; ".join(f"{s.kind} over {len(s.mesh_dims)} dim(s)"
                                  for s in self.runner_up.steps)
                lines.append(f"  runner-up: {self.runner_up.summary()} [{steps}]")
            if self.model is not None:
                lines.append(f"  ({self.model.source} cost model; set DEVMESH_COST_MODEL to a "
                             "`devmesh bench --json` file to price your machine)")
        return "\n".join(lines)


def plan_redistribute(src: ShardingSpec, dst: ShardingSpec, itemsize: int = 4,
                      model: CostModel | None = None) -> Plan:
    """The cheapest plan that turns a tensor laid out as ``src`` into ``dst`` on the same mesh.

    ``model`` prices the candidates (default: :func:`devmesh.layout.cost.cost_model`). Every
    rank must plan with the same model, or ranks could run different collectives.
    """
    # specs compare without their dim names; the cache key must not, or a plan made for
    # ('dp', 'tp') would describe itself with those names for a mesh named ('x', 'y')
    return _plan(src, dst, itemsize, model or cost_model(), src.mesh_dim_names,
                 dst.mesh_dim_names)


def candidate_plans(src: ShardingSpec, dst: ShardingSpec, itemsize: int = 4,
                    model: CostModel | None = None) -> list[Plan]:
    """Every distinct candidate plan, cheapest first (the first is what
    :func:`plan_redistribute` runs)."""
    return list(_candidates(src, dst, itemsize, model or cost_model(), src.mesh_dim_names,
                            dst.mesh_dim_names))


@functools.lru_cache(maxsize=4096)
def _plan(src, dst, itemsize, model, _src_names, _dst_names) -> Plan:
    candidates = _candidates(src, dst, itemsize, model, _src_names, _dst_names)
    best = candidates[0]
    if len(candidates) > 1:
        best = dataclasses.replace(best, runner_up=candidates[1])
    return best


@functools.lru_cache(maxsize=4096)
def _candidates(src, dst, itemsize, model, _src_names, _dst_names) -> tuple[Plan, ...]:
    if src.mesh_shape != dst.mesh_shape:
        raise ShardingSpecError(
            f"cannot redistribute between meshes of shapes {src.mesh_shape} and {dst.mesh_shape}"
        )
    if src.global_shape != dst.global_shape:
        raise ShardingSpecError(
            f"cannot redistribute a tensor of shape {src.global_shape} to shape {dst.global_shape}"
        )
    plans: dict[tuple, Plan] = {}
    for strategy, phases in STRATEGIES.items():
        steps: list[Step] = []
        cur = src
        for phase in phases:
            for step in phase(cur, dst, itemsize):
                steps.append(with_traffic(step, itemsize))
                cur = step.after
        assert cur == dst, (strategy, cur, dst)
        key = tuple((s.kind, s.mesh_dims, s.after) for s in steps)
        if key not in plans:
            seconds = sum(step.seconds(model) for step in steps)
            plans[key] = Plan(src, dst, tuple(steps), strategy, seconds, model)
    # stable sort: among equal costs and collective counts, the earlier strategy wins
    return tuple(sorted(plans.values(), key=lambda p: (round(p.seconds, 9), p.collectives)))


def explain_redistribute(src: ShardingSpec, dst: ShardingSpec, itemsize: int = 4) -> str:
    """The plan as text: every step, the collective, its mesh dims and bytes per rank, the
    predicted time and the runner-up."""
    return str(plan_redistribute(src, dst, itemsize))
