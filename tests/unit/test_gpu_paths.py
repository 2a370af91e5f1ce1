"""What a GPU mesh relies on, checked where CI runs (no GPU): the default group devmesh starts
on GPUs takes CPU tensors too, and devmesh's small agreement tensors and pipeline buffers go
where the group's backend accepts them. NCCL itself has not run these paths (no GPU was lent
to the sessions that wrote them); these tests pin the choices that make them possible."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from devmesh.distributed import comm, env


@pytest.fixture
def no_launcher(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                 "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_a_gpu_world_pairs_nccl_with_gloo_for_cpu_tensors(monkeypatch, no_launcher):
    started = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: started.update(kwargs))
    monkeypatch.setattr(env, "check_device", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)

    env.ensure_default_group("cuda", expected_world_size=1)
    assert started["backend"] == "cpu:gloo,cuda:nccl"
    env.ensure_default_group("cpu", expected_world_size=1)
    assert started["backend"] == "gloo"


@pytest.mark.parametrize("device_types, expected", [
    (["cpu"], torch.device("cpu")),
    (["cuda", "cpu"], torch.device("cpu")),        # gloo beside NCCL: CPU flags stay home
    (["cuda"], torch.device("cuda", 3)),           # a user's NCCL-only group
])
def test_agreement_tensors_go_where_the_group_takes_them(monkeypatch, device_types, expected):
    monkeypatch.setattr(torch, "get_device_module",
                        lambda kind: SimpleNamespace(current_device=lambda: 3))
    group = SimpleNamespace(_device_types=[torch.device(t) for t in device_types])
    assert comm.small_tensor_device(group) == expected


def test_pipeline_buffers_live_on_the_mesh_device(monkeypatch):
    monkeypatch.setattr(torch, "get_device_module",
                        lambda kind: SimpleNamespace(current_device=lambda: 1))
    assert comm.mesh_device(SimpleNamespace(device_type="cpu")) == torch.device("cpu")
    assert comm.mesh_device(SimpleNamespace(device_type="cuda")) == torch.device("cuda", 1)
