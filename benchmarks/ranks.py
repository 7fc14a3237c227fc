"""What every rank runs: join the process group, run the selected cases, return the results.

Every rank runs every case (the collectives need them all); rank 0 alone reports progress, and
its results are the ones returned to the launcher.
"""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from cases import CASES, Case, Count, Ratio
from report import Result, Row, Timed
from timing import Progress, measure
from workloads import Context, Workload

from credit.parallel._averaging import buckets as _buckets
from credit.parallel._common.launch import init_process_group
from testbed.fake_world import count_collectives
from testbed.memory import extra_memory


@dataclass(frozen=True)
class Config:
    """The run's settings, the same on every rank."""

    backend: str
    warmup: int
    reps: int
    bucket_cap_mb: float
    cases: tuple[str, ...]
    timeout_s: float


def rank_main(config: Config) -> list[Result] | None:
    """One rank of the benchmark; started by ``launch_local``, which sets its environment.

    Returns:
        The results of the selected cases on rank 0, None on the other ranks.
    """
    rank, local_ranks = int(os.environ["RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if config.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
    # torch warns on every norm per mesh group on a 2D mesh that it redistributes with two
    # sequential all_reduces; the report counts them instead.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    torch.manual_seed(0)
    init_process_group(config.backend, timeout=timedelta(seconds=config.timeout_s))
    try:
        device = torch.device("cuda" if config.backend == "nccl" else "cpu")
        ctx = Context(device, config.warmup, config.reps, config.bucket_cap_mb)
        selected = [case for case in CASES if case.key in config.cases]
        progress = Progress(len(selected), enabled=rank == 0)
        results = [run_case(case, ctx, progress) for case in selected]
        progress.close()
    finally:
        dist.destroy_process_group()
    return results if rank == 0 else None


def run_case(case: Case, ctx: Context, progress: Progress) -> Result:
    """Build the case's workload, time its ways side by side, and derive its rows."""
    progress.start(case.key)
    skipped = _skipped(case, ctx.world)
    if skipped is not None:
        return Result(case.key, case.family, case.name, case.name, notes=[skipped])
    workload = case.build(ctx)
    calls = {way.key: way.make(workload) for way in case.ways}
    times = measure(calls, warmup=ctx.warmup, reps=ctx.reps, device=ctx.device, progress=progress)
    timed = {
        way.key: Timed(
            way.key,
            way.label,
            times[way.key].median_ms,
            times[way.key].cpu_median_ms,
            [1e3 * seconds for seconds in times[way.key].wall],
            1e3 * times[way.key].first_call,
            count_collectives(calls[way.key]),
        )
        for way in case.ways
    }
    if case.memory:
        for key, call in calls.items():
            timed[key].peak_extra_bytes = extra_memory(call, ctx.device).peak_bytes
            timed[key].kept_bytes = _kept_after(call)
    rows = [_ratio_row(ratio, timed) for ratio in case.ratios]
    rows += [_count_row(count, timed, workload) for count in case.counts]
    return Result(
        case.key,
        case.family,
        case.name,
        workload.title,
        list(timed.values()),
        rows + workload.rows,
        workload.notes,
        len(workload.grads) if workload.per_gradient else 0,
        workload.first_calls,
    )


def _skipped(case: Case, world: int) -> str | None:
    """Why ``case`` cannot run on ``world`` ranks, or None where it can."""
    if case.even_world and world % 2:
        return "needs an even number of ranks"
    if world < case.min_world:
        return (
            f"needs at least {case.min_world} ranks ({case.needs}); skipped on {world}: run "
            f"with --nproc-per-node {case.min_world}"
        )
    return None


def _kept_after(call: Callable[[], object]) -> int:
    """Bytes the library keeps between calls after ``call`` (its bucket buffers).

    No public API reports them, hence the private module.
    """
    _buckets.release_buffers()
    call()
    return _buckets.kept_buffer_bytes()


def _ratio_row(ratio: Ratio, timed: dict[str, Timed]) -> Row:
    ours, baseline = timed[ratio.ours.key], timed[ratio.baseline.key]
    label = f"{ours.label} / {baseline.label}"
    if ratio.paired:
        pairs = zip(ours.times_ms, baseline.times_ms, strict=True)
        value = statistics.median(a / b for a, b in pairs)
        label = f"{label}, median of per-repetition ratios"
    elif ratio.less is not None:
        less = timed[ratio.less.key]
        value = (ours.median_ms - less.median_ms) / (baseline.median_ms - less.median_ms)
        label = f"{label}, less {less.label}"
    else:
        value = ours.median_ms / baseline.median_ms
    if ratio.at_most is None:
        return Row(label, value)
    goal = ratio.goal or f"<= {ratio.at_most:g}x"
    return Row(label, value, "ratio", goal, value <= ratio.at_most, ratio.at_most)


def _count_row(count: Count, timed: dict[str, Timed], workload: Workload) -> Row:
    seen = timed[count.way.key].collectives
    label = f"collectives per call, {count.way.label}"
    expected = workload.buckets if count.per_bucket else count.expected
    if expected is None:
        return Row(label, seen, "count")
    goal = f"== {expected}" + (" (one per bucket)" if count.per_bucket else "")
    return Row(label, seen, "count", goal, seen == expected)
