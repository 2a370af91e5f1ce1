"""Models other libraries write, under devmesh's parallelisms: transformers' declared plans
read as devmesh styles (:mod:`.transformers`), and ``parallelize(model, mesh)``, every
parallelism a mesh's dim names ask for in one call (:mod:`.parallelize`)."""

from devmesh.integrations.parallelize import parallelize

__all__ = ["parallelize"]
