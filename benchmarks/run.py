"""Benchmark of credit.parallel's collectives against named baselines, on ranks of this machine.

Run from the repository root (``make bench``)::

    python benchmarks/run.py --json bench-results/bench.json --plot docs/_static/bench.png

It starts ``--nproc-per-node`` ranks (2 gloo processes on CPU by default; ``--backend nccl`` where
GPUs exist) through torch's elastic launcher, times every selected case of ``cases.CASES`` on them
side by side, counts the collectives per call at simulated worlds of 16, 64 and 1024 ranks in fresh
processes, measures what one rank pays for the norm at simulated worlds of 1,024 to 65,536 ranks
(``world_scale.py``: first call, steady host time, the elements of each collective, memory held),
and prints one report: medians, ratios with their goals in words, collectives per call and
memory. ``--help`` lists the options; ``--cases world-scale`` runs the last alone::

    python benchmarks/run.py --cases world-scale --worlds 1024,8192,65536 --models 8b,70b

The copy-groups cases, where the norm compares copies in their own process groups before the
world's all_reduce, need 4 ranks or more; on fewer they are skipped with a note::

    python benchmarks/run.py --cases copy-groups --nproc-per-node 4

The benchmark is not part of the installed package. It shares its workloads with the test suite
instead of keeping copies, in the package ``testbed/`` at the repository's root: the FSDP2 and
FSDP2 + TP layouts (``testbed/layouts.py``), the simulated-scale counting
(``testbed/fake_world.py``), the world-scale layouts (``testbed/world_layouts.py``) and the memory
measurement (``testbed/memory.py``). This script puts the repository's root on ``sys.path`` after
its own folder, so the benchmark's modules and the tests import the same ones; neither imports
the other's.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SIMULATED = "simulated"
WORLD_SCALE = "world-scale"


def _parser(families: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/run.py",
        description="Timings, collectives per call and memory of credit.parallel's collectives "
        "against named baselines, on ranks started on this machine.",
    )
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default="gloo",
        help="gloo on CPU (default) or nccl on CUDA GPUs, one per rank",
    )
    parser.add_argument("--nproc-per-node", type=int, default=2, help="ranks to start (default 2)")
    parser.add_argument("--reps", type=int, help="timed repetitions (default 15, quick 5)")
    parser.add_argument("--warmup", type=int, help="untimed rounds first (default 3, quick 2)")
    parser.add_argument("--quick", action="store_true", help="a short run: 2 warm-up, 5 timed")
    parser.add_argument(
        "--bucket-cap-mb", type=float, default=25.0, help="bucket cap under test (default 25)"
    )
    parser.add_argument(
        "--cases",
        default=",".join(families),
        help=f"comma-separated, of {','.join(families)} (default: all)",
    )
    parser.add_argument(
        "--worlds",
        default="1024,8192,65536",
        help="world-scale: comma-separated world sizes in ranks (default 1024,8192,65536)",
    )
    parser.add_argument(
        "--layouts",
        default="fsdp-tp,hsdp-tp,pipeline,experts",
        help="world-scale: comma-separated, of fsdp-tp,hsdp-tp,hsdp-tp-8,pipeline,experts "
        "(default fsdp-tp,hsdp-tp,pipeline,experts)",
    )
    parser.add_argument(
        "--models", default="8b,70b", help="world-scale: comma-separated, of 8b,70b,4-layer"
    )
    parser.add_argument(
        "--steady-calls", type=int, default=20, help="world-scale: later calls timed (default 20)"
    )
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--plot", type=Path, help="write a PNG chart of the ratios here")
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds a rank waits for its peers before the run fails (default 600)",
    )
    return parser


def _world_scale_options(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[list[int], list[str], list[str]]:
    """The worlds, layouts and models of the world-scale case, checked."""
    from testbed.world_layouts import LAYOUTS, MODELS, fits, fixed_ranks

    try:
        worlds = [int(world) for world in args.worlds.split(",") if world.strip()]
    except ValueError:
        parser.error(f"--worlds takes comma-separated integers, got {args.worlds!r}")
    layouts = _names(parser, args.layouts, LAYOUTS, "--layouts")
    models = _names(parser, args.models, tuple(MODELS), "--models")
    misfits = [
        f"{world} ({layout})" for world in worlds for layout in layouts if not fits(layout, world)
    ]
    if not worlds or misfits:
        parser.error(
            f"--worlds: {', '.join(misfits) or 'none given'} do not fit; each must be a multiple, "
            "at least twice, of "
            + ", ".join(f"{layout}: {fixed_ranks(layout)}" for layout in layouts)
        )
    if args.steady_calls < 1:
        parser.error("--steady-calls must be at least 1")
    return worlds, layouts, models


def _names(
    parser: argparse.ArgumentParser, text: str, known: tuple[str, ...], option: str
) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        parser.error(f"{option}: choose from {', '.join(known)}, got {text!r}")
    return names


def _meta(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    return {
        "backend": args.backend,
        "ranks": args.nproc_per_node,
        "warmup": args.warmup,
        "reps": args.reps,
        "bucket_cap_mb": args.bucket_cap_mb,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_at_end": [round(load, 2) for load in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark.

    Returns:
        0 when every selected case ran (a missed goal is reported, not an error), 1 when a rank
        failed, 2 for bad options.
    """
    sys.path.insert(1, str(ROOT))
    from cases import CASES

    families = [*dict.fromkeys(case.family for case in CASES), SIMULATED, WORLD_SCALE]
    parser = _parser(families)
    args = parser.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    args.reps = args.reps if args.reps is not None else (5 if args.quick else 15)
    chosen = {name.strip() for name in args.cases.split(",") if name.strip()}
    if chosen - set(families):
        parser.error(f"unknown cases: {', '.join(sorted(chosen - set(families)))}")
    if args.nproc_per_node < 1:
        parser.error("--nproc-per-node must be at least 1")
    scale = _world_scale_options(parser, args) if WORLD_SCALE in chosen else None
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install 'credit-parallel[bench]'")

    from plot import write_plot
    from ranks import Config, rank_main
    from report import format_report, write_json
    from simulated import simulated
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from credit.parallel._common.launch import launch_local

    config = Config(
        backend=args.backend,
        warmup=args.warmup,
        reps=args.reps,
        bucket_cap_mb=args.bucket_cap_mb,
        cases=tuple(case.key for case in CASES if case.family in chosen),
        timeout_s=args.timeout,
    )
    results = []
    if config.cases:
        print(f"launching {args.nproc_per_node} ranks ({args.backend}) ...", file=sys.stderr)
        try:
            by_rank = launch_local(
                rank_main,
                (config,),
                args.nproc_per_node,
                # CUDA must not be initialised in a forked child; gloo ranks start faster forked.
                start_method="spawn" if args.backend == "nccl" else "fork",
                timeout=timedelta(seconds=args.timeout),
            )
        except ChildFailedError as error:
            print(f"benchmark failed: {error.format_msg()}", file=sys.stderr)
            return 1
        results = by_rank[0]
    if SIMULATED in chosen:
        print("counting collectives at simulated worlds ...", file=sys.stderr)
        results.append(simulated(args.timeout))
    if scale is not None:
        from world_scale import world_scale

        print("measuring one rank at simulated worlds ...", file=sys.stderr)
        results.append(world_scale(*scale, args.steady_calls, args.timeout))
    meta = _meta(args)
    title = (
        f"credit.parallel benchmark: {args.nproc_per_node} ranks, {args.backend}, "
        f"torch {meta['torch']}, {meta['cpus']} CPUs, load average {meta['load_average_at_end'][0]}"
    )
    print(
        format_report(
            f"{title}\n{args.warmup} warm-up rounds, then {args.reps} repetitions alternating "
            "between variants; each time is the median over repetitions of the slowest rank's time",
            results,
        )
    )
    if args.json is not None:
        write_json(args.json, meta, results)
        print(f"wrote {args.json}")
    if args.plot is not None:
        write_plot(args.plot, title, results)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
