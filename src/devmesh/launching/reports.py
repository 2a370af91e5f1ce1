"""One summary of a failed ``devmesh run``, instead of every rank's traceback through the
launcher's frames.

When a rank's script raises, every other rank soon fails too (a peer closed its connection)
and torchrun prints each traceback — ``runpy`` and launcher frames first — then a table naming
its own entry point. Under ``devmesh run`` each rank instead writes a report (JSON, no
pickle) to a folder the launcher made: its exception, the traceback of the user's frames only,
whether the error was a peer gone, and when. The launcher then prints one summary: the rank
that failed first on its own, with its traceback, and one line per other rank saying what it
was doing.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Iterable
from typing import Any

from devmesh._log import get_logger

__all__ = ["REPORTS_VARIABLE", "write_report", "where_in_script", "summary"]

REPORTS_VARIABLE = "DEVMESH_RUN_REPORTS"
# the installed package's own folders, by path: a user's folder named devmesh/ is not them
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LAUNCHING = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _user_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """The traceback without runpy's and the launcher's frames."""
    frames = traceback.extract_tb(exc.__traceback__)
    return [f for f in frames if not (os.path.abspath(f.filename).startswith(_LAUNCHING)
                                      or os.path.basename(f.filename) == "runpy.py"
                                      or f.filename.startswith("<frozen runpy"))]


def where_in_script(exc: BaseException) -> str:
    """``file.py:line`` of the innermost frame of the user's own code (not torch's, not
    devmesh's), or ``?``."""
    torch = sys.modules.get("torch")  # not imported here: a script without torch has none
    libraries = (_PACKAGE,) if torch is None else (
        os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, _PACKAGE)
    mine = [f for f in _user_frames(exc)
            if not os.path.abspath(f.filename).startswith(libraries)]
    return f"{os.path.basename(mine[-1].filename)}:{mine[-1].lineno}" if mine else "?"


def write_report(exc: BaseException) -> dict[str, Any] | None:
    """Record this rank's failure for ``devmesh run``'s summary (nothing outside it)."""
    folder = os.environ.get(REPORTS_VARIABLE)
    if not folder:
        return None
    from devmesh.errors import is_peer_gone, is_timeout

    frames = _user_frames(exc)
    where = where_in_script(exc)
    text = f"{type(exc).__name__}: {exc}".strip()
    report = {
        "rank": int(os.environ.get("RANK", "-1")),
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        "world": int(os.environ.get("WORLD_SIZE", "0")),
        "time": time.time(),
        "exception": text,
        "where": where,
        "traceback": "Traceback (most recent call last):\n"
                     + "".join(traceback.format_list(frames)) + text,
        "consequence": is_peer_gone(exc) or is_timeout(exc),
    }
    path = os.path.join(folder, f"rank{report['rank']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)
    return report


def summary(folder: str, target: str, codes: dict[int, int],
            ranks: int | Iterable[int] = 0) -> str | None:
    """The failure in words from the ranks' reports in ``folder`` (``None`` without any):
    the rank that failed first on its own — not one that only heard a peer go — with its
    traceback, then what every other rank was doing: those of ``codes`` (global rank -> exit
    code of the ranks that failed) and of ``ranks`` (the global ranks started on this host,
    or their number when they are ``0..ranks-1``; one in neither had finished)."""
    if isinstance(ranks, int):
        ranks = range(ranks)
    reports: dict[int, dict[str, Any]] = {}
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                report = json.load(f)
            reports[int(report["rank"])] = report
    if not reports:
        return None
    attempt = max(r.get("attempt", 0) for r in reports.values())  # the last restart's
    reports = {rank: r for rank, r in reports.items() if r.get("attempt", 0) == attempt}
    first = min(reports.values(), key=lambda r: (r["consequence"], r["time"]))
    world = first["world"] or len(codes)
    after = f" (restart {attempt})" if attempt else ""
    lines = [f"devmesh run: rank {first['rank']} of {world} failed first{after}, running "
             f"{target}:",
             first["traceback"], "the other ranks:"]
    for rank in sorted(set(codes) | set(reports) | set(ranks)):
        if rank == first["rank"]:
            continue
        report = reports.get(rank)
        if report is not None and report["consequence"]:
            lines.append(f"  rank {rank}: at {report['where']}: lost its peers (a collective "
                         f"broke off or timed out after rank {first['rank']} failed)")
        elif report is not None:
            head = report["exception"].splitlines()[0][:200]
            lines.append(f"  rank {rank}: at {report['where']}: {head}")
        elif codes.get(rank, 0) < 0:
            lines.append(f"  rank {rank}: stopped by signal {-codes[rank]} after rank "
                         f"{first['rank']} failed")
        elif rank in codes:
            lines.append(f"  rank {rank}: exited with code {codes[rank]}")
        else:
            lines.append(f"  rank {rank}: had finished (exit code 0)")
    return "\n".join(lines)


class _ElasticNews(logging.Handler):
    """torchrun's agent, told in devmesh's words: which rank failed first and with what exit
    code, and that every rank restarts (k of n). Everything else the agent logs is dropped:
    devmesh run summarises a final failure itself."""

    def __init__(self, max_restarts: int) -> None:
        super().__init__(logging.INFO)
        self.max_restarts = max_restarts
        self.log = get_logger("launch")

    def emit(self, record: logging.LogRecord) -> None:
        text = str(record.msg)
        if text.startswith("failed (exitcode") and len(record.args or ()) >= 2:
            code, local_rank = record.args[0], record.args[1]
            how = f"signal {-code}" if isinstance(code, int) and code < 0 else f"exit code {code}"
            self.log.info("local rank %s failed first (%s); the other ranks are stopped",
                          local_rank, how)
        elif "attempts left" in text and len(record.args or ()) >= 4:
            left = int(record.args[2])
            self.log.info("restarting every rank: restart %d of at most %d (resume from your "
                          "last checkpoint)", self.max_restarts - left + 1, self.max_restarts)


ELASTIC_LOGGERS = ("torch.distributed.elastic.multiprocessing.api",
                   "torch.distributed.elastic.agent.server.api")


def relay_restarts(max_restarts: int) -> None:
    """With ``DEVMESH_LOG=info``: say, in the launching process, when a rank fails and every
    rank restarts (torchrun's agent logs it at its own level, which devmesh run keeps quiet)."""
    if not get_logger("launch").isEnabledFor(logging.INFO):
        return
    news = _ElasticNews(max_restarts)
    for name in ELASTIC_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.addHandler(news)
        logger.propagate = False
