"""Command-line options of the demo, checked before anything is launched."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from credit.parallel.demo._config import ModelConfig

BACKENDS = ("gloo", "nccl")
DEVICES = ("cpu", "cuda")
DOMAIN_SYNCS = ("in-backward", "explicit")
# In backward: the same bits as explicit, and nothing left to run after backward.
DEFAULT_DOMAIN_SYNC = "in-backward"
OPTIMIZERS = ("adamw", "sgd")
# Loss scaling: off, fp16 (scaled by credit.parallel.amp.GradScaler), bf16 (not scaled; the
# scaler only skips non-finite steps). The model computes in float32 either way.
AMP_MODES = ("off", "fp16", "bf16")
DEFAULT_NONFINITE_STEP = 3  # with --amp: the step at which one rank's gradient gets an inf
# --spike-step: SpikePolicy(warmup=SPIKE_WARMUP), its other settings the defaults (a skip above a
# z-score of 6 over an EMA of the norm, alpha 0.97). Its default warm-up of 25 values outlasts the
# demo's 10 steps; after 5, the demo's own norms stay far below the limit (measured over 30 steps,
# AdamW seeds 0-3 and SGD seeds 0-9: z-scores of 3.4 at most), while the planted spike, one data
# shard's inputs times SPIKE_FACTOR, lies thousands of standard deviations out.
SPIKE_WARMUP = 5
SPIKE_FACTOR = 1e3
START_METHODS = ("fork", "forkserver", "spawn")
DEFAULT_DP, DEFAULT_TP = 2, 2
# float32 rounding differs between the sharded run and the replica (TP splits the projections'
# sums, FSDP2 and domain averaging add in another order), and AdamW turns rounding noise in small
# gradients into small weight differences that grow with the steps. Measured on CPU/gloo over
# 10-30 steps and 8 layouts: at most 6.3e-7 relative on the loss and grad norm, 2.8e-6 on the
# weights (tensor by tensor, norm-wise). Faults show far above the tolerance: without the domain
# sync the grad norm departs by 1e-1 at the first step.
DEFAULT_RTOL = 1e-4
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class Options:
    """Everything a launcher and its ranks need to know, resolved and checked."""

    dp: int
    tp: int
    domain: int
    domain_sync: str
    steps: int
    accum: int
    micro_batch: int
    backend: str
    optimizer: str
    lr: float
    max_norm: float
    seed: int
    rtol: float
    start_method: str
    in_place: bool  # started by torchrun: run as this rank, launch nothing
    model: ModelConfig = field(default_factory=ModelConfig)
    amp: str = "off"
    nonfinite_step: int | None = None  # the step (from 1) at which one rank plants an inf
    spike_step: int | None = None  # the step (from 1) at which one data shard's inputs spike
    verify_replicas: int | None = None  # check every copy's bits every N steps (None: never)
    device: str = "cpu"  # where the ranks' tensors live: "cuda" with nccl, either with gloo

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.domain


def parse(argv: list[str]) -> Options:
    """Parse and check ``argv``; exit with status 2 and a clear message on a bad option."""
    parser = _parser()
    args = parser.parse_args(argv)
    in_place = all(name in os.environ for name in TORCHRUN_VARIABLES)
    try:
        return _resolve(args, in_place)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


T = TypeVar("T")


def _number(
    convert: Callable[[str], T], accept: Callable[[T], bool], wanted: str
) -> Callable[[str], T]:
    """An argparse type: ``convert`` the text, then require ``accept``; errors say ``wanted``."""

    def parse(text: str) -> T:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {value}")
        return value

    return parse


_positive_int = _number(int, lambda value: value >= 1, "a positive integer")
_positive_float = _number(float, lambda value: 0 < value < float("inf"), "a positive finite number")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="credit-parallel demo",
        description=(
            "Train a tiny weather model on real ranks with FSDP2 + tensor parallelism + domain "
            "parallelism, with credit.parallel's gradient syncs and clipping, and check every "
            "step against a single-process replica. Launches its ranks on this machine through "
            "torch's elastic launcher, listening on 127.0.0.1 only; under torchrun (on one "
            "node or many) it runs as the rank torchrun started."
        ),
    )
    _add_layout(parser.add_argument_group("layout"))
    _add_training(parser.add_argument_group("training"))
    _add_launch(parser.add_argument_group("launch (ignored under torchrun)"))
    return parser


def _add_layout(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--dp",
        type=_positive_int,
        metavar="N",
        help=f"data-parallel size (FSDP2). Default: {DEFAULT_DP}, or under torchrun world size / "
        "(tp * domain)",
    )
    group.add_argument(
        "--tp",
        type=_positive_int,
        default=DEFAULT_TP,
        metavar="N",
        help=f"tensor-parallel size. Default: {DEFAULT_TP}",
    )
    group.add_argument(
        "--domain",
        type=_positive_int,
        default=1,
        metavar="N",
        help="domain-parallel size: latitude bands. Default: 1",
    )
    group.add_argument(
        "--domain-sync",
        choices=DOMAIN_SYNCS,
        default=DEFAULT_DOMAIN_SYNC,
        help="average over the domain group inside backward (FSDP2's all-reduce hook) or "
        f"after it (sync_domain_gradients). Default: {DEFAULT_DOMAIN_SYNC}",
    )
    group.add_argument(
        "--backend",
        choices=BACKENDS,
        default="gloo",
        help="gloo (CPU, or CUDA with --device cuda) or nccl (one GPU per rank). Default: gloo",
    )
    group.add_argument(
        "--device",
        choices=DEVICES,
        help="where the ranks' tensors live: cuda with nccl; with gloo cpu, or cuda, where the "
        "ranks share the GPUs there are (one is enough). Default: cuda with nccl, else cpu",
    )


def _add_training(group: argparse._ArgumentGroup) -> None:
    for flag, default, what in (
        ("--steps", 10, "optimizer steps"),
        ("--accum", 2, "micro-steps per optimizer step"),
        ("--micro-batch", 2, "samples per dp rank per micro-step"),
    ):
        group.add_argument(
            flag,
            type=_positive_int,
            default=default,
            metavar="N",
            help=f"{what}. Default: {default}",
        )
    group.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="Default: adamw")
    group.add_argument("--lr", type=_positive_float, default=3e-3, help="Default: 3e-3")
    group.add_argument(
        "--max-norm", type=_positive_float, default=0.25, help="clipping threshold. Default: 0.25"
    )
    group.add_argument("--seed", type=int, default=0, help="model and data seed. Default: 0")
    group.add_argument(
        "--rtol",
        type=_positive_float,
        default=DEFAULT_RTOL,
        help=f"largest relative difference from the replica that passes. Default: {DEFAULT_RTOL:.0e}",
    )
    _add_faults(group)


def _add_faults(group: argparse._ArgumentGroup) -> None:
    """The options that plant faults the run must survive, and check its replicas."""
    group.add_argument(
        "--amp",
        choices=AMP_MODES,
        default="off",
        help="loss scaling with credit.parallel.amp.GradScaler: fp16 scales the loss; bf16 only "
        "skips non-finite steps (the model computes in float32 either way, so the replica "
        "stays comparable). Default: off",
    )
    group.add_argument(
        "--nonfinite-step",
        type=_positive_int,
        metavar="N",
        help="with --amp: the step at which the last rank plants an inf in its shard of a "
        f"gradient, which every rank must skip. Default: {DEFAULT_NONFINITE_STEP}, or the last "
        "step if there are fewer",
    )
    group.add_argument(
        "--spike-step",
        type=_positive_int,
        metavar="N",
        help="clip with a credit.parallel.spikes.SpikePolicy held by the GradScaler "
        "(GradScaler(scaling=False) without --amp), and plant a gradient spike at step N: the "
        f"inputs of the last rank's data shard times {SPIKE_FACTOR:g}, a step every rank and the "
        "replica must skip; then print how far taking it would move the weights. The policy is "
        f"SpikePolicy(warmup={SPIKE_WARMUP}), its other settings the defaults (skip above a "
        "z-score of 6 over an EMA of the norm, alpha 0.97): the default warm-up of 25 steps "
        f"outlasts the demo's. N must come after the warm-up: from {SPIKE_WARMUP + 1} on, one "
        "later when --nonfinite-step is before N (a skipped step does not count). Default: no "
        "policy",
    )
    group.add_argument(
        "--verify-replicas",
        type=_positive_int,
        metavar="N",
        help="every N steps, prove every copy of every parameter and optimizer state "
        "bit-identical (credit.parallel.replicas.verify_replicas) and print its cost per call; "
        "with --amp fp16, also after torch's scaler's planted step. Default: never",
    )


def _add_launch(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--start-method",
        choices=START_METHODS,
        help="how ranks are started. Default: fork with gloo on Linux, else spawn",
    )


def _resolve(args: argparse.Namespace, in_place: bool) -> Options:
    model = ModelConfig()
    _check_model_fit(args.tp, args.domain, model)
    dp = _in_place_dp(args) if in_place else (args.dp or DEFAULT_DP)
    device, start_method = _device_and_start_method(args, dp * args.tp * args.domain)
    nonfinite_step = _nonfinite_step(args)
    return Options(
        amp=args.amp,
        nonfinite_step=nonfinite_step,
        spike_step=_spike_step(args, nonfinite_step),
        verify_replicas=args.verify_replicas,
        dp=dp,
        tp=args.tp,
        domain=args.domain,
        domain_sync=args.domain_sync,
        steps=args.steps,
        accum=args.accum,
        micro_batch=args.micro_batch,
        backend=args.backend,
        device=device,
        optimizer=args.optimizer,
        lr=args.lr,
        max_norm=args.max_norm,
        seed=args.seed,
        rtol=args.rtol,
        start_method=start_method,
        in_place=in_place,
        model=model,
    )


def _device_and_start_method(args: argparse.Namespace, world: int) -> tuple[str, str]:
    """Where the ranks' tensors live and how the ranks start, checked against the GPUs here."""
    device = args.device or ("cuda" if args.backend == "nccl" else "cpu")
    if args.backend == "nccl" and device != "cuda":
        raise ValueError("--backend nccl needs --device cuda")
    # A forked rank cannot initialise CUDA: ranks that use it are spawned.
    start_method = args.start_method or (
        "fork" if device == "cpu" and sys.platform.startswith("linux") else "spawn"
    )
    if start_method == "fork" and device == "cuda":
        raise ValueError("--device cuda needs --start-method spawn or forkserver")
    if args.backend == "nccl":
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        _check_cuda(ranks, f"--backend nccl needs one CUDA GPU per rank: {ranks} ranks")
    elif device == "cuda":
        _check_cuda(1, "--device cuda needs a CUDA GPU")
    return device, start_method


def _nonfinite_step(args: argparse.Namespace) -> int | None:
    if args.amp == "off":
        if args.nonfinite_step is not None:
            raise ValueError("--nonfinite-step needs --amp fp16 or --amp bf16")
        return None
    step = args.nonfinite_step or min(DEFAULT_NONFINITE_STEP, args.steps)
    if step > args.steps:
        raise ValueError(f"--nonfinite-step {step} is past the last step ({args.steps})")
    return step


def _spike_step(args: argparse.Namespace, nonfinite_step: int | None) -> int | None:
    """The checked ``--spike-step``: after the policy's warm-up (which a skipped non-finite step
    lengthens: it enters no history), within the steps, not the non-finite step."""
    step = args.spike_step
    if step is None:
        return None
    if step > args.steps:
        raise ValueError(f"--spike-step {step} is past the last step ({args.steps})")
    if step == nonfinite_step:
        raise ValueError(
            f"--spike-step {step} is also the step of the planted inf (--nonfinite-step): "
            "a non-finite step is skipped as such, not as a spike; pick another step"
        )
    shifted = nonfinite_step is not None and nonfinite_step < step
    first = SPIKE_WARMUP + 1 + shifted
    if step < first:
        taken = f"{SPIKE_WARMUP} taken steps"
        if shifted:
            taken += f" (the skipped step {nonfinite_step} not one of them)"
        hint = (
            f"use a step from {first} to {args.steps}"
            if first <= args.steps
            else f"use a step from {first} on, with --steps {first} or more"
        )
        raise ValueError(
            f"--spike-step {step} is within the spike policy's warm-up: its first {taken} "
            f"decide nothing; {hint}"
        )
    return step


def _check_model_fit(tp: int, domain: int, model: ModelConfig) -> None:
    if model.heads % tp or model.hidden % tp:
        raise ValueError(
            f"--tp {tp} must divide the model's {model.heads} attention heads and "
            f"{model.hidden} hidden features (use 1, 2 or 4)"
        )
    if domain > model.lat:
        raise ValueError(f"--domain {domain}: more latitude bands than the grid's {model.lat} rows")


def _check_cuda(gpus: int, need: str) -> None:
    """ValueError (saying ``need``) unless this machine has ``gpus`` CUDA GPUs."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < gpus:
        raise ValueError(f"{need} on this machine, {count} GPUs")


def _in_place_dp(args: argparse.Namespace) -> int:
    """``dp`` under torchrun, from its world size."""
    world = int(os.environ["WORLD_SIZE"])
    per_dp = args.tp * args.domain
    dp = args.dp if args.dp is not None else world // per_dp
    if dp * per_dp != world:
        raise ValueError(
            f"dp * tp * domain = {dp} * {args.tp} * {args.domain} = {dp * per_dp} does not "
            f"equal torchrun's world size {world}"
        )
    return dp
