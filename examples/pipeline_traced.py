"""torch's pipelining tutorial ("split a model automatically"), with devmesh's imports: trace
the whole model on every rank, split it at a layer's name, build this rank's stage, train
with 1F1B. The model ties its embedding to its output head: torch's tracer copies that weight
into both stages, and devmesh keeps the copies one weight, so the pipeline trains exactly as
one process does (checked at the end, on the last stage's rank).

    devmesh run -n 2 examples/pipeline_traced.py
    torchrun --nproc_per_node=2 examples/pipeline_traced.py
"""

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from devmesh import init_device_mesh
from devmesh.parallel.pipeline import Schedule1F1B, SplitPoint, pipeline

VOCAB, WIDTH, SEQ, BATCH, MICROBATCHES = 64, 32, 16, 8, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.mlp(self.norm(x)))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        nn.init.normal_(self.embed.weight, std=0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen))


def train_pipelined(steps: int = 3) -> tuple[int, list[float], dict[str, torch.Tensor]]:
    """This rank's stage index, the step losses (last stage) and its parameters after
    ``steps``."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    rank = mesh.get_coordinate()[0]
    with warnings.catch_warnings():  # torch.export's deprecation notes
        warnings.simplefilter("ignore")
        pipe = pipeline(TinyLM(), mb_args=(batch(0)[0][:BATCH // MICROBATCHES],),
                        split_spec={"layers.2": SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"), mesh.get_group("pp"))
    schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=loss_fn)
    opt = torch.optim.AdamW(stage.submod.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        tokens, targets = batch(step)
        step_losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(tokens)
        else:
            schedule.step(target=targets, losses=step_losses)
            losses.append(sum(loss.item() for loss in step_losses) / MICROBATCHES)
        opt.step()
        opt.zero_grad()
    params = {name: p.detach() for name, p in stage.submod.named_parameters()}
    return rank, losses, params


def train_one_process(steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        tokens, targets = batch(step)
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, dict(model.named_parameters(remove_duplicate=False))


if __name__ == "__main__":
    rank, losses, params = train_pipelined()
    single_losses, single = train_one_process()
    same = all(torch.allclose(p, single[name], rtol=1e-5, atol=1e-6)
               for name, p in params.items())
    print(f"rank {rank}: stage {rank} holds {sorted(params)}")
    print(f"rank {rank}: parameters same as one process: {same}")
    if losses:
        print(f"rank {rank}: losses {[round(x, 4) for x in losses]} "
              f"(one process: {[round(x, 4) for x in single_losses]})")
    dist.destroy_process_group()
