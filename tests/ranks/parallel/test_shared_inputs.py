"""Column-sharded modules that read one input (q, k and v; gate and up) share its conversion:
its gradient is reduced once for all of them (one all-reduce, or one reduce-scatter under
sequence parallelism, whose forward gathers once), and training still equals one process.
Counted on real gloo ranks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from devmesh import init_device_mesh
from devmesh.distributed.comm import comm_stats

DIM, HEADS_DIM = 8, 12


class Attention(nn.Module):
    """Three projections of one input, then one back (``change_between``: the input changes
    in place between the second and the third, so the third reads another value)."""

    def __init__(self, change_between: bool = False) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(DIM, HEADS_DIM, dtype=torch.float64)
                                  for _ in range(3))
        self.o = nn.Linear(HEADS_DIM, DIM, dtype=torch.float64)
        self.change_between = change_between

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 1.0  # an input of this module's own, free to change
        q, k = self.q(x), self.k(x)
        if self.change_between:
            x.mul_(2.0)
        return self.o(torch.tanh(q) * k + self.v(x))


def _plan(sequence_parallel: bool):
    from devmesh.parallel import ColwiseParallel, RowwiseParallel
    from devmesh.tensor import Replicate, Shard

    have = Shard(1) if sequence_parallel else Replicate()
    colwise = ColwiseParallel(input_layouts=have)
    return {"q": colwise, "k": colwise, "v": colwise,
            "o": RowwiseParallel(output_layouts=have)}


def backward_collectives(sequence_parallel: bool):
    from devmesh.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = Attention()
    reference = copy.deepcopy(model)
    parallelize_module(model, mesh, _plan(sequence_parallel))
    x = torch.randn(2, 4, DIM, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    rank = mesh.get_rank()
    mine = x.detach().chunk(2, dim=1)[rank].requires_grad_() if sequence_parallel else x
    with comm_stats() as forward:
        y = model(mine)
    with comm_stats() as backward:
        y.square().sum().backward()
    expected = reference(x_ref)
    expected.square().sum().backward()
    full_y = expected.chunk(2, dim=1)[rank] if sequence_parallel else expected
    full_grad = x_ref.grad.chunk(2, dim=1)[rank] if sequence_parallel else x_ref.grad
    rows = model.q.weight.shape[0]
    return {"forward": forward.by_collective(), "backward": backward.by_collective(),
            "output": torch.allclose(y, full_y, atol=1e-12),
            "input_grad": torch.allclose(mine.grad, full_grad, atol=1e-12),
            "q_grad": torch.allclose(model.q.weight.grad,
                                     reference.q.weight.grad[rank * rows:(rank + 1) * rows],
                                     atol=1e-12)}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated", "sequence"])
def test_modules_reading_one_input_reduce_its_gradient_once(mesh_pool, sequence_parallel):
    """Before, each of q, k and v reduced the input's gradient on its own: three all-reduces
    (three reduce-scatters, after three all-gathers in forward)."""
    for r in mesh_pool.run(backward_collectives, 2, sequence_parallel):
        assert r["output"] and r["input_grad"] and r["q_grad"], r
        if sequence_parallel:
            assert r["forward"]["all_gather"][0] == 1, r  # the input, once for q, k and v
            assert r["backward"]["reduce_scatter"][0] == 1, r
            # and o's bias, replicated, sums its gradient over the sequence's blocks
            assert r["backward"]["all_reduce"] == (1, DIM * 8), r
        else:
            assert r["backward"]["all_reduce"][0] == 1, r


def forward_changed_in_place(inference: bool = False):
    from devmesh.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = Attention(change_between=True)
    reference = copy.deepcopy(model)
    parallelize_module(model, mesh, _plan(sequence_parallel=True))
    x = torch.randn(2, 4, DIM, dtype=torch.float64)
    rank = mesh.get_rank()
    mode = torch.inference_mode() if inference else torch.no_grad()
    with mode, comm_stats() as forward:
        y = model(x.chunk(2, dim=1)[rank])
    with torch.no_grad():
        expected = reference(x).chunk(2, dim=1)[rank]
    return forward.by_collective(), torch.allclose(y, expected, atol=1e-12)


def test_an_input_changed_in_place_between_its_readers_is_gathered_again(mesh_pool):
    """(Outside autograd: with gradients, autograd itself refuses a change to an input its
    conversion returned a view of.)"""
    for forward, right in mesh_pool.run(forward_changed_in_place, 2):
        assert right
        # q and k share one gather; v gathers the changed input again
        assert forward["all_gather"][0] == 2, forward


def llama_tp_collectives():
    import transformers as T

    from devmesh.parallel import parallelize

    T.logging.set_verbosity_error()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=64)
    model = parallelize(T.LlamaForCausalLM(config), mesh)
    ids = torch.randint(0, 64, (2, 12))
    with comm_stats() as forward:
        loss = model(input_ids=ids, labels=ids).loss
    with comm_stats() as backward:
        loss.backward()
    return forward.by_collective(), backward.by_collective(), config.num_hidden_layers


def test_a_transformers_llama_under_its_tp_plan_reduces_two_gradients_a_layer(mesh_pool):
    """transformers' plan splits q, k, v, gate and up column-wise, each reading its block's
    input: backward reduces that input's gradient twice a layer (attention's, the MLP's), plus
    the head's input once; forward, the rows-split o and down, and the embedding (before:
    five a layer in backward)."""
    pytest.importorskip("transformers")
    for forward, backward, layers in mesh_pool.run(llama_tp_collectives, 2):
        assert backward["all_reduce"][0] == 2 * layers + 1, backward
        assert forward["all_reduce"][0] == 2 * layers + 1, forward


def test_an_inference_tensor_is_gathered_for_each_reader(mesh_pool):
    """An inference tensor keeps no version, so a change cannot be seen: each module gathers
    it (before, asking its version raised under ``torch.inference_mode()``)."""
    for forward, right in mesh_pool.run(forward_changed_in_place, 2, True):
        assert right
        assert forward["all_gather"][0] == 3, forward
