"""Progress of long work, on a terminal and off it.

On a terminal, a rich progress bar; anywhere else (a CI log, ``| tee``, a file, a rank's output
under a launcher) rich would draw nothing until the end, so a plain line is printed instead,
at most every ``DEVMESH_PROGRESS_SECONDS`` seconds (5 by default; 0 turns progress off)::

    checkpoint save: 1.2 GiB of 4.0 GiB (30%), 6 s, about 14 s left

Work that ends before the first interval prints nothing: progress is for what is long.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["Progress", "SECONDS_VARIABLE", "count_text", "bytes_text"]

SECONDS_VARIABLE = "DEVMESH_PROGRESS_SECONDS"


def count_text(n: float) -> str:
    return f"{n:g}"


def bytes_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def interval() -> float:
    """Seconds between plain progress lines (``DEVMESH_PROGRESS_SECONDS``); 0: none."""
    text = os.environ.get(SECONDS_VARIABLE, "5")
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"{SECONDS_VARIABLE}={text!r}: give seconds between progress lines "
                         "(e.g. 5), or 0 for none") from None
    if seconds < 0:
        raise ValueError(f"{SECONDS_VARIABLE}={text!r} is negative: give 0 for no progress")
    return seconds


class Progress:
    """``total`` units of work titled ``title``; :meth:`advance` as they are done.

    ``show=False`` (a rank other than the one that reports) makes every call a no-op.
    ``bar``: a rich bar when ``stream`` is a terminal (the demo's training); ``False`` for
    work inside a user's program (a checkpoint save), which gets plain lines only, and only
    once it has run longer than the interval."""

    def __init__(self, title: str, total: float, *, show: bool = True, bar: bool = True,
                 stream: TextIO | None = None, amount: Callable[[float], str] = count_text,
                 unit: str = "") -> None:
        self.title, self.total, self.done = title, total, 0.0
        self._stream = stream if stream is not None else sys.stderr
        self._amount, self._unit = amount, unit
        self._show = show
        self._every = interval() if show else 0.0
        self._start = self._last = time.monotonic()
        self._printed = False
        self._bar = None
        if show and bar and self._stream.isatty():
            from rich.console import Console
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(console=Console(file=self._stream), transient=False)
            self._bar.start()
            self._task = self._bar.add_task(title, total=total)

    def advance(self, amount: float = 1) -> None:
        self.done += amount
        if self._bar is not None:
            self._bar.advance(self._task, amount)
        elif self._every and time.monotonic() - self._last >= self._every:
            self._line()

    def print(self, text: str) -> None:
        """A line of its own (an epoch's result), above the bar on a terminal."""
        if self._bar is not None:
            self._bar.console.print(text)
        elif self._show:
            print(text, file=self._stream, flush=True)

    def close(self) -> None:
        """Stop the bar; off a terminal, a last line if any line was printed."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif self._printed:
            self._line()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _line(self) -> None:
        now = time.monotonic()
        self._last, self._printed = now, True
        elapsed = now - self._start
        unit = f" {self._unit}" if self._unit else ""
        text = f"{self.title}: {self._amount(self.done)} of {self._amount(self.total)}{unit}"
        if self.total:
            share = min(self.done / self.total, 1.0)
            text += f" ({100 * share:.0f}%), {elapsed:.0f} s"
            if 0 < share < 1:
                text += f", about {elapsed * (1 - share) / share:.0f} s left"
        print(text, file=self._stream, flush=True)
