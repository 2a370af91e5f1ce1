"""Models other libraries write, under devmesh's parallelisms: transformers' declared plans
read as devmesh styles (:mod:`.transformers`), ``parallelize(model, mesh)``, every
parallelism a mesh's dim names ask for in one call (:mod:`.parallelize`; a model's pipeline
stages by its declared plan, :mod:`.pipeline_stages`), and checkpoints in
transformers' safetensors format read into and written from parallelized models
(:mod:`.pretrained`)."""

from devmesh.integrations.parallelize import parallelize
from devmesh.integrations.pretrained import LoadedWeights, load_pretrained, save_pretrained
from devmesh.integrations.transformers import context_parallel_batch

__all__ = ["parallelize", "load_pretrained", "save_pretrained", "LoadedWeights",
           "context_parallel_batch"]
