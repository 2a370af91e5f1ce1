"""Starting local ranks: the worker pool and ``launch`` (:mod:`.launcher`), the worker
process (:mod:`._worker`) and its authentication (:mod:`._auth`). The pytest plugin built on
them is the public :mod:`devmesh.testing`."""
