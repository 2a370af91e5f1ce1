"""Modules devmesh did not write, as other libraries write them (issue 67, item 1): a style
keeps a subclass's own forward (Gemma's scaled embedding) or refuses it by name; only one side
of a tied embedding and head split is refused by name; a full state dict has exactly the keys
``nn.Module.state_dict()`` has (no non-persistent buffers, ``_extra_state``, state-dict
hooks) and loads back; FSDP composes with tensor parallelism placed on an equal mesh from a
second ``init_device_mesh`` call (what ``from_pretrained`` makes). Each against one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from devmesh import init_device_mesh
from devmesh.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    fully_shard,
    load_state_dict,
    parallelize_module,
    state_dict,
)
from devmesh.tensor import Replicate
from helpers import caught


class ScaledEmbedding(nn.Embedding):
    """Gemma's word embedding: the table's rows times a constant buffer."""

    def __init__(self, *args, scale: float = 8.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("embed_scale", torch.tensor(scale, dtype=torch.float64),
                             persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)


def _ids() -> torch.Tensor:
    return torch.tensor([[0, 3, 7, 9, 2], [9, 9, 1, 5, 4]])


def scaled_embedding_trains_as_one_process(padding_idx, scale_grad_by_freq, by_keyword):
    torch.manual_seed(0)
    ref = ScaledEmbedding(10, 4, padding_idx=padding_idx,
                          scale_grad_by_freq=scale_grad_by_freq).double()
    emb = ScaledEmbedding(10, 4, padding_idx=padding_idx,
                          scale_grad_by_freq=scale_grad_by_freq).double()
    emb.load_state_dict(ref.state_dict())
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    parallelize_module(emb, mesh, RowwiseParallel(input_layouts=Replicate()))
    ids = _ids()
    out = emb(input_ids=ids) if by_keyword else emb(ids)
    want = ref(ids)
    (out * torch.arange(4.0, dtype=torch.float64)).sum().backward()
    (want * torch.arange(4.0, dtype=torch.float64)).sum().backward()
    start = 5 * mesh.get_local_rank()
    return ((out - want).abs().max().item(),
            (emb.weight.grad - ref.weight.grad[start:start + 5]).abs().max().item(),
            emb.padding_idx == padding_idx, isinstance(emb.weight, nn.Parameter))


@pytest.mark.parametrize("padding_idx, scale_grad_by_freq, by_keyword",
                         [(None, False, False), (9, True, True), (3, False, False)])
def test_a_subclass_forward_runs_under_rowwise_parallel(mesh_pool, padding_idx,
                                                        scale_grad_by_freq, by_keyword):
    for out, grad, padding_kept, weight_restored in mesh_pool.run(
            scaled_embedding_trains_as_one_process, 2, padding_idx, scale_grad_by_freq,
            by_keyword):
        assert out <= 1e-14 and grad <= 1e-14
        assert padding_kept and weight_restored


def hook_sees_the_reduced_output():
    torch.manual_seed(0)
    emb = ScaledEmbedding(10, 4).double()
    want = emb(_ids())
    seen = []
    emb.register_forward_hook(lambda module, args, y: seen.append(y.detach().clone()))
    parallelize_module(emb, init_device_mesh("cpu", (2,)), RowwiseParallel(
        input_layouts=Replicate()))
    emb(_ids())
    return (seen[-1] - want).abs().max().item()


def test_a_hook_registered_before_rowwise_parallel_sees_the_whole_output(mesh_pool):
    assert all(d <= 1e-14 for d in mesh_pool.run(hook_sees_the_reduced_output, 2))


class Doubled(nn.Linear):
    def forward(self, x):
        return torch.tanh(super().forward(x))


class EmbeddingWithBias(nn.Embedding):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.shift = nn.Parameter(torch.zeros(self.embedding_dim))

    def forward(self, ids):
        return super().forward(ids) + self.shift


def subclass_refused(which: str):
    mesh = init_device_mesh("cpu", (2,))
    module = Doubled(4, 4) if which == "linear" else EmbeddingWithBias(8, 4)
    before = module.weight
    error = caught(lambda: parallelize_module(module, mesh, RowwiseParallel()))
    return error, module.weight is before


@pytest.mark.parametrize("which, says", [("linear", "overrides nn.Linear.forward"),
                                         ("embedding", "holds parameters ['shift']")])
def test_a_subclass_rowwise_cannot_wrap_is_refused_by_name(mesh_pool, which, says):
    for error, untouched in mesh_pool.run(subclass_refused, 2, which):
        assert error is not None and error[0] == "ParallelizeError"
        assert says in error[1] and "RowwiseParallel" in error[1]
        assert untouched


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(8, 4).double()
        self.head = nn.Linear(4, 8, bias=False).double()
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids))


def one_side_of_a_tie(split_head_later: bool):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ref, model = TiedLM(), TiedLM()
    parallelize_module(model, mesh, {"embed": RowwiseParallel(input_layouts=Replicate())})
    if split_head_later:  # torch's plans split the head in a call of its own
        parallelize_module(model, mesh, {"head": ColwiseParallel(
            output_layouts=Replicate())})
    ids = torch.arange(8).reshape(2, 4)
    error = caught(lambda: model(ids))
    if error is not None:
        return error
    return (model(ids) - ref(ids)).abs().max().item()


def test_splitting_one_side_of_a_tied_pair_is_refused_naming_the_tie(mesh_pool):
    for error in mesh_pool.run(one_side_of_a_tie, 2, False):
        assert error[0] == "ParallelizeError"
        assert "tied to embed.weight, which RowwiseParallel split" in error[1]
    assert all(d <= 1e-14 for d in mesh_pool.run(one_side_of_a_tie, 2, True))


class WithState(nn.Module):
    """Llama's rotary buffers (not saved), a saved buffer and an extra state."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(4, 8).double()
        self.down = nn.Linear(8, 4).double()
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)
        self.register_buffer("steps", torch.zeros(()))
        self.counter = 0

    def get_extra_state(self):
        return {"counter": self.counter}

    def set_extra_state(self, state):
        self.counter = state["counter"]

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) * self.inv_freq


def full_state_dict_keys(sharded: bool):
    model = WithState()
    model.counter = 7
    want = model.state_dict()
    if sharded:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(),
                                               "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    full = state_dict(model, full=True)
    plain = WithState()
    plain.load_state_dict(full)  # strict: nn.Module's own
    back = WithState()
    if sharded:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        fully_shard(back, mesh=mesh["dp"])
    back.counter = 0
    load_state_dict(back, full)
    equal = all(torch.equal(full[k], want[k]) for k in want if isinstance(want[k], torch.Tensor))
    return list(full), list(want), equal, plain.counter, back.counter


@pytest.mark.parametrize("sharded", [False, True])
def test_a_full_state_dict_has_the_keys_nn_module_gives(mesh_pool, sharded):
    for got, want, equal, plain_counter, back_counter in mesh_pool.run(
            full_state_dict_keys, 4, sharded):
        assert got == want and "inv_freq" not in got and "_extra_state" in got
        assert equal and plain_counter == 7 and back_counter == 7


def fsdp_over_tp_on_an_equal_mesh():
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).double()

    ref, model = make(), make()
    first = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    second = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # from_pretrained's
    torch_parallelize(model, second["tp"], {"0": TorchColwise(), "2": TorchRowwise()})
    fully_shard(model, mesh=first["dp"])
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (ref, model)]
    dp = first.get_coordinate()[0]
    for step in range(3):
        x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        ref(x).pow(2).mean().backward()
        model(x[2 * dp: 2 * dp + 2]).pow(2).mean().backward()  # FSDP averages over dp
        for opt in opts:
            opt.step()
            opt.zero_grad()
    full = state_dict(model, full=True)
    return max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())


def test_fsdp_composes_with_tp_on_an_equal_mesh_of_another_call(mesh_pool):
    assert all(d <= 1e-13 for d in mesh_pool.run(fsdp_over_tp_on_an_equal_mesh, 4))
