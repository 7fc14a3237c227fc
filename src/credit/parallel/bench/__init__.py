"""``python -m credit.parallel bench``: timings, collective counts and memory against baselines.

The benchmark starts its own ranks on this machine (gloo on CPU by default, 2 ranks; ``--backend
nccl`` where GPUs exist), runs every comparison side by side with warm-up and alternating
repetitions, and prints a table of medians, ratios, collective counts and peak extra memory, each
goal next to its ratio with whether it holds. A simulated large world (torch's fake backend, in a
subprocess) shows that collectives per call do not grow with the world size.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from credit.parallel.bench._report import Case, Row, format_table, write_json, write_plot

logger = logging.getLogger(__name__)

CASE_NAMES = ("dense", "tiny", "dtensor", "clip", "mixed", "scale")
SCALE_WORLDS = (8, 64, 1024)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m credit.parallel bench",
        description="Timings, collective counts and memory of credit.parallel's collectives "
        "against their baselines, on ranks started on this machine.",
    )
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default="gloo",
        help="gloo on CPU (default) or nccl on CUDA GPUs, one per rank",
    )
    parser.add_argument("--nproc-per-node", type=int, default=2, help="ranks to start (default 2)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 15)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds (default 3)")
    parser.add_argument("--quick", action="store_true", help="a short run: 2 warm-up, 5 timed")
    parser.add_argument(
        "--bucket-cap-mb", type=float, default=25.0, help="bucket cap under test (default 25)"
    )
    parser.add_argument(
        "--cases", default=",".join(CASE_NAMES), help=f"comma-separated, of {','.join(CASE_NAMES)}"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG bar chart here")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before giving up")
    return parser


def _meta(args: argparse.Namespace, device: str) -> dict[str, Any]:
    import torch

    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    return {
        "backend": args.backend,
        "device": device,
        "ranks": args.nproc_per_node,
        "warmup": args.warmup,
        "reps": args.reps,
        "bucket_cap_mb": args.bucket_cap_mb,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_at_end": [round(x, 2) for x in load],
    }


def _scale_case(timeout_s: float) -> Case:
    """G6, in a fresh interpreter: the fake process group must not meet the real ones."""
    command = [sys.executable, "-m", "credit.parallel.bench._scale", *map(str, SCALE_WORLDS)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    case = Case("scale", f"collectives per call at simulated worlds {SCALE_WORLDS} (fake backend)")
    if done.returncode != 0:
        case.notes.append(f"the simulation failed: {done.stderr.strip()[-500:]}")
        return case
    counts: dict[str, dict[str, int]] = json.loads(done.stdout.strip().splitlines()[-1])
    worlds = [str(world) for world in SCALE_WORLDS]
    expected = {
        "total_grad_norm": 1,
        "clip_grad_norm_": 1,
        "total_grad_norm with pp_group": 1,
        "allreduce_grads_avg": counts[worlds[0]]["expected_buckets"],
    }
    for name, want in expected.items():
        seen = [counts[world][name] for world in worlds]
        label = f"{name}: collectives at {' / '.join(worlds)} ranks"
        holds = all(count == want for count in seen)
        if name == "allreduce_grads_avg":  # the bucket count itself must not depend on the world
            holds = holds and all(counts[world]["expected_buckets"] == want for world in worlds)
        value = " / ".join(map(str, seen))
        case.rows.append(Row("G6", label, value, f"{want} at every size", holds, "count"))
    case.notes.append(
        "mesh (world/8, 8) as (dp, tp); averaging over tp, 8 KiB buckets; with pp_group: "
        "(2, world/(2*tp), tp) as (pp, dp, tp) with tp = min(8, world/2), two pipeline stages"
    )
    return case


def main(argv: list[str]) -> int:
    """Run the benchmark; return the process exit code (0, or 1 when it could not run).

    Args:
        argv: the command line after ``bench`` (``--help`` lists the options).

    Returns:
        0 when every selected case ran (goals missed are reported, not an error), else 1.
    """
    args = _parser().parse_args(argv)
    if args.quick:
        args.warmup = 2 if args.warmup is None else args.warmup
        args.reps = 5 if args.reps is None else args.reps
    args.warmup = 3 if args.warmup is None else args.warmup
    args.reps = 15 if args.reps is None else args.reps
    cases = [name.strip() for name in args.cases.split(",") if name.strip()]
    unknown = sorted(set(cases) - set(CASE_NAMES))
    if unknown:
        print(
            f"unknown cases: {', '.join(unknown)} (known: {', '.join(CASE_NAMES)})", file=sys.stderr
        )
        return 2
    if args.nproc_per_node < 1:
        print("--nproc-per-node must be at least 1", file=sys.stderr)
        return 2
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                "--plot needs matplotlib, an optional dependency: "
                "pip install 'credit-parallel[bench]' (or pip install matplotlib)",
                file=sys.stderr,
            )
            return 2
    device = "cuda" if args.backend == "nccl" else "cpu"
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("--backend nccl needs CUDA GPUs; none are visible", file=sys.stderr)
            return 2

    from credit.parallel.bench._cases import run_cases
    from credit.parallel.bench._launch import run_ranks

    config = {
        "device": device,
        "warmup": args.warmup,
        "reps": args.reps,
        "bucket_cap_mb": args.bucket_cap_mb,
        "cases": [name for name in cases if name != "scale"],
    }
    results: list[Case] = []
    try:
        if config["cases"]:
            results = run_ranks(run_cases, config, args.nproc_per_node, args.backend, args.timeout)
        if "scale" in cases:
            print("simulating large worlds ...", file=sys.stderr)
            results.append(_scale_case(timeout_s=600))
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        print(f"benchmark failed: {error}", file=sys.stderr)
        return 1
    meta = _meta(args, device)
    header = (
        f"credit.parallel bench: {args.nproc_per_node} ranks, {args.backend} on {device}, "
        f"torch {meta['torch']}, {meta['cpus']} CPUs, load average {meta['load_average_at_end'][0]}"
        f"\n{args.warmup} warm-up rounds, then {args.reps} repetitions alternating between "
        "variants; each figure is the median over repetitions of the slowest rank's time"
    )
    print(format_table(header, results))
    if args.json is not None:
        write_json(args.json, meta, results)
        print(f"wrote {args.json}")
    if args.plot is not None:
        write_plot(args.plot, header.splitlines()[0], results)
        print(f"wrote {args.plot}")
    return 0
