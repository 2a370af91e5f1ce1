"""``parallelize(model, mesh)``: every parallelism a mesh's dim names ask for, applied to a
model in torchtitan's order — tensor parallelism over ``tp`` (the model's own plan, for a
transformers model; torchtitan's, for a torchtitan Llama 3 or Qwen3), expert parallelism
over ``ep``, activation checkpointing of its blocks, then FSDP over the sharded
data-parallel dim (HSDP with a replicate dim beside it) or DDP over replicate dims alone.

Dim names, as torchtitan's ``ParallelDims`` and devmesh's docs write them:

* ``tp``: tensor parallelism;
* ``ep``: expert parallelism — each experts module (transformers' stacked experts, a devmesh
  ``MoE``) split over it; its ranks are data-parallel ranks too, as torchtitan borrows
  ``ep`` from the data dims: the experts are then sharded over the shard dim alone, every
  other parameter over the shard dim and ``ep`` together (DDP over ``ep`` without a shard
  dim); the experts are left out of the tensor-parallel plan (each expert whole on its
  rank), or with ``experts_over_tp=True`` split over ``tp`` as well;
* ``cp``: context parallelism — the model's ``scaled_dot_product_attention`` calls attend
  over the whole sequence while each rank holds a part of it (feed each rank
  :func:`~devmesh.integrations.transformers.context_parallel_batch`'s share); its ranks
  are data-parallel ranks for the parameters, as ``ep``'s (not both at once): FSDP over
  the shard dim and ``cp``, DDP over the replicate dim and ``cp``, or, with no
  data-parallel dim, FSDP over ``cp`` alone (torchtitan's FSDP over ``dp_shard x cp``);
* ``dp_shard``, ``shard``, ``dp``, ``fsdp``: FSDP's shard dim;
* ``dp_replicate``, ``replicate``: replicas (HSDP with a shard dim, else DDP).

* ``pp``: pipeline stages — a transformers model split by its declared plan
  (:mod:`.pipeline_stages`: the embedding on the first stage, the decoder layers in even runs,
  the final norm and head on the last), each stage parallelized as above on the other dims,
  run by a :class:`~devmesh.parallel.pipeline.PipelineRunner` with the given schedule, which
  ``parallelize`` returns instead of the model.

A dim name it does not know is refused by name, listing those it reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from devmesh.distributed import comm
from devmesh.errors import ParallelizeError
from devmesh.mesh import DeviceMesh
from devmesh.integrations import torchtitan as titan
from devmesh.integrations import transformers as hf
from devmesh.integrations.pipeline_stages import REMOVED, transformers_stages
from devmesh.integrations.pretrained import SavesWhole
from devmesh.layout.data_parallel import (cp_beside_one_data_dim, cp_shards_parameters,
                                          flattened_name)
from devmesh.layout.schedule import Schedule, build_schedule
from devmesh.parallel.activation_checkpointing import MODES, check_mode, checkpoint_blocks
from devmesh.parallel.compute_dtype import compute_in
from devmesh.parallel.context_parallel import context_parallel
from devmesh.parallel.expert_parallel import MoE, expert_parallel
from devmesh.parallel.expert_parallel.stacked import is_stacked_experts, is_unroutable_experts
from devmesh.parallel.fsdp import MixedPrecisionPolicy, batched_checks, fully_shard
from devmesh.parallel.param import with_methods
from devmesh.parallel.pipeline import PipelineRunner
from devmesh.parallel.replicate import replicate
from devmesh.parallel.tensor_parallel import ParallelStyle, parallelize_module

__all__ = ["parallelize", "SHARD_DIMS", "REPLICATE_DIMS", "CHECKPOINTING"]

SHARD_DIMS = ("dp_shard", "shard", "dp", "fsdp")
REPLICATE_DIMS = ("dp_replicate", "replicate")
CHECKPOINTING = MODES


def parallelize(model: nn.Module, mesh: DeviceMesh, *,
                tp_plan: Mapping[str, ParallelStyle] | None = None,
                blocks: Sequence[nn.Module] | None = None,
                activation_checkpointing: str | int = "none",
                mp_policy: MixedPrecisionPolicy | None = None,
                reshard_after_forward: bool | None = None,
                experts_over_tp: bool = False,
                schedule: str | Schedule = "1f1b", microbatches: int | None = None,
                loss_fn: Callable[..., torch.Tensor] | None = None
                ) -> nn.Module | PipelineRunner:
    """Apply to ``model`` what ``mesh``'s dim names ask for (see the module's docstring),
    in torchtitan's order, and return it — or, when the mesh has ``pp``, the
    :class:`~devmesh.parallel.pipeline.PipelineRunner` of this rank's stages.

    ``tp_plan``: module name -> devmesh style (default: a transformers model's own
    ``_tp_plan``, translated; devmesh's plan for an architecture whose own leaves its
    blocks whole, GPT-2's and gpt-oss's: :mod:`devmesh.integrations.transformers_plans`;
    torchtitan's plan for a torchtitan Llama 3 or Qwen3:
    :mod:`devmesh.integrations.torchtitan`). ``blocks``: the repeated blocks, each an FSDP
    unit and a checkpointed region (default: a transformers model's ``_no_split_modules``
    instances, a torchtitan model's ``layers``). ``activation_checkpointing``: ``"none"``;
    ``"full"`` (every block recomputed in backward); ``"selective"`` (every block, saving
    the outputs of its matmuls and attention and recomputing the rest, as torchtitan's
    per-op mode); or an int ``k``: every k-th block
    in full. ``mp_policy``: compute in its ``param_dtype`` over parameters kept in their own
    dtype, under FSDP (``fully_shard``'s), DDP (``replicate``'s) or tensor parallelism
    alone; ``reshard_after_forward``: as ``fully_shard``'s. ``experts_over_tp``: with both
    ``ep`` and ``tp``, every expert split over ``tp`` too, as the model's plan splits it
    without ``ep`` (torchtitan's expert tensor parallelism): each rank holds its experts'
    ``1/tp`` of features; by default the experts are split over ``ep`` alone, each whole.

    With ``pp``: ``schedule`` (a name of :data:`~devmesh.parallel.pipeline.SCHEDULES`, or a
    :class:`~devmesh.parallel.pipeline.Schedule`) over ``microbatches`` (default: the
    ``pp`` size); ``loss_fn(logits, targets)`` (default: the model's own causal LM loss,
    its ``loss_function``, the mean over a micro-batch's targets). Train with
    ``runner.step(input_ids, targets=labels)`` and an optimizer over
    ``runner.module.parameters()``. The model passed in becomes one of this rank's stages,
    the other stages' parts removed from it: use ``runner.module`` from then on.
    """
    names = tuple(mesh.mesh_dim_names or ())
    if not names:
        raise ParallelizeError("parallelize reads the mesh's dim names: build it with "
                               "mesh_dim_names, e.g. ('dp_shard', 'tp')")
    _refuse_unknown_dims(names)
    check_mode(activation_checkpointing)
    if experts_over_tp and not {"ep", "tp"} <= set(names):
        raise ParallelizeError(
            f"experts_over_tp=True splits the experts over both 'ep' and 'tp', but the mesh "
            f"has {names}: add both dims, or leave experts_over_tp out (without 'ep' the "
            "model's plan splits every expert over 'tp' already)")
    options = {"tp_plan": tp_plan, "activation_checkpointing": activation_checkpointing,
               "mp_policy": mp_policy, "reshard_after_forward": reshard_after_forward,
               "experts_over_tp": experts_over_tp}
    if "pp" in names:
        if blocks is not None:
            raise ParallelizeError(
                "parallelize with 'pp' takes each stage's blocks from the model's own "
                "_no_split_modules: leave blocks= out")
        return _pipelined(model, mesh, schedule, microbatches, loss_fn, options)
    return _parallelize_on(model, mesh, names, blocks, **options)


def _pipelined(model: nn.Module, mesh: DeviceMesh, schedule: str | Schedule,
               microbatches: int | None, loss_fn: Callable[..., torch.Tensor] | None,
               options: dict) -> PipelineRunner:
    """This rank's stages of ``model``, each parallelized on the mesh's other dims, and the
    runner that plays ``schedule`` over them."""
    names = tuple(mesh.mesh_dim_names or ())
    pp = mesh["pp"]
    if isinstance(schedule, str):
        schedule = build_schedule(schedule, pp.size(), microbatches or pp.size())
    elif microbatches is not None and microbatches != schedule.microbatches:
        raise ParallelizeError(
            f"the schedule given plays {schedule.microbatches} micro-batches, microbatches="
            f"{microbatches}: leave microbatches= out with a Schedule, or give the name")
    if options["activation_checkpointing"] == "selective" and schedule.splits_backward:
        raise ParallelizeError(
            f"the schedule {schedule.name!r} splits each backward in two (input gradients, "
            "then weight gradients), and torch's selective checkpointing allows one backward "
            "through a region: use activation_checkpointing='full' (or an int) with it, or "
            "a schedule without split backwards (1f1b, interleaved-1f1b, gpipe)")
    index = pp.get_local_rank()
    mine = [s for s in range(schedule.stages) if schedule.rank_of(s) == index]
    others = tuple(n for n in names if n != "pp")
    # the model's experts, which some stage holds (refused here if none): a stage without
    # any (DeepSeek's dense first layers) is data-parallel over ep
    _experts(model, others, [n for n in others if n in REPLICATE_DIMS])
    stages = transformers_stages(model, schedule.stages, mine)
    if loss_fn is None:
        loss_fn = _causal_lm_loss(model)
    if others or options["mp_policy"] is not None or \
            options["activation_checkpointing"] != "none":
        inner = mesh[others] if others else None
        for s, stage in stages.items():
            _parallelize_on(stage, inner, others, None, **options, a_stage=True)
    return PipelineRunner(stages, mesh, schedule, loss_fn)


def _causal_lm_loss(model: nn.Module) -> Callable[..., torch.Tensor]:
    """The model's own loss of logits against unshifted targets (transformers'
    ``loss_function``: shifted, float32, the mean over the targets not ignored)."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is None or not hasattr(model, "loss_function"):
        raise ParallelizeError(
            f"{type(model).__name__} has no causal LM loss (a transformers model's "
            "loss_function and config.vocab_size): pass loss_fn=(logits, targets) -> loss")
    function = model.loss_function

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return function(logits, targets, vocab_size=vocab)

    return loss


def _parallelize_on(model: nn.Module, mesh: DeviceMesh | None, names: tuple[str, ...],
                    blocks: Sequence[nn.Module] | None, *,
                    tp_plan: Mapping[str, ParallelStyle] | None,
                    activation_checkpointing: str | int,
                    mp_policy: MixedPrecisionPolicy | None,
                    reshard_after_forward: bool | None,
                    experts_over_tp: bool = False, a_stage: bool = False) -> nn.Module:
    """``parallelize`` without ``pp``, on ``mesh`` whose dims are ``names`` (``None`` and no
    names: activation checkpointing and compute dtype alone); ``a_stage``: ``model`` is a
    pipeline stage, which may hold none of the model's experts."""
    shard = [n for n in names if n in SHARD_DIMS]
    replicas = [n for n in names if n in REPLICATE_DIMS]
    if len(shard) > 1 or len(replicas) > 1:
        raise ParallelizeError(
            f"the mesh {names} names several data-parallel dims of one kind "
            f"({shard or replicas}): give one shard dim and at most one replicate dim "
            "(build the mesh with one of each, e.g. ('dp_replicate', 'dp_shard', 'tp'))")
    experts = _experts(model, names, replicas, none_here=a_stage)
    borrowed = "ep" if "ep" in names else "cp" if "cp" in names else None
    if "cp" in names:
        _check_context_parallel(model, names, shard, replicas)
    if blocks is None:
        blocks = (hf.blocks_of(model) if hf.is_transformers_model(model)
                  else titan.blocks_of(model) if titan.is_torchtitan_model(model) else [])
    blocks = _untied(model, list(blocks))
    if "tp" in names:
        _tensor_parallel(model, mesh["tp"], tp_plan,  # type: ignore[index]
                         [] if experts_over_tp else experts)
    if experts:
        data = mesh[(shard[0], "ep")] if shard else mesh["ep"]
        for layer in experts:
            expert_parallel(layer, mesh["ep"], data_mesh=data)
    if "cp" in names:  # on each block: a checkpointed block's recompute routes it again
        windowed = hf.is_transformers_model(model)
        for part in blocks or [model]:
            # a sliding or chunked layer attends within its window over the whole sequence
            window, chunk = hf.attention_window(part) if windowed else (None, None)
            context_parallel(part, mesh["cp"], sliding_window=window, chunk_size=chunk)
    blocks = _checkpoint(model, blocks, activation_checkpointing)
    # the ranks of ep and cp hold their own tokens: data-parallel ranks for the parameters
    data_dims = [*(replicas or shard), *([borrowed] if borrowed else [])]
    data_mesh = (mesh[tuple(data_dims)]._flatten(flattened_name(data_dims)) if len(data_dims) > 1
                 else mesh[data_dims[0]] if data_dims else None)
    # cp alone shards the parameters over its ranks (torchtitan's FSDP over dp_shard x cp)
    over_cp = borrowed == "cp" and cp_shards_parameters(bool(replicas), bool(shard))
    if shard or over_cp:
        shard_kwargs = {"mp_policy": mp_policy or MixedPrecisionPolicy(),
                        "reshard_after_forward": reshard_after_forward}
        dp_mesh = mesh[tuple(replicas + shard)] if replicas else data_mesh
        meshes = [mesh[shard[0]]] if experts else []
        for one in [*meshes, dp_mesh]:  # the units' groups, made by every rank before
            comm.process_group(one, range(one.ndim))
        with batched_checks():  # the calls' checks in two collectives, not one per call
            # the experts over the shard dim; the rest over the shard dim and ep
            for layer in experts:
                fully_shard(_split_part(layer), mesh=meshes[0], **shard_kwargs)
            for block in blocks:
                fully_shard(block, mesh=dp_mesh, **shard_kwargs)
            fully_shard(model, mesh=dp_mesh, **shard_kwargs)
    elif data_mesh is not None:
        # a transformers model's buffers are constants (rotary tables, embedding scales),
        # equal after replicate's first broadcast; broadcast again in place before each
        # forward, they would change under a pipeline's earlier micro-batches' graphs
        replicate(model, mesh=data_mesh, mp_policy=mp_policy,
                  ignored_modules=[_split_part(layer) for layer in experts],
                  forward_sync_buffers=not hf.is_transformers_model(model))
        if mp_policy is not None:  # DDP leaves the experts alone: they compute in it too
            for layer in experts:
                compute_in(_split_part(layer), mp_policy)
    elif mp_policy is not None:  # tensor parallelism alone: nothing reduces the gradients
        compute_in(model, mp_policy)
    if hf.is_transformers_model(model) and not a_stage:  # its save_pretrained: the whole
        with_methods(model, SavesWhole)
    return model


def _check_context_parallel(model: nn.Module, names: tuple[str, ...], shard: list[str],
                            replicas: list[str]) -> None:
    if "ep" in names:
        raise ParallelizeError(
            f"the mesh {names} has both 'cp' and 'ep': parallelize places one of them "
            "(both borrow the data-parallel ranks); build the mesh with one")
    if not cp_beside_one_data_dim(bool(replicas), bool(shard)):
        raise ParallelizeError(
            f"parallelize places 'cp' beside one data-parallel dim (the mesh {names} has "
            f"{replicas[0]!r} and {shard[0]!r}): build it as ('dp_shard', 'cp'), "
            "('dp_replicate', 'cp') or ('cp',), with 'tp' if wanted")
    tuned = [name for name, m in model.named_modules()
             if getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", True)]
    if tuned:
        raise ParallelizeError(
            f"{type(model).__name__}'s attention {tuned[0]!r} scales its queries by their "
            "positions counted from this rank's first token (Llama 4's temperature tuning "
            "in layers without rotary embeddings), which under context parallelism are not "
            "the positions in the sequence: turn it off (config.attn_temperature_tuning="
            "False) or build the mesh without 'cp'")
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa")
    if implementation != "sdpa":
        raise ParallelizeError(
            f"context parallelism routes scaled_dot_product_attention, and "
            f"{type(model).__name__} attends with {implementation!r}: load or build it with "
            "attn_implementation='sdpa'")


def _experts(model: nn.Module, names: tuple[str, ...], replicas: list[str], *,
             none_here: bool = False) -> list[nn.Module]:
    """The expert layers ``ep`` splits (none without ``ep``): transformers' stacked experts
    modules and devmesh ``MoE`` layers. ``none_here``: a model holding none is no error (a
    pipeline stage of a model whose experts are on other stages)."""
    if "ep" not in names:
        return []
    if replicas:
        raise ParallelizeError(
            f"parallelize places 'ep' beside a shard dim or alone (the mesh {names} has the "
            f"replicate dim {replicas[0]!r} too): build the mesh as ('dp_shard', 'ep'), "
            "('ep',), with 'tp' if wanted")
    found = [m for m in model.modules() if isinstance(m, MoE) or is_stacked_experts(m)]
    unroutable = [(n, m) for n, m in model.named_modules() if is_unroutable_experts(m)]
    if not found and none_here and not unroutable:
        return []
    if not found and unroutable:
        name, module = unroutable[0]
        raise ParallelizeError(
            f"the mesh has 'ep' but {type(model).__name__}'s experts ({name!r}, "
            f"{type(module).__name__}) are called with every token for every expert, not "
            "with each token's chosen experts (transformers' usual (hidden_states, "
            "top_k_index, top_k_weights), or torchtitan's (x, num_tokens_per_expert)): "
            "there are no tokens to send to each expert's rank. Split every expert over "
            "'tp' instead (a mesh without 'ep': the model's own plan does)")
    if not found:
        raise ParallelizeError(
            f"the mesh has 'ep' but {type(model).__name__} has no experts to split (a "
            "transformers experts module holding its experts' weights stacked along dim 0, "
            "or a devmesh.parallel.MoE): build the mesh without 'ep'")
    return found


def _split_part(layer: nn.Module) -> nn.Module:
    """The module whose parameters expert parallelism split: an ``MoE``'s experts, or the
    stacked experts module itself."""
    return layer.experts if isinstance(layer, MoE) else layer


def _untied(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The blocks none of whose parameters is also registered outside them (BERT's
    embeddings share their table with the head): such a block stays in its parent's FSDP
    unit, since one parameter cannot be sharded by two units."""
    places: dict[int, int] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                places[id(p)] = places.get(id(p), 0) + 1
    kept = []
    for block in blocks:
        inside: dict[int, int] = {}
        for module in block.modules():
            for p in module._parameters.values():
                if p is not None:
                    inside[id(p)] = inside.get(id(p), 0) + 1
        if all(places[k] == n for k, n in inside.items()):
            kept.append(block)
    return kept


def _refuse_unknown_dims(names: tuple[str, ...]) -> None:
    for name in names:
        if name not in ("pp", "tp", "ep", "cp") and name not in SHARD_DIMS + REPLICATE_DIMS:
            raise ParallelizeError(
                f"parallelize does not know the mesh dim {name!r}: it reads 'pp', 'tp', 'ep', "
                f"'cp', a shard dim ({', '.join(SHARD_DIMS)}) and a replicate dim "
                f"({', '.join(REPLICATE_DIMS)})")


def _tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh,
                     plan: Mapping[str, ParallelStyle] | None, experts: list[nn.Module]
                     ) -> None:
    if plan is None:
        where = {id(m): name for name, m in model.named_modules()}
        leave_out = [where[id(m)] for m in experts]
        if titan.is_torchtitan_model(model):
            _check_heads(model, tp_mesh.size(), titan.heads(model))
            plan = titan.tensor_parallel_plan(model, leave_out)
        elif hf.is_transformers_model(model):
            config = getattr(model, "config", None)
            heads = getattr(config, "num_attention_heads", None)
            kv_heads = getattr(config, "num_key_value_heads", None) or heads
            _check_heads(model, tp_mesh.size(), (heads, kv_heads) if heads else None)
            plan = hf.tensor_parallel_plan(
                model, leave_out=leave_out + list(getattr(model, REMOVED, ())))
        else:
            raise ParallelizeError(
                f"the mesh has 'tp' but {type(model).__name__} declares no plan: pass "
                "tp_plan={module name: style}")
    parallelize_module(model, tp_mesh, dict(plan))


def _check_heads(model: nn.Module, tp: int, counts: tuple[int, int] | None) -> None:
    """Attention splits by whole heads: tp must divide the query and key/value heads
    (``counts``, when the model says them)."""
    if counts is None:
        return
    heads, kv_heads = counts
    if heads % tp or kv_heads % tp:
        fits = [t for t in range(1, heads + 1) if heads % t == 0 and kv_heads % t == 0]
        raise ParallelizeError(
            f"tp={tp} does not divide {type(model).__name__}'s attention heads "
            f"({heads} query, {kv_heads} key/value): tensor parallelism splits whole heads; "
            f"tp may be {', '.join(map(str, fits))}")


def _checkpoint(model: nn.Module, blocks: list[nn.Module], mode: str | int) -> list[nn.Module]:
    """Checkpoint the chosen blocks (:mod:`devmesh.parallel.activation_checkpointing`);
    returns the blocks as the model now holds them."""
    if mode != "none":
        # a block recomputed in backward would append its keys and values to the cache a
        # second time
        hf.turn_off_caches(model)
    return checkpoint_blocks(model, blocks, mode)
