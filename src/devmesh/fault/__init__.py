"""Training that survives a failed replica group: the groups of the mesh's replicate dim
(HSDP's ``dp``, DDP's ranks) form a quorum every step; a group that fails is dropped while
the others step on, and its restart heals from a live peer instead of a checkpoint.

``devmesh run --replica-groups G -n N train.py`` starts ``G`` groups of ``N`` ranks and the
:class:`Coordinator` that admits them; in the script, :class:`ReplicaGroups` wraps the model
and optimizer and its :meth:`~ReplicaGroups.step` replaces ``optimizer.step()``.
"""

from devmesh.fault.coordinator import Coordinator
from devmesh.fault.protocol import DEFAULT_TIMEOUT, TIMEOUT_VARIABLE
from devmesh.fault.replicas import ReplicaGroups, StepResult

__all__ = ["Coordinator", "ReplicaGroups", "StepResult", "DEFAULT_TIMEOUT", "TIMEOUT_VARIABLE"]
