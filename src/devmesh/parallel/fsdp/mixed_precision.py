"""``MixedPrecisionPolicy``: the dtypes a ``fully_shard`` unit computes and reduces in."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``param_dtype``: dtype of the gathered parameters (compute); ``reduce_dtype``: dtype of
    gradient reduction (``None``: as the running torch — ``param_dtype`` up to 2.14, the
    parameters' own dtype from 2.15; neither set: the parameters' own);
    ``output_dtype``: floating-point outputs of the unit's forward are
    cast to it; ``cast_forward_inputs``: floating-point inputs of each unit's forward are
    cast to ``param_dtype`` (torch's default too). Sharded parameters (the optimizer's master
    copy) keep their dtype. The fields and their order are torch's, whose own
    ``MixedPrecisionPolicy`` ``fully_shard`` accepts as well."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

