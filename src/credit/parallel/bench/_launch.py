"""Start the benchmark's ranks on this machine and collect rank 0's results.

The parent process hosts the rendezvous store on a free loopback port (127.0.0.1, picked by the
OS) and spawns one process per rank; each joins the default process group through that store,
runs ``target(config)`` and, on rank 0, sends back what it returns.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from credit.parallel._store import host_store

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    threads: int,
    target: Callable[[dict[str, Any]], Any],
    config: dict[str, Any],
    conn: multiprocessing.connection.Connection,
) -> None:
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.TCPStore(HOST, port, world_size, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=600)
    )
    try:
        result = target(config)
        if rank == 0:
            conn.send(("ok", result))
    except Exception as error:
        conn.send(("error", f"rank {rank}: {error!r}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()


def run_ranks(
    target: Callable[[dict[str, Any]], Any],
    config: dict[str, Any],
    world_size: int,
    backend: str,
    timeout_s: float,
) -> Any:
    """Run ``target(config)`` on ``world_size`` fresh ranks; return rank 0's result.

    Args:
        target: a module-level function (it is pickled by reference).
        config: its argument, the same on every rank.
        world_size: how many ranks (processes) to start.
        backend: the process group backend ("gloo" or "nccl").
        timeout_s: give up (and end the ranks) after this long.

    Returns:
        What ``target`` returned on rank 0.

    Raises:
        RuntimeError: a rank raised or died, or the run timed out.
    """
    threads = max(1, (os.cpu_count() or 1) // world_size)
    store = host_store(world_size, HOST)
    context = multiprocessing.get_context("spawn")
    procs, conns = [], []
    for rank in range(world_size):
        parent, child = context.Pipe(duplex=False)
        proc = context.Process(
            target=_rank_main,
            args=(rank, world_size, store.port, backend, threads, target, config, child),
            daemon=True,
        )
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    try:
        return _collect(procs, conns, timeout_s)
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _collect(
    procs: Sequence[multiprocessing.process.BaseProcess],
    conns: Sequence[multiprocessing.connection.Connection],
    timeout_s: float,
) -> Any:
    deadline = time.monotonic() + timeout_s
    pending = dict(enumerate(conns))
    result: Any = None
    while pending:
        waitables: list[Any] = list(pending.values()) + [procs[r].sentinel for r in pending]
        ready = multiprocessing.connection.wait(waitables, max(0.0, deadline - time.monotonic()))
        if not ready:
            raise RuntimeError(f"the benchmark timed out after {timeout_s:.0f} s")
        for rank, conn in list(pending.items()):
            if conn in ready or procs[rank].sentinel in ready:
                try:
                    kind, payload = conn.recv()
                except EOFError:  # the rank exited: fine unless it failed
                    procs[rank].join(30)
                    if procs[rank].exitcode != 0:
                        raise RuntimeError(
                            f"rank {rank} died with exit code {procs[rank].exitcode}"
                        ) from None
                    del pending[rank]
                    continue
                if kind == "error":
                    raise RuntimeError(payload)
                result = payload
                del pending[rank]
    return result
