"""transformers models under FSDP computing in bfloat16 over float32 parameters, reducing in
float32 (torchtitan's everyday setting): devmesh's ``parallelize`` against torch's own
FSDP2 (``fully_shard`` on each decoder layer, then the model, as torchtitan applies it) on
the same 4 ranks, data and policy. bfloat16 rounding makes one process a loose reference;
torch's run is an exact one: the losses and the trained parameters are equal bit for bit."""

from __future__ import annotations

import pytest
import torch

from helpers import TorchRuns

transformers = pytest.importorskip("transformers")

VOCAB, STEPS = 64, 3
ARCHS = ("llama", "qwen3", "mixtral")


def _model(arch: str) -> torch.nn.Module:
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if arch == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**common))
    if arch == "qwen3":  # q/k norms
        return T.Qwen3ForCausalLM(T.Qwen3Config(**common, head_dim=8))
    return T.MixtralForCausalLM(T.MixtralConfig(**common, num_local_experts=4,
                                                num_experts_per_tok=2))


def trained(library: str, arch: str) -> dict:
    """This rank's losses (one row of each batch) and the trained full state dict, the model
    sharded over 4 ranks by ``library``'s FSDP in bfloat16 over float32."""
    model = _model(arch)
    if library == "devmesh":
        from devmesh import init_device_mesh
        from devmesh.parallel import MixedPrecisionPolicy, parallelize, state_dict

        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
        model = parallelize(model, mesh, mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    rank = torch.distributed.get_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(step))
        mine = ids[rank:rank + 1]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if library == "devmesh":
        full = state_dict(model, full=True)
    else:
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                for k, v in model.state_dict().items()}
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in full.items()}}


@pytest.fixture(scope="module")
def torch_runs() -> TorchRuns:
    return TorchRuns({4: [(trained, ("torch", arch)) for arch in ARCHS]})


@pytest.mark.parametrize("arch", ARCHS)
def test_fsdp_in_bfloat16_trains_a_transformers_model_as_torchs_fsdp2(mesh_pool, torch_runs,
                                                                      arch):
    ours = mesh_pool.run(trained, 4, "devmesh", arch)
    theirs = torch_runs(4, trained, "torch", arch)
    for a, b in zip(ours, theirs, strict=True):
        assert a["losses"] == b["losses"]
        assert a["params"].keys() == b["params"].keys()
        for key, value in b["params"].items():
            assert torch.equal(a["params"][key], value), key
