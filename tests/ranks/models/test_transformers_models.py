"""Hugging Face transformers' architectures (tiny random configs, nothing downloaded) under
``devmesh.parallel.parallelize``, each strategy against the same model trained in one
process: DDP, FSDP, HSDP, TP (the model's own plan) with DDP or FSDP, and activation
checkpointing (full, selective, every k-th block). Float64, 4 ranks, 3 AdamW steps; the full
state dict must have ``nn.Module.state_dict()``'s keys and the trained values.

Dropout is off (GPT-2's and BERT's configs have it on): one process and the ranks would
draw different masks. Gemma 3's RMSNorm computes in float32 whatever the model's dtype, so its results agree to
float32's precision only (the same model split differently rounds differently there)."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from devmesh import init_device_mesh
from helpers import caught

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, STEPS = 64, 12, 4, 3
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
# models that compute parts in float32 whatever their dtype agree to float32's precision only
# (the same model split differently rounds differently there): Gemma 3's and Cohere 2's
# norms; GLM-4-MoE's, DeepSeek-V3's and ERNIE-4.5-MoE's routers; Llama 4's router's sigmoid
# (with those casts removed every one agrees to 1e-12). float64 everywhere else
TOLERANCE = {"gemma3": 1e-6, "cohere2": 1e-6, "glm4_moe": 1e-6, "deepseek_v3": 1e-6,
             "ernie4_5_moe": 1e-6, "llama4": 1e-5}
# Mixtral's router hands its experts the routing weights in float32 (Qwen3-MoE's casts them
# back): with every expert split over tp, each rank's partial gradient of them is rounded
# to float32 before the sum, one process rounds the whole sum once, so the router and what
# precedes it agree to float32's precision only
TP_EXPERTS_TOLERANCE = {"mixtral": 1e-6}


def make(arch: str, layers: int = 2) -> torch.nn.Module:
    import transformers as T

    torch.manual_seed(0)
    COMMON = dict(globals()["COMMON"], num_hidden_layers=layers)
    if arch == "llama":
        model = T.LlamaForCausalLM(T.LlamaConfig(**COMMON))
    elif arch == "llama-eager":  # attention by matmuls, not scaled_dot_product_attention
        model = T.LlamaForCausalLM(T.LlamaConfig(**COMMON, attn_implementation="eager"))
    elif arch == "qwen3":  # q_norm / k_norm over the local heads: gradients summed over tp
        model = T.Qwen3ForCausalLM(T.Qwen3Config(**COMMON, head_dim=8))
    elif arch == "mistral":  # sliding-window attention, shorter than the sequence
        model = T.MistralForCausalLM(T.MistralConfig(**COMMON, sliding_window=4))
    elif arch == "mistral-window8":  # a window wider than a rank's share under cp = 2:
        # transformers then builds no mask, as if the window held every token
        model = T.MistralForCausalLM(T.MistralConfig(**COMMON, sliding_window=8))
    elif arch == "gemma3":  # scaled, tied embedding; logit soft-capping; sliding layers
        model = T.Gemma3ForCausalLM(T.Gemma3TextConfig(
            **COMMON, head_dim=8, sliding_window=4, final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2)))
    elif arch == "gpt2":  # Conv1D weights, stored transposed
        model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32,
                                               n_layer=2, n_head=4, resid_pdrop=0.0,
                                               embd_pdrop=0.0, attn_pdrop=0.0,
                                               bos_token_id=0, eos_token_id=0))
    elif arch == "mixtral":  # a mixture of experts with a softmax router (the eager experts:
        # torch._grouped_mm takes no float64)
        model = T.MixtralForCausalLM(T.MixtralConfig(**COMMON, num_local_experts=4,
                                                     num_experts_per_tok=2,
                                                     experts_implementation="eager"))
    elif arch == "qwen3_moe":  # experts in layer 0, a dense MLP in layer 1; q/k norms
        model = T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
            **COMMON, head_dim=8, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=24, mlp_only_layers=[1], experts_implementation="eager"))
    elif arch == "qwen3_moe_all":  # experts in every layer (as Qwen3-30B-A3B): its plan's
        # dense-MLP entries name nothing
        model = T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
            **COMMON, head_dim=8, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=24, mlp_only_layers=[], experts_implementation="eager"))
    elif arch == "qwen2":  # biases on q, k and v
        model = T.Qwen2ForCausalLM(T.Qwen2Config(**COMMON))
    elif arch == "phi3":  # q/k/v and gate/up packed, each split and gathered back
        model = T.Phi3ForCausalLM(T.Phi3Config(**COMMON, pad_token_id=0))
    elif arch == "olmo2":  # q/k norms over all heads: projections gathered back
        model = T.Olmo2ForCausalLM(T.Olmo2Config(**COMMON, pad_token_id=0))
    elif arch == "granite":  # embedding, residual, attention and logit multipliers
        model = T.GraniteForCausalLM(T.GraniteConfig(
            **COMMON, embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8.0,
            attention_multiplier=0.015))
    elif arch == "exaone4":  # q/k norms replicated, their gradients summed over tp
        model = T.Exaone4ForCausalLM(T.Exaone4Config(
            **COMMON, head_dim=8, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2)))
    elif arch == "cohere2":  # parallel attention and MLP; tied embedding; logit scale
        model = T.Cohere2ForCausalLM(T.Cohere2Config(
            **COMMON, head_dim=8, sliding_window=4, pad_token_id=0,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2)))
    elif arch in ("gpt_oss", "gpt_oss_experts_tp"):  # experts (E, in, out) with biases,
        # gate/up interleaved (gpt_oss_experts_tp: biases drawn non-zero);
        # attention sinks; called (hidden_states, router_indices, routing_weights)
        model = T.GptOssForCausalLM(T.GptOssConfig(
            **COMMON, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=4, experts_implementation="eager",
            layer_types=["sliding_attention", "full_attention"] * (layers // 2)))
    elif arch == "deepseek_v3":  # latent attention; grouped routing; a shared expert
        model = T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
            **dict(COMMON, num_key_value_heads=4), moe_intermediate_size=24,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
            topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
            head_dim=4, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
            experts_implementation="eager"))
    elif arch == "qwen2_moe":  # a gated shared expert beside the routed ones
        model = T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
            **COMMON, moe_intermediate_size=24, shared_expert_intermediate_size=32,
            num_experts=4, num_experts_per_tok=2, experts_implementation="eager"))
    elif arch == "glm4_moe":  # a dense first layer; shared experts; sigmoid routing
        model = T.Glm4MoeForCausalLM(T.Glm4MoeConfig(
            **COMMON, head_dim=8, moe_intermediate_size=24, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
            first_k_dense_replace=1, experts_implementation="eager"))
    elif arch == "llama4":  # experts (E, in, out), every token through every expert;
        # chunked attention
        model = T.Llama4ForCausalLM(T.Llama4TextConfig(
            **COMMON, head_dim=8, intermediate_size_mlp=48, num_local_experts=4,
            num_experts_per_tok=1, interleave_moe_layer_step=1, attention_chunk_size=8,
            experts_implementation="eager"))
    elif arch == "llama4-nope":  # its second layer without rotary embeddings, with
        # temperature tuning (queries scaled by their position)
        model = T.Llama4ForCausalLM(T.Llama4TextConfig(
            **COMMON, head_dim=8, intermediate_size_mlp=48, num_local_experts=4,
            num_experts_per_tok=1, interleave_moe_layer_step=1, attention_chunk_size=8,
            no_rope_layers=[1, 0] * (layers // 2), experts_implementation="eager"))
    elif arch == "ernie4_5_moe":  # shared experts; a correction bias in routing
        model = T.Ernie4_5_MoeForCausalLM(T.Ernie4_5_MoeConfig(
            **COMMON, moe_intermediate_size=24, moe_num_experts=4, moe_k=2,
            moe_num_shared_experts=1, moe_layer_start_index=0,
            experts_implementation="eager"))
    elif arch == "bert":  # an encoder
        model = T.BertForMaskedLM(T.BertConfig(vocab_size=VOCAB, hidden_size=32,
                                               num_hidden_layers=2, num_attention_heads=4,
                                               intermediate_size=48,
                                               max_position_embeddings=64,
                                               hidden_dropout_prob=0.0,
                                               attention_probs_dropout_prob=0.0))
    else:
        raise ValueError(arch)
    if arch == "gpt_oss_experts_tp":  # transformers starts the experts' biases at zero
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("_bias"):
                    param.normal_(std=0.1)
    return model.double()


IMAGE_TOKEN = VOCAB - 1  # the vision-language models' image token (and Qwen2-VL's start: -3)


def make_vision_language(arch: str) -> torch.nn.Module:
    """A tiny vision-language model: a vision tower whose image features replace the image
    tokens, and a Llama-shaped language model under its own config (``text_config``)."""
    import transformers as T

    torch.manual_seed(0)
    text = dict(COMMON)
    if arch == "llava":  # CLIP's vision tower, 8x8 images in 4 patches of 4x4
        vision = T.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, image_size=8, patch_size=4)
        model = T.LlavaForConditionalGeneration(T.LlavaConfig(
            vision_config=vision, text_config=T.LlamaConfig(**text),
            image_token_index=IMAGE_TOKEN, vision_feature_layer=-1))
    elif arch == "qwen2_vl":  # multimodal rotary positions (M-RoPE)
        model = T.Qwen2VLForConditionalGeneration(T.Qwen2VLConfig(
            text_config=dict(text, model_type="qwen2_vl_text",
                             rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
            vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2,
                               patch_size=2, temporal_patch_size=1, spatial_merge_size=1,
                               in_channels=3),
            image_token_id=IMAGE_TOKEN, video_token_id=VOCAB - 2,
            vision_start_token_id=VOCAB - 3))
    else:
        raise ValueError(arch)
    return model.double()


def _vision_language_batch(arch: str, step: int, rows: slice) -> dict:
    """``rows`` of a batch of 4: an image (4 image tokens) and 8 text tokens each, the
    labels ignoring the image's tokens."""
    gen = torch.Generator().manual_seed(step)
    text = torch.randint(0, VOCAB - 4, (BATCH, 8), generator=gen)
    image = torch.full((BATCH, 4), IMAGE_TOKEN)
    if arch == "llava":
        ids = torch.cat([image, text], 1)
        batch = {"pixel_values": torch.randn(BATCH, 3, 8, 8, generator=gen,
                                             dtype=torch.float64)[rows]}
    else:  # each image's 4 patches flattened, its grid (1, 2, 2), its tokens marked
        ids = torch.cat([torch.full((BATCH, 1), VOCAB - 3), image, text], 1)
        patches = torch.randn(BATCH, 4, 12, generator=gen, dtype=torch.float64)[rows]
        batch = {"pixel_values": patches.reshape(-1, 12),
                 "image_grid_thw": torch.tensor([[1, 2, 2]] * BATCH)[rows],
                 "mm_token_type_ids": (ids == IMAGE_TOKEN).long()[rows]}
    labels = ids.masked_fill(ids >= VOCAB - 3, -100)
    return {"input_ids": ids[rows], "labels": labels[rows], **batch}


def train_vision_language(arch: str, strategy: str):
    """A vision-language model under ``parallelize`` (its language model's own tensor-parallel
    plan; vision and language blocks sharded or checkpointed alike) against one process on
    the whole batch: the largest difference of a trained parameter, and the keys."""
    from devmesh.parallel import parallelize, state_dict

    shape, names, checkpointing = STRATEGIES[strategy]
    ref = make_vision_language(arch)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = parallelize(make_vision_language(arch), mesh,
                        activation_checkpointing=checkpointing)
    mine = _data_rows(mesh, names)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        ref(**_vision_language_batch(arch, step, slice(None))).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        model(**_vision_language_batch(arch, step, mine)).loss.backward()
        opt.step()
        opt.zero_grad()
    full = state_dict(model, full=True)
    want = ref.state_dict()
    return (max((full[k] - v).abs().max().item() for k, v in want.items()),
            list(full) == list(want))


@pytest.mark.parametrize("arch, strategy", [
    ("llava", "fsdp_tp"), ("llava", "hsdp_selective_ac"), ("qwen2_vl", "ddp_tp_full_ac"),
    # selective checkpointing failed: the language model's cache (its text_config's
    # use_cache) took each recomputed block's keys a second time
    ("qwen2_vl", "hsdp_selective_ac")])
def test_a_vision_language_model_trains_as_one_process(mesh_pool, arch, strategy):
    for difference, keys in mesh_pool.run(train_vision_language, 4, arch, strategy):
        assert keys, "the full state dict's keys differ from nn.Module's"
        assert difference <= 1e-12, difference


def _data_rows(mesh, names: tuple[str, ...]) -> slice:
    """This rank's rows of a batch of ``BATCH``: its share by its index over the mesh's
    data-parallel dims (every dim but ``tp``)."""
    dp = mesh[tuple(n for n in names if n != "tp")]
    coordinate = dp.get_coordinate()
    index = coordinate[0] * (dp.shape[1] if dp.ndim > 1 else 1) + (
        coordinate[1] if dp.ndim > 1 else 0)
    per = BATCH // dp.size()
    return slice(index * per, (index + 1) * per)


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def _train(model, rows: slice) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        ids = _ids(step)[rows]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


STRATEGIES = {  # name: (mesh shape, dim names, activation checkpointing)
    "ddp": ((4,), ("dp_replicate",), "none"),
    "fsdp": ((4,), ("dp_shard",), "none"),
    "hsdp_selective_ac": ((2, 2), ("dp_replicate", "dp_shard"), "selective"),
    "ddp_tp_full_ac": ((2, 2), ("dp_replicate", "tp"), "full"),
    "fsdp_tp": ((2, 2), ("dp_shard", "tp"), "none"),
    "fsdp_tp_every_2nd_ac": ((2, 2), ("dp_shard", "tp"), 2),
    "ep": ((4,), ("ep",), "none"),  # the experts split, every other parameter DDP's
    "fsdp_ep": ((2, 2), ("dp_shard", "ep"), "none"),
    "fsdp_ep_selective_ac": ((2, 2), ("dp_shard", "ep"), "selective"),
    "fsdp_ep_full_ac": ((2, 2), ("dp_shard", "ep"), "full"),
    "ep_tp_selective_ac": ((2, 2), ("ep", "tp"), "selective"),
    # every expert split over ep and over tp too (parallelize's experts_over_tp)
    "ep_tp_experts_over_tp": ((2, 2), ("ep", "tp"), "none"),
    "fsdp_ep_tp_experts_over_tp": ((2, 2, 2), ("dp_shard", "ep", "tp"), "none"),  # 8 ranks
}
OPTIONS = {"ep_tp_experts_over_tp": {"experts_over_tp": True},
           "fsdp_ep_tp_experts_over_tp": {"experts_over_tp": True}}


def train_parallel(arch: str, strategy: str):
    """This rank's losses (over its share of each batch) next to one process's on the same
    share, and the full state dict against the one process's."""
    from devmesh.parallel import parallelize, state_dict

    shape, names, checkpointing = STRATEGIES[strategy]
    ref = make(arch)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    # GPT-2 declares no tensor-parallel plan and gpt-oss one for its head only: parallelize
    # splits them by devmesh's (devmesh.integrations.transformers_plans)
    model = parallelize(make(arch), mesh, activation_checkpointing=checkpointing,
                        **OPTIONS.get(strategy, {}))
    rows = _data_rows(mesh, names)
    ref_losses = []
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(STEPS):  # one process on the whole batch; its loss on this share
        ids = _ids(step)
        with torch.no_grad():
            share = ids[rows]
            ref_losses.append(ref(input_ids=share, labels=share).loss.item())
        ref(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    losses = _train(model, rows)
    full = state_dict(model, full=True)
    want = ref.state_dict()
    return {"losses": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
            "params": max((full[k] - v).abs().max().item() for k, v in want.items()),
            "worst": sorted(((full[k] - v).abs().max().item(), k) for k, v in want.items())[-3:],
            "keys": list(full) == list(want)}


DECODERS = ("llama", "qwen3", "mistral", "gemma3")
CASES = ([(arch, s) for arch in DECODERS for s in STRATEGIES if "ep" not in s.split("_")]
         + [(arch, s) for arch in ("gpt2", "mixtral", "bert")
            for s in ("ddp", "fsdp", "hsdp_selective_ac")]
         + [("gpt2", s) for s in ("ddp_tp_full_ac", "fsdp_tp", "fsdp_tp_every_2nd_ac")]
         + [(arch, s) for arch in ("mixtral", "qwen3_moe")
            for s in ("ep", "fsdp_ep", "ep_tp_selective_ac", "fsdp_ep_selective_ac",
                      "fsdp_ep_full_ac")]
         + [("qwen3_moe", s) for s in ("ddp", "fsdp")]
         # every expert split over tp: the model's own moe_tp_experts / packed_colwise plan
         + [(arch, s) for arch in ("mixtral", "qwen3_moe")
            for s in ("ddp_tp_full_ac", "fsdp_tp", "fsdp_tp_every_2nd_ac")]
         + [("qwen3_moe_all", "fsdp_tp")]
         + [(arch, "ep_tp_experts_over_tp") for arch in ("mixtral", "qwen3_moe")]
         + [("qwen3_moe", "fsdp_ep_tp_experts_over_tp")]
         # more architectures, each under its own tensor-parallel plan with FSDP (the
         # plan's styles: gathered outputs, split inputs, gradients summed over tp)
         + [(arch, "fsdp_tp") for arch in ("qwen2", "phi3", "olmo2", "granite", "exaone4",
                                           "cohere2", "deepseek_v3", "qwen2_moe",
                                           "glm4_moe", "llama4", "ernie4_5_moe")]
         + [("llama4", "ddp_tp_full_ac")]  # every expert (E, in, out) split over tp
         # their experts over ep
         + [(arch, "fsdp_ep") for arch in ("gpt_oss", "deepseek_v3", "qwen2_moe",
                                           "glm4_moe", "ernie4_5_moe")]
         + [("gpt_oss", "ep_tp_selective_ac")]
         # every expert with its biases split over tp (devmesh's plan for gpt-oss)
         + [("gpt_oss_experts_tp", s) for s in ("ddp_tp_full_ac", "fsdp_tp",
                                                "ep_tp_experts_over_tp",
                                                "fsdp_ep_tp_experts_over_tp")])


@pytest.mark.parametrize("arch, strategy", CASES)
def test_a_transformers_model_trains_as_one_process(mesh_pool, arch, strategy):
    tolerance = TOLERANCE.get(arch, 1e-12)
    if ("tp" in strategy.split("_") and "ep" not in strategy.split("_")
            or OPTIONS.get(strategy, {}).get("experts_over_tp")):
        tolerance = TP_EXPERTS_TOLERANCE.get(arch, tolerance)
    world = math.prod(STRATEGIES[strategy][0])
    for result in mesh_pool.run(train_parallel, world, arch, strategy):
        assert result["keys"], "the full state dict's keys differ from nn.Module's"
        assert result["losses"] <= tolerance, result
        assert result["params"] <= tolerance, result


def split_without_a_plan(arch: str) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """A model whose own plan leaves its blocks whole, parallelized over tp = 2 with no
    tp_plan: each named weight's shape on this rank and in one process."""
    from devmesh.parallel import parallelize

    whole = dict(make(arch).named_parameters())
    model = parallelize(make(arch), init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    here = dict(model.named_parameters())
    names = {"gpt2": ["transformer.h.0.attn.c_attn.weight", "transformer.h.0.mlp.c_fc.weight",
                      "transformer.h.0.mlp.c_proj.weight", "transformer.wte.weight"],
             "gpt_oss": ["model.layers.0.self_attn.q_proj.weight",
                         "model.layers.0.self_attn.o_proj.weight",
                         "model.layers.0.self_attn.sinks",
                         "model.layers.0.mlp.experts.gate_up_proj",
                         "model.layers.0.mlp.experts.down_proj", "lm_head.weight"]}[arch]
    return {n: (tuple(here[n].shape), tuple(whole[n].shape)) for n in names}


@pytest.mark.parametrize("arch", ["gpt2", "gpt_oss"])
def test_parallelize_splits_the_blocks_a_models_own_plan_leaves_whole(mesh_pool, arch):
    """GPT-2 declares no tensor-parallel plan, gpt-oss one for its head only (its attention
    and experts stayed whole on every rank, computed tp times): parallelize applies
    devmesh's plan for them, so each rank holds half of every split weight (training equal
    to one process: the FSDP x TP rows above)."""
    for shapes in mesh_pool.run(split_without_a_plan, 2, arch):
        for name, (here, whole) in shapes.items():
            assert math.prod(here) * 2 == math.prod(whole), (name, here, whole)


def _conv1d_grad_errors(mlp, ref, cols: slice) -> dict[str, float]:
    """The largest differences of a split GPT-2 MLP's weight and bias gradients from one
    process's: ``c_fc``'s columns ``cols``, ``c_proj``'s rows ``cols`` and its whole bias."""
    return {
        "c_fc": max((mlp.c_fc.weight.grad - ref.c_fc.weight.grad[:, cols]).abs().max().item(),
                    (mlp.c_fc.bias.grad - ref.c_fc.bias.grad[cols]).abs().max().item()),
        "c_proj": max((mlp.c_proj.weight.grad - ref.c_proj.weight.grad[cols]).abs().max().item(),
                      (mlp.c_proj.bias.grad - ref.c_proj.bias.grad).abs().max().item()),
    }


def gpt2_mlp_under_tp(sequence_parallel: bool):
    """transformers' own GPT-2 MLP (two ``Conv1D``: weights stored ``(in, out)``) with
    ``c_fc`` split by columns and ``c_proj`` by rows (or, sequence-parallel, its input and
    output split on the sequence): output, input gradient and the full weights' gradients
    against one process."""
    import transformers as T
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    from devmesh.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from devmesh.tensor import Shard

    config = T.GPT2Config(n_embd=8, resid_pdrop=0.0)
    torch.manual_seed(0)
    ref = GPT2MLP(12, config).double()
    mlp = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    rank = mesh.get_local_rank()
    if sequence_parallel:
        plan = {"c_fc": ColwiseParallel(input_layouts=Shard(1)),
                "c_proj": RowwiseParallel(output_layouts=Shard(1))}
    else:
        plan = {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()}
    parallelize_module(mlp, mesh, plan)
    x = torch.randn(2, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    whole = x.clone().requires_grad_(True)
    want = ref(whole)
    want.square().sum().backward()
    mine = (x[:, 2 * rank:2 * rank + 2] if sequence_parallel else x).clone().requires_grad_(True)
    out = mlp(mine)
    out.square().sum().backward()
    rows = slice(2 * rank, 2 * rank + 2)
    cols = slice(6 * rank, 6 * rank + 6)
    return {
        "local": (tuple(mlp.c_fc.weight.shape), tuple(mlp.c_proj.weight.shape)),
        "out": (out - (want[:, rows] if sequence_parallel else want)).abs().max().item(),
        "input_grad": (mine.grad - (whole.grad[:, rows] if sequence_parallel
                                    else whole.grad)).abs().max().item(),
        **_conv1d_grad_errors(mlp, ref, cols),
    }


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_gpt2_conv1d_splits_by_column_and_row_as_one_process(mesh_pool, sequence_parallel):
    for result in mesh_pool.run(gpt2_mlp_under_tp, 2, sequence_parallel):
        assert result["local"] == ((8, 6), (6, 8)), result  # (in, out) as stored
        for key in ("out", "input_grad", "c_fc", "c_proj"):
            assert result[key] <= 1e-13, result


def gpt2_mlp_uneven_under_tp():
    """GPT-2's MLP with 9 inner features over 2 ranks: ``c_fc``'s columns and ``c_proj``'s rows
    split 5 and 4 (``torch.chunk``), each rank's ``Conv1D`` shaped by its own share; against
    one process. And a ``Conv1D`` subclass with a ``forward`` of its own, refused row-wise by
    name (the style replaces the forward to add the bias once, after the reduction)."""
    import transformers as T
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
    from transformers.pytorch_utils import Conv1D

    from devmesh.errors import ParallelizeError
    from devmesh.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    config = T.GPT2Config(n_embd=8, resid_pdrop=0.0)
    torch.manual_seed(0)
    ref = GPT2MLP(9, config).double()
    mlp = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    rank = mesh.get_local_rank()
    parallelize_module(mlp, mesh, {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()})
    x = torch.randn(2, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    whole = x.clone().requires_grad_(True)
    ref(whole).square().sum().backward()
    mine = x.clone().requires_grad_(True)
    out = mlp(mine)
    out.square().sum().backward()
    cols = slice(0, 5) if rank == 0 else slice(5, 9)

    class Doubled(Conv1D):
        def forward(self, x):
            return 2 * super().forward(x)

    error = None
    try:
        parallelize_module(torch.nn.Sequential(Doubled(8, 8)), mesh, {"0": RowwiseParallel()})
    except ParallelizeError as exc:
        error = str(exc)
    return {
        "local": (mlp.c_fc.nf, tuple(mlp.c_fc.weight.shape), tuple(mlp.c_proj.weight.shape)),
        "out": (out - ref(x)).abs().max().item(),
        "input_grad": (mine.grad - whole.grad).abs().max().item(),
        **_conv1d_grad_errors(mlp, ref, cols),
        "refused": error,
    }


def test_gpt2_conv1d_of_uneven_features_splits_as_torch_chunk_and_equals_one_process(
        mesh_pool):
    results = mesh_pool.run(gpt2_mlp_uneven_under_tp, 2)
    assert [r["local"] for r in results] == [(5, (8, 5), (5, 8)), (4, (8, 4), (4, 8))]
    for result in results:
        for key in ("out", "input_grad", "c_fc", "c_proj"):
            assert result[key] <= 1e-13, result
        assert result["refused"] is not None and "Doubled overrides" in result["refused"], \
            result


def refused(arch: str, names: tuple[str, ...], shape: tuple[int, ...], options: dict):
    from devmesh.parallel import parallelize

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return caught(lambda: parallelize(make(arch), mesh, **options))


@pytest.mark.parametrize("arch, names, shape, says, options", [(*row, {}) for row in [
    ("bert", ("dp_shard", "tp"), (2, 2), "declares no tensor-parallel plan"),
    ("mixtral", ("dp_replicate", "ep"), (2, 2), "build the mesh as ('dp_shard', 'ep')"),
    ("llama", ("ep",), (4,), "LlamaForCausalLM has no experts to split"),
    ("llama4", ("dp_shard", "ep"), (2, 2), "Llama4TextExperts) are called with every token "
     "for every expert"),
    ("mixtral", ("cp", "ep"), (2, 2), "has both 'cp' and 'ep'"),
    ("llama", ("dp_replicate", "dp_shard", "cp"), (1, 2, 2), "build it as ('dp_shard', 'cp')"),
    ("llama-eager", ("dp_shard", "cp"), (2, 2), "attends with 'eager': load or build it with "
     "attn_implementation='sdpa'"),
    ("llama4-nope", ("dp_shard", "cp"), (2, 2), "scales its queries by their positions "
     "counted from this rank's first token"),
    ("llama", ("tp",), (4,), "tp may be 1, 2"),
    ("gpt2", ("pp", "dp_shard"), (2, 2), "GPT2LMHeadModel declares no pipeline plan"),
    ("llama", ("pp", "tp"), (4, 1), "4 pipeline stages need at least one decoder layer each; "
     "the model has 2"),
    ("llama", ("dp", "rows"), (2, 2), "does not know the mesh dim 'rows'"),
]] + [
    ("llama", ("pp", "tp"), (2, 2), "torch's selective checkpointing allows one backward "
     "through a region: use activation_checkpointing='full'",
     {"schedule": "zbv-zero-bubble", "activation_checkpointing": "selective"}),
    ("llama", ("pp", "tp"), (2, 2), "leave blocks= out", {"blocks": []}),
    ("mixtral", ("dp_shard", "tp"), (2, 2), "experts_over_tp=True splits the experts over "
     "both 'ep' and 'tp'", {"experts_over_tp": True}),
])
def test_what_parallelize_cannot_place_is_refused_by_name(mesh_pool, arch, names, shape, says,
                                                          options):
    for error in mesh_pool.run(refused, 4, arch, names, shape, options):
        assert error is not None and error[0] == "ParallelizeError" and says in error[1], error


def load_and_save(folder: str, out: str):
    """A Llama parallelized (FSDP x TP) reads a save_pretrained folder, each rank its own
    blocks; the model written back is the checkpoint's."""
    from devmesh.integrations import load_pretrained, save_pretrained
    from devmesh.parallel import parallelize, state_dict

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = parallelize(make("llama"), mesh)  # seed 0: other weights than the checkpoint's
    loaded = load_pretrained(model, folder)
    mine = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local")
               else p.numel() * p.element_size() for p in model.parameters())
    full = state_dict(model, full=True)
    rank0 = state_dict(model, full=True, rank0_only=True)
    from devmesh.integrations import pretrained

    held = []  # the full state save_pretrained gathered on this rank: rank 0's alone

    def recorded(*args, **kwargs):
        value = state_dict(*args, **kwargs)
        held.append(len(value))
        return value

    pretrained.state_dict, before = recorded, pretrained.state_dict
    try:
        save_pretrained(model, out)
    finally:
        pretrained.state_dict = before
    return (loaded, mine, {k: v.clone() for k, v in full.items()},
            {k: torch.equal(v, full[k]) for k, v in rank0.items()}, held)


def test_a_transformers_checkpoint_loads_into_a_sharded_model_and_back(mesh_pool, tmp_path):
    import transformers as T

    torch.manual_seed(1)
    pretrained = T.LlamaForCausalLM(T.LlamaConfig(**COMMON)).double()
    pretrained.save_pretrained(tmp_path / "in", max_shard_size="20KB")  # several shards
    assert (tmp_path / "in" / "model.safetensors.index.json").exists()
    want = pretrained.state_dict()
    results = mesh_pool.run(load_and_save, 4, str(tmp_path / "in"), str(tmp_path / "out"))
    for rank, (loaded, mine, full, rank0, held) in enumerate(results):
        assert all(torch.equal(full[k], v) for k, v in want.items())
        assert loaded.bytes_read == mine < loaded.checkpoint_bytes / 2  # its blocks only
        # rank0_only: rank 0 keeps the full tensors, equal to everyone's; the others none,
        # and save_pretrained holds the whole model on rank 0 alone
        assert (rank0 == {k: True for k in full}) if rank == 0 else rank0 == {}, rank
        assert held == ([len(full)] if rank == 0 else [0]), (rank, held)
    back = T.LlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in want.items())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def load_experts_and_save(arch: str, folder: str, out: str, split: str = "ep"):
    """A mixture of experts parallelized over ``("dp_shard", "ep")`` (or every expert split
    over ``tp``, gate and up packed) reads a folder in the checkpoint's own names (each
    expert's tensors apart, as transformers' save_pretrained writes them and the downloaded
    checkpoints hold them), each rank its own experts (or its piece of each)."""
    from devmesh.integrations import load_pretrained, save_pretrained
    from devmesh.parallel import parallelize, state_dict

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", split))
    model = parallelize(make(arch), mesh)  # seed 0: other weights than the checkpoint's
    loaded = load_pretrained(model, folder)
    mine = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local")
               else p.numel() * p.element_size() for p in model.parameters())
    kept = set(model.state_dict())  # persistent buffers (DeepSeek's routing bias) read whole
    mine += sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n in kept)
    full = state_dict(model, full=True)
    save_pretrained(model, out)
    return loaded, mine, {k: v.clone() for k, v in full.items()}


# (gpt-oss and Llama 4 store their experts stacked, as the model holds them; Llama 4's
# (E, in, out), its packed gate/up split over tp on dim -1)
STACKED_IN_CHECKPOINTS = ("gpt_oss", "llama4")


@pytest.mark.parametrize("arch, split", [("mixtral", "ep"), ("qwen3_moe", "ep"),
                                         ("mixtral", "tp"), ("deepseek_v3", "ep"),
                                         ("gpt_oss", "ep"), ("llama4", "tp")])
def test_a_mixture_of_experts_checkpoint_loads_expert_by_expert_and_back(mesh_pool, tmp_path,
                                                                         arch, split):
    from safetensors import safe_open

    torch.manual_seed(1)
    pretrained = make(arch)
    for p in pretrained.parameters():  # not make()'s seed-0 weights
        torch.nn.init.normal_(p)
    pretrained.save_pretrained(tmp_path / "in", max_shard_size="20KB")
    stored = set()
    for file in (tmp_path / "in").glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            stored |= set(f.keys())
    apart = arch not in STACKED_IN_CHECKPOINTS
    assert any(".experts.3." in key for key in stored) == apart  # each expert's own tensors
    assert any(key.endswith("gate_up_proj") for key in stored) != apart
    want = pretrained.state_dict()
    results = mesh_pool.run(load_experts_and_save, 4, arch, str(tmp_path / "in"),
                            str(tmp_path / "out"), split)
    for loaded, mine, full in results:
        assert set(full) == set(want)
        assert all(torch.equal(full[k], v) for k, v in want.items())
        assert loaded.bytes_read == mine < loaded.checkpoint_bytes / 2  # its experts only
    back = type(pretrained).from_pretrained(tmp_path / "out", dtype=torch.float64,
                                            experts_implementation="eager")
    assert all(torch.equal(back.state_dict()[k], v) for k, v in want.items())


def test_experts_missing_from_a_checkpoint_are_named_and_nothing_loaded(mesh_pool, tmp_path):
    from safetensors.torch import load_file, save_file

    make("mixtral").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for error, untouched in mesh_pool.run(load_refused, 1, str(tmp_path), "mixtral"):
        assert error[0] == "StateDictError" and untouched, error
        assert ("model.layers.1.mlp.experts.gate_up_proj: the checkpoint's experts for "
                "'.experts.*.w3.weight' are numbered [0, 1, 3]") in error[1], error
        assert "Nothing was loaded" in error[1]


def load_into_the_base_model(folder: str):
    """A ``LlamaModel`` (no head) sharded over 2 ranks reads a ``LlamaForCausalLM``
    checkpoint, whose keys carry the ``model.`` prefix, as transformers' loading does."""
    import transformers as T

    from devmesh.integrations import load_pretrained
    from devmesh.parallel import parallelize, state_dict

    torch.manual_seed(0)
    base = T.LlamaModel(T.LlamaConfig(**COMMON)).double()
    parallelize(base, init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",)))
    refused = caught(lambda: load_pretrained(base, folder))
    load_pretrained(base, folder, strict=False)
    return refused, {k: v.clone() for k, v in state_dict(base, full=True).items()}


def test_a_causal_lm_checkpoint_loads_into_its_base_model_as_transformers_does(mesh_pool,
                                                                                tmp_path):
    import transformers as T

    torch.manual_seed(1)
    pretrained = T.LlamaForCausalLM(T.LlamaConfig(**COMMON)).double()
    pretrained.save_pretrained(tmp_path)
    want = pretrained.state_dict()
    for refused, loaded in mesh_pool.run(load_into_the_base_model, 2, str(tmp_path)):
        assert refused[0] == "StateDictError" and "not in the model: ['lm_head.weight']" \
            in refused[1], refused  # strict: the head it has no place for, by name
        assert loaded and all(torch.equal(v, want["model." + k]) for k, v in loaded.items())


def load_refused(folder: str, arch: str = "mistral"):
    from devmesh.integrations import load_pretrained

    model = make(arch)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    error = caught(lambda: load_pretrained(model, folder))
    return error, all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_checkpoint_of_another_model_is_refused_and_nothing_loaded(mesh_pool, tmp_path):
    import transformers as T

    torch.manual_seed(1)
    other = dict(COMMON, intermediate_size=40)
    T.LlamaForCausalLM(T.LlamaConfig(**other)).double().save_pretrained(tmp_path)
    for error, untouched in mesh_pool.run(load_refused, 1, str(tmp_path)):
        assert error[0] == "StateDictError" and "the checkpoint's shape is (40, 32)" in error[1]
        assert "Nothing was loaded" in error[1] and untouched


def load_where_one_rank_lacks_the_folder(good: str, bad: str):
    """Rank 1 names a folder without a checkpoint; the others a good one."""
    import torch.distributed as dist

    from devmesh.integrations import load_pretrained
    from devmesh.parallel import parallelize

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    model = parallelize(make("llama"), mesh)
    error = caught(lambda: load_pretrained(model, bad if dist.get_rank() == 1 else good))
    dist.barrier()  # every rank got here: none waits in a collective the others left
    return error


def test_a_load_refused_on_one_rank_is_refused_on_every_rank(mesh_pool, tmp_path):
    import transformers as T

    T.LlamaForCausalLM(T.LlamaConfig(**COMMON)).double().save_pretrained(tmp_path / "good")
    (tmp_path / "empty").mkdir()
    mine, other = mesh_pool.run(load_where_one_rank_lacks_the_folder, 2,
                                str(tmp_path / "good"), str(tmp_path / "empty"))
    assert other[0] == "StateDictError" and "holds neither" in other[1]
    assert mine[0] == "StateDictError" and "load_pretrained was refused on other ranks" in mine[1]
    assert "rank 1:" in mine[1]


def bfloat16_compute(arch: str, names: tuple[str, ...]):
    """A float32 model parallelized with a bfloat16 MixedPrecisionPolicy on a DDP, a
    tensor-parallel or an expert-parallel mesh: it computes in bfloat16 (its logits, its
    experts' outputs), its parameters stay float32, and its first loss is one process's with
    the same policy to bfloat16's precision."""
    from devmesh.parallel import MixedPrecisionPolicy, parallelize

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=names)
    model = parallelize(make(arch).float(), mesh, mp_policy=policy)
    experts = set()
    for module in model.modules():
        if type(module).__name__.endswith("Experts"):
            module.register_forward_hook(lambda m, a, out: experts.add(str(out.dtype)))
    ids = _ids(0)[:2]
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    dtypes = {str(p.dtype) for p in model.parameters()}
    grads = {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
    return str(out.logits.dtype), dtypes, grads, out.loss.item(), experts


@pytest.mark.parametrize("arch, names", [("llama", ("dp_replicate",)), ("llama", ("tp",)),
                                         ("mixtral", ("ep",))], ids=str)
def test_mixed_precision_without_fsdp_computes_in_bfloat16_over_float32_weights(mesh_pool,
                                                                              arch, names):
    from devmesh.parallel.compute_dtype import compute_in
    from devmesh.parallel import MixedPrecisionPolicy

    one = make(arch).float()
    compute_in(one, MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    ids = _ids(0)[:2]
    want = one(input_ids=ids, labels=ids)
    assert want.logits.dtype == torch.bfloat16
    for logits, dtypes, grads, loss, experts in mesh_pool.run(bfloat16_compute, 2, arch,
                                                              names):
        assert logits == "torch.bfloat16" and dtypes == grads == {"torch.float32"}
        assert experts == ({"torch.bfloat16"} if arch == "mixtral" else set())
        assert loss == pytest.approx(want.loss.item(), rel=2e-2)


def _mixtral_block() -> torch.nn.Module:
    """transformers' own Mixtral sparse-MoE block (4 experts, top 2), float64, its weights
    drawn wide enough for the routing to matter."""
    import transformers as T
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = T.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                             experts_implementation="eager")
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(config).double()
    block.config = config
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return block


def mixtral_block_under_ep(ep_size: int, uneven: bool):
    """transformers' own Mixtral sparse-MoE block (router, SwiGLU experts with packed
    ``gate_up_proj``) with its experts split over ``ep``: each rank's output on its rows, its
    input's gradient and the experts' and router's gradients against one process on the
    whole batch (the router's averaged over the ranks, as data parallelism would)."""
    import torch.distributed as dist
    from devmesh.parallel import expert_parallel

    block = _mixtral_block()
    if uneven:  # nearly every token to experts 0 and 1: one rank gets most of them
        with torch.no_grad():
            block.gate.weight[:2] += 2.0
    ref = type(block)(block.config).double()
    ref.load_state_dict(block.state_dict())
    x = torch.randn(4, 6, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mesh = init_device_mesh("cpu", (ep_size,), mesh_dim_names=("ep",))
    expert_parallel(block.experts, mesh["ep"])
    rank = mesh.get_local_rank()
    mine = x.chunk(ep_size)[rank].clone().requires_grad_(True)
    out = block(mine)
    out.square().mean().backward()
    dist.all_reduce(block.gate.weight.grad)
    block.gate.weight.grad /= ep_size
    whole = x.clone().requires_grad_(True)
    ref_out = ref(whole)
    # the mean over each rank's rows, averaged over the ranks: the whole batch's mean
    ref_out.square().mean().backward()
    # a copy (deepcopy, pickling) computes as the block; a second split is refused
    copied = copy.deepcopy(block)
    buffer = io.BytesIO()
    torch.save(block, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    again = caught(lambda: expert_parallel(block.experts, mesh["ep"]))
    local = 4 // ep_size
    rows = slice(rank * (4 // ep_size), (rank + 1) * (4 // ep_size))
    experts = slice(rank * local, (rank + 1) * local)
    return {
        "shape": tuple(block.experts.gate_up_proj.shape),
        "out": (out - ref_out[rows]).abs().max().item(),
        "input_grad": (mine.grad / ep_size - whole.grad[rows]).abs().max().item(),
        "router": (block.gate.weight.grad - ref.gate.weight.grad).abs().max().item(),
        "gate_up": (block.experts.gate_up_proj.grad
                    - ref.experts.gate_up_proj.grad[experts]).abs().max().item(),
        "down": (block.experts.down_proj.grad
                 - ref.experts.down_proj.grad[experts]).abs().max().item(),
        "copies": [(m(mine.detach()) - out).abs().max().item() for m in (copied, loaded)],
        "again": again,
    }


@pytest.mark.parametrize("ep_size, uneven", [(2, False), (4, False), (2, True)])
def test_transformers_own_mixtral_experts_split_over_ep_compute_as_one_process(
        mesh_pool, ep_size, uneven):
    for result in mesh_pool.run(mixtral_block_under_ep, ep_size, ep_size, uneven):
        assert result["shape"] == (4 // ep_size, 96, 32), result
        for key in ("out", "input_grad", "router", "gate_up", "down"):
            assert result[key] <= 1e-12, result
        assert result["copies"] == [0.0, 0.0], result
        assert result["again"][0] == "ParallelizeError" and result["again"][1].endswith(
            f"is already split over an ep mesh (4 experts, {4 // ep_size} on this rank); "
            f"call expert_parallel once per experts module"), result


def mixtral_block_under_ep_and_tp():
    """transformers' Mixtral sparse-MoE block with its experts split over ``ep`` and every
    expert over ``tp`` too (torchtitan's expert tensor parallelism): each ep rank's rows,
    shared by its tp ranks; the output, the input's, the router's and the experts' gradients
    (each rank's experts, its features of each) against one process on the whole batch."""
    import torch.distributed as dist

    from devmesh.parallel import (ExpertsTensorParallel, expert_parallel, parallelize_module,
                                  state_dict)

    block = _mixtral_block()
    ref = type(block)(block.config).double()
    ref.load_state_dict(block.state_dict())
    x = torch.randn(4, 6, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    parallelize_module(block.experts, mesh["tp"], ExpertsTensorParallel())
    expert_parallel(block.experts, mesh["ep"])
    ep, tp = mesh["ep"].get_local_rank(), mesh["tp"].get_local_rank()
    mine = x.chunk(2)[ep].clone().requires_grad_(True)
    out = block(mine)
    out.square().mean().backward()
    dist.all_reduce(block.gate.weight.grad, group=mesh["ep"].get_group())
    block.gate.weight.grad /= 2
    whole = x.clone().requires_grad_(True)
    ref_out = ref(whole)
    ref_out.square().mean().backward()
    rows, experts, features = slice(2 * ep, 2 * ep + 2), slice(2 * ep, 2 * ep + 2), slice(
        24 * tp, 24 * tp + 24)  # 48 features of gate and of up, 24 per tp rank
    gate_up = ref.experts.gate_up_proj.grad[experts]
    full = state_dict(block.experts, full=True)
    return {
        "shape": tuple(block.experts.gate_up_proj.shape),
        "out": (out - ref_out[rows]).abs().max().item(),
        "input_grad": (mine.grad / 2 - whole.grad[rows]).abs().max().item(),
        "router": (block.gate.weight.grad - ref.gate.weight.grad).abs().max().item(),
        "gate_up": (block.experts.gate_up_proj.grad - torch.cat(
            [gate_up[:, :48][:, features], gate_up[:, 48:][:, features]], 1)).abs().max().item(),
        "down": (block.experts.down_proj.grad
                 - ref.experts.down_proj.grad[experts][:, :, features]).abs().max().item(),
        "state": all(torch.equal(full[k], v) for k, v in ref.experts.state_dict().items()),
    }


def test_mixtral_experts_split_over_ep_and_each_over_tp_compute_as_one_process(mesh_pool):
    for result in mesh_pool.run(mixtral_block_under_ep_and_tp, 4):
        assert result["shape"] == (2, 48, 32), result  # 2 of 4 experts, 24 + 24 features
        assert result["state"], result
        for key in ("out", "gate_up", "down"):
            assert result[key] <= 1e-12, result
        # through the router, whose routing weights are float32 (TP_EXPERTS_TOLERANCE)
        for key in ("input_grad", "router"):
            assert result[key] <= 1e-6, result


def _steps_against_one_process(ref, parameters, mesh, step) -> list[float]:
    """``STEPS`` AdamW steps of ``ref`` (one process, the whole batch) and of the
    parallelized model's ``parameters`` (``step(rows)``: its forward and backward on this
    data rank's rows, returning the loss where it is known, else ``None``); the gap between
    each known loss and one process's loss on the same rows."""
    names = mesh.mesh_dim_names
    index, ranks = 0, 1  # this rank's place among the data ranks (every data dim)
    for name in names:
        if name not in ("pp", "tp", "cp"):
            index = index * mesh[name].size() + mesh[name].get_local_rank()
            ranks *= mesh[name].size()
    per = BATCH // ranks
    rows = slice(index * per, (index + 1) * per)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(parameters, lr=1e-2)
    gaps = []
    for number in range(STEPS):
        ids = _ids(number)
        with torch.no_grad():
            want = ref(input_ids=ids[rows], labels=ids[rows]).loss.item()
        ref(input_ids=ids, labels=ids).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = step(ids[rows])
        opt.step()
        opt.zero_grad()
        if loss is not None:
            gaps.append(abs(loss - want))
    return gaps


CP_STRATEGIES = {  # name: (mesh shape, dim names, activation checkpointing)
    "ddp_cp": ((2, 2), ("dp_replicate", "cp"), "none"),
    "fsdp_cp_full_ac": ((2, 2), ("dp_shard", "cp"), "full"),
    "cp_tp_selective_ac": ((2, 2), ("cp", "tp"), "selective"),
}


def train_context_parallel(arch: str, strategy: str):
    """Context parallelism over ``cp`` (with DDP, FSDP or TP): each rank trains on its share
    of each sequence (``context_parallel_batch``); the loss averaged over ``cp`` against one
    process's on the same rows, and the full state dict against the one process's."""
    import torch.distributed as dist

    from devmesh.integrations.transformers import context_parallel_batch
    from devmesh.parallel import parallelize, state_dict

    shape, names, checkpointing = CP_STRATEGIES[strategy]
    ref = make(arch)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = parallelize(make(arch), mesh, activation_checkpointing=checkpointing)
    cp = mesh["cp"]

    def step(ids: torch.Tensor) -> float:
        loss = model(**context_parallel_batch(ids, cp)).loss
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=cp.get_group())
        return mean.item() / cp.size()

    gaps = _steps_against_one_process(ref, model.parameters(), mesh, step)
    full = state_dict(model, full=True)
    want_state = ref.state_dict()
    return {"losses": max(gaps),
            "params": max((full[k] - v).abs().max().item() for k, v in want_state.items()),
            "keys": list(full) == list(want_state)}


@pytest.mark.parametrize("arch, strategy", [(a, s) for a in ("llama", "qwen3")
                                            for s in CP_STRATEGIES] + [
    # windowed attention over the whole sequence: a window narrower than a rank's share
    # (transformers passes its mask of the rank's tokens) and wider (it passes none)
    ("mistral", "fsdp_cp_full_ac"), ("mistral-window8", "fsdp_cp_full_ac"),
    ("mistral-window8", "cp_tp_selective_ac"), ("gemma3", "ddp_cp"),
    ("cohere2", "fsdp_cp_full_ac"), ("llama4", "fsdp_cp_full_ac")])  # Llama 4: chunks of 8
def test_a_transformers_model_trains_under_context_parallelism_as_one_process(
        mesh_pool, arch, strategy):
    for result in mesh_pool.run(train_context_parallel, 4, arch, strategy):
        assert result["keys"], "the full state dict's keys differ from nn.Module's"
        # transformers' loss computes in float32 (logits.float()): each rank sums its own
        # tokens' there, one process takes the mean of all
        assert result["losses"] <= 1e-6, result
        assert result["params"] <= TOLERANCE.get(arch, 1e-12), result


def torchs_clip(params: list[torch.nn.Parameter], how: str) -> torch.Tensor:
    """Clip at 0.1 by torch's own functions, as ``how`` names: ``clip_grad_norm_`` (FSDP2
    code), or ``get_total_norm`` on the gradients then ``clip_grads_with_norm_`` (torchtitan's
    ``clip_grad_norm_`` and transformers' ``Trainer``); returns the norm."""
    if how == "clip_grad_norm_":
        return torch.nn.utils.clip_grad_norm_(params, 0.1)
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    torch.nn.utils.clip_grads_with_norm_(params, 0.1, norm)
    return norm


def clipped_by_torchs_clip_grad_norm(strategy: str, how: str):
    """Llama trained with gradients clipped by torch's own functions (:func:`torchs_clip`) at
    a norm below the gradients', by SGD: the norms torch's return and the trained parameters
    against one process clipped alike."""
    from devmesh.parallel import parallelize, state_dict

    shape, names, checkpointing = STRATEGIES[strategy]
    ref = make("llama")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = parallelize(make("llama"), mesh, activation_checkpointing=checkpointing)
    mine = _data_rows(mesh, names)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    norms = []
    for step in range(STEPS):
        ids = _ids(step)
        ref(input_ids=ids, labels=ids).loss.backward()
        want = torchs_clip(list(ref.parameters()), how)
        ref_opt.step()
        ref_opt.zero_grad()
        model(input_ids=ids[mine], labels=ids[mine]).loss.backward()
        got = torchs_clip(list(model.parameters()), how)
        opt.step()
        opt.zero_grad()
        norms.append(abs(float(got) - float(want)))
    full = state_dict(model, full=True)
    return max(norms), max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())


@pytest.mark.parametrize("strategy,how", [
    ("fsdp", "clip_grad_norm_"), ("fsdp_tp", "clip_grad_norm_"),
    ("hsdp_selective_ac", "clip_grad_norm_"), ("fsdp", "get_total_norm"),
    ("fsdp_tp", "get_total_norm")])
def test_torchs_clip_grad_norm_clips_a_sharded_model_by_its_global_norm(mesh_pool, strategy,
                                                                        how):
    """torch's clip_grad_norm_ on a devmesh-sharded model took each rank's own blocks' norm
    (0.73 for a global 1.38 under FSDP) and trained unlike one process (0.006); its
    get_total_norm on the gradients (torchtitan's and transformers' Trainer's way) alike."""
    for norms, params in mesh_pool.run(clipped_by_torchs_clip_grad_norm, 4, strategy, how):
        assert norms <= 1e-12 and params <= 1e-12, (norms, params)


def saved_by_its_own_save_pretrained(folder: str, names: tuple[str, ...],
                                     shape: tuple[int, ...]):
    """A parallelized Llama, trained a step, written by its own ``save_pretrained`` called
    on every rank as transformers' docs call it; its full state dict to compare."""
    from devmesh.parallel import parallelize, state_dict

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = parallelize(make("llama"), mesh)
    ids = _ids(0)
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    full = {k: v.clone() for k, v in state_dict(model, full=True).items()}
    model.save_pretrained(folder, is_main_process=torch.distributed.get_rank() == 0)
    return full


@pytest.mark.parametrize("names, shape", [(("dp_shard",), (4,)), (("dp_shard", "tp"), (2, 2))],
                         ids=str)
def test_a_parallelized_models_own_save_pretrained_writes_the_whole_model(mesh_pool, tmp_path,
                                                                          names, shape):
    """transformers' save_pretrained handed safetensors the ranks' sharded tensors ("invalid
    python storage"); the model's own method now writes the whole model."""
    import transformers as T

    full = mesh_pool.run(saved_by_its_own_save_pretrained, 4, str(tmp_path), names, shape)[0]
    back = T.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).state_dict()
    assert full.keys() == back.keys()
    assert all(torch.equal(back[k], v) for k, v in full.items())


def with_transformers_own_checkpointing(strategy: str, when: str):
    """Llama with transformers' own gradient checkpointing
    (``model.gradient_checkpointing_enable()``, before or after ``parallelize``): each
    recomputed layer gathers its parameters again. Trained against one process."""
    from devmesh.parallel import parallelize, state_dict

    shape, names, _ = STRATEGIES[strategy]
    ref = make("llama")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = make("llama")
    if when == "before":
        model.gradient_checkpointing_enable()
    model = parallelize(model, mesh)
    if when == "after":
        model.gradient_checkpointing_enable()
    model.train()
    rows = _data_rows(mesh, names)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        ids = _ids(step)
        ref(input_ids=ids, labels=ids).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        model(input_ids=ids[rows], labels=ids[rows]).loss.backward()
        opt.step()
        opt.zero_grad()
    full = state_dict(model, full=True)
    return max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())


@pytest.mark.parametrize("strategy, when", [("fsdp", "before"), ("fsdp_tp", "after")])
def test_transformers_own_gradient_checkpointing_trains_as_one_process(mesh_pool, strategy,
                                                                       when):
    for difference in mesh_pool.run(with_transformers_own_checkpointing, 4, strategy, when):
        assert difference <= 1e-12, difference


def trained_by_transformers_own_fsdp_and_tp(folder: str, checkpoint: str):
    """transformers' own parallelism (``from_pretrained(distributed_config=...)``: its
    tensor-parallel plan and torch's FSDP2 on a mesh it builds) over the process group
    devmesh's ``init_device_mesh`` started; devmesh's full state dict and sharded checkpoint
    of the result, loaded back into a second such model."""
    import transformers as T
    from devmesh.parallel import load_checkpoint, save_checkpoint, state_dict

    init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    config = T.DistributedConfig(tp_size=2, fsdp_size=2)
    model = T.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float64,
                                               distributed_config=config)
    fsdp = model._device_mesh["fsdp"].get_local_rank()  # the mesh transformers built
    per = BATCH // 2
    losses = _train(model, slice(fsdp * per, (fsdp + 1) * per))
    full = {k: v.clone() for k, v in state_dict(model, full=True).items()}
    save_checkpoint(checkpoint, model)
    again = T.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float64,
                                               distributed_config=config)
    load_checkpoint(checkpoint, again)
    reloaded = state_dict(again, full=True)
    return fsdp, losses, full, max((reloaded[k] - v).abs().max().item()
                                   for k, v in full.items())


def test_transformers_own_fsdp_and_tp_over_devmeshs_process_group_train_as_one_process(
        mesh_pool, tmp_path):
    """A model transformers distributes itself trains as one process on devmesh's process
    group, and devmesh's state dict and checkpoints read its torch DTensors: the whole
    model, and a checkpoint a plain model in this process loads."""
    import transformers as T
    from devmesh.parallel import load_checkpoint

    torch.manual_seed(1)
    T.LlamaForCausalLM(T.LlamaConfig(**COMMON)).double().save_pretrained(tmp_path / "in")
    ref = T.LlamaForCausalLM.from_pretrained(tmp_path / "in", dtype=torch.float64)
    results = mesh_pool.run(trained_by_transformers_own_fsdp_and_tp, 4, str(tmp_path / "in"),
                            str(tmp_path / "checkpoint"))
    per, halves = BATCH // 2, []  # one process on the whole batch; its loss on each half
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(STEPS):
        ids = _ids(step)
        with torch.no_grad():
            halves.append([ref(input_ids=ids[i * per:(i + 1) * per],
                               labels=ids[i * per:(i + 1) * per]).loss.item() for i in (0, 1)])
        ref(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    want = ref.state_dict()
    for fsdp, losses, full, reloaded in results:
        assert list(full) == list(want)
        assert max((full[k] - v).abs().max().item() for k, v in want.items()) <= 1e-12
        assert max(abs(a - h[fsdp]) for a, h in zip(losses, halves, strict=True)) <= 1e-12
        assert reloaded == 0.0
    plain = T.LlamaForCausalLM.from_pretrained(tmp_path / "in", dtype=torch.float64)
    load_checkpoint(str(tmp_path / "checkpoint"), plain)
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in results[0][2].items())


def handed_to_trainer(folder: str):
    """transformers' Trainer given a Llama devmesh parallelized (FSDP × TP): accelerate
    wraps it in torch's DDP over the whole world, which would broadcast rank 0's blocks over
    every rank's and average different blocks. What ``train()`` raises, and whether the
    blocks are still this rank's own."""
    import transformers as T
    from devmesh.parallel import parallelize
    from helpers import caught

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = parallelize(make("llama"), mesh)
    before = [p.detach().clone() for p in model.parameters()]
    rows = [{"input_ids": ids, "labels": ids} for ids in _ids(0)]
    args = T.TrainingArguments(output_dir=folder, per_device_train_batch_size=1, max_steps=1,
                               report_to=[], save_strategy="no", use_cpu=True)
    refusal = caught(T.Trainer(model=model, args=args, train_dataset=rows).train)
    return refusal, all(torch.equal(a, b) for a, b in zip(before, model.parameters(),
                                                          strict=True))


def test_transformers_trainer_over_a_devmesh_parallelized_model_is_refused_by_name(
        mesh_pool, tmp_path):
    """It trained, silently unlike one process (every rank's blocks became rank 0's)."""
    for refusal, kept in mesh_pool.run(handed_to_trainer, 4, str(tmp_path)):
        assert refusal is not None and refusal[0] == "ParallelizeError", refusal
        assert "torch's DistributedDataParallel over SavesWholeFSDPLlamaForCausalLM" in refusal[1]
        assert "transformers' Trainer wraps it so" in refusal[1]
        assert kept


def generated(arch: str, strategy: str):
    """Greedy generation (transformers' ``generate``, its key/value cache) and the logits of
    a parallelized model against the same model in one process."""
    from devmesh.parallel import parallelize

    shape, names, _ = STRATEGIES[strategy]
    ref = make(arch)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = parallelize(make(arch), mesh)
    ids = _ids(0)[:2, :6]
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        logits = (ref(input_ids=ids).logits - model(input_ids=ids).logits).abs().max().item()
    return torch.equal(want, got), logits


@pytest.mark.parametrize("arch, strategy", [("llama", "fsdp_tp"), ("gemma3", "fsdp"),
                                            ("qwen3_moe", "fsdp_ep")])
def test_a_parallelized_model_generates_as_one_process(mesh_pool, arch, strategy):
    for same, logits in mesh_pool.run(generated, 4, arch, strategy):
        assert same and logits <= 1e-12, (same, logits)


def cp_alone_shards_parameters():
    """With cp and no data-parallel dim, the parameters are sharded over cp (torchtitan's
    FSDP over dp_shard x cp): each rank holds its share of every block's weights."""
    from devmesh.parallel import parallelize
    from devmesh.parallel.param import get_layout

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    model = parallelize(make("llama"), mesh)
    norm = model.model.layers[0].input_layernorm.weight  # not split over tp: over cp only
    layout = get_layout(norm)
    return (tuple(layout.mesh.mesh_dim_names), tuple(norm.shape),
            tuple(layout.full_shape))


def test_cp_without_a_data_dim_shards_the_parameters_over_it(mesh_pool):
    for names, local, full in mesh_pool.run(cp_alone_shards_parameters, 4):
        assert "cp" in names and local == (full[0] // 2,), (names, local, full)


PP_STRATEGIES = {  # name: (mesh shape, dim names, schedule, micro-batches, layers, checkpointing)
    "pp_fsdp": ((2, 2), ("pp", "dp_shard"), "1f1b", 2, 2, "none"),
    "pp_ddp_interleaved_full_ac": ((2, 2), ("pp", "dp_replicate"), "interleaved-1f1b", 2, 4,
                                   "full"),
    "pp_tp_dualpipe_v_full_ac": ((2, 2), ("pp", "tp"), "dualpipe-v", 4, 4, "full"),
    "pp_tp_selective_ac": ((2, 2), ("pp", "tp"), "gpipe", 2, 2, "selective"),
    "pp_ep": ((2, 2), ("pp", "ep"), "1f1b", 2, 2, "none"),
    "pp_fsdp_ep": ((2, 2, 2), ("pp", "dp_shard", "ep"), "1f1b", 1, 2, "none"),
}


def train_pipelined(arch: str, strategy: str):
    """Pipeline stages over ``pp`` (the model's declared plan) with FSDP, DDP, TP or EP on
    the other dim: the last stage's loss against one process's on the same rows, and the
    whole model's state dict (every stage's) against the one process's."""
    from devmesh.parallel import parallelize

    shape, names, schedule, microbatches, layers, checkpointing = PP_STRATEGIES[strategy]
    ref = make(arch, layers)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    runner = parallelize(make(arch, layers), mesh, schedule=schedule,
                         microbatches=microbatches, activation_checkpointing=checkpointing)

    def step(ids: torch.Tensor) -> float | None:
        loss = runner.step(ids, targets=ids)
        return None if loss is None else loss.item()  # on the last stage's ranks

    gaps = _steps_against_one_process(ref, runner.module.parameters(), mesh, step)
    full = runner.state_dict(full=True)
    want_state = ref.state_dict()
    return {"losses": max(gaps, default=0.0), "had_loss": bool(gaps),
            "stages": {s: type(m).__name__ for s, m in runner.stages.items()},
            "params": max((full[k] - v).abs().max().item() for k, v in want_state.items()),
            "keys": sorted(full) == sorted(want_state)}


@pytest.mark.parametrize("arch, strategy", [
    ("llama", "pp_fsdp"), ("gemma3", "pp_ddp_interleaved_full_ac"),
    ("qwen3", "pp_tp_dualpipe_v_full_ac"), ("gemma3", "pp_tp_selective_ac"),
    ("mixtral", "pp_ep"), ("mixtral", "pp_fsdp_ep"),
    ("qwen3_moe", "pp_tp_selective_ac"),  # every expert split over tp in its stage
    # Granite scales inputs_embeds in its base model's forward: once, on the first stage
    ("granite", "pp_fsdp"), ("granite", "pp_ddp_interleaved_full_ac"),
    ("gpt_oss", "pp_ep"),
    ("deepseek_v3", "pp_fsdp_ep")])  # its dense first layer alone on stage 0
def test_a_transformers_model_trains_in_pipeline_stages_as_one_process(mesh_pool, arch,
                                                                       strategy):
    shape = PP_STRATEGIES[strategy][0]
    world = shape[0] * shape[1] * (shape[2] if len(shape) > 2 else 1)
    results = mesh_pool.run(train_pipelined, world, arch, strategy)
    # a last stage per data rank
    assert sum(r["had_loss"] for r in results) == world // shape[0], results
    for result in results:
        assert result["keys"], "the stages' state dicts together are not the model's"
        # transformers computes the loss in float32 (logits.float())
        assert result["losses"] <= 1e-6, result
        assert result["params"] <= TOLERANCE.get(arch, 1e-12), result


def train_pipelined_context_parallel(arch: str):
    """Pipeline stages over ``pp`` with context parallelism over ``cp``: each stage's
    attention runs the ring over ``cp``; the first stage takes this rank's tokens, every
    stage their whole-sequence positions (``input_kwargs``), the last stage the targets
    shifted over the whole sequence, summed and divided by the batch's count of them, so
    the loss averaged over ``cp`` (and over micro-batches, by the runner) is the batch's
    mean. The loss and the whole model against one process's."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from devmesh.integrations.transformers import context_parallel_batch
    from devmesh.parallel import parallelize

    ref = make(arch)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "cp"))
    microbatches = 2
    runner = parallelize(make(arch), mesh, schedule="1f1b", microbatches=microbatches,
                         loss_fn=lambda logits, targets: F.cross_entropy(
                             logits.flatten(0, 1).float(), targets.flatten(),
                             ignore_index=-100, reduction="sum") * microbatches / count[0])
    cp = mesh["cp"]
    count = [None]

    def step(ids: torch.Tensor) -> float | None:
        batch = context_parallel_batch(ids, cp)
        count[0] = batch["num_items_in_batch"]
        loss = runner.step(batch["input_ids"], targets=batch["shift_labels"],
                           input_kwargs={"position_ids": batch["position_ids"],
                                         "attention_mask": batch["attention_mask"]})
        if loss is None:
            return None
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=cp.get_group())
        return mean.item() / cp.size()

    gaps = _steps_against_one_process(ref, runner.module.parameters(), mesh, step)
    full = runner.state_dict(full=True)
    want_state = ref.state_dict()
    return {"losses": max(gaps, default=0.0), "had_loss": bool(gaps),
            "params": max((full[k] - v).abs().max().item() for k, v in want_state.items()),
            "keys": sorted(full) == sorted(want_state)}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # Gemma 3: sliding layers, per stage
def test_a_pipelined_transformers_model_trains_under_context_parallelism_as_one_process(
        mesh_pool, arch):
    results = mesh_pool.run(train_pipelined_context_parallel, 4, arch)
    assert sum(r["had_loss"] for r in results) == 2, results  # the last stage's cp ranks
    for result in results:
        assert result["keys"], "the stages' state dicts together are not the model's"
        assert result["losses"] <= 1e-6, result
        assert result["params"] <= TOLERANCE.get(arch, 1e-12), result


def packed_experts_through_every_state_path(folder: str, arch: str = "mixtral"):
    """Mixtral's (or Llama 4's, stored (E, in, out): packed on dim -1) experts split over tp
    (gate and up packed in one weight, each part split)
    with FSDP: every way a state leaves and comes back gives the parameters in their own
    shapes, and a fresh model of the same layout, or of another, takes it back equal."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from devmesh.parallel import (load_checkpoint, load_state_dict, parallelize,
                                  save_checkpoint, state_dict)
    from devmesh.parallel.checkpoint.torch_dcp import load_torch_dcp

    names = ("dp_shard", "tp")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    model = parallelize(make(arch), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = _ids(0)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    want = {k: v.clone() for k, v in state_dict(model, full=True).items()}
    shapes = {k: tuple(v.shape) for k, v in make(arch).state_dict().items()}
    out = {"full shapes": {k: tuple(v.shape) for k, v in want.items()} == shapes}

    def fresh(mesh_=mesh):
        other = parallelize(make(arch), mesh_)
        with torch.no_grad():
            for p in other.parameters():
                p.zero_()
        return other

    def equal(other) -> bool:
        got = state_dict(other, full=True)
        return all(torch.equal(got[k], v) for k, v in want.items())

    module_state = model.state_dict()  # DTensors, each in its parameter's own shape
    key = next(k for k in module_state if k.endswith("experts.gate_up_proj"))
    packed = module_state[key]
    out["module shapes"] = {k: tuple(v.shape) for k, v in module_state.items()} == shapes
    out["dtensor full"] = (isinstance(packed, DTensor) and torch.equal(
        packed.full_tensor(), want[key]))
    other = fresh()
    other.load_state_dict(module_state)
    out["module load"] = equal(other)
    other = fresh()
    load_state_dict(other, state_dict(model, full=False))
    out["sharded load"] = equal(other)
    other = fresh()
    load_state_dict(other, want)
    out["full load"] = equal(other)
    states = opt.state_dict()["state"]
    out["optimizer shapes"] = sorted(tuple(s["exp_avg"].shape) for s in states.values()) == \
        sorted(shapes[k] for k in shapes if k in dict(model.named_parameters()))

    save_checkpoint(f"{folder}/devmesh", model, opt)
    other = fresh()
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    load_checkpoint(f"{folder}/devmesh", other, other_opt)
    out["checkpoint"] = equal(other)
    out["checkpoint optimizer"] = all(  # the same layout: the same blocks
        torch.equal(opt.state[p]["exp_avg"], other_opt.state[q]["exp_avg"])
        for p, q in zip(model.parameters(), other.parameters(), strict=True))
    fsdp_only = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    other = fresh(fsdp_only)  # another layout: the experts whole on every tp rank
    load_checkpoint(f"{folder}/devmesh", other)
    out["checkpoint into another layout"] = equal(other)

    # torch's DCP writes one box per rank, which a packed parameter's block is not: its
    # checkpoint of the whole model, as another job (any layout) wrote it, is read here
    dcp.save({"model": want}, checkpoint_id=f"{folder}/dcp")
    other = fresh()
    load_torch_dcp(f"{folder}/dcp", other)
    out["torch dcp"] = equal(other)
    return out


@pytest.mark.parametrize("arch", ["mixtral", "llama4"])
def test_experts_split_over_tp_leave_and_return_through_every_state_path(mesh_pool, tmp_path,
                                                                         arch):
    for result in mesh_pool.run(packed_experts_through_every_state_path, 4, str(tmp_path),
                                arch):
        assert all(result.values()), result
