"""Timing side by side: warm-up, then repetitions that alternate between the variants.

Every timed call starts behind a barrier, so all ranks start it together; a call's time is the
longest any rank took (the step waits for the slowest rank), and a variant's figure is the median
over repetitions. Variants alternate within each repetition (A, B, C, then B, C, A, ...), so a
load spike from elsewhere on the machine hits them alike and no variant always runs after the
same one. Beside the wall-clock time, each call's CPU time
(all threads of the rank's process, the backend's included; the largest over ranks) shows what
the call costs when the machine is shared.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

import torch
import torch.distributed as dist


class Progress:
    """A one-line progress bar on stderr (rank 0 only), over a fixed number of cases."""

    def __init__(self, cases: int, enabled: bool, stream: TextIO | None = None) -> None:
        self.cases = max(1, cases)
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self._tty = self.stream.isatty()
        self._last_line = ""

    def update(self, label: str, fraction: float) -> None:
        """Show ``label``, ``fraction`` of the way through the current case."""
        if not self.enabled:
            return
        overall = (self.done + min(max(fraction, 0.0), 1.0)) / self.cases
        filled = round(30 * overall)
        line = f"[{'#' * filled}{'.' * (30 - filled)}] {100 * overall:3.0f}%  {label}"
        if self._tty:
            self.stream.write("\r" + line.ljust(len(self._last_line)))
        elif label.split(":")[0] != self._last_line.split("  ", 1)[-1].split(":")[0]:
            self.stream.write(line + "\n")  # not a terminal: one line per case
        self._last_line = line
        self.stream.flush()

    def case_done(self) -> None:
        self.done += 1

    def close(self) -> None:
        if self.enabled and self._tty:
            self.stream.write("\n")
            self.stream.flush()


def device_sync(device: torch.device) -> Callable[[], None]:
    """What waits for the device's queued work (nothing to wait for on CPU)."""
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


@dataclass
class Timings:
    """Per-repetition seconds of one variant, each the largest over ranks."""

    wall: list[float]
    cpu: list[float]


def measure(
    variants: dict[str, Callable[[], object]],
    *,
    warmup: int,
    reps: int,
    device: torch.device,
    progress: Progress,
    label: str,
) -> dict[str, Timings]:
    """Time every variant ``reps`` times, alternating; seconds per repetition, max over ranks.

    Args:
        variants: name -> the call to time (every rank runs the same calls in the same order).
        warmup: untimed rounds first (buffers allocated, caches warm).
        reps: timed rounds.
        device: where the work runs (CUDA work is waited for before the clock stops).
        progress: the progress bar to advance.
        label: what the progress bar says.

    Returns:
        name -> the per-repetition wall-clock and CPU times, each the slowest rank's.
    """
    sync = device_sync(device)
    names = list(variants)
    total = warmup + reps
    for round_index in range(warmup):
        progress.update(f"{label}: warm-up", round_index / total)
        for name in names:
            variants[name]()
        sync()
    local: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in names}
    for rep in range(reps):
        progress.update(f"{label}: repetition {rep + 1}/{reps}", (warmup + rep) / total)
        # Each round starts one variant later, so every variant runs in every position equally
        # often (after each of the others), and no variant always follows the same neighbour.
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            cpu_start, start = time.process_time(), time.perf_counter()
            variants[name]()
            sync()
            local[name][0].append(time.perf_counter() - start)
            local[name][1].append(time.process_time() - cpu_start)
    gathered: list[dict[str, tuple[list[float], list[float]]] | None] = [
        None
    ] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    ranks = [times for times in gathered if times is not None]
    return {
        name: Timings(
            wall=[max(times[name][0][rep] for times in ranks) for rep in range(reps)],
            cpu=[max(times[name][1][rep] for times in ranks) for rep in range(reps)],
        )
        for name in names
    }


def median_ms(times: list[float]) -> float:
    return 1e3 * statistics.median(times)
