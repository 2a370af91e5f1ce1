"""Talking to other ranks: the launch environment (:mod:`.env`), process groups made once per
rank list and the agreement checks (:mod:`.groups`), and every collective devmesh issues,
counted per mesh dim (:mod:`.comm`)."""
