"""The rendezvous store of a launch on this machine, served on loopback only.

torch's ``TCPStore`` server binds every interface; a local launch has no reason to be
reachable from the network, so devmesh binds the listening socket itself (on ``127.0.0.1`` or
``::1``) and hands it to the store. Serving the store from the process that launches the
ranks (``devmesh run``, :class:`~devmesh.launching.launcher.WorkerPool`) also means its port is
held from the moment it is chosen: no other launch on the machine can take it before rank 0
binds it, as it could if a free port were picked, closed and bound again later.
"""

from __future__ import annotations

import datetime
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["RUN_STORE_VARIABLE", "serve_loopback_store"]

# ``HOST:PORT`` of the store ``devmesh run`` serves for its ranks' process group. torchrun
# hands the ranks a ``MASTER_PORT`` it found free and closed again; binding it later in
# rank 0 races every other launch on the machine ("Address already in use"), so devmesh's
# ranks join the launcher's store, held from the moment it was chosen, instead.
RUN_STORE_VARIABLE = "DEVMESH_RUN_STORE"


def serve_loopback_store(host: str = "127.0.0.1", port: int = 0, world_size: int | None = None,
                         timeout: datetime.timedelta = datetime.timedelta(minutes=30)
                         ) -> tuple[dist.TCPStore, int]:
    """A TCPStore server listening on ``host`` (loopback) only, and its port (``port=0``: a
    free one). The server lives as long as the returned store object."""
    import torch.distributed as dist

    family = socket.AF_INET6 if host == "::1" else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(max(128, world_size or 0))
    port = listener.getsockname()[1]
    # the store owns the listening descriptor from here on (it closes it when destroyed)
    store = dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False,
                          master_listen_fd=listener.detach(), use_libuv=False)
    return store, port
