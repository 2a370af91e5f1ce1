"""A tensor-parallel plan's entries against a model's modules: transformers' and
``parallelize_module``'s names, ``*`` standing for one segment (``layers.*.attention.wq``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

from torch import nn

__all__ = ["names_module", "within", "entries_for"]

Style = TypeVar("Style")


def names_module(pattern: str, module: str) -> bool:
    """Whether the plan's entry ``pattern`` is ``module`` itself."""
    return pattern.count(".") == module.count(".") and within(pattern, module)


def within(pattern: str, module: str) -> bool:
    """Whether the plan's entry ``pattern`` names ``module`` or a module inside it."""
    have, want = pattern.split("."), module.split(".")
    return len(have) >= len(want) and all(
        a == "*" or a == b for a, b in zip(have, want, strict=False))


def entries_for(model: nn.Module, plan: Mapping[str, Style], leave_out: Sequence[str] = ()
                ) -> dict[str, Style]:
    """``plan``'s entries that name a module (or parameter) ``model`` has, without those
    inside the modules named in ``leave_out`` (experts split over ``ep`` instead): a dense
    MLP's entries are passed by where every layer has experts (or the reverse), another
    pipeline stage's layers' too, as transformers' own loading passes them by."""
    present = ([name for name, _ in model.named_modules() if name]
               + [name for name, _ in model.named_parameters()])  # (expert weights' entries)
    return {name: style for name, style in plan.items()
            if not any(within(name, module) for module in leave_out)
            and any(names_module(name, module) for module in present)}
