"""Train the quickstart network (seed 003) on scikit-learn's digits under any mesh strategy.

The mesh is given as ``dp=2,shard=2,tp=2`` (any subset, in any order): ``tp`` is tensor
parallelism (first hidden layer column-wise, second row-wise), ``shard`` is FSDP, ``dp`` alone
is DDP and ``dp`` with ``shard`` is HSDP (``dp`` replicates, ``shard`` shards). Each global
batch is split over the data-parallel ranks. With ``verify=True`` every rank also trains the
plain model on the whole batch and the losses are compared step by step.

Data: ``sklearn.datasets.load_digits`` (1,797 8x8 images, shipped with scikit-learn: no
download).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from devmesh._progress import Progress

__all__ = ["MeshPlan", "parse_mesh", "train", "NeuralNetwork", "load_data"]


@dataclass(frozen=True)
class MeshPlan:
    names: tuple[str, ...]
    shape: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def size(self, name: str) -> int:
        return self.shape[self.names.index(name)] if name in self.names else 1

    def describe(self) -> str:
        parts = [f"PP={self.size('pp')}"] if "pp" in self.names else []
        if "tp" in self.names:
            parts.append(f"TP={self.size('tp')}")
        if "shard" in self.names and "dp" in self.names:
            parts.append(f"HSDP (dp={self.size('dp')} replicates, shard={self.size('shard')} "
                         "shards)")
        elif "shard" in self.names:
            parts.append(f"FSDP={self.size('shard')}")
        elif "dp" in self.names:
            parts.append(f"DDP={self.size('dp')}")
        return " + ".join(parts) or "single rank"


def parse_mesh(text: str, allowed: tuple[str, ...] = ("dp", "shard", "tp")) -> MeshPlan:
    """``"dp=2,shard=2,tp=2"`` -> MeshPlan; raises ValueError that names the bad part.
    ``allowed`` are the dim names the caller can run (the pipelined demo adds ``pp``)."""
    names, shape = [], []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, size = part.partition("=")
        if name not in allowed or not size.isdigit() or int(size) < 1:
            raise ValueError(
                f"mesh part {part!r}: use name=size with names {', '.join(allowed)}, "
                f"e.g. {','.join(f'{n}=2' for n in allowed)}"
            )
        if name in names:
            raise ValueError(f"mesh part {name!r} appears twice in {text!r}")
        names.append(name)
        shape.append(int(size))
    if not names:
        raise ValueError("the mesh is empty; e.g. --mesh dp=2,shard=2,tp=2")
    return MeshPlan(tuple(names), tuple(shape))


class NeuralNetwork(nn.Module):
    """Seed 003's quickstart network, for 8x8 digits."""

    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(
            nn.Linear(8 * 8, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_relu_stack(self.flatten(x))


def load_data(seed: int = 0):
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError(
            "the digits demo needs scikit-learn (its bundled digits data set): "
            "pip install 'devmesh[demo]'"
        ) from None

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    return (x[:1500], y[:1500]), (x[1500:], y[1500:])


def _parallelize(model: NeuralNetwork, plan: MeshPlan):
    """Apply the plan; returns (mesh, data-parallel mesh or None)."""
    from devmesh import init_device_mesh
    from devmesh.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        fully_shard,
        parallelize_module,
        replicate,
    )

    mesh = init_device_mesh("cpu", plan.shape, mesh_dim_names=plan.names)
    if "tp" in plan.names:
        parallelize_module(model.linear_relu_stack, mesh["tp"],
                           {"0": ColwiseParallel(), "2": RowwiseParallel()})
    dp_names = tuple(n for n in ("dp", "shard") if n in plan.names)
    if not dp_names:
        return mesh, None
    dp_mesh = mesh[dp_names] if len(dp_names) > 1 or mesh.ndim > 1 else mesh
    if "shard" in dp_names:
        for layer in model.linear_relu_stack:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    else:
        replicate(model, mesh=dp_mesh)
    return mesh, dp_mesh


@dataclass
class Result:
    losses: list[float] = field(default_factory=list)
    reference_losses: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)
    max_param_diff: float | None = None
    describe: str = ""
    mesh: str = ""
    reference_accuracies: list[float] = field(default_factory=list)  # single-process, per epoch


def train(mesh_text: str = "dp=2,shard=2,tp=2", *, epochs: int = 3, batch_size: int = 64,
          lr: float = 0.2, verify: bool = False, progress: bool = True) -> Result:
    """Runs on every rank (under a launcher); returns this rank's Result."""
    from devmesh.parallel import describe, state_dict

    plan = parse_mesh(mesh_text)
    torch.manual_seed(0)
    model = NeuralNetwork()
    reference = copy.deepcopy(model) if verify else None
    mesh, dp_mesh = _parallelize(model, plan)
    dp_size, dp_index = _data_parallel_position(dp_mesh)
    if batch_size % dp_size:
        raise ValueError(f"batch size {batch_size} must be divisible by the data-parallel degree {dp_size}")
    (x_train, y_train), (x_test, y_test) = load_data()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr) if reference is not None else None
    result = Result(describe=describe(model), mesh=repr(mesh))
    steps_per_epoch = len(y_train) // batch_size
    bar = Progress(f"training ({plan.describe()})", epochs * steps_per_epoch,
                   show=progress and dist.get_rank() == 0, unit="steps")
    per_rank = batch_size // dp_size
    mine = slice(dp_index * per_rank, (dp_index + 1) * per_rank)
    for epoch in range(epochs):
        order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(epoch))
        for step in range(steps_per_epoch):
            idx = order[step * batch_size:(step + 1) * batch_size]
            x, y = x_train[idx], y_train[idx]
            result.losses.append(_train_step(model, opt, x[mine], y[mine]))
            if reference is not None:
                result.reference_losses.append(_train_step(reference, ref_opt, x, y,
                                                           average=False))
            bar.advance()
        with torch.no_grad():
            correct = (model(x_test).argmax(1) == y_test).float().mean().item()
        result.accuracies.append(correct)
        bar.print(f"epoch {epoch + 1}: loss {result.losses[-1]:.4f}, "
                  f"test accuracy {100 * correct:.1f}%")
    bar.close()
    if reference is not None:
        full = state_dict(model)
        ref = reference.state_dict()
        result.max_param_diff = max((full[k] - ref[k]).abs().max().item() for k in ref)
    return result


def _data_parallel_position(dp_mesh) -> tuple[int, int]:
    """How many data-parallel replicas there are, and which one this rank is."""
    if dp_mesh is None:
        return 1, 0
    index = 0
    for c, s in zip(dp_mesh.get_coordinate(), dp_mesh.shape, strict=True):
        index = index * s + c
    return dp_mesh.size(), index


def _train_step(model, opt, x, y, *, average: bool = True) -> float:
    """One SGD step; the loss averaged over all ranks (``average``) or this one's."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if not average:
        return loss.item()
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    return global_loss.item() / dist.get_world_size()


def plot_losses(result: Result, path: str) -> None:
    """Loss curve (and the single-process reference, if verified) as a PNG, written atomically."""
    from devmesh._files import pyplot, save_figure

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(result.losses, label="devmesh (parallel)")
    if result.reference_losses:
        ax.plot(result.reference_losses, "--", label="single process")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("digits: training loss")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
