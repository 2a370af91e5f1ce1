#!/usr/bin/env python3
"""What CI cannot check, on a machine with one CUDA GPU: run it from the checkout's root.

    PYTHONPATH=src python3 .ci/gpu_check.py

CI has no GPU, so these paths are otherwise checked only by their choices (tests/unit/
test_gpu_paths.py). Each check prints PASS or FAIL with what it saw, and the exit code is the
number of failures:

- a ``WorkerPool``'s workers are forked from one process that imported torch: that process
  must never start CUDA (a child of a process that did cannot use the GPU), so every worker
  starts with CUDA uninitialised and can then use the GPU;
- one rank on NCCL in the pool: the default group pairs NCCL with gloo, a CUDA all-reduce and
  devmesh's agreements (on CPU) both work, and devmesh's FSDP with a bf16 policy equals torch's
  FSDP2 on the GPU bit for bit;
- two ranks on one GPU are refused with the error that says so, not an NCCL failure;
- ``devmesh doctor -n 1 --device cuda`` passes;
- a plain process with no launcher (a notebook) gets a one-GPU mesh.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
import traceback

os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # as the pool's zygote has it

import torch  # noqa: E402

FAILURES: list[str] = []


def check(name: str):
    def wrap(fn):
        started = time.monotonic()
        try:
            seen = fn()
            print(f"PASS  {name} ({time.monotonic() - started:.1f} s): {seen}", flush=True)
        except Exception:
            FAILURES.append(name)
            print(f"FAIL  {name} ({time.monotonic() - started:.1f} s)\n{traceback.format_exc()}",
                  flush=True)
        return fn
    return wrap


def worker_view() -> dict:
    """On a pool worker: CUDA's state at the task's start, then a product on the GPU."""
    initialised_at_start = torch.cuda.is_initialized()
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    on_gpu = (a.cuda() @ a.cuda()).cpu()
    return {"pid": os.getpid(), "parent": os.getppid(),
            "cuda_initialised_at_start": initialised_at_start,
            "gpu_matches_cpu": torch.allclose(on_gpu, a @ a, atol=1e-3, rtol=1e-3)}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 64)).cuda()


def nccl_rank(library: str) -> dict:
    """One NCCL rank: the group's backends, a CUDA all-reduce, an agreement, three bf16 FSDP
    steps (devmesh's or torch's) with fp32 reduction; the losses, to compare bit for bit."""
    import torch.distributed as dist

    from devmesh import init_device_mesh
    from devmesh.distributed.consensus import gather_texts

    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x)
    agreed = gather_texts("agreed", mesh.get_group("dp")) if library == "devmesh" else None
    model = make_model()
    if library == "devmesh":
        from devmesh.parallel import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        loss = model(torch.randn(8, 64, generator=gen).cuda()).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"backend": str(dist.get_backend()), "all_reduce": x.tolist(), "agreed": agreed,
            "param_device": str(next(model.parameters()).device), "losses": losses}


def two_ranks_on_one_gpu() -> None:
    from devmesh import init_device_mesh

    init_device_mesh("cuda", (2,))


def fork_premise() -> None:
    """The premise of the pool's zygote, without devmesh (for a torch devmesh does not
    support): after what ``_worker.prepare`` imports, with NVML answering CUDA checks, a
    forked child can use the GPU and start an NCCL group."""
    import gc

    import torch._dynamo  # noqa: F401 - what prepare() imports through _torch_compat
    import torch.distributed as dist

    torch.cuda.is_available()  # must read NVML, not start CUDA
    assert not torch.cuda.is_initialized(), "CUDA started by the imports or the check"
    gc.collect()
    gc.freeze()
    children = []
    for index in range(2):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                a = torch.randn(64, 64)
                ok = torch.allclose((a.cuda() @ a.cuda()).cpu(), a @ a, atol=1e-3, rtol=1e-3)
                store = dist.HashStore()
                dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                                        device_id=torch.device("cuda", 0))
                t = torch.full((4,), float(index + 1), device="cuda")
                dist.all_reduce(t)
                dist.destroy_process_group()
                code = 0 if ok and t.tolist() == [index + 1.0] * 4 else 3
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        children.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    assert codes == [0, 0], f"forked children exited with {codes}"
    return "2 forked children used the GPU and NCCL after the parent imported torch, dynamo"


def fork_control() -> str:
    """The same fork with CUDA's own availability check in the parent: the child must fail,
    or the premise check above proves nothing."""
    code = ("import os, torch; assert torch.cuda.is_available(); pid = os.fork()\n"
            "if pid == 0:\n"
            "    try: torch.ones(1, device='cuda'); os._exit(0)\n"
            "    except BaseException as e: print(type(e).__name__, str(e)[:200]); os._exit(1)\n"
            "print('child exit', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))")
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert "child exit 1" in done.stdout, done.stdout + done.stderr
    return done.stdout.strip().replace("\n", " | ")


def main() -> int:
    # nothing here starts CUDA in this process: the premise check forks it
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"available {torch.cuda.is_available()}, devices {torch.cuda.device_count()}",
          flush=True)
    from devmesh.errors import RankFailedError, TorchVersionError

    try:
        importlib.import_module("devmesh._torch_compat")  # raises for a torch it does not support
    except TorchVersionError as exc:
        print(f"devmesh refuses this torch ({str(exc)[:160]}...): checking only the zygote's "
              "premise", flush=True)
        check("fork after torch's import (the zygote's premise), NVML for CUDA checks")(
            fork_premise)
        check("control: without NVML's check, a child forked after is_available() cannot")(
            fork_control)
        print(f"{len(FAILURES)} failed: {FAILURES}" if FAILURES else "all passed", flush=True)
        return len(FAILURES)
    from devmesh import WorkerPool

    with WorkerPool(2) as pool:
        @check("pool workers forked after torch's import can use the GPU")
        def _():
            views = pool.run(worker_view, 2)
            zygotes = {v["parent"] for v in views}
            assert len(zygotes) == 1, f"workers have different parents: {views}"
            assert not any(v["cuda_initialised_at_start"] for v in views), views
            assert all(v["gpu_matches_cpu"] for v in views), views
            maps = open(f"/proc/{zygotes.pop()}/maps").read()
            assert "libcuda.so" not in maps, "the zygote loaded the CUDA driver"
            return views

        @check("a replaced worker (a new fork) can use the GPU too")
        def _():
            pool._replace([0, 1])
            views = pool.run(worker_view, 2)
            assert all(v["gpu_matches_cpu"] and not v["cuda_initialised_at_start"]
                       for v in views), views
            return views

        @check("one NCCL rank: gloo beside NCCL, agreement, FSDP bf16 equals torch's FSDP2")
        def _():
            ours = pool.run(nccl_rank, 1, "devmesh")[0]
            theirs = pool.run(nccl_rank, 1, "torch")[0]
            assert "nccl" in ours["backend"] and "gloo" in ours["backend"], ours
            assert ours["all_reduce"] == [1.0] * 4 and ours["agreed"] == ["agreed"], ours
            assert ours["param_device"].startswith("cuda"), ours
            assert ours["losses"] == theirs["losses"], (ours, theirs)
            return ours

        @check("two ranks on one GPU are refused by name")
        def _():
            try:
                pool.run(two_ranks_on_one_gpu, 2)
            except RankFailedError as exc:
                assert "share 1 GPU" in str(exc), exc
                return str(exc).splitlines()[0]
            raise AssertionError("two ranks on one GPU were not refused")

    @check("devmesh doctor -n 1 --device cuda")
    def _():
        done = subprocess.run([sys.executable, "-m", "devmesh", "doctor", "-n", "1",
                               "--device", "cuda"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout.strip().splitlines()[-1]

    @check("a plain process with no launcher gets a one-GPU mesh")
    def _():
        code = ("import torch; from devmesh import init_device_mesh; "
                "m = init_device_mesh('cuda', (1,)); t = torch.ones(2, device='cuda'); "
                "import torch.distributed as d; d.all_reduce(t); print(m, t.tolist())")
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=300, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout.strip()

    print(f"{len(FAILURES)} failed: {FAILURES}" if FAILURES else "all passed", flush=True)
    return len(FAILURES)


if __name__ == "__main__":
    sys.exit(main())
