"""Expert parallelism for experts modules as transformers and torchtitan write them: one
module holding every expert's weights stacked along dim 0 (Mixtral's ``gate_up_proj
(experts, 2·hidden, dim)`` and ``down_proj (experts, dim, hidden)``, Qwen-MoE's, gpt-oss's
with biases; torchtitan's ``GroupedExperts`` ``w1``, ``w2``, ``w3``), called after the
block's own router in one of two ways:

* transformers': ``experts(hidden_states, top_k_index, top_k_weights)``, each token with its
  experts and their weights (the module weighs and sums);
* torchtitan's: ``experts(x, num_tokens_per_expert)``, the routed tokens already sorted by
  expert with each expert's count (the caller weighs and puts them back).

The module's own computation is kept, whatever its MLP (SwiGLU, GELU, biases, packed or not,
eager or grouped kernels): only its weights are split — each parameter's dim 0 over ``ep``,
``num_experts`` set to the local count — and its call is wrapped. The wrapper sorts this
rank's ``(token, expert)`` assignments by expert, sends each token to the rank holding its
expert (:class:`~.dispatch.ExpertParallelDispatch`'s all-to-alls), runs the module's own
forward there on the arriving tokens with their local expert index and weight one, sends the
outputs back, and weighs and sums them per token, as the module itself does.

A module called torchtitan's way gets the same exchange without the sorting and weighing:
its sorted tokens go to their experts' ranks, its own forward runs there on the arriving
tokens with this rank's counts, and the outputs come back in the order they were given.

The ranks of ``ep`` are data-parallel ranks too, so the experts' gradients, summed over every
rank's tokens by the dispatch, are divided by ``ep`` (as data parallelism averages the other
parameters'): the local run's input gradient is scaled by ``ep`` and its output gradient by
``1/ep``, which scales the weights' gradients alone and leaves the tokens' as they were.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from devmesh.errors import ParallelizeError
from devmesh.mesh import DeviceMesh
from devmesh.parallel.expert_parallel.dispatch import ExpertParallelDispatch, expert_counts
from devmesh.parallel.expert_parallel.moe import _ScaleGradient
from devmesh.layout.spec import chunk_bounds
from devmesh.parallel.param import (ParamLayout, combined_mesh, get_layout, is_dtensor,
                                    sharded_parameter, with_methods)
from devmesh.parallel.placement import place_parameter
from devmesh.tensor import Shard, ShardingSpec, distribute_tensor

__all__ = ["is_stacked_experts", "is_unroutable_experts", "split_stacked_experts",
           "split_by_expert", "ExpertParallelExperts", "ExpertParallelSortedExperts"]

# transformers' call, each token's experts and their weights after the tokens, under the
# names most models give them or gpt-oss's
_CALLS = (("top_k_index", "top_k_weights"), ("router_indices", "routing_weights"))
_SORTED_CALL = ("num_tokens_per_expert",)  # torchtitan's


def _forward_takes(module: nn.Module, names: tuple[str, ...]) -> bool:
    try:
        taken = list(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return False
    return all(name in taken for name in names)


def _takes_routed_tokens(module: nn.Module) -> bool:
    return any(_forward_takes(module, names) for names in _CALLS)


def takes_sorted_tokens(module: nn.Module) -> bool:
    """Whether an experts module is called torchtitan's way, ``(x, num_tokens_per_expert)``."""
    return _forward_takes(module, _SORTED_CALL) and not _takes_routed_tokens(module)


def is_stacked_experts(module: nn.Module) -> bool:
    """An experts module expert parallelism can split as it is: an int ``num_experts``, its
    own parameters all stacked along dim 0 by expert, and a forward called transformers'
    way ``(hidden_states, top_k_index, top_k_weights)`` or torchtitan's
    ``(x, num_tokens_per_expert)``."""
    return _stacked(module) and (_takes_routed_tokens(module) or takes_sorted_tokens(module))


def is_unroutable_experts(module: nn.Module) -> bool:
    """An experts module with its weights stacked by expert but called some other way
    (Llama 4's: every token through every expert, ``forward(hidden_states)``): expert
    parallelism has no tokens per expert to send."""
    return _stacked(module) and not is_stacked_experts(module)


def _stacked(module: nn.Module) -> bool:
    experts = getattr(module, "num_experts", None)
    params = list(module._parameters.values())
    if not isinstance(experts, int) or not params:
        return False
    return all(p is not None and p.dim() >= 1 and p.shape[0] == experts for p in params)


class ExpertParallelExperts:
    """What expert parallelism adds to a stacked experts module's class (see the module's
    docstring); its own forward runs the local experts."""

    _devmesh_prefix = "ExpertParallel"
    expert_dispatch: ExpertParallelDispatch
    global_num_experts: int  #: the experts of the whole layer

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        tokens, k = top_k_index.shape
        expert = top_k_index.reshape(-1)
        order = torch.argsort(expert, stable=True)  # by expert, then token order
        token = torch.arange(tokens, device=expert.device).repeat_interleave(k)[order]
        weight, expert = top_k_weights.reshape(-1)[order], expert[order]
        per_expert = expert_counts(expert, self.global_num_experts)
        ep = self.expert_dispatch.mesh.size()

        def local(arriving: torch.Tensor, counts: list[int]) -> torch.Tensor:
            index = torch.repeat_interleave(
                torch.arange(len(counts), device=arriving.device),
                torch.tensor(counts, device=arriving.device),
                output_size=sum(counts))[:, None]  # known: a meta tensor's too (a dry run)
            ones = torch.ones(index.shape, dtype=top_k_weights.dtype, device=arriving.device)
            scaled = _ScaleGradient.apply(arriving, float(ep))
            out = super(ExpertParallelExperts, self).forward(  # type: ignore[misc]
                scaled, index, ones, *args, **kwargs)
            return _ScaleGradient.apply(out, 1.0 / ep)

        out = self.expert_dispatch.run(hidden_states[token], per_expert, local)
        weighted = out * weight[:, None].to(out.dtype)
        return torch.zeros_like(hidden_states).index_add_(0, token,
                                                          weighted.to(hidden_states.dtype))


class ExpertParallelSortedExperts(ExpertParallelExperts):
    """What expert parallelism adds to an experts module called torchtitan's way: the
    tokens, sorted by expert, to their experts' ranks and back in the same order."""

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor, *args,
                **kwargs) -> torch.Tensor:
        counts = num_tokens_per_expert
        if counts.is_meta:  # a dry run: balanced routing
            per_expert = expert_counts(counts.new_empty(x.shape[0], dtype=torch.long),
                                       self.global_num_experts)
        else:
            per_expert = [int(n) for n in counts.tolist()]
        ep = self.expert_dispatch.mesh.size()

        def local(arriving: torch.Tensor, local_counts: list[int]) -> torch.Tensor:
            scaled = _ScaleGradient.apply(arriving, float(ep))
            out = super(ExpertParallelExperts, self).forward(  # type: ignore[misc]
                scaled, torch.tensor(local_counts, dtype=counts.dtype, device=counts.device),
                *args, **kwargs)
            return _ScaleGradient.apply(out, 1.0 / ep)

        return self.expert_dispatch.run(x, per_expert, local)


def split_by_expert(module: nn.Module, names: list[str], mesh: DeviceMesh) -> None:
    """Replace ``module``'s parameters ``names`` (experts along dim 0) by this rank's
    contiguous block of experts over the 1-D ``mesh``: ``experts / ep`` of them, in order.
    Every expert already split over tensor parallelism (:class:`~devmesh.parallel.
    ExpertsTensorParallel`, torchtitan's expert tensor parallelism) keeps its split, the
    experts' dim split over ``ep`` around it. A parameter whose experts' dim is already
    distributed (expert_parallel or fully_shard ran first), or a torch DTensor, is refused:
    splitting it again would silently hand each rank a fraction of its own experts."""
    for name in names:
        param = module._parameters[name]
        layout = get_layout(param)
        if is_dtensor(param) or (layout is not None and (
                layout.spec.dim_map[0] or layout.shape == () or layout.packed is not None
                and layout.packed[0] == 0)):
            raise ParallelizeError(
                f"expert_parallel: {type(module).__name__}.{name} is already distributed "
                f"along its experts (expert_parallel, fully_shard or torch's tensor "
                f"parallelism ran on it first); apply expert_parallel once, after devmesh's "
                f"tensor parallelism if any, before FSDP")
    for name in names:
        param = module._parameters[name]
        layout = get_layout(param)
        if layout is not None:  # split over tp already: ep splits the experts around it
            place_parameter(module, name, _nested_by_expert(param, layout, mesh))
            continue
        split = distribute_tensor(param.detach(), mesh, [Shard(0)])
        place_parameter(module, name, sharded_parameter(
            split.to_local().contiguous(), param.requires_grad, mesh, split.spec))


def _nested_by_expert(param: torch.Tensor, layout: ParamLayout, mesh: DeviceMesh
                      ) -> nn.Parameter:
    """``param`` (this rank's tensor-parallel block) cut to this rank's experts over the 1-D
    ``mesh``, laid out on the mesh spanning both: the experts' dim split over ``ep``."""
    both = combined_mesh(layout.mesh, mesh)
    index = {n: i for i, n in enumerate(both.mesh_dim_names)}
    old = layout.mesh.mesh_dim_names
    dim_map = [tuple(index[old[m]] for m in dims) for dims in layout.spec.dim_map]
    dim_map[0] = (index[mesh.mesh_dim_names[0]],)
    spec = ShardingSpec(both.shape, layout.spec.global_shape, tuple(dim_map),
                        mesh_dim_names=both.mesh_dim_names)
    start, size = chunk_bounds(layout.spec.global_shape[0], mesh.size(), mesh.get_local_rank())
    local = param.detach().narrow(0, start, size).clone()
    return sharded_parameter(local, param.requires_grad, both, spec, shape=layout.shape)


def split_stacked_experts(experts: nn.Module, mesh: DeviceMesh, data_mesh: DeviceMesh
                          ) -> nn.Module:
    """Split ``experts``' stacked parameters over the 1-D ``mesh`` and wrap its call (in
    place; returns it)."""
    if isinstance(experts, ExpertParallelExperts):
        raise ParallelizeError(
            f"expert_parallel: {type(experts).__name__} is already split over an ep mesh "
            f"({experts.global_num_experts} experts, {experts.num_experts} on this rank); "
            f"call expert_parallel once per experts module")
    total, ep = experts.num_experts, mesh.size()
    if total % ep:
        raise ParallelizeError(
            f"expert_parallel: {total} experts of {type(experts).__name__} do not split "
            f"evenly over ep = {ep}: use an ep size dividing {total}")
    split_by_expert(experts, list(experts._parameters), mesh)
    experts.num_experts = total // ep
    experts.global_num_experts = total
    experts.expert_dispatch = ExpertParallelDispatch(mesh, data_mesh)
    with_methods(experts, ExpertParallelSortedExperts if takes_sorted_tokens(experts)
                 else ExpertParallelExperts)
    return experts
