"""What the ``devmesh`` commands' arguments may be: each checked when it is parsed,
before any process starts; and the help formatter every command shares."""

from __future__ import annotations

import argparse

__all__ = ["parse_shape", "parse_names", "parse_sizes", "parse_ops", "positive",
           "DefaultsOnce"]


def parse_shape(text: str) -> tuple[int, ...]:
    """``"2,4"`` (or ``"2x4"``) -> ``(2, 4)``; every part a positive integer, none empty."""
    parts = text.replace("x", ",").split(",")
    if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"mesh shape {text!r} must be positive integers separated by commas, e.g. 2,2,2 "
            "(no empty or non-numeric parts)"
        )
    return tuple(int(p) for p in parts)



def parse_names(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(
            f"dimension names {text!r} must be non-empty and separated by commas, e.g. dp,tp")
    return names



def parse_sizes(text: str) -> list[int]:
    from devmesh.tools.commbench import parse_size

    try:
        return [parse_size(part) for part in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None



def parse_ops(text: str) -> tuple[str, ...]:
    from devmesh.tools.commbench import OPS

    ops = tuple(part.strip() for part in text.split(","))
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown collective(s) {', '.join(map(repr, unknown))}; choose from "
            f"{', '.join(OPS)}")
    return ops



def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return value


class DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults in --help, but only where the help does not already say its
    default, and never ``(default: None)`` (an option with no default)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)
