"""Setup cost: devmesh's ``fully_shard`` and ``parallelize_module`` vs torch's, on a model of
many blocks, 8 gloo ranks, measured in the same run.

Setup is what a job pays before its first step: every ``fully_shard`` call (one per block,
then the root) and every ``parallelize_module`` call. devmesh's run agreements there (a
refusal checked on every rank, settings compared across ranks) so that a bad argument on
one rank is raised on every rank instead of leaving the others in a collective; this
measures what they cost, and counts them.

Cases (each in a fresh world; the time is the slowest rank's, median of ``--repeats``):

- ``fully_shard``: ``--blocks`` blocks (Linear(64, 128) -> ReLU -> Linear(128, 64)), each
  block sharded, then the root, over a (8,) mesh; for devmesh twice: the calls as written
  (their checks held and agreed together at the root's call, which the time includes), and
  inside ``batched_checks()`` (agreed together at its end);
- ``parallelize_module``: the same model, one call with a plan of column- and row-wise
  layers for every block, over a (8,) mesh (torch sends each split parameter from rank
  0 on its own — a scatter of its blocks, a broadcast of a replicated bias; devmesh sends
  each rank its blocks of all of them in buckets).

For each, the time, the ratio devmesh / torch (< 1: devmesh faster) and, per call, the
collectives (``torch.distributed``'s functions entered) and rendezvous-store operations each
library made. "A/A" times torch's case a second time in each repeat: its ratio to the first
is the machine's noise.

    .venv/bin/python bench/setup.py [--blocks 100] [--repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings

class _CountingStore:
    """The rendezvous store, counting each operation made through it."""

    def __init__(self, store, counts: dict[str, int]) -> None:
        self._store, self._counts = store, counts

    def __getattr__(self, name):
        attribute = getattr(self._store, name)
        if not callable(attribute):
            return attribute

        def counted(*args, **kwargs):
            self._counts["store"] += 1
            return attribute(*args, **kwargs)

        return counted


@contextlib.contextmanager
def _counting(counts: dict[str, int]):
    """Count the collectives entered on any process group (from Python: torch's functional
    collectives, which DTensor's redistributions use, run in C++ and are not counted) and
    the rendezvous store's operations inside the block."""
    from devmesh import _torch_compat
    from devmesh.distributed.entered import entered_collectives

    store = _torch_compat.default_store
    _torch_compat.default_store = lambda: _CountingStore(store(), counts)
    try:
        with entered_collectives() as entered:
            yield
    finally:
        _torch_compat.default_store = store
        counts["collectives"] = sum(entered.values())


def _model(blocks: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
                           for _ in range(blocks)])


def case(which: str, what: str, blocks: int) -> dict[str, float]:
    """On every rank of a fresh world: this rank's seconds and counts for one case."""
    import logging

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    dist.init_process_group("gloo")
    batched = contextlib.nullcontext
    if which == "devmesh":
        from devmesh import init_device_mesh
        from devmesh.parallel import (ColwiseParallel, RowwiseParallel, batched_checks,
                                      fully_shard, parallelize_module)
        if what == "fsdp batched":
            batched = batched_checks
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("tp" if what == "tp" else "dp",))
    model = _model(blocks)
    counts = {"collectives": 0, "store": 0}
    dist.barrier()
    with _counting(counts):
        start = time.perf_counter()
        if what != "tp":
            with batched():
                for block in model:
                    fully_shard(block, mesh=mesh)
                fully_shard(model, mesh=mesh)
            calls = blocks + 1
        else:
            plan = {}
            for i in range(blocks):
                plan[f"{i}.0"], plan[f"{i}.2"] = ColwiseParallel(), RowwiseParallel()
            parallelize_module(model, mesh, plan)
            calls = 1
        seconds = time.perf_counter() - start
    dist.barrier()
    return {"seconds": seconds, "calls": calls, **counts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from devmesh.launching.launcher import WorkerPool

    print(f"setup of a {args.blocks}-block model on 8 gloo ranks: devmesh vs torch "
          "(slowest rank, median of repeats; ratio = devmesh / torch, < 1: devmesh faster)")
    print(f"  {'case':<22}{'devmesh':>11}{'torch':>11}{'ratio':>8}{'A/A':>7}"
          f"   per call: collectives, store ops (devmesh | torch)")
    with WorkerPool(8) as pool:
        for what, title in (("fsdp", f"fully_shard x{args.blocks + 1}"),
                            ("fsdp batched", "  in batched_checks()"),
                            ("tp", "parallelize_module")):
            runs: dict[str, list[dict]] = {"devmesh": [], "torch": [], "torch again": []}
            for _ in range(args.repeats):
                for which in ("torch", "devmesh", "torch again"):
                    per_rank = pool.run(case, 8, which.split()[0], what, args.blocks)
                    slowest = max(per_rank, key=lambda r: r["seconds"])
                    runs[which].append(slowest)
            time_of = {w: statistics.median(r["seconds"] for r in rs) for w, rs in runs.items()}
            last = {w: rs[-1] for w, rs in runs.items()}

            def per_call(r):
                return f"{r['collectives'] / r['calls']:.2f}, {r['store'] / r['calls']:.2f}"

            print(f"  {title:<22}{time_of['devmesh'] * 1e3:>9.1f}ms"
                  f"{time_of['torch'] * 1e3:>9.1f}ms"
                  f"{time_of['devmesh'] / time_of['torch']:>8.2f}"
                  f"{time_of['torch again'] / time_of['torch']:>7.2f}"
                  f"   {per_call(last['devmesh'])} | {per_call(last['torch'])}")


if __name__ == "__main__":
    main()
