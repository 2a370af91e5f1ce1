"""Checkpoint save and load: devmesh's sharded checkpoint vs torch.distributed.checkpoint.

Same model, same layout (8 gloo ranks), same data, in one run: an 8.4M-parameter MLP (4
blocks of Linear(512, 2048) -> ReLU -> Linear(2048, 512)) after one AdamW step, so a
checkpoint holds the weights and both Adam moments (~101 MB). Layouts (``--strategies``):
``fsdp`` (1-D over 8 ranks, ~12.6 MB a rank), ``hsdp`` ((2, 4): every block on 2 ranks) and
``ddp`` (every tensor on every rank). devmesh uses its own ``fully_shard``/``replicate`` and
``save_checkpoint``/``load_checkpoint`` (which checks that replicas agree, digesting each
replicated block); torch uses FSDP2 ``fully_shard`` / ``DistributedDataParallel`` on the same
process groups and ``dcp.save``/``dcp.load`` of ``get_state_dict``. Prints the slowest rank's
median time, the ratio devmesh / torch, each rank's peak memory growth during the save (RSS
sampled every millisecond, minus the RSS before), the bytes written, the time devmesh spends
computing its blocks' checksums (XXH3, against the save's time), and for FSDP, devmesh's
``async_=True``: how long the call blocks and how much a training step slows while the
write runs. torch runs a second time after its first: that A/A ratio shows how much the
machine alone (and the previous run's bytes still being written back) moves a ratio.

    .venv/bin/python bench/checkpoint.py [--repeats 3] [--dir /tmp] [--strategies fsdp,hsdp,ddp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings

import cloudpickle
import train_step  # bench/: the same model as the training-step benchmark
from train_step import build_model

cloudpickle.register_pickle_by_value(train_step)  # the ranks need not find bench/ on their path


class PeakRSS:
    """Peak resident memory of this process while the context runs, minus the RSS before."""

    def __enter__(self) -> PeakRSS:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.base = self.peak = self._rss()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def run(library: str, directory: str, repeats: int, strategy: str = "fsdp"):
    import logging

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from devmesh import init_device_mesh

    shape, names = ((2, 4), ("replicate", "shard")) if strategy == "hsdp" else ((8,), ("dp",))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = build_model()
    if library == "torch":
        from torch.distributed.fsdp import fully_shard

        tmesh = mesh.to_torch()
    else:
        from devmesh.parallel import fully_shard, replicate

        tmesh = mesh
    if strategy == "ddp" and library == "torch":
        model = torch.nn.parallel.DistributedDataParallel(model, process_group=mesh.get_group())
    elif strategy == "ddp":
        replicate(model, mesh=mesh)
    else:
        for i in range(0, len(model), 3):
            fully_shard(model[i], mesh=tmesh)
            fully_shard(model[i + 2], mesh=tmesh)
        fully_shard(model, mesh=tmesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 512, generator=torch.Generator().manual_seed(dist.get_rank()))

    def step() -> float:
        start = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start

    step()
    own_mb = sum(p.numel() * p.element_size() * 3 for p in model.parameters()) / 2**20
    path = os.path.join(directory, library)

    if library == "torch":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        def save() -> None:
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

        def load() -> None:
            model_sd, optim_sd = get_state_dict(model, opt)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
    else:
        from devmesh.parallel import load_checkpoint, save_checkpoint

        def save() -> None:
            save_checkpoint(path, model, opt)

        def load() -> None:
            load_checkpoint(path, model, opt)

    saves, loads, growth = [], [], []
    for _ in range(repeats):
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        with PeakRSS() as memory:
            start = time.perf_counter()
            save()
            dist.barrier()
            saves.append(time.perf_counter() - start)
        growth.append(memory.growth_mb)
        dist.barrier()
        start = time.perf_counter()
        load()
        dist.barrier()
        loads.append(time.perf_counter() - start)
    written = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                  if not f.startswith("."))
    blocking = slowed = check_seconds = None
    if library == "devmesh":  # what the blocks' checksums cost: the CRC of this rank's files
        from devmesh.parallel.checkpoint.checksums import checksums_of

        files = [os.path.join(path, f) for f in os.listdir(path)
                 if f.endswith(f"r{dist.get_rank():05d}.bin")]
        data = [open(f, "rb").read() for f in files]
        start = time.perf_counter()
        for raw in data:
            checksums_of(raw, (len(raw),), 1, 4 << 20)
        check_seconds = time.perf_counter() - start
    if library == "devmesh" and strategy == "fsdp":
        plain = statistics.median(step() for _ in range(3))
        dist.barrier()
        start = time.perf_counter()
        handle = save_checkpoint(path, model, opt, async_=True)
        blocking = time.perf_counter() - start
        during = step()
        handle.wait()
        slowed = during / plain
    return (statistics.median(saves), statistics.median(loads), max(growth), own_mb, written,
            blocking, slowed, check_seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--strategies", default="fsdp,hsdp,ddp",
                        help="layouts to compare, comma-separated: fsdp, hsdp, ddp")
    args = parser.parse_args()
    from devmesh.launching.launcher import launch

    from devmesh._progress import Progress

    directory = tempfile.mkdtemp(prefix="devmesh-bench-", dir=args.dir)
    strategies = args.strategies.split(",")
    with Progress("bench checkpoint", 3 * len(strategies), bar=False, unit="runs") as progress:
        for strategy in strategies:
            results = {}
            try:
                for lib in ("devmesh", "torch", "again"):  # again: torch's A/A
                    results[lib] = launch(run, 8, "torch" if lib == "again" else lib,
                                          directory, args.repeats, strategy, timeout=1800)
                    progress.advance()
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            report(strategy, results, args.repeats)


def report(strategy: str, results: dict, repeats: int) -> None:
    layout = {"fsdp": "FSDP over 8", "hsdp": "HSDP (2, 4) over 8", "ddp": "DDP over 8"}
    print(f"\n8.4M-parameter MLP + AdamW state, {layout[strategy]} gloo ranks; slowest "
          f"rank's median of {repeats}")
    print(f"{'':<26}{'devmesh':>12}{'torch DCP':>12}{'ratio':>8}{'A/A (torch again)':>20}")
    ours, theirs, again = results["devmesh"], results["torch"], results["again"]
    for label, index, unit, scale in (("save", 0, "ms", 1e3), ("load", 1, "ms", 1e3)):
        a = max(r[index] for r in ours) * scale
        b = max(r[index] for r in theirs) * scale
        c = max(r[index] for r in again) * scale
        print(f"{label + ' time':<26}{a:>10.0f}{unit}{b:>10.0f}{unit}{a / b:>8.2f}"
              f"{c / b:>20.2f}")
    a, b = max(r[2] for r in ours), max(r[2] for r in theirs)
    own = max(r[3] for r in ours)
    print(f"{'peak RSS growth in save':<26}{a:>10.1f}MB{b:>10.1f}MB{a / max(b, 1e-9):>8.2f}"
          f"   (a rank's own blocks + Adam state: {own:.1f} MB)")
    a, b = ours[0][4], theirs[0][4]
    print(f"{'bytes written':<26}{a / 2**20:>10.1f}MB{b / 2**20:>10.1f}MB{a / b:>8.2f}")
    crc = max(r[7] for r in ours)
    print(f"devmesh's checksums (XXH3 of a rank's data file): {crc * 1e3:.1f} ms of a "
          f"{max(r[0] for r in ours) * 1e3:.0f} ms save")
    if strategy == "fsdp":
        blocking = max(r[5] for r in ours)
        slowed = max(r[6] for r in ours)
        print(f"devmesh async_=True: the call blocks {blocking * 1e3:.0f} ms (sync save "
              f"{max(r[0] for r in ours) * 1e3:.0f} ms); a training step during the write "
              f"takes {slowed:.2f}x a normal one")


if __name__ == "__main__":
    main()
