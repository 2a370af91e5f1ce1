"""Context and expert parallelism: what they save and what they cost, against torch.

1. **Attention memory per rank under context parallelism**: the bytes autograd saves for
   backward inside one causal attention call (summed over the distinct storages a
   ``saved_tensors_hooks`` pair sees), for torch's ``scaled_dot_product_attention`` on the
   whole sequence in one process and for devmesh's ring attention per rank at cp = 2 and 4.
   Ring attention saves this rank's q, k, v, output and log-sum-exp: it falls as 1 / cp.
2. **Step time of context parallelism against torch's** ``context_parallel``
   (``torch.distributed.tensor.experimental``) on 2 gloo ranks, forward + backward of one
   causal attention; where torch's does not run on this machine, the error is printed.
3. **Expert dispatch against an all-gather baseline** on 2 gloo ranks, forward + backward of
   one MoE layer (4 experts, top-2): devmesh's all-to-all of each token to its experts' rank
   against every rank gathering every token (torch's differentiable ``all_gather``), running
   its experts on those assigned to them, and reduce-scattering the outputs back.

    .venv/bin/python bench/context_and_experts.py [--length 4096] [--tokens 4096] [--repeats 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def _median(fn, repeats: int) -> float:
    import torch.distributed as dist

    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while ``fn`` runs."""
    import torch

    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def _qkv(length: int, heads: int = 8, head_dim: int = 64):
    import torch

    torch.manual_seed(0)
    return [torch.randn(1, heads, length, head_dim, requires_grad=True) for _ in range(3)]


def attention_memory(length: int) -> int:
    """One rank's saved bytes for causal ring attention over ``length`` tokens."""
    from devmesh import init_device_mesh
    from devmesh.parallel import ring_attention, shard_sequence

    cp = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("cp",))
    mine = [shard_sequence(t.detach(), cp, 2).requires_grad_() for t in _qkv(length)]
    return _saved_bytes(lambda: ring_attention(*mine, cp, is_causal=True))


def attention_time(library: str, length: int, repeats: int):
    import torch
    import torch.nn.functional as F

    if library == "devmesh":
        from devmesh import init_device_mesh
        from devmesh.parallel import ring_attention, shard_sequence

        cp = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        mine = [shard_sequence(t.detach(), cp, 2).requires_grad_() for t in _qkv(length)]

        def step():
            ring_attention(*mine, cp, is_causal=True).sum().backward()

        return "ok", _median(step, repeats)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    cp = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))

    scales = [torch.ones((), requires_grad=True) for _ in range(3)]

    def step():
        # torch shards its buffers in place: inputs that need no gradient, as a model's
        # tokens; q, k and v are computed from them inside, as a model's projections would
        q, k, v = (t.detach() for t in _qkv(length))
        with context_parallel(cp, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            mine = [t * s for t, s in zip((q, k, v), scales)]
            F.scaled_dot_product_attention(*mine, is_causal=True).sum().backward()

    try:
        return "ok", _median(step, repeats)
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        return "error", f"{type(exc).__name__}: {exc}"


def expert_time(kind: str, tokens: int, repeats: int) -> float:
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_nn
    import torch.nn.functional as F

    from devmesh import init_device_mesh
    from devmesh.parallel import MoE, expert_parallel

    ep = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    torch.manual_seed(0)
    moe = MoE(256, 1024, experts=4, top_k=2)
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(tokens, 256)
    if kind == "all-to-all":
        expert_parallel(moe, ep)

        def step():
            moe(x).sum().backward()

        return _median(step, repeats)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed.nn's
    rank, world = dist.get_rank(), 2
    local = 4 // world
    w1 = moe.experts.w1.detach()[rank * local:(rank + 1) * local].requires_grad_()
    w2 = moe.experts.w2.detach()[rank * local:(rank + 1) * local].requires_grad_()

    def step():
        probs = torch.softmax(moe.router(x), -1)
        weights, chosen = probs.topk(2, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        every = torch.cat(dist_nn.all_gather(x))                       # every rank's tokens
        chosen_all = torch.cat(dist_nn.all_gather(chosen.contiguous()))
        weights_all = torch.cat(dist_nn.all_gather(weights.contiguous()))
        out = torch.zeros_like(every)
        for e in range(local):
            token, slot = (chosen_all == rank * local + e).nonzero(as_tuple=True)
            y = F.gelu(every[token] @ w1[e]) @ w2[e]
            out = out.index_add(0, token, y * weights_all[token, slot, None])
        mine = dist_nn.reduce_scatter(torch.empty_like(x), list(out.chunk(world)))
        mine.sum().backward()

    return _median(step, repeats)


def _single_process_attention(length: int, repeats: int) -> float:
    import torch.nn.functional as F

    q, k, v = _qkv(length)

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=4096, help="sequence length")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank (MoE)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    from devmesh.launching.launcher import launch

    print(f"1. attention saved for backward, causal, 8 heads x 64, {args.length} tokens")
    whole = _saved_bytes(lambda: F.scaled_dot_product_attention(*_qkv(args.length),
                                                                  is_causal=True))
    print(f"   torch SDPA, one process, whole sequence: {whole / 2**20:8.2f} MiB")
    for cp in (2, 4):
        per_rank = max(launch(attention_memory, cp, args.length, timeout=600))
        print(f"   devmesh ring attention, cp = {cp}, per rank:  {per_rank / 2**20:8.2f} MiB "
              f"({per_rank / whole:.2f} of one process)")

    print(f"2. causal attention forward + backward, {args.length} tokens, cp = 2 "
          f"(median of {args.repeats}, slowest rank)")
    ours = max(t for _, t in launch(attention_time, 2, "devmesh", args.length, args.repeats,
                                    timeout=1200))
    torch.set_num_threads(1)  # as each rank has
    whole_time = _single_process_attention(args.length, args.repeats)
    print(f"   torch SDPA, one process, one thread, whole sequence: {whole_time * 1e3:8.1f} ms")
    print(f"   devmesh ring attention: {ours * 1e3:8.1f} ms")
    theirs = launch(attention_time, 2, "torch", args.length, args.repeats, timeout=1200)
    if theirs[0][0] == "ok":
        slowest = max(t for _, t in theirs)
        print(f"   torch context_parallel: {slowest * 1e3:8.1f} ms   devmesh / torch "
              f"{ours / slowest:.2f}")
    else:
        print(f"   torch context_parallel does not run here (torch {torch.__version__}, CPU, "
              f"gloo): {theirs[0][1]}")

    print(f"3. MoE layer forward + backward (4 experts, top-2, dim 256, hidden 1024), "
          f"{args.tokens} tokens per rank, ep = 2")
    dispatch = max(launch(expert_time, 2, "all-to-all", args.tokens, args.repeats,
                          timeout=1200))
    gathered = max(launch(expert_time, 2, "all-gather", args.tokens, args.repeats,
                          timeout=1200))
    print(f"   devmesh all-to-all dispatch: {dispatch * 1e3:8.1f} ms")
    print(f"   all-gather baseline:         {gathered * 1e3:8.1f} ms   dispatch / baseline "
          f"{dispatch / gathered:.2f}")


if __name__ == "__main__":
    main()
