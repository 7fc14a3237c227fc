"""Timing side by side: warm-up, then repetitions that alternate between the variants.

Every timed call starts behind a barrier, so all ranks start it together; a call's time is the
longest any rank took (a training step waits for its slowest rank), and a variant's figure is the
median over repetitions. Each repetition starts one variant later than the one before (A, B, C,
then B, C, A, ...), so a load spike from elsewhere on the machine hits every variant alike and no
variant always runs after the same one. Beside the wall-clock time, each call's CPU time (every
thread of the rank's process, the backend's included; the largest over ranks) shows what the call
costs when the cores are shared.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


class Progress:
    """What rank 0 is running, on stderr: one line per case, kept on one line on a terminal."""

    def __init__(self, cases: int, enabled: bool) -> None:
        self.cases = cases
        self.enabled = enabled
        self.done = 0
        self._name = ""
        self._tty = sys.stderr.isatty()

    def start(self, name: str) -> None:
        """Announce the next case."""
        self.done += 1
        self._name = name
        self._show(name)

    def step(self, text: str) -> None:
        """Show how far the current case is (on a terminal only)."""
        if self._tty:
            self._show(f"{self._name}: {text}")

    def close(self) -> None:
        if self.enabled and self._tty:
            sys.stderr.write("\n")

    def _show(self, text: str) -> None:
        if not self.enabled:
            return
        line = f"[{self.done}/{self.cases}] {text}"
        sys.stderr.write(f"\r{line}\033[K" if self._tty else f"{line}\n")
        sys.stderr.flush()


@dataclass
class Timings:
    """Seconds of one variant, each the largest over ranks: per repetition, and its first call."""

    wall: list[float]
    cpu: list[float]
    first_call: float

    @property
    def median_ms(self) -> float:
        return 1e3 * statistics.median(self.wall)

    @property
    def cpu_median_ms(self) -> float:
        return 1e3 * statistics.median(self.cpu)


def _timed(call: Callable[[], object], sync: Callable[[], None]) -> tuple[float, float]:
    """Wall-clock and CPU seconds of ``call``, started on every rank together."""
    dist.barrier()
    cpu_start, start = time.process_time(), time.perf_counter()
    call()
    sync()
    return time.perf_counter() - start, time.process_time() - cpu_start


def measure(
    variants: dict[str, Callable[[], object]],
    *,
    warmup: int,
    reps: int,
    device: torch.device,
    progress: Progress,
) -> dict[str, Timings]:
    """Time every variant ``reps`` times, alternating, after ``warmup`` untimed rounds.

    Args:
        variants: name -> the call to time (every rank runs the same calls in the same order).
        warmup: rounds first (buffers allocated, caches warm), of which only the first call of
            each variant is timed, as its first call.
        reps: timed rounds.
        device: where the work runs (CUDA work is waited for before the clock stops).
        progress: where to report how far the timing is.

    Returns:
        name -> the per-repetition wall-clock and CPU times and the first call's wall-clock
        time, each the slowest rank's.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    names = list(variants)
    first = {name: 0.0 for name in names}
    for round_index in range(warmup):
        progress.step(f"warm-up {round_index + 1}/{warmup}")
        for name in names:
            if round_index == 0:
                first[name] = _timed(variants[name], sync)[0]
            else:
                variants[name]()
        sync()
    local: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in names}
    for rep in range(reps):
        progress.step(f"repetition {rep + 1}/{reps}")
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            wall, cpu = _timed(variants[name], sync)
            if warmup == 0 and rep == 0:
                first[name] = wall
            local[name][0].append(wall)
            local[name][1].append(cpu)
    everyone: list[tuple[dict, dict]] = [({}, {})] * dist.get_world_size()
    dist.all_gather_object(everyone, (local, first))
    return {
        name: Timings(
            wall=[max(times[name][0][rep] for times, _ in everyone) for rep in range(reps)],
            cpu=[max(times[name][1][rep] for times, _ in everyone) for rep in range(reps)],
            first_call=max(firsts[name] for _, firsts in everyone),
        )
        for name in names
    }
