"""Context parallelism: a long sequence split over a ``cp`` mesh dim, attention exact.

* :mod:`.sequence`: which tokens each rank holds (load-balanced head and tail chunks), and
  gathering them back.
* :mod:`.ring`: ring attention (keys and values passed around the ring, partial softmax
  results merged by log-sum-exp) and the all-gather variant, forward and backward.
* :mod:`.api`: ``context_parallel(module, mesh["cp"])`` routes a module's
  ``scaled_dot_product_attention`` calls through them.
"""

from devmesh.parallel.context_parallel.api import context_parallel, context_parallel_attention
from devmesh.parallel.context_parallel.ring import ring_attention
from devmesh.parallel.context_parallel.sequence import (
    gather_sequence,
    sequence_positions,
    shard_sequence,
)

__all__ = ["context_parallel", "context_parallel_attention", "ring_attention",
           "shard_sequence", "gather_sequence", "sequence_positions"]
