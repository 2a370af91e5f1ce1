"""Sharded checkpoints: every rank writes its own blocks, any layout reads them back.

* :func:`save_checkpoint` (collective; ``async_=True`` writes in the background),
* :func:`load_checkpoint` (collective; reshards into the model's current layout),
* :class:`CheckpointReader` and :mod:`~devmesh.parallel.checkpoint.offline` to inspect or
  consolidate a checkpoint without launching anything (``devmesh ckpt info|consolidate``),
* :mod:`~devmesh.parallel.checkpoint.torch_dcp` for torch.distributed.checkpoint interop.

The format is described in :mod:`~devmesh.parallel.checkpoint.format`.
"""

from devmesh.parallel.checkpoint.format import FORMAT, CheckpointReader
from devmesh.parallel.checkpoint.load import load_checkpoint
from devmesh.parallel.checkpoint.save import SaveHandle, save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "SaveHandle", "CheckpointReader", "FORMAT"]
