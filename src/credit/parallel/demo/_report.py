"""What rank 0 prints: the set-up, torch's clip on this layout, one line per step, a verdict."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from credit.parallel.demo._amp import GROWTH_INTERVAL, INIT_SCALE
from credit.parallel.demo._cli import SPIKE_FACTOR, SPIKE_WARMUP

if TYPE_CHECKING:
    from credit.parallel.demo._cli import Options
    from credit.parallel.demo._history import History
    from credit.parallel.demo._spikes import SpikeSeen
    from credit.parallel.replicas import Mismatch

MESSAGE_WIDTH = 90
COLUMNS = ("step", "loss", "loss (1 proc)", "rel diff", "grad norm", "norm (1 proc)", "rel diff")
WIDTHS = (4, 12, 13, 8, 12, 13, 8)
# With loss scaling: the scale after the step, and whether every rank skipped it.
SCALER_COLUMNS = ("scale", "skipped")
SCALER_WIDTHS = (7, 7)


def say(text: str) -> None:
    print(text, flush=True)


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def layout_name(options: Options) -> str:
    return f"dp={options.dp} x tp={options.tp} x domain={options.domain}"


def transport(options: Options) -> str:
    """The backend, and the device where it is not the backend's own (gloo's CPU, nccl's CUDA)."""
    own = "cuda" if options.backend == "nccl" else "cpu"
    return options.backend if options.device == own else f"{options.backend} on {options.device}"


def ready(options: Options, parameters: int, started: float) -> None:
    """The set-up, once the ranks are up."""
    m = options.model
    say(
        f"{plural(options.world, 'rank')} up in {time.perf_counter() - started:.1f} s "
        f"({layout_name(options)}, {transport(options)})"
    )
    say(
        f"model: {m.depth} transformer blocks (dim {m.dim}, {m.heads} heads), {parameters:,} "
        f"parameters, on a {m.channels} x {m.lat} x {m.lon} grid (channels x lat x lon)"
    )
    say(f"layout: {_layout_description(options)}")
    say(
        f"training: {plural(options.steps, 'step')} of {plural(options.accum, 'micro-step')}, "
        f"{options.optimizer} lr {options.lr:g}, clip at {options.max_norm:g}; "
        "replica: 1 process on rank 0"
    )
    if options.amp != "off":
        say(f"loss scaling: {_scaling_description(options)}")
    if options.spike_step is not None:
        say(f"spikes: {_as_whatdescription(options)}")


def _as_whatdescription(options: Options) -> str:
    held = "credit.parallel.amp.GradScaler" + ("(scaling=False)" if options.amp != "fp16" else "")
    return (
        f"SpikePolicy(warmup={SPIKE_WARMUP}) held by {held}, skipping a step whose grad norm "
        f"lies over 6 standard deviations above its moving average; at step {options.spike_step}, "
        f"the inputs of the last rank's data shard x {SPIKE_FACTOR:g} (dp rank {options.dp - 1}: "
        f"{_ranks(_shard_ranks(options))}); replica: the same rule on its own norms"
    )


def _shard_ranks(options: Options) -> list[int]:
    """The ranks that train on the last dp rank's data shard."""
    per_shard = options.tp * options.domain
    return list(range((options.dp - 1) * per_shard, options.dp * per_shard))


def _scaling_description(options: Options) -> str:
    planted = f"an inf planted on rank {options.world - 1} at step {options.nonfinite_step}"
    if options.amp == "bf16":
        return (
            "bf16 mode, credit.parallel.amp.GradScaler(scaling=False) skips non-finite steps; "
            f"{planted}; replica: skips a non-finite step"
        )
    return (
        f"fp16 mode, credit.parallel.amp.GradScaler from {INIT_SCALE:g}, doubling every "
        f"{GROWTH_INTERVAL} clean steps; {planted}; replica: torch.amp.GradScaler"
    )


def _layout_description(options: Options) -> str:
    tp = "TP on attention q/k/v/out and MLP fc1/fc2" if options.tp > 1 else "no TP"
    if options.domain == 1:
        return f"{tp}, FSDP2 over dp, loss on the whole grid"
    when = "inside backward" if options.domain_sync == "in-backward" else "after backward"
    lat = options.model.lat
    sizes = sorted(
        {lat * (i + 1) // options.domain - lat * i // options.domain for i in range(options.domain)}
    )
    rows = "-".join(map(str, sizes))
    return (
        f"{tp}, FSDP2 over dp, each domain rank's loss on its own band of {rows} latitude rows, "
        f"domain average {when}"
    )


def torch_clip(error: str | None) -> None:
    """How torch's own clip_grad_norm_ fares on this layout, in one line."""
    if error is None:
        say("torch.nn.utils.clip_grad_norm_ on this layout: works (every parameter on one mesh)")
        return
    say(f"torch.nn.utils.clip_grad_norm_ on this layout: {shorten(error)}")


def shorten(message: str, width: int = MESSAGE_WIDTH) -> str:
    """The first sentence of ``message``; when too long, its first clause, then "..."."""
    text = " ".join(message.split())
    sentence = text.split(". ", 1)[0].rstrip(".")
    if len(sentence) <= width:
        return sentence
    clause_end = sentence.find(", ", 30)
    if 0 < clause_end <= width:
        return sentence[:clause_end] + ", ..."
    return sentence[: width - 3].rstrip() + "..."


def header(options: Options) -> None:
    scaled = options.amp != "off" or options.spike_step is not None
    columns = COLUMNS + SCALER_COLUMNS * scaled
    widths = WIDTHS + SCALER_WIDTHS * scaled
    say("  ".join(name.rjust(width) for name, width in zip(columns, widths, strict=True)))


def row(step: int, run: History, replica: History) -> None:
    """The table line of ``step`` (counted from 1)."""
    loss, ref_loss = run.loss[step - 1], replica.loss[step - 1]
    norm, ref_norm = run.norm[step - 1], replica.norm[step - 1]
    cells: tuple[str, ...] = (
        str(step),
        f"{loss:.8g}",
        f"{ref_loss:.8g}",
        f"{relative(loss, ref_loss):.1e}",
        f"{norm:.8g}",
        f"{ref_norm:.8g}",
        f"{relative(norm, ref_norm):.1e}",
    )
    widths: tuple[int, ...] = WIDTHS
    if run.scale:
        cells += (f"{run.scale[step - 1]:g}", "yes" if run.skipped[step - 1] else "no")
        widths += SCALER_WIDTHS
    say("  ".join(cell.rjust(width) for cell, width in zip(cells, widths, strict=True)))


def relative(value: float, reference: float) -> float:
    """|value - reference| / |reference|: 0 when neither is finite (a skipped step's norms), inf
    when only one is."""
    finite = math.isfinite(value), math.isfinite(reference)
    if not all(finite):
        return math.inf if any(finite) else 0.0
    return abs(value - reference) / max(abs(reference), 1e-30)


def torch_scaler(step: int, skipped: list[bool], diverged: str | None) -> None:
    """How torch's own GradScaler decides the planted step on this layout, in one line; with
    --verify-replicas, a second line: what the replica check found after that step."""
    skipping = [rank for rank, flag in enumerate(skipped) if flag]
    stepping = [rank for rank, flag in enumerate(skipped) if not flag]
    prefix = "torch.amp.GradScaler on this layout:"
    if not stepping:
        say(f"{prefix} every rank skipped step {step}")
    else:
        say(
            f"{prefix} {_ranks(skipping)} skipped step {step}, {_ranks(stepping)} stepped: "
            "the replicas diverged"
        )
    if diverged is not None:
        say(f"verify_replicas after torch's scaler's step: {diverged}")


def spike(
    options: Options, skipped: list[bool], figures: dict[str, float], seen: SpikeSeen | None
) -> None:
    """Two lines on the planted spike: which ranks skipped it (``skipped``, by rank), with the
    policy's figures and the replica's decision; and what taking it, without the policy, does
    to the weights (measured on copies of the replica)."""
    step = options.spike_step
    assert step is not None and seen is not None
    skipping = [rank for rank, flag in enumerate(skipped) if flag]
    stepping = [rank for rank, flag in enumerate(skipped) if not flag]
    if not stepping:
        who = f"every rank skipped step {step} as a spike"
    elif not skipping:
        who = f"no rank skipped step {step} as a spike"
    else:
        who = f"{_ranks(skipping)} skipped step {step} as a spike, {_ranks(stepping)} took it"
    replica = f"z-score {seen.zscore:.3g}" if seen.zscore is not None else "in its warm-up"
    say(
        f"SpikePolicy: {who}: grad norm {figures['norm']:.4g}, z-score "
        f"{figures['norm_z']:.3g} (skipped above {figures['skip_limit']:.4g}); the replica "
        f"{'skipped' if seen.skipped else 'took'} it ({replica} on its own norms)"
    )
    measure = "||w_after - w_before|| / ||w_before||, all parameters, on copies of the replica"
    before = ""
    if seen.previous is not None and seen.previous[1] > 0:
        prior, moved = seen.previous
        before = f", {seen.move / moved:.2f}x step {prior}'s {moved:.2e}"
    still = "; with it they do not move" if not stepping else ""
    say(
        f"without the policy: step {step} is taken, its grad norm {seen.norm:.4g} clipped to "
        f"{options.max_norm:g}, and the weights move by {seen.move:.2e} ({measure}){before}"
        f"{still}"
    )


def mismatches(step: int, found: Iterable[Mismatch]) -> str:
    """What a failed replica check found, in one line: the first two tensors, each with every
    rank whose copy differs from a strict majority's, or the ranks of each group that disagree
    where no strict majority tells which copy is right."""
    by_name: dict[str, list[str]] = {}
    for m in found:
        if m.reference is None:
            by_name.setdefault(m.name, []).append(f"{_ranks(list(m.ranks))} disagree")
            continue
        by_name.setdefault(m.name, []).extend(f"rank {r} from rank {m.reference}" for r in m.ranks)
    shown = "; ".join(f"{name} ({', '.join(pairs)})" for name, pairs in list(by_name.items())[:2])
    more = f"; and {len(by_name) - 2} more" if len(by_name) > 2 else ""
    return f"at step {step}, {plural(len(by_name), 'tensor')} differ across copies: {shown}{more}"


def replica_checks(run: History) -> None:
    """What the replica checks of the parallel run found and cost, in one line."""
    if run.diverged is not None:
        say(f"verify_replicas: FAIL {run.diverged}")
        return
    steps = ", ".join(str(step) for step, _ in run.checks)
    cost = statistics.median(ms for _, ms in run.checks)
    say(
        f"verify_replicas at {'step' if len(run.checks) == 1 else 'steps'} {steps}: "
        f"{run.compared} of the {run.tensors} tensors (parameters and AdamW state) have copies "
        f"on other ranks, all bit-identical; {cost:.1f} ms per call, one all_reduce"
    )


def _skips(skipped: list[bool], spikes: list[bool]) -> str:
    """Which steps every rank skipped, as the replica, and why, for the verdict."""
    steps = [step for step, flag in enumerate(skipped, 1) if flag]
    if not steps:
        return "no rank skipped a step, nor did the replica"
    spiked = [step for step in steps if spikes[step - 1]]
    non_finite = [step for step in steps if not spikes[step - 1]]
    reasons = []
    if non_finite:
        reasons.append("grad norms not finite on either side, left out of the maxima")
    if spiked:
        as_what = "a spike" if len(spiked) == 1 else "spikes"
        reasons.append(f"{as_what} to the policy and to the replica's rule alike, norms compared")
    if non_finite and spiked:
        by_step = [(non_finite, reasons[0]), (spiked, reasons[1])]
        reasons = [f"{_steps(which)}: {why}" for which, why in sorted(by_step)]
    return f"every rank skipped {_steps(steps)}, as the replica ({'; '.join(reasons)})"


def _steps(steps: list[int]) -> str:
    return f"{'step' if len(steps) == 1 else 'steps'} {', '.join(map(str, steps))}"


def _ranks(ranks: list[int]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks)) or 'none'}"


def _norm_difference(run: History, replica: History) -> float:
    """The largest relative difference of the grad norms, steps skipped for a NaN or inf left
    out."""
    skipped = run.skipped or [False] * len(run.norm)
    spikes = run.spikes or [False] * len(run.norm)
    return max(
        (
            relative(value, reference)
            for value, reference, skip, spike in zip(
                run.norm, replica.norm, skipped, spikes, strict=True
            )
            if spike or not skip
        ),
        default=0.0,
    )


def verdict(
    options: Options,
    run: History,
    replica: History,
    weights: float,
    same_bits: bool,
    started: float,
) -> bool:
    """Print the one-line verdict; return whether the run matches the replica.

    With loss scaling or a spike policy, the run must also skip the steps the replica skips, for
    the same causes, with its scales; the norms of steps skipped for a NaN or inf (not finite on
    either side) are left out of the maxima, a spike's are compared.
    """
    loss = max(map(relative, run.loss, replica.loss))
    norm = _norm_difference(run, replica)
    worst = max(loss, norm, weights)
    scaler_agrees = (run.skipped, run.spikes, run.scale) == (
        replica.skipped,
        replica.spikes,
        replica.scale,
    )
    passed = worst <= options.rtol and same_bits and scaler_agrees and run.diverged is None
    figures = (
        f"max relative difference {loss:.1e} (loss), {norm:.1e} (grad norm), "
        f"{weights:.1e} (weights) over {plural(options.steps, 'step')}, "
        f"tolerance {options.rtol:.0e}"
    )
    elapsed = f"{time.perf_counter() - started:.1f} s"
    skips = f"; {_skips(run.skipped, run.spikes)}" if run.skipped else ""
    if passed:
        say(
            f"PASS: the {options.world}-rank run matches the single-process replica: {figures}; "
            f"all ranks hold the same bits{skips}; {elapsed}"
        )
    else:
        reasons = [] if worst <= options.rtol else ["beyond the tolerance"]
        reasons += [] if same_bits else ["ranks disagree on the loss or grad norm bits"]
        reasons += [] if scaler_agrees else ["the skipped steps or scales differ"]
        reasons += [] if run.diverged is None else ["copies of parameters or state differ"]
        say(
            f"FAIL: the {options.world}-rank run departs from the single-process replica "
            f"({', '.join(reasons)}): {figures}; {elapsed}"
        )
    return passed
