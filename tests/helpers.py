"""Small helpers shared by test modules (run on the workers too, so import nothing heavy)."""

from __future__ import annotations

import os
import random
import runpy
import socket
import sys
import time

from devmesh.errors import DevmeshError


def caught(fn):
    """``(type name, message)`` of the devmesh error ``fn()`` raises, or ``None``."""
    try:
        fn()
    except DevmeshError as exc:
        return type(exc).__name__, str(exc)
    return None


def run_script(path: str, args: list[str]) -> None:
    """Run the script at ``path`` with ``args`` as its command line, as ``python path args``
    would — on a rank of the worker pool, in the launch environment the pool gives it."""
    before, sys.argv = sys.argv, [path, *args]
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv = before  # the worker goes on to other tests


def reported(folder: str, rank: int) -> None:
    """Mark, in ``folder``, that ``rank`` has what the test wanted from it (its error, say)."""
    open(os.path.join(folder, f"reported{rank}"), "w").close()


def stay_away_until_reported(folder: str, ranks, within: float = 60.0) -> None:
    """A rank stuck in its own code, for as long as the test needs it: until every rank in
    ``ranks`` has :func:`reported`, rather than for a fixed sleep sized for a slow machine."""
    deadline = time.monotonic() + within
    while not all(os.path.exists(os.path.join(folder, f"reported{r}")) for r in ranks):
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks {list(ranks)} did not report within {within} s")
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead but not yet waited for, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still has a pid: read its state, after the command name's ")"
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def all_gone(pids, within: float) -> bool:
    """Whether every process in ``pids`` is gone (or a zombie) within ``within`` seconds."""
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(p) for p in pids)


def _each(calls):
    """This rank's result of every ``(fn, args)`` in turn."""
    return [fn(*args) for fn, args in calls]


class TorchRuns:
    """torch's own runs of a test module (its FSDP2, DDP, ...), to compare devmesh with.

    They need fresh processes: torch's sharded models keep their process groups (and gloo's
    threads) alive after a task, so they cannot run on the shared worker pool. A launch costs
    every rank a torch import (seconds here), so all of a module's runs of one world size go
    in one launch, made when a test first asks for one of them; each test then reads its own.
    """

    def __init__(self, calls: dict[int, list[tuple]]) -> None:
        self._calls = calls
        self._results: dict[int, list[list]] = {}

    def __call__(self, world_size: int, fn, *args) -> list:
        """Every rank's result of ``fn(*args)``, which must be one of the registered runs."""
        from devmesh.launching.launcher import launch

        calls = self._calls.get(world_size, [])
        if (fn, args) not in calls:
            raise LookupError(f"{fn.__name__}{args} on {world_size} ranks is not among this "
                              "module's torch runs: add it to the module's TorchRuns")
        if world_size not in self._results:
            self._results[world_size] = launch(_each, world_size, calls, timeout=600)
        index = calls.index((fn, args))
        return [per_rank[index] for per_rank in self._results[world_size]]


def seeded_batch(step: int, size: int = 16, features: int = 16, classes: int = 4):
    """The inputs and class targets of ``step``, the same in every process."""
    import torch

    gen = torch.Generator().manual_seed(step)
    return (torch.randn(size, features, generator=gen),
            torch.randint(0, classes, (size,), generator=gen))


def train_alone(model, steps: int, batch=seeded_batch, losses: list | None = None) -> dict:
    """Single-process training of ``model`` (SGD, lr 0.1, cross entropy) on ``batch(step)``:
    the reference a parallel run must equal. Returns the trained state dict, copied (and
    appends each step's loss to ``losses`` where given)."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batch(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if losses is not None:
            losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def hand_written_schedule(*ranks: str, stages: int = 2, microbatches: int = 1,
                          pp: int | None = None):
    """A schedule from one string of actions per rank, as ``str(schedule)`` prints them
    (``"F0@0 I0@0 W0@0"``), for ``pp`` ranks (default: one per string)."""
    from devmesh.layout.schedule import parse_schedule

    header = f"hand-written: {stages} stages on {pp or len(ranks)} ranks, {microbatches} micro-batches"
    return parse_schedule("\n".join([header] + [f"rank {r}: {actions}"
                                                for r, actions in enumerate(ranks)]))


# on 2 ranks, 4 micro-batches: whole and split backwards mixed on each stage, a whole one
# after a split one's W ("I1@0 B2@0 W1@0") and after its I alone ("I2@1 W0@1 F3@1 B3@1")
MIXED_BACKWARDS = ("F0@0 F1@0 F2@0 F3@0 I0@0 W0@0 I1@0 B2@0 W1@0 B3@0",
                   "F0@1 I0@1 F1@1 B1@1 F2@1 I2@1 W0@1 F3@1 B3@1 W2@1")


def shard_blocks_and_root(model, kind: str):
    """``fully_shard`` — torch's FSDP2 (``kind == "torch"``) or devmesh's — on each of
    ``model.blocks`` and then the root, over every rank as ``dp``; ``model`` unchanged for
    ``"one process"``."""
    if kind == "one process":
        return model
    from devmesh import init_device_mesh

    if kind == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from devmesh.parallel import fully_shard
    import os

    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("dp",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_params(model, kind: str) -> dict:
    """The model's state as full tensors, whichever ``fully_shard`` sharded it."""
    if kind == "devmesh":
        from devmesh.parallel import state_dict

        return state_dict(model, full=True)
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def port_for_a_server() -> int:
    """A free loopback port for a server the test starts later (torchrun's ``--master_port``),
    chosen below the kernel's ephemeral range: a port from ``bind(0)``, closed again, may be
    handed to another process's outgoing connection before the server binds it (the suite
    opens thousands of them), one below that range only to an explicit bind."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    for _ in range(100):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port below {low}")

