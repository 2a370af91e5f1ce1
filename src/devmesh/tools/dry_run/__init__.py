"""Dry runs: one rank of a big job measured in this process, on ``meta`` tensors under torch's
``fake`` process group (:mod:`.run`), on a transformer described by a few numbers
(:mod:`.model`); the mesh for N ranks chosen among every candidate (:mod:`.search`);
``devmesh plan --model`` prints them."""

from devmesh.tools.dry_run.model import PRESETS, TransformerConfig, read_config
from devmesh.tools.dry_run.run import RankReport, dry_run, parse_mesh, ranks_to_report

__all__ = ["PRESETS", "TransformerConfig", "read_config", "RankReport", "dry_run",
           "parse_mesh", "ranks_to_report"]
