"""Training step of a Hugging Face transformers Llama: devmesh's ``parallelize`` against
torch's FSDP2 and tensor parallelism (torch's styles for transformers' own TP plan), same
model, same mesh, same data, 8 gloo ranks.

A Llama of 4 layers, hidden 256, 8 heads, MLP 688, vocabulary 4096 (~11M parameters),
float32, 2 sequences of 256 tokens per data-parallel rank, AdamW. Each (library, strategy)
runs in fresh processes so that peak RSS (``ru_maxrss``) belongs to that run alone. Prints
the slowest rank's median step time, the ratio devmesh / torch, the largest peak RSS, and
the most bytes one more step's tensors hold at once (counted op by op under a dispatch mode,
:class:`devmesh.tools.dry_run.live.LiveBytes`: the step's part of the peak a GPU's allocator
would report; the process's RSS adds what glibc keeps of freed memory, which differs from
run to run);
``--repeats`` runs every pair again and prints each ratio (the machine's noise).

    .venv/bin/python bench/transformers_step.py [--steps 5] [--strategies fsdp,tp,fsdp+tp]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
import warnings

MESHES = {"fsdp": ((8,), ("dp_shard",)), "tp": ((8,), ("tp",)),
          "fsdp+tp": ((4, 2), ("dp_shard", "tp"))}


def build_model():
    import torch
    import transformers as T

    T.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                           max_position_embeddings=512, use_cache=False)
    return T.LlamaForCausalLM(config)


def _torch_styles(model):
    """transformers' plan of the model as torch's styles."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
              "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate())}
    return {name: styles[style]() for name, style in model._tp_plan.items()}


def run(library: str, strategy: str, steps: int):
    import logging

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from devmesh import init_device_mesh

    torch.set_num_threads(1)
    shape, names = MESHES[strategy]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = build_model()
    if library == "devmesh":
        from devmesh.parallel import parallelize

        model = parallelize(model, mesh)
    else:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        troot = mesh.to_torch()
        if "tp" in names:
            parallelize_module(model, troot["tp"], _torch_styles(model))
        if "dp_shard" in names:
            dp = troot["dp_shard"]
            for layer in model.model.layers:
                fully_shard(layer, mesh=dp)
            fully_shard(model, mesh=dp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dp_index = mesh["dp_shard"].get_local_rank() if "dp_shard" in names else 0
    gen = torch.Generator().manual_seed(dp_index)
    ids = torch.randint(0, 4096, (2, 256), generator=gen)
    times = []
    for step in range(steps + 2):
        dist.barrier()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if step >= 2:
            times.append(time.perf_counter() - start)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    from devmesh.tools.dry_run.live import LiveBytes

    with LiveBytes() as live:  # one more step, untimed: the bytes its ops hold at most
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return statistics.median(times), rss, live.peak / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--strategies", default="fsdp,tp,fsdp+tp")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    from devmesh.launching.launcher import launch

    def measure(library, strategy):
        per_rank = launch(run, 8, library, strategy, args.steps, timeout=1800)
        return (max(t for t, _, _ in per_rank), max(m for _, m, _ in per_rank),
                max(a for _, _, a in per_rank))

    print(f"transformers Llama (~11M parameters), float32, 2 x 256 tokens per data-parallel "
          f"rank, AdamW, 8 gloo ranks; slowest rank's median of {args.steps} steps")
    print("peak RSS: the process's (ru_maxrss); allocated: the most bytes a step's tensors "
          "hold at once,\nbeyond the model and optimizer state (the step's part of the peak "
          "a GPU's allocator reports)")
    print(f"{'strategy':<10}{'devmesh':>12}{'torch':>12}{'ratio':>8}{'devmesh RSS':>14}"
          f"{'torch RSS':>12}{'allocated':>20}")
    for strategy in args.strategies.split(","):
        for _ in range(args.repeats):
            ours_t, ours_m, ours_a = measure("devmesh", strategy)
            theirs_t, theirs_m, theirs_a = measure("torch", strategy)
            print(f"{strategy:<10}{ours_t * 1e3:>10.0f}ms{theirs_t * 1e3:>10.0f}ms"
                  f"{ours_t / theirs_t:>8.2f}{ours_m:>12.0f}MB{theirs_m:>10.0f}MB"
                  f"{ours_a:>10.1f} / {theirs_a:.1f}MB", flush=True)


if __name__ == "__main__":
    main()
