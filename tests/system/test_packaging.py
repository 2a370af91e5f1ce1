"""The package as a user installs it: ``python -m build`` makes a wheel and an sdist, and the
wheel installed into a fresh virtual environment runs ``devmesh --version``, ``devmesh show``
and a 2-rank ``devmesh run``.

The fresh environment borrows torch and the other dependencies from the test environment (a
path line, not an install: torch is a large download), so what is tested is the wheel's own
content — the package's files, ``py.typed``, the ``devmesh`` script, the version string — and
that nothing in it depends on the source checkout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

import devmesh

ROOT = Path(__file__).resolve().parents[2]


def _check(args: list, **kwargs) -> str:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True,
                            timeout=300, **kwargs)
    assert result.returncode == 0, f"{args}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The wheel and sdist ``python -m build`` makes from this checkout."""
    out = tmp_path_factory.mktemp("dist")
    _check([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--sdist",
            "--outdir", out, ROOT], cwd=tmp_path_factory.mktemp("build-cwd"))
    wheels, sdists = list(out.glob("*.whl")), list(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in out.iterdir())
    return wheels[0], sdists[0]


def test_the_wheel_and_sdist_carry_one_version_and_the_type_hints(built):
    wheel, sdist = built
    assert f"devmesh-{devmesh.__version__}-" in wheel.name
    assert sdist.name == f"devmesh-{devmesh.__version__}.tar.gz"
    names = zipfile.ZipFile(wheel).namelist()
    assert "devmesh/py.typed" in names
    assert "devmesh/parallel/fsdp/unit.py" in names
    assert not [n for n in names if n.startswith(("tests/", "docs/", "bench/"))]
    with tarfile.open(sdist) as archive:
        assert any(n.endswith("src/devmesh/__init__.py") for n in archive.getnames())


def test_the_wheel_in_a_fresh_environment_shows_and_runs(built, tmp_path):
    wheel, _ = built
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(_check([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
                       ).strip())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "DEVMESH_"))}
    _check([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
            "--no-index", wheel], env=env)
    # then the dependencies (torch, numpy, rich, cloudpickle) from the test environment, after
    # the environment's own site-packages; devmesh itself comes from the wheel only (an
    # editable install's finder is not carried over)
    (site / "borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    where = _check([python, "-c", "import devmesh; print(devmesh.__file__)"], cwd=elsewhere,
                   env=env)
    assert where.startswith(str(site)), f"devmesh imported from {where}, not the wheel"
    script = env_dir / "bin" / "devmesh"  # the console script, run as a user runs it
    assert _check([script, "--version"], cwd=elsewhere, env=env).strip().endswith(
        devmesh.__version__)
    shown = _check([script, "show", "2,2", "--names", "dp,tp"], cwd=elsewhere, env=env)
    assert "dp" in shown and "tp" in shown and "3" in shown

    user_script = elsewhere / "hello.py"
    user_script.write_text(
        "from devmesh import init_device_mesh\n"
        "mesh = init_device_mesh('cpu', (2,), mesh_dim_names=('dp',))\n"
        "print('group', mesh.get_group('dp').size(), 'rank', mesh.get_rank())\n")
    output = _check([script, "run", "-n", "2", user_script],
                    cwd=elsewhere, env=env)
    assert sorted(re.findall(r"group 2 rank (\d)", output)) == ["0", "1"], output
