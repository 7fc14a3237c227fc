"""``python -m credit.parallel demo``: a real multi-rank training run, checked against one process.

A tiny weather-style transformer is trained on real ranks laid out as (dp, tp, domain): FSDP2
over dp, a TP plan on the attention and MLP projections over tp, and each domain rank's loss
restricted to its own latitude band. The domain average runs inside backward
(:func:`~credit.parallel.grad_sync.sync_domain_gradients_in_backward`, the default) or after it (:func:`~credit.parallel.grad_sync.sync_domain_gradients`,
``--domain-sync explicit``); at every accumulation boundary the trainer then calls
:func:`~credit.parallel.grad_sync.sync_replicated_gradients` and
:func:`~credit.parallel.collectives.clip_grad_norm_` before the optimizer step. Rank 0 trains a
single-process replica of the same model on the same global batches with torch's own clipping
and prints, step by step, both losses and gradient norms and their relative differences, then a
verdict. The exit status is 0 when the run matches the replica within the tolerance.

By default 4 gloo ranks on CPU (dp=2 x tp=2) are launched on this machine through torch's elastic
launcher; ``--device cuda`` puts their tensors on the GPUs there are (shared), ``--backend nccl``
gives each rank a GPU of its own. Started by ``torchrun`` (on one node or many), the command runs
as the rank torchrun started instead.
"""

from __future__ import annotations

import os
import sys

from credit.parallel.demo._cli import DEFAULT_RTOL, Options, parse

__all__ = ["DEFAULT_RTOL", "Options", "main"]


def main(argv: list[str]) -> int:
    """Run the demo with command-line arguments ``argv``.

    Args:
        argv: the arguments after ``demo``, e.g. ``["--dp", "2", "--tp", "2", "--steps", "5"]``.

    Returns:
        The exit status: 0 when the run matches the single-process replica, 1 when it departs
        from it or a rank fails, 2 for bad options (reported before anything is launched).
    """
    try:
        options = parse(argv)
    except SystemExit as exc:  # argparse: --help (0) or a bad option (2)
        return exc.code if isinstance(exc.code, int) else 2
    if options.in_place:
        from credit.parallel.demo._train import run_worker

        code = run_worker(options)
        # Leave without the interpreter's teardown: on gloo, torch's worker threads can still be
        # releasing the last collective's tensors when Python shuts down, and taking the GIL then
        # aborts about one run of six under torchrun ("terminate called without an active
        # exception"), which would turn a passing run into a failure.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    from credit.parallel.demo._launch import launch

    return launch(options)
