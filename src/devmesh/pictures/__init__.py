"""Pictures of meshes and shardings, as text, rich tables or PNGs: layouts
(:mod:`.render`, :mod:`.render_png`; pure, used by ``devmesh show``), how a tensor is sharded
(:mod:`.sharding`) and what every rank of a parallelized model holds (:mod:`.describe`).
Nothing here is imported unless a picture is asked for."""
