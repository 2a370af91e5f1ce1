"""The documentation cannot rot: the site builds with ``mkdocs build --strict`` (a broken link
or API reference fails), README stays short and tells no history, and every fenced code block
of README and ``docs/`` either runs here or says why it cannot.

A block is marked by an HTML comment on the line before it (invisible in the rendered page):

- ``<!-- docs-test: run -->``: a ``console`` block's ``$ devmesh ...`` commands run, exit 0
  (or fail, where the output shown says ``ERROR``) and each output line shown (but ``...``
  elisions) must appear in the output; a ``python`` block runs
  in a fresh interpreter.
- ``<!-- docs-test: launch N; given: CODE -->``: a ``python`` block runs on N ranks of the test
  pool, after ``CODE`` (what the page assumes the reader has: a model, a batch).
- ``<!-- docs-test: slurm -->``: a ``console`` block run as ``run`` is, on a real Slurm of
  two nodes this test starts (``tests/slurm_cluster.py``): its commands (``devmesh``,
  ``sbatch``, ``squeue``, ``scontrol``, ``scancel``, ``cat``) run on the controller, the
  jobs on the nodes; skipped, saying why, where Slurm's daemons are not installed.
- ``<!-- docs-test: skip: REASON -->``: not run, for the reason given.
- ``<!-- docs-test: file NAME -->``: a script the page's console blocks run: written as
  ``NAME`` into their folder (a console command may set variables first: ``VAR=1 devmesh ...``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CODE = ("python", "console", "bash")
MARK = re.compile(r"<!-- docs-test: (run|slurm|launch (\d+)(?:; given: (.*?))?|skip: (.+?)|"
                  r"file (\S+)) -->")
SLURM_COMMANDS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo", "cat")


def _blocks():
    for page in PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = re.match(r"^```(\w+)\s*$", lines[i])
            if not fence:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            if fence.group(1) in CODE:
                mark = MARK.search(lines[i - 1]) if i else None
                yield page.relative_to(ROOT), i + 1, fence.group(1), mark, \
                    "\n".join(lines[i + 1:end])
            i = end + 1


BLOCKS = list(_blocks())


def test_every_code_block_runs_or_says_why_not():
    unmarked = [f"{page}:{line} ({kind})" for page, line, kind, mark, _ in BLOCKS if mark is None]
    assert not unmarked, ("blocks with no docs-test mark (run, launch N, or skip: reason): "
                          + ", ".join(unmarked))


def _ids(block):
    page, line, kind, mark, _ = block
    return f"{page}:{line}"


def _console(text: str, tmp_path: Path, files: dict[str, str], cluster=None) -> None:
    """Run the block's ``$`` commands in ``tmp_path`` (on ``cluster``'s controller, given a
    Slurm cluster) and check what they print."""
    for name, content in files.items():
        (tmp_path / name).write_text(content + "\n")
    commands: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], []))
        elif commands:
            commands[-1][1].append(line)
    for command, shown in commands:
        words = command.split()
        env = dict(os.environ)
        while "=" in words[0]:  # VAR=value before the command
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        if words[0] == "devmesh":
            argv = [sys.executable, "-m", "devmesh", *words[1:]]
            argv += ["--plain"] if words[1] == "show" else []
        else:
            assert cluster is not None and words[0] in SLURM_COMMANDS, command
            argv = words
        if cluster is not None:
            env = dict(cluster.environment, **{k: v for k, v in env.items()
                                               if k not in os.environ})
            argv = ["nsenter", f"--net=/run/netns/{cluster.controller}", *argv]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env=env)
        out = done.stdout + done.stderr
        # a command shown failing (its output says ERROR) must fail; every other must succeed
        refused = any(line.startswith("ERROR") or "error:" in line for line in shown)
        assert (done.returncode != 0) == refused, \
            f"{command!r} exited {done.returncode}:\n{out}"
        for line in shown:
            wanted = line.split("...")[0].split("…")[0].rstrip()
            if wanted:
                assert wanted in out, f"{command!r} no longer prints {wanted!r}:\n{out}"


def _exec_block(code: str, directory: str):
    """Run ``code`` as a rank of the pool, in ``directory``; the pool's workers go on."""
    import torch.distributed as dist

    before = os.getcwd()
    os.chdir(directory)
    try:
        exec(compile(code, "<docs block>", "exec"), {"__name__": "__docs__"})
    finally:
        os.chdir(before)
        if dist.is_initialized():
            dist.barrier()
    return True


@pytest.mark.parametrize("block", [b for b in BLOCKS if b[3] is not None
                                   and not b[3].group(1).startswith(("skip", "file"))],
                         ids=_ids)
def test_a_documented_block_runs(block, tmp_path, mesh_pool):
    page, line, kind, mark, text = block
    if kind == "console":
        assert mark.group(1) in ("run", "slurm")
        files = {m.group(5): t for p, _, _, m, t in BLOCKS
                 if p == page and m is not None and m.group(5)}
        if mark.group(1) == "run":
            _console(text, tmp_path, files)
            return
        import slurm_cluster

        why = slurm_cluster.missing()
        if why is not None:
            pytest.skip(why)
        environment = {"PATH": os.path.dirname(sys.executable) + os.pathsep
                       + os.environ["PATH"], "PYTHONWARNINGS": "ignore::FutureWarning"}
        with slurm_cluster.slurm_cluster(tmp_path / "slurm", cpus=8,
                                         environment=environment) as cluster:
            _console(text, tmp_path, files, cluster)
    elif mark.group(1) == "run":
        done = subprocess.run([sys.executable, "-c", text], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)
        assert done.returncode == 0, f"{page}:{line} failed:\n{done.stderr[-3000:]}"
    else:
        ranks, given = int(mark.group(2)), mark.group(3) or ""
        code = given.replace("; ", "\n") + "\n" + text
        assert all(mesh_pool.run(_exec_block, ranks, code, str(tmp_path), timeout=300))


def test_the_skipped_blocks_give_a_reason():
    for page, line, kind, mark, _ in BLOCKS:
        if mark is not None and mark.group(4) is not None:
            assert len(mark.group(4)) > 10, f"{page}:{line}: say why it cannot run"


def test_the_site_builds_strictly(tmp_path):
    """Broken links, missing pages and API references that no longer resolve fail."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "api" / "index.html").exists()
    raw = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):[`<]")
    for page in (tmp_path / "site").rglob("*.html"):  # docstrings' roles rendered, not raw
        found = raw.search(page.read_text())
        assert found is None, f"{page.relative_to(tmp_path)} shows a raw role: {found.group(0)}"
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert '<a href="#devmesh.' in api  # a role naming a documented object links to it


def test_readme_is_short_and_the_docs_tell_no_history():
    assert len((ROOT / "README.md").read_bytes()) <= 12 * 1024
    history = re.compile(r"[Ss]ession \d+|[(;—] ?before[:,]|\(was \d|tests/(?:\w+/)*test_|went from "
                         r"|used to (?:be|give|raise)")
    for page in PAGES:
        found = history.search(page.read_text())
        assert found is None, f"{page.relative_to(ROOT)} tells history: {found.group(0)!r}"
