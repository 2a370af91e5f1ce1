"""The console side of ``devmesh run``: each rank's lines, prefixed once with its rank.

torchrun's agent copies every rank's output to the console a whole line at a time, each line
prefixed ``[rankN]:``. torch's own log formatter writes the same prefix at the start of its
lines once the process group is up, so torch's warnings read ``[rank1]:[rank1]:W1204 ...``.
The prefix is dropped here, on the launcher's side, where the lines are copied: a rank's
process is left exactly as the user's script makes it (nothing imported before the script).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

__all__ = ["one_rank_prefix"]

_TWICE = re.compile(r"^(\[rank\d+\]:)\1", re.M)


class _OnePrefix:
    """A text stream that writes ``[rankN]:[rankN]:`` at a line's start as ``[rankN]:``."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(_TWICE.sub(r"\1", text))
        return len(text)

    def __getattr__(self, name: str):  # flush, fileno, encoding, isatty ...: the stream's
        return getattr(self._stream, name)


@contextmanager
def one_rank_prefix() -> Iterator[None]:
    """While inside, ``sys.stdout`` and ``sys.stderr`` write a doubled rank prefix once: the
    agent's copying threads take the streams as they are when it starts its ranks."""
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _OnePrefix(sys.stdout), _OnePrefix(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = streams
