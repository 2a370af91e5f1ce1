"""Expert parallelism: a mixture-of-experts layer's experts split over an ``ep`` mesh dim.

* :mod:`.moe`: ``MoE`` (top-k router, batched experts, load-balancing loss, capacity).
* :mod:`.dispatch`: tokens to their experts' ranks and back with all-to-all.
* :mod:`.api`: ``expert_parallel(moe, mesh["ep"])``.
"""

from devmesh.parallel.expert_parallel.api import expert_parallel, expert_parameters
from devmesh.parallel.expert_parallel.moe import MoE, GroupedExperts

__all__ = ["MoE", "GroupedExperts", "expert_parallel", "expert_parameters"]
