"""Starting local ranks: the worker pool and ``launch`` (:mod:`.launcher`), the worker
process (:mod:`._worker`), the zygote it is forked from (:mod:`._zygote`, with the pool's
side in :mod:`.forking`) and its authentication (:mod:`._auth`). The pytest plugin built on
them is the public :mod:`devmesh.testing`."""
