"""Peak extra memory of one call, as the tests and the benchmark (``benchmarks/``) measure it.

On CPU torch keeps no allocator statistics, so the call runs under
``torch.profiler.profile(profile_memory=True)``, which records every allocation and free torch
makes on the calling thread; the peak is the highest running sum of those events over the call
(what the call holds at its worst beyond what existed before it). Memory the backend allocates
outside torch (gloo's own transfer buffers) is not seen, for any call alike. On CUDA the
allocator's peak statistic gives the same figure.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MemoryUse:
    """Bytes a call allocated: its peak beyond the memory in use before, and its largest block."""

    peak_bytes: int
    largest_bytes: int


def extra_memory(call: Callable[[], object], device: torch.device) -> MemoryUse:
    """Run ``call`` once and report the memory it needed beyond what was already allocated."""
    if device.type == "cuda":
        return _cuda_extra(call, device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with (
        _quiet_stderr(),
        torch.profiler.profile(activities=activities, profile_memory=True) as prof,
    ):
        call()
    events = sorted(
        (event.start_ns(), event.nbytes())
        for event in prof.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU
    )
    running = peak = largest = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
        largest = max(largest, nbytes)
    return MemoryUse(peak, largest)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence the profiler's start and stop lines, which its C++ side writes to fd 2."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _cuda_extra(call: Callable[[], object], device: torch.device) -> MemoryUse:
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    call()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    return MemoryUse(peak, peak)
