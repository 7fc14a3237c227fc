"""Run a test body on N real gloo ranks on CPU, reusing the worker processes across tests.

Starting torch in a process costs seconds, so each world size gets one pool of workers for the
whole session. A body is a module-level function (pickled by reference); every rank runs it with
the same arguments inside an initialised default process group and sends back its return value.

Failure handling:
- an exception on any rank fails the test with every failing rank's traceback;
- a rank that dies (gloo aborts the process on a collective mismatch) fails the test with its
  exit code;
- a body that runs past its timeout fails the test with the Python stack of every rank at that
  moment (faulthandler), so a hang shows where each rank waits.
In every failure case the pool is torn down and restarted, since the process group may be stuck.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from credit.parallel._common.launch import host_store

HOST = "127.0.0.1"
DEFAULT_TIMEOUT_S = 90.0
# Collectives give up after this long, so that even a hang the harness misses ends eventually.
PROCESS_GROUP_TIMEOUT_S = 300.0


class RankFailure(Exception):
    """One or more ranks failed; the message holds their tracebacks."""


def _worker_main(rank: int, world_size: int, port: int, conn: Any, sys_path: list[str]) -> None:
    sys.path[:] = sys_path
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore(HOST, port, world_size, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
    )
    conn.send(("ready", None))
    while True:
        message = conn.recv()
        if message is None:
            break
        fn, args, timeout_s, dump_path = message
        with open(dump_path, "w") as dump:
            faulthandler.dump_traceback_later(timeout_s, exit=False, file=dump)
            try:
                reply = ("ok", fn(*args))
            except BaseException:
                reply = ("error", traceback.format_exc())
            finally:
                faulthandler.cancel_dump_traceback_later()
        conn.send(reply)
    # Exit at once: tearing down gloo groups waits on peers that are exiting too.
    os._exit(0)


class RankPool:
    """``world_size`` worker processes in one gloo process group, started once and reused."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._dump_dir = Path(tempfile.mkdtemp(prefix=f"ranks{world_size}-"))
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._store: Any = None

    def start(self) -> None:

        # The store server lives here, on a free loopback port picked by the OS.
        self._store = host_store(self.world_size, HOST)
        ctx = multiprocessing.get_context("spawn")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, self._store.port, child, list(sys.path)),
                daemon=True,
            )
            proc.start()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect(timeout_s=120.0, what="start-up")

    def stop(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        deadline = time.monotonic() + 10
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs, self._conns, self._store = [], [], None

    def restart(self) -> None:
        self.stop()
        self.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> list:
        """Run ``fn(*args)`` on every rank; return the per-rank results, indexed by rank."""
        if not self._procs:
            self.start()
        dumps = [self._dump_dir / f"rank{rank}.txt" for rank in range(self.world_size)]
        for conn, dump in zip(self._conns, dumps, strict=False):
            conn.send((fn, args, timeout_s, str(dump)))
        try:
            # The stacks are dumped at timeout_s, by faulthandler's watchdog: read them soon after.
            return self._collect(timeout_s + 2.0, what=fn.__name__, dumps=dumps)
        except RankFailure:
            self.restart()
            raise

    def _collect(self, timeout_s: float, what: str, dumps: list[Path] | None = None) -> list:
        replies: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < self.world_size:
            pending = {
                rank: self._conns[rank] for rank in range(self.world_size) if rank not in replies
            }
            waitables: list[Any] = list(pending.values())
            waitables += [self._procs[rank].sentinel for rank in pending]
            ready = multiprocessing.connection.wait(waitables, deadline - time.monotonic())
            if not ready:
                raise RankFailure(self._hang_report(what, pending, dumps))
            for rank, conn in pending.items():
                try:
                    if conn.poll():
                        replies[rank] = conn.recv()
                        continue
                except EOFError:
                    pass  # the pipe closed: the worker is gone
                proc = self._procs[rank]
                if not proc.is_alive() or conn.closed:
                    proc.join(5)
                    replies[rank] = ("error", f"rank {rank} died with exit code {proc.exitcode}")
        errors = [
            f"--- rank {r} ---\n{body}" for r, (kind, body) in replies.items() if kind == "error"
        ]
        if errors:
            raise RankFailure(f"{what} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return [replies[rank][1] for rank in range(self.world_size)]

    def _hang_report(self, what: str, pending: dict[int, Any], dumps: list[Path] | None) -> str:
        lines = [f"{what} timed out; ranks still running: {sorted(pending)}"]
        for rank in sorted(pending):
            stack = dumps[rank].read_text() if dumps and dumps[rank].exists() else "(no stack)"
            lines.append(f"--- rank {rank} stack at the timeout ---\n{stack}")
        return "\n".join(lines)


class Ranks:
    """Session-wide access to one pool per world size: ``ranks.run(4, body, *args)``."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def pool(self, world_size: int) -> RankPool:
        if world_size not in self._pools:
            self._pools[world_size] = RankPool(world_size)
        return self._pools[world_size]

    def run(
        self,
        world_size: int,
        fn: Callable[..., Any],
        *args: Any,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> list:
        return self.pool(world_size).run(fn, *args, timeout_s=timeout_s)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.stop()
        self._pools.clear()
