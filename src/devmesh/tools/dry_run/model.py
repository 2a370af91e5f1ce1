"""The transformer a dry run builds: a Llama-shaped decoder described by a few numbers.

:class:`TransformerConfig` holds what sizes a training step (layers, width, heads, grouped
key/value heads, feed-forward width, vocabulary, sequence, global batch, dtype, and a mixture
of experts in place of some feed-forwards); presets name well-known shapes (``llama3-8b``,
``llama3-70b``, ``llama3-405b``; ``deepseek-v3`` and ``llama4-scout`` / ``llama4-maverick``
shaped mixtures of experts; ``tiny`` and ``tiny-moe`` for tests).
The modules are plain PyTorch and run on any device, ``meta`` included (a dry run computes
shapes only). Attention reads its head count from its projection's output width, so a
tensor-parallel split of the projections (heads divided among ranks) runs unchanged, as in
torchtitan's Llama.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from devmesh._torch_compat import cpu_flash_attention
from devmesh.errors import DryRunError as ConfigError
from devmesh.layout.schedule import stage_bounds

__all__ = ["TransformerConfig", "PRESETS", "read_config", "Transformer", "Block",
           "MoEFeedForward", "Experts", "stage_layers", "tp_plan"]


@dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only transformer and the batch it trains on (``batch``: sequences per
    step, over all data-parallel ranks)."""

    layers: int
    dim: int
    heads: int
    kv_heads: int
    ffn_dim: int
    vocab: int
    seq: int = 2048
    batch: int = 8
    dtype: str = "bfloat16"
    #: a mixture of experts in place of the feed-forward of some layers (0: a dense model);
    #: each token goes to ``top_k`` of them, each a SwiGLU of ``expert_ffn_dim`` (0: the
    #: ``ffn_dim``), and through ``shared_experts`` more (one SwiGLU that much wider)
    experts: int = 0
    top_k: int = 1
    expert_ffn_dim: int = 0
    shared_experts: int = 0
    #: the first ``dense_layers`` keep the dense feed-forward (DeepSeek-V3's 3); after them
    #: every ``moe_every``-th layer has experts (Llama 4 Maverick's 2: layers 1, 3, 5, ...)
    dense_layers: int = 0
    moe_every: int = 1

    _MAY_BE_ZERO = ("experts", "expert_ffn_dim", "shared_experts", "dense_layers")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            least = 0 if f.name in self._MAY_BE_ZERO else 1
            if f.name != "dtype" and (not isinstance(value, int) or value < least):
                raise ConfigError(f"model config: {f.name} must be "
                                  f"{'a non-negative' if least == 0 else 'a positive'} "
                                  f"integer, got {value!r}")
        if self.experts and self.top_k > self.experts:
            raise ConfigError(f"model config: top_k {self.top_k} is more than the "
                              f"{self.experts} experts")
        if self.dim % self.heads:
            raise ConfigError(f"model config: dim {self.dim} is not a multiple of heads "
                              f"{self.heads}")
        if self.heads % self.kv_heads:
            raise ConfigError(f"model config: heads {self.heads} is not a multiple of "
                              f"kv_heads {self.kv_heads}")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ConfigError(f"model config: dtype {self.dtype!r} is not a torch dtype "
                              "(e.g. bfloat16, float32)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def expert_hidden(self) -> int:
        return self.expert_ffn_dim or self.ffn_dim

    def has_experts(self, layer: int) -> bool:
        """Whether layer ``layer`` (from 0) has a mixture of experts."""
        return (self.experts > 0 and layer >= self.dense_layers
                and (layer - self.dense_layers) % self.moe_every == self.moe_every - 1)

    def feed_forward_parameters(self, layer: int, *, active: bool = False) -> int:
        """Layer ``layer``'s feed-forward parameters (``active``: those one token uses)."""
        if not self.has_experts(layer):
            return 3 * self.dim * self.ffn_dim
        experts = self.top_k if active else self.experts
        return (self.dim * self.experts  # the router
                + (experts + self.shared_experts) * 3 * self.dim * self.expert_hidden)

    def parameters(self) -> int:
        """The model's parameter count (embedding and head untied)."""
        kv = self.kv_heads * self.head_dim
        attention = 2 * self.dim * self.dim + 2 * self.dim * kv
        blocks = sum(attention + self.feed_forward_parameters(i) + 2 * self.dim
                     for i in range(self.layers))
        return blocks + 2 * self.vocab * self.dim + self.dim

    def describe(self) -> str:
        moe = (f"; {sum(map(self.has_experts, range(self.layers)))} layers of {self.experts} "
               f"experts (top {self.top_k}, ffn {self.expert_hidden}"
               + (f", {self.shared_experts} shared" if self.shared_experts else "") + ")"
               if self.experts else "")
        return (f"{self.layers} layers, dim {self.dim}, {self.heads} heads ({self.kv_heads} "
                f"kv), ffn {self.ffn_dim}, vocab {self.vocab}{moe}; "
                f"{self.parameters() / 1e9:.2f}B parameters; batch {self.batch} x {self.seq} "
                f"tokens in {self.dtype}")


PRESETS: dict[str, TransformerConfig] = {
    "llama3-8b": TransformerConfig(32, 4096, 32, 8, 14336, 128256, seq=8192, batch=1024),
    "llama3-70b": TransformerConfig(80, 8192, 64, 8, 28672, 128256, seq=8192, batch=1024),
    "llama3-405b": TransformerConfig(126, 16384, 128, 8, 53248, 128256, seq=8192, batch=2048),
    # DeepSeek-V3's shape (671B): its multi-head latent attention taken as plain attention
    # of 128 heads (MLA's low-rank projections are not modelled), 256 routed experts (top 8)
    # and one shared in every layer after the first 3 dense ones
    "deepseek-v3": TransformerConfig(61, 7168, 128, 128, 18432, 129280, seq=4096, batch=1536,
                                     experts=256, top_k=8, expert_ffn_dim=2048,
                                     shared_experts=1, dense_layers=3),
    # Llama 4 Scout (109B: 16 experts, top 1, one shared, in every layer) and Maverick
    # (400B: 128 experts in every second layer, dense ones between)
    "llama4-scout": TransformerConfig(48, 5120, 40, 8, 16384, 202048, seq=8192, batch=512,
                                      experts=16, top_k=1, expert_ffn_dim=8192,
                                      shared_experts=1),
    "llama4-maverick": TransformerConfig(48, 5120, 40, 8, 16384, 202048, seq=8192, batch=512,
                                         experts=128, top_k=1, expert_ffn_dim=8192,
                                         shared_experts=1, moe_every=2),
    "tiny": TransformerConfig(4, 64, 8, 4, 128, 256, seq=16, batch=16, dtype="float32"),
    "tiny-moe": TransformerConfig(4, 64, 8, 4, 128, 256, seq=16, batch=16, dtype="float32",
                                  experts=8, top_k=2, expert_ffn_dim=32, shared_experts=1,
                                  dense_layers=1),
}


def read_config(text: str) -> TransformerConfig:
    """A config from a preset name, a JSON file of the fields, or ``NAME:key=value,...``
    overriding a preset's fields (``llama3-8b:seq=4096,batch=512``)."""
    name, _, overrides = text.partition(":")
    if name in PRESETS:
        config = PRESETS[name]
    elif Path(name).is_file():
        try:
            values = json.loads(Path(name).read_text())
            config = TransformerConfig(**values)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"model config {name}: {exc} (fields: "
                              f"{', '.join(f.name for f in fields(TransformerConfig))})") from exc
    else:
        raise ConfigError(f"model config {name!r} is neither a preset ({', '.join(PRESETS)}) "
                          "nor a JSON file")
    if overrides:
        known = {f.name: f.type for f in fields(TransformerConfig)}
        changes = {}
        for item in overrides.split(","):
            key, _, value = item.partition("=")
            if key not in known or not value:
                raise ConfigError(f"model config override {item!r}: use key=value with keys "
                                  f"{', '.join(known)}")
            changes[key] = value if key == "dtype" else int(value)
        config = replace(config, **changes)
    return config


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-5)


class Attention(nn.Module):
    """Grouped-query causal self-attention; heads read from the projections' widths."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        kv = config.kv_heads * config.head_dim
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, kv, bias=False)
        self.wv = nn.Linear(config.dim, kv, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.routed = False  # scaled_dot_product_attention is context parallelism's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        if q.is_meta and not self.routed:
            # on meta, torch picks the math path, whose saved scores grow with seq x seq; a
            # real run uses a fused kernel saving q, k, v, the output and its log-sum-exp:
            # run that one (its meta kernel), k and v repeated to the query heads
            if k.shape[1] != q.shape[1]:
                k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
            out = cpu_flash_attention()(q, k, v, 0.0, True)[0]
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, config: TransformerConfig, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or config.ffn_dim
        self.w1 = nn.Linear(config.dim, hidden, bias=False)
        self.w3 = nn.Linear(config.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """``num_experts`` SwiGLU MLPs, their weights stacked along dim 0 (``w1``/``w3``
    ``(experts, hidden, dim)``, ``w2`` ``(experts, dim, hidden)``) and called as transformers'
    experts modules are, ``(hidden_states, top_k_index, top_k_weights)``: so expert
    parallelism splits them as it splits a transformers model's."""

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) / dim ** 0.5)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, dim) / dim ** 0.5)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden) / hidden ** 0.5)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        from devmesh.parallel.expert_parallel.dispatch import expert_counts

        device = hidden_states.device
        tokens, k = top_k_index.shape
        expert = top_k_index.reshape(-1).to(device)
        order = torch.argsort(expert, stable=True)  # each expert's tokens one run
        token = torch.arange(tokens, device=device).repeat_interleave(k)[order]
        runs = hidden_states[token].split(expert_counts(expert, self.num_experts))
        out = torch.cat([F.linear(F.silu(F.linear(x, self.w1[e])) * F.linear(x, self.w3[e]),
                                  self.w2[e]) for e, x in enumerate(runs)])
        weighted = out * top_k_weights.reshape(-1).to(device)[order][:, None].to(out.dtype)
        return torch.zeros_like(hidden_states).index_add_(0, token, weighted)


class MoEFeedForward(nn.Module):
    """A router, ``experts`` routed SwiGLU experts (``top_k`` per token, weighted by the
    router's probabilities) and the shared experts every token goes through.

    Which experts a token goes to is the one thing a dry run cannot know (it depends on the
    values), so this router is balanced by construction: token ``t``'s ``j``-th choice is
    expert ``(t * top_k + j) mod experts``, every expert getting an equal share. It still
    computes its scores (their FLOPs and saved bytes), and the choices' scores weigh the
    outputs, so the router trains."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.router = nn.Linear(config.dim, config.experts, bias=False)
        self.experts = Experts(config.experts, config.dim, config.expert_hidden)
        self.shared = (FeedForward(config, config.shared_experts * config.expert_hidden)
                       if config.shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        scores = torch.softmax(self.router(flat).float(), dim=-1)
        experts = scores.shape[-1]
        chosen = (torch.arange(flat.shape[0] * self.top_k, device=x.device)
                  % experts).view(-1, self.top_k)
        out = self.experts(flat, chosen, scores.gather(-1, chosen).to(x.dtype))
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view(x.shape)


class Block(nn.Module):
    def __init__(self, config: TransformerConfig, layer: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim)
        self.feed_forward = (MoEFeedForward(config) if config.has_experts(layer)
                             else FeedForward(config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Layers ``first..last-1`` of the model; the embedding on the stage holding layer 0,
    the final norm and output head on the one holding the last layer (a pipeline stage), or
    where ``head`` says (a stage built with fewer of its blocks)."""

    def __init__(self, config: TransformerConfig, first: int = 0, last: int | None = None,
                 *, head: bool | None = None) -> None:
        super().__init__()
        last = config.layers if last is None else last
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab, config.dim) if first == 0 else None
        self.layers = nn.ModuleDict({str(i): Block(config, i) for i in range(first, last)})
        end = last == config.layers if head is None else head
        self.norm = RMSNorm(config.dim) if end else None
        self.output = nn.Linear(config.dim, config.vocab, bias=False) if end else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.output(self.norm(h))
        return h


def stage_layers(config: TransformerConfig, stages: int, stage: int) -> tuple[int, int]:
    """The layers of pipeline stage ``stage`` of ``stages``: as even as they divide, the
    earlier stages taking one more (torchtitan's even split)."""
    if stages > config.layers:
        raise ConfigError(f"{stages} pipeline stages for {config.layers} layers: use at most "
                          f"{config.layers} stages")
    return stage_bounds(config.layers, stages)[stage]


def tp_plan(model: Transformer) -> dict[str, object]:
    """torchtitan's tensor-parallel plan for its Llama, with sequence and loss parallelism:
    the embedding split by rows (vocabulary) and the head by columns (its logits stay split
    over the vocabulary for the loss, which runs under ``loss_parallel()``); norms and the
    residual stream split along the sequence between blocks; q/k/v and w1/w3 column-wise
    after an all-gather of the sequence, wo and w2 row-wise ending in a reduce-scatter to it.
    Whichever parts this stage holds.

    A mixture-of-experts block's feed-forward as torchtitan's ``apply_moe_ep_tp`` splits it
    without ``ep``: its tokens gathered from the sequence, every routed expert split over
    tp (w1/w3 by their hidden features, w2 by its inputs) and the shared experts likewise,
    both leaving partial sums that one reduce-scatter returns to the sequence; the router
    whole on every rank."""
    from devmesh.parallel import (ColwiseParallel, ExpertsTensorParallel, PrepareModuleInput,
                                  PrepareModuleInputOutput, RowwiseParallel, SequenceParallel)
    from devmesh.tensor import Partial, Replicate, Shard

    plan: dict[str, object] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Shard(1))
    if model.output is not None:
        plan["norm"] = SequenceParallel()
        plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                         use_local_output=False)
    for name, block in model.layers.items():
        moe = isinstance(block.feed_forward, MoEFeedForward)
        plan[f"layers.{name}.attention"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        for norm in ("attention_norm", "ffn_norm"):
            plan[f"layers.{name}.{norm}"] = SequenceParallel()
        for linear in ("attention.wq", "attention.wk", "attention.wv"):
            plan[f"layers.{name}.{linear}"] = ColwiseParallel()
        plan[f"layers.{name}.attention.wo"] = RowwiseParallel(output_layouts=Shard(1))
        if not moe:
            plan[f"layers.{name}.feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            for linear in ("w1", "w3"):
                plan[f"layers.{name}.feed_forward.{linear}"] = ColwiseParallel()
            plan[f"layers.{name}.feed_forward.w2"] = RowwiseParallel(output_layouts=Shard(1))
            continue
        plan[f"layers.{name}.feed_forward"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
            use_local_input=True, output_layouts=(Partial(),),
            desired_output_layouts=(Shard(1),))
        plan[f"layers.{name}.feed_forward.experts"] = ExpertsTensorParallel(
            colwise={"w1": 1, "w3": 1}, rowwise=("w2",), output_layouts=Partial())
        if block.feed_forward.shared is not None:
            for linear in ("w1", "w3"):
                plan[f"layers.{name}.feed_forward.shared.{linear}"] = ColwiseParallel()
            plan[f"layers.{name}.feed_forward.shared.w2"] = RowwiseParallel(
                output_layouts=Partial())
    return plan
