"""Healing: a live replica's state sent rank to rank to the same rank of a group behind it,
over the members' process group — parameters and buffers tensor by tensor into the
receiver's own storage (a sharded parameter's local block), the optimizer's state as one
serialized message — no checkpoint read."""

from __future__ import annotations

import io

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["send_state", "receive_state"]

_TAG = 7


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    """What a replica's model holds, in a fixed order: parameters, then buffers."""
    return [_local(t) for t in (*model.parameters(), *model.buffers())]


def _optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict:
    """The optimizer's state by parameter index, sharded tensors as their local blocks."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    state = {}
    for param, values in optimizer.state.items():
        state[index[id(param)]] = {
            key: (("dtensor", _local(v).detach().clone()) if isinstance(v, DTensor)
                  else ("value", v)) for key, v in values.items()}
    groups = [{k: v for k, v in group.items() if k != "params"}
              for group in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def send_state(group, peer: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Send this replica's model and optimizer state to ``peer`` of ``group``; the bytes."""
    sent = 0
    with torch.no_grad():
        for tensor in _tensors(model):
            group.send([tensor.contiguous()], peer, _TAG).wait()
            sent += tensor.numel() * tensor.element_size()
        buffer = io.BytesIO()
        torch.save(_optimizer_state(optimizer, model), buffer)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        group.send([torch.tensor([payload.numel()], dtype=torch.int64)], peer, _TAG).wait()
        group.send([payload], peer, _TAG).wait()
    return sent + payload.numel()


def receive_state(group, peer: int, model: nn.Module,
                  optimizer: torch.optim.Optimizer) -> int:
    """Overwrite this replica's model and optimizer state with ``peer``'s; the bytes."""
    received = 0
    with torch.no_grad():
        for tensor in _tensors(model):
            block = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            group.recv([block], peer, _TAG).wait()
            tensor.copy_(block)
            received += block.numel() * block.element_size()
        size = torch.empty(1, dtype=torch.int64)
        group.recv([size], peer, _TAG).wait()
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        group.recv([payload], peer, _TAG).wait()
    # tensors and plain values only: nothing read from a peer is unpickled as code
    sent = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
    params = list(model.parameters())
    optimizer.state.clear()
    for i, values in sent["state"].items():
        param = params[i]
        optimizer.state[param] = {
            key: (DTensor.from_local(v, param.device_mesh, param.placements, run_check=False,
                                     shape=param.shape, stride=param.stride())
                  if kind == "dtensor" else v)
            for key, (kind, v) in values.items()}
    for group_settings, settings in zip(optimizer.param_groups, sent["param_groups"]):
        group_settings.update(settings)
    return received + payload.numel()
