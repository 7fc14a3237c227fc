"""Start ranks on this machine through torch's elastic launcher, listening on loopback only.

``TCPStore`` given a host still listens on every interface, and so do the stores torchrun's
rendezvous and ``init_process_group("env://")`` create. Here the rendezvous store and the ranks'
store are each hosted on a socket bound to 127.0.0.1 (:func:`host_store`) and gloo binds to the
loopback interface: nothing listens beyond this machine. Under torchrun, ranks initialise from
torchrun's environment instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

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


# Set in the ranks launch_local starts: rank 0 then hosts the ranks' store itself.
_OWN_STORE = "CREDIT_PARALLEL_OWN_STORE"


def launch_local(
    entry: Callable[..., Any],
    args: tuple[Any, ...],
    nproc: int,
    *,
    start_method: str = "fork",
    timeout: timedelta = timedelta(seconds=120),
) -> dict[int, Any]:
    """Run ``entry(*args)`` in ``nproc`` ranks on this machine; their return values, by rank.

    Each rank should call :func:`init_process_group` first.

    Raises:
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a rank failed.
    """
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    store = host_store(host=LOOPBACK, timeout=timeout)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id="credit-parallel",
        rdzv_backend="c10d",
        rdzv_endpoint=f"{LOOPBACK}:{store.port}",
        rdzv_configs={"is_host": False, "join_timeout": int(timeout.total_seconds())},
        max_restarts=0,
        monitor_interval=0.05,
        start_method=start_method,
        local_addr=LOOPBACK,
    )
    with _environment():
        try:
            return elastic_launch(config, entry)(*args)
        finally:
            del store


@contextlib.contextmanager
def _environment() -> Iterator[None]:
    """The variables the launcher and its ranks read, restored afterwards."""
    wanted = {
        # One thread per rank (and no launcher banner about it): the ranks share the cores.
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        # Rank 0 hosts the ranks' store on a bound socket instead of sharing the launcher's.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "GLOO_SOCKET_IFNAME": os.environ.get(
            "GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo"
        ),
        _OWN_STORE: "1",
    }
    saved = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def init_process_group(backend: str, timeout: timedelta = timedelta(seconds=120)) -> None:
    """Initialise this rank's default process group, in a rank from :func:`launch_local` or
    from torchrun (whose environment names the store)."""
    if os.environ.get(_OWN_STORE) != "1":
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store: dist.Store
    if rank == 0:
        store = host_store(world, host, port, timeout=timeout)
    else:
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
