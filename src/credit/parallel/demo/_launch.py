"""Start the demo's ranks through torch's elastic launcher, as torchrun does.

Node 0 hosts the c10d rendezvous store itself, on a socket bound to the rendezvous host only
(127.0.0.1 by default), and the launcher of every node joins it as a client. The ranks' own store is
hosted by rank 0 the same way, on ``MASTER_ADDR``, and gloo binds to the loopback interface when
the rendezvous is on loopback: nothing listens beyond the given address.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousTimeoutError,
)
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from credit.parallel._store import host_store
from credit.parallel.demo import _report
from credit.parallel.demo._cli import Options
from credit.parallel.demo._train import (
    EXIT_ERROR,
    EXIT_PASS,
    EXIT_PEER_FAILED,
    quiet_torch,
    run_worker,
)


def launch(options: Options) -> int:
    """Launch this node's ranks, wait for them, and return the demo's exit status.

    Args:
        options: the checked command-line options.

    Returns:
        0 when every rank of this node reports a run that matches the replica, 1 otherwise.
    """
    quiet_torch()
    if options.start_method == "fork":
        # Imported by the optimizers on first use (~0.5 s): once here, not once per forked rank.
        importlib.import_module("torch._dynamo")
    # The launcher's own failure report is replaced by the one-line summary below.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        with _environment(options), _rendezvous_store(options) as port:
            _report.say(_launch_line(options, port))
            if options.node_rank != 0:
                _wait_for_rendezvous(options)
            results = _launch_and_wait(options, port)
    except _LaunchFailed as exc:
        _report.say(f"FAILED: {exc}")
        return 1
    return 0 if results and all(code == EXIT_PASS for code in results.values()) else 1


class _LaunchFailed(Exception):
    """The launch failed; the message says how, in one line."""


def _launch_and_wait(options: Options, port: int) -> dict[int, int]:
    """Run this node's ranks through the elastic launcher; their exit statuses, by global rank."""
    config = LaunchConfig(
        min_nodes=options.nnodes,
        max_nodes=options.nnodes,
        nproc_per_node=options.nproc_per_node,
        run_id=options.rdzv_id,
        rdzv_backend="c10d",
        rdzv_endpoint=_join(options.rdzv_host, port),
        rdzv_configs={
            "is_host": False,
            "join_timeout": options.rdzv_timeout,
            "read_timeout": options.rdzv_timeout,
        },
        max_restarts=0,
        monitor_interval=0.05,
        start_method=options.start_method,
        local_addr=options.local_addr,
    )
    try:
        return elastic_launch(config, run_worker)(options, True)
    except ChildFailedError as exc:
        raise _LaunchFailed(_failure_summary(exc)) from None
    except RendezvousError as exc:
        raise _LaunchFailed(_rendezvous_failure(exc, options, port)) from None


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _launch_line(options: Options, port: int) -> str:
    layout = f"{_report.layout_name(options)}, {options.backend}, {options.start_method}"
    if options.nnodes == 1:
        return f"launching {_report.plural(options.nproc_per_node, 'rank')} ({layout}) ..."
    return (
        f"node {options.node_rank} of {options.nnodes}: launching {options.nproc_per_node} of "
        f"{options.world} ranks ({layout}), rendezvous at {_join(options.rdzv_host, port)} ..."
    )


@contextlib.contextmanager
def _environment(options: Options) -> Iterator[None]:
    """Set the variables the launcher and its ranks read; restore the old values afterwards."""
    wanted = {
        # One thread per rank (and no launcher banner about it); the ranks share the cores.
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        # Rank 0 hosts the ranks' store on a bound socket instead of the launcher sharing its own.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    if options.loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
        wanted["GLOO_SOCKET_IFNAME"] = "lo0" if sys.platform == "darwin" else "lo"
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


@contextlib.contextmanager
def _rendezvous_store(options: Options) -> Iterator[int]:
    """On node 0, host the rendezvous store on the rendezvous host; yield its port."""
    if options.node_rank != 0:
        yield options.rdzv_port
        return
    host, port = options.rdzv_host, options.rdzv_port
    try:
        store = host_store(host=host, port=port, timeout=timedelta(seconds=options.rdzv_timeout))
    except OSError as exc:
        raise _LaunchFailed(
            f"cannot host the rendezvous at {_join(host, port)}: {exc.strerror} "
            "(is another launcher already node 0?)"
        ) from None
    port = store.port
    try:
        yield port
    finally:
        del store


def _rendezvous_failure(exc: RendezvousError, options: Options, port: int) -> str:
    where = f"the rendezvous at {_join(options.rdzv_host, port)}"
    if isinstance(exc, RendezvousTimeoutError):
        return f"not all {options.nnodes} nodes joined {where} within {options.rdzv_timeout} s"
    if isinstance(exc, RendezvousConnectionError):
        return f"cannot reach {where} (is node 0 up?)"
    return f"{where}: {type(exc).__name__}: {exc}"


def _wait_for_rendezvous(options: Options) -> None:
    """Wait until node 0 listens (the store's client would fill the console with retries)."""
    address = (options.rdzv_host, options.rdzv_port)
    deadline = time.monotonic() + options.rdzv_timeout
    while True:
        try:
            socket.create_connection(address, timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise _LaunchFailed(
                    f"cannot reach the rendezvous at {_join(*address)} within "
                    f"{options.rdzv_timeout} s (is node 0 up?)"
                ) from None
            time.sleep(0.2)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _failure_summary(exc: ChildFailedError) -> str:
    """One line on which ranks failed and how."""
    errors, stopped, other = [], [], []
    for rank, failure in sorted(exc.failures.items()):
        if failure.exitcode == EXIT_ERROR:
            errors.append(rank)
        elif failure.exitcode == EXIT_PEER_FAILED or failure.signal_name() == "SIGTERM":
            stopped.append(rank)
        else:
            how = (
                f"was killed by {failure.signal_name()}"
                if failure.exitcode < 0
                else f"exited with code {failure.exitcode}"
            )
            other.append(f"rank {rank} {how}")
    parts = [f"rank {_ranks(errors)} raised an error (see above)"] if errors else []
    parts += other
    if stopped:
        parts.append(f"rank {_ranks(stopped)} stopped when another rank failed (see above)")
    return "; ".join(parts)
