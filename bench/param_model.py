"""What a distributed parameter costs on the CPU: torch's DTensor against devmesh's blocks.

devmesh keeps each parameter as a plain ``nn.Parameter`` holding this rank's block, its layout
in a typed record beside it; torch's FSDP2 and tensor parallelism make every parameter a
``DTensor``, whose every operation goes through sharding propagation in Python. This measures
what that costs, with the communication taken out: one process, rank 0 of torch's ``fake``
process group of 8 ranks (collectives return at once), so what is left is the CPU work around
each operation. Printed per case: the median time of devmesh's blocks and of torch's DTensors,
and their ratio (torch / devmesh).

Cases:

* one elementwise op (``a + b``) and one matmul on a parameter's block, 64 x 64 (per-op
  dispatch: the overhead every op of a training step pays);
* an optimizer step (AdamW, foreach) over 64 parameters of 64 x 64: what ``opt.step()``
  costs when its parameters are DTensors;
* ``bench/train_step.py``'s MLP (4 blocks of Linear(512, 2048) -> ReLU -> Linear(2048, 512),
  batch 8) under FSDP, forward + backward + SGD step: devmesh's ``fully_shard`` vs torch's;
* the same MLP under tensor parallelism (colwise then rowwise per block): devmesh's
  ``parallelize_module`` vs torch's;
* a transformer block of torch's test Transformer (dim 256, 4 heads, 2 layers, sequence 32)
  under FSDP, forward + backward + AdamW step.

    .venv/bin/python bench/param_model.py [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings


def _median_seconds(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fake_world(world: int = 8):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def _mlp(batch_dim: int = 512, hidden: int = 2048):
    import torch
    from torch import nn

    torch.manual_seed(0)
    blocks = []
    for _ in range(4):
        blocks += [nn.Linear(batch_dim, hidden), nn.ReLU(), nn.Linear(hidden, batch_dim)]
    return nn.Sequential(*blocks)


def _transformer():
    import torch
    from torch.testing._internal.distributed._tensor.common_dtensor import (
        ModelArgs,
        Transformer,
    )

    torch.manual_seed(0)
    return Transformer(ModelArgs(dim=256, n_heads=4, n_layers=2, vocab_size=512,
                                 max_seq_len=32, dropout_p=0.0))


def op_cases(repeats: int) -> list[tuple[str, float, float]]:
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from devmesh import init_device_mesh

    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    block_a, block_b = torch.randn(64, 64), torch.randn(64, 64)
    whole_a, whole_b = torch.randn(512, 64), torch.randn(512, 64)
    dt_a = distribute_tensor(whole_a, mesh, [Shard(0)])
    dt_b = distribute_tensor(whole_b, mesh, [Shard(0)])
    weight = torch.randn(64, 64)
    dt_weight = distribute_tensor(weight, mesh, [Replicate()])
    rows = []
    n = 500

    def per_op(op):
        def loop():
            for _ in range(n):
                op()
        return _median_seconds(loop, repeats) / n

    rows.append(("a + b, 64 x 64 block (per op)", per_op(lambda: block_a + block_b),
                 per_op(lambda: dt_a + dt_b)))
    rows.append(("block @ weight (per op)", per_op(lambda: block_a @ weight),
                 per_op(lambda: dt_a @ dt_weight)))

    def optimizer_step(params):
        for p in params:
            p.grad = torch.ones_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
        opt.step()  # the state is created here; the timed steps reuse it
        return lambda: opt.step()

    plain = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(64)]
    dtensors = [torch.nn.Parameter(distribute_tensor(torch.randn(512, 64), mesh, [Shard(0)]))
                for _ in range(64)]
    rows.append(("AdamW step, 64 params of 64 x 64",
                 _median_seconds(optimizer_step(plain), repeats),
                 _median_seconds(optimizer_step(dtensors), repeats)))
    return rows


def model_cases(repeats: int) -> list[tuple[str, float, float]]:
    import torch
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    from devmesh import init_device_mesh
    from devmesh.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        fully_shard,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))

    def step_of(model, optimizer_class, batch):
        opt = optimizer_class(model.parameters(), lr=1e-3)

        def step():
            loss = F.mse_loss(model(batch[0]), batch[1]) if batch[1] is not None else \
                model(batch[0]).float().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        return step

    rows = []
    mlp_batch = (torch.randn(8, 512), torch.randn(8, 512))

    def fsdp(shard, model):
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                shard(layer, mesh=mesh)  # a unit per linear layer, then the root
        shard(model, mesh=mesh)
        return model

    ours = step_of(fsdp(fully_shard, _mlp()), torch.optim.SGD, mlp_batch)
    theirs = step_of(fsdp(torch_fully_shard, _mlp()), torch.optim.SGD, mlp_batch)
    rows.append(("MLP 8.4M params, FSDP step", _median_seconds(ours, repeats),
                 _median_seconds(theirs, repeats)))

    def tp(parallelize, colwise, rowwise, model):
        plan = {}
        for i in range(0, len(model), 3):
            plan[str(i)], plan[str(i + 2)] = colwise(), rowwise()
        parallelize(model, mesh, plan)
        return model

    ours = step_of(tp(parallelize_module, ColwiseParallel, RowwiseParallel, _mlp()),
                   torch.optim.SGD, mlp_batch)
    theirs = step_of(tp(torch_parallelize, TorchColwise, TorchRowwise, _mlp()),
                     torch.optim.SGD, mlp_batch)
    rows.append(("MLP 8.4M params, TP step", _median_seconds(ours, repeats),
                 _median_seconds(theirs, repeats)))

    tokens = (torch.randint(0, 512, (4, 32)), None)

    def fsdp_transformer(shard):
        model = _transformer()
        for layer in model.layers:
            shard(layer, mesh=mesh)
        shard(model, mesh=mesh)
        return model

    ours = step_of(fsdp_transformer(fully_shard), torch.optim.AdamW, tokens)
    theirs = step_of(fsdp_transformer(torch_fully_shard), torch.optim.AdamW, tokens)
    rows.append(("test Transformer (2 layers), FSDP step", _median_seconds(ours, repeats),
                 _median_seconds(theirs, repeats)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    _fake_world()
    print("rank 0 of torch's fake process group of 8 (no communication), torch "
          f"{torch.__version__}, 1 thread; median of {args.repeats}")
    print(f"{'case':<44}{'devmesh blocks':>16}{'torch DTensor':>16}{'torch/devmesh':>15}")
    for name, ours, theirs in op_cases(args.repeats) + model_cases(max(5, args.repeats // 3)):
        unit, scale = ("us", 1e6) if ours < 1e-3 else ("ms", 1e3)
        print(f"{name:<44}{ours * scale:>13.1f} {unit}{theirs * scale:>13.1f} {unit}"
              f"{theirs / ours:>15.2f}", flush=True)


if __name__ == "__main__":
    main()
