"""A block of a tensor transformers merges from per-expert checkpoint tensors, read from
those tensors alone, equals the same block of the merged tensor (transformers' own
``MergeModulelist`` and ``Concatenate``), for every block, and reads no expert or row
outside it."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from devmesh.integrations.checkpoint_names import Stacked, Stored


class _Slice:
    """A stand-in for a safetensors slice that records the elements read."""

    def __init__(self, tensor: torch.Tensor, reads: list[int]) -> None:
        self.tensor, self.reads = tensor, reads

    def get_shape(self):
        return list(self.tensor.shape)

    def __getitem__(self, index):
        out = self.tensor[index].clone()
        self.reads.append(out.numel())
        return out


def _source(parts: list[list[torch.Tensor]], concat_dim: int | None):
    tensors = {}
    stacked = []
    for p, experts in enumerate(parts):
        stored = []
        for e, tensor in enumerate(experts):
            key = f"experts.{e}.w{p}.weight"
            tensors[key] = tensor
            stored.append(Stored(key, Path("model.safetensors")))
        stacked.append(tuple(stored))
    reads: list[int] = []
    return Stacked(tuple(stacked), concat_dim), (lambda s: _Slice(tensors[s.key], reads)), reads


def _merged(parts, concat_dim):
    """transformers' own operations on the whole checkpoint."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    patterns = [f"p{i}" for i in range(len(parts))]
    out = MergeModulelist(dim=0).convert({p: list(t) for p, t in zip(patterns, parts)},
                                         source_patterns=patterns, target_patterns=["t"])
    if concat_dim is None:
        return out["t"]
    return Concatenate(dim=concat_dim).convert(out, source_patterns=patterns,
                                               target_patterns=["t"])["t"]


@pytest.mark.parametrize("concat_dim", [None, 1, 2])
def test_every_block_equals_the_merged_tensors_and_reads_only_itself(concat_dim):
    torch.manual_seed(0)
    experts = 3
    if concat_dim is None:
        parts = [[torch.randn(4, 2) for _ in range(experts)]]
    elif concat_dim == 1:  # Mixtral's gate and up: rows of each expert's two tensors
        parts = [[torch.randn(3, 2) for _ in range(experts)],
                 [torch.randn(2, 2) for _ in range(experts)]]
    else:
        parts = [[torch.randn(2, 3) for _ in range(experts)],
                 [torch.randn(2, 1) for _ in range(experts)]]
    whole = _merged(parts, concat_dim)
    source, open_, reads = _source(parts, concat_dim)
    assert source.shape(open_) == tuple(whole.shape)
    spans = [[(s, n) for s in range(size + 1) for n in range(size - s + 1)]
             for size in whole.shape]
    for bounds in itertools.product(*spans):
        reads.clear()
        block = source.read(open_, bounds)
        want = whole
        for d, (start, size) in enumerate(bounds):
            want = want.narrow(d, start, size)
        assert block.shape == want.shape and torch.equal(block, want), bounds
        assert sum(reads) == want.numel() or want.numel() == 0, (bounds, reads)


def test_parts_that_cannot_be_concatenated_are_named():
    parts = [[torch.randn(3, 2)], [torch.randn(3, 4)]]
    source, open_, _ = _source(parts, 1)
    with pytest.raises(ValueError, match=r"parts' shapes \(3, 2\) and \(3, 4\) cannot be "
                                         "concatenated along dim 1"):
        source.shape(open_)


def test_an_experts_key_without_its_number_is_named_not_raised():
    """A checkpoint key transformers' pattern takes (``.experts.*.w1.weight``) whose ``*``
    is not an expert's number: a problem naming it, as load_pretrained reports the others."""
    import transformers as T

    from devmesh.integrations.checkpoint_names import sources

    model = T.MixtralForCausalLM(T.MixtralConfig(
        vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2))
    key = "model.layers.0.block_sparse_moe.experts.first.w1.weight"
    found, problems = sources(model, {key: Path("model.safetensors")},
                              dict(model.named_parameters()))
    assert found == {} and len(problems) == 1, problems
    assert f"no expert number in {key.replace('block_sparse_moe', 'mlp')!r}" in problems[0]
