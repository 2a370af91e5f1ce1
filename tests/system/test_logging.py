"""``DEVMESH_LOG=info|debug``: what a person running a job wants to know, one line each, with
the rank; nothing by default."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import os
    import torch
    from devmesh import init_device_mesh
    from devmesh.parallel import fully_shard, load_checkpoint, save_checkpoint

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = torch.nn.Linear(4, 4)
    fully_shard(model, mesh=mesh)
    model(torch.ones(2, 4)).sum().backward()
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        raise SystemExit(1 if mesh.get_rank() == 1 else 0)  # the first attempt dies
    save_checkpoint("ckpt", model, extra={"step": 7})
    load_checkpoint("ckpt", model)
""")


def _run(tmp_path, level):
    (tmp_path / "train.py").write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "DEVMESH_LOG"}
    if level:
        env["DEVMESH_LOG"] = level
    done = subprocess.run([sys.executable, "-m", "devmesh", "run", "-n", "2", "--max-restarts",
                           "1", "train.py"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def test_info_says_what_happened_and_debug_lists_the_collectives(tmp_path):
    out = _run(tmp_path, "debug")  # debug shows the info lines too
    assert ("[devmesh rank 0] info devmesh.mesh: mesh {'dp': 2} built on 2 ranks (cpu, gloo): "
            "0 process group(s) created") in out, out[-3000:]
    assert "info devmesh.launch: restart 1 (of at most 1): rank 1 of 2 joins again" in out
    assert "info devmesh.checkpoint: saved checkpoint ckpt: this rank wrote" in out
    assert "info devmesh.checkpoint: loaded checkpoint ckpt:" in out and "{'step': 7}" in out
    assert "debug devmesh.comm: all_gather over dp (ranks [0, 1]):" in out


def quiet_mesh():
    import logging

    from devmesh import init_device_mesh

    init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    logger = logging.getLogger("devmesh")
    return len(logger.handlers), logger.isEnabledFor(logging.INFO)


def test_quiet_by_default(mesh_pool):
    assert "DEVMESH_LOG" not in os.environ
    assert mesh_pool.run(quiet_mesh, 2) == [(0, False)] * 2
