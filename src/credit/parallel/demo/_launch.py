"""Start the demo's ranks on this machine and sum up how they ended."""

from __future__ import annotations

import importlib

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from credit.parallel._common.launch import launch_local
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
    """Launch the ranks, wait for them, and return the demo's exit status.

    Args:
        options: the checked command-line options.

    Returns:
        0 when every rank reports a run that matches the replica, 1 otherwise.
    """
    quiet_torch()
    if options.start_method == "fork":
        # Imported by the optimizers on first use (~0.5 s): once here, not once per forked rank.
        importlib.import_module("torch._dynamo")
    layout = f"{_report.layout_name(options)}, {_report.transport(options)}, {options.start_method}"
    _report.say(f"launching {_report.plural(options.world, 'rank')} ({layout}) ...")
    try:
        results = launch_local(
            run_worker, (options,), options.world, start_method=options.start_method
        )
    except ChildFailedError as exc:
        _report.say(f"FAILED: {_failure_summary(exc)}")
        return 1
    return 0 if all(code == EXIT_PASS for code in results.values()) else 1


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


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))
