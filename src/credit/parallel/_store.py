"""A rendezvous store that listens on one address only."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

LOOPBACK = "127.0.0.1"


def host_store(
    world_size: int | None = None,
    host: str = LOOPBACK,
    port: int = 0,
    timeout: timedelta = timedelta(seconds=300),
) -> dist.TCPStore:
    """Host a TCPStore server on ``host`` alone (port 0: a free one; its ``.port`` tells which).

    ``TCPStore`` given a host still listens on every interface; here it is handed a socket bound
    to ``host``, so a store on the loopback address cannot be reached from the network.

    Raises:
        OSError: the address cannot be bound (e.g. the port is taken).
    """
    family = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
    listener = socket.create_server((host, port), family=family)
    return dist.TCPStore(
        host,
        listener.getsockname()[1],
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timeout,
        master_listen_fd=listener.detach(),
    )
