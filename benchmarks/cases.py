"""Every case of the benchmark, declared once.

A :class:`Case` names the workload it builds (``workloads``), the variants it times side by side,
the ratios of their medians it reports (with the goal, in words, where there is one) and the
collectives per call it expects. Each variant is declared once below, as a :class:`Way`, and
shared by every case that times it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import baselines
import torch.distributed as dist
import workloads
from workloads import Context, Workload

from credit.parallel.collectives import (
    all_reduce_avg,
    allreduce_grads_avg,
    clip_grad_norm_,
    total_grad_norm,
)


@dataclass(frozen=True)
class Way:
    """A variant: ``make(workload)`` returns the call to time."""

    key: str
    label: str
    make: Callable[[Workload], Callable[[], object]]


@dataclass(frozen=True)
class Ratio:
    """median(ours) / median(baseline); at most ``at_most`` where that is the goal.

    ``goal`` says the goal in words (default ``"<= {at_most}x"``); ``paired`` takes instead the
    median of each repetition's own ratio, which drifting load moves less; ``less`` takes the
    median of that variant (a part both others run, such as a forward) off both medians first.
    """

    ours: Way
    baseline: Way
    at_most: float | None = None
    goal: str | None = None
    paired: bool = False
    less: Way | None = None


@dataclass(frozen=True)
class Count:
    """Collectives per call of ``way``: ``expected``, or one per bucket by the bucketing rule."""

    way: Way
    expected: int | None = 1
    per_bucket: bool = False


@dataclass(frozen=True)
class Case:
    """One comparison: a workload, the ways timed on it, and what is derived from the timings.

    ``family`` groups cases that differ only in size (selected and reported together; default:
    the key);
    ``memory`` adds each variant's peak extra memory and the memory it keeps between calls;
    ``even_world`` skips the case on an odd number of ranks, ``min_world`` on fewer ranks than
    that, with ``needs`` (why, in words) in its note.
    """

    key: str
    name: str
    build: Callable[[Context], Workload]
    ways: tuple[Way, ...]
    ratios: tuple[Ratio, ...] = ()
    counts: tuple[Count, ...] = ()
    memory: bool = False
    even_world: bool = False
    min_world: int = 1
    needs: str = ""
    family: str = ""

    def __post_init__(self) -> None:
        if not self.family:
            object.__setattr__(self, "family", self.key)


def _average(tensors: Callable[[Workload], list]) -> Callable[[Workload], Callable[[], object]]:
    return lambda w: functools.partial(
        allreduce_grads_avg, tensors(w), w.group, bucket_cap_mb=w.bucket_cap_mb
    )


OURS_AVG = Way("ours", "ours (allreduce_grads_avg)", _average(lambda w: w.grads))
OURS_ZERO_COPY = Way(
    "ours_zero_copy", "ours, grads laid out by contiguous_grads_", _average(lambda w: w.tiled)
)
FLAT_FLOOR = Way(
    "flat_floor",
    "one all_reduce of a pre-flattened buffer (floor)",
    lambda w: functools.partial(all_reduce_avg, w.flat, w.group),
)
FLAT_SUM = Way(
    "flat_sum",
    "that all_reduce as a SUM, without the division",
    lambda w: functools.partial(dist.all_reduce, w.flat, group=w.group),
)
FRESH_BUFFER = Way(
    "fresh_flat_buffer",
    "fresh flat buffer per call",
    lambda w: functools.partial(baselines.fresh_flat_buffer, w.grads, w.group),
)
COALESCED = Way(
    "all_reduce_coalesced",
    "torch.distributed.all_reduce_coalesced",
    lambda w: functools.partial(baselines.all_reduce_coalesced, w.grads, w.group),
)
LOOP = Way(
    "per_parameter_loop",
    "per-parameter loop",
    lambda w: functools.partial(baselines.per_parameter_loop, w.grads, w.group),
)
PER_SHARD = Way(
    "per_shard_async",
    "per-shard async all_reduces",
    lambda w: functools.partial(baselines.per_shard_async, w.grads, w.group),
)
OURS_CLIP = Way(
    "ours_clip",
    "ours (clip_grad_norm_)",
    lambda w: functools.partial(clip_grad_norm_, w.params, w.max_norm),
)
TORCH_CLIP = Way(
    "torch_clip",
    "torch.nn.utils.clip_grad_norm_",
    lambda w: functools.partial(baselines.torch_clip, w.params, w.max_norm),
)
CLIP_PER_GROUP = Way(
    "clip_per_mesh_group",
    "one clip per mesh group",
    lambda w: functools.partial(baselines.clip_per_mesh_group, w.params, w.max_norm),
)
KERNELS = Way(
    "kernels_floor",
    "the kernels alone (floor)",
    lambda w: baselines.clip_kernels(w.grads, w.max_norm),
)
OURS_PIPELINE_CLIP = Way(
    "ours_pipeline_clip",
    "ours (clip_grad_norm_ with pp_group)",
    lambda w: functools.partial(clip_grad_norm_, w.params, w.max_norm, pp_group=w.group),
)
PIPELINE_CLIP = Way(
    "pipeline_clip",
    "torch's clip per stage, squares summed over pp (torchtitan's)",
    lambda w: functools.partial(baselines.pipeline_clip, w.params, w.max_norm, w.group),
)
OURS_NORM = Way(
    "ours_norm", "ours (total_grad_norm)", lambda w: functools.partial(total_grad_norm, w.grads)
)
OURS_NORM_CHECKED = Way(
    "ours_norm_check",
    "ours (total_grad_norm), check mode",
    lambda w: functools.partial(total_grad_norm, w.grads, check=True),
)
TORCH_NORM = Way(
    "torch_norm",
    "torch.nn.utils.get_total_norm + full_tensor()",
    lambda w: functools.partial(baselines.torch_norm, w.grads),
)
NORM_PER_GROUP = Way(
    "norm_per_mesh_group",
    "one norm per mesh group",
    lambda w: functools.partial(baselines.norm_per_mesh_group, w.grads),
)
FIRST_CALL = Way(
    "first_call",
    "ours (total_grad_norm), first call for a layout",
    lambda w: lambda: total_grad_norm(next(w.fresh)),
)
LATER_CALL = Way(
    "later_call",
    "ours (total_grad_norm), a later call",
    lambda w: functools.partial(total_grad_norm, w.grads),
)

EXPLICIT_STEP = Way(
    "explicit_step",
    "backward, then sync_domain_gradients (explicit)",
    lambda w: w.steps["explicit"],
)
IN_BACKWARD_STEP = Way(
    "in_backward_step",
    "backward with sync_domain_gradients_in_backward (ours)",
    lambda w: w.steps["in_backward"],
)
FORWARD_ALONE = Way("forward_alone", "the forward alone", lambda w: w.steps["forward"])

OURS_AMP = Way("amp_ours", "ours (GradScaler + clip_grad_norm_)", lambda w: w.steps["ours"])
TORCH_AMP = Way(
    "amp_torch",
    "torch.amp.GradScaler + torch.nn.utils.clip_grad_norm_",
    lambda w: w.steps["torch"],
)
SHARDED_AMP = Way(
    "amp_sharded",
    "ShardedGradScaler + torch.nn.utils.clip_grad_norm_",
    lambda w: w.steps["sharded"],
)
SPIKES_AMP = Way(
    "amp_spikes",
    "ours with a SpikePolicy (skip + adaptive clip) in place of the clip",
    lambda w: w.steps["spikes"],
)
SPIKES_LOSS_AMP = Way(
    "amp_spikes_loss",
    "ours with a SpikePolicy given the loss",
    lambda w: w.steps["spikes_loss"],
)
NO_SCALER = Way(
    "amp_no_scaler",
    "no scaler: torch.nn.utils.clip_grad_norm_ and the step",
    lambda w: w.steps["no_scaler"],
)

OURS_REPLICAS = Way("replicas_ours", "ours (verify_replicas)", lambda w: w.steps["ours"])
SHA1_REPLICAS = Way(
    "replicas_sha1",
    "SHA-1 of each tensor on the host, all_gather of the digests (Megatron's scheme)",
    lambda w: w.steps["sha1"],
)
GATHER_REPLICAS = Way(
    "replicas_all_gather", "all_gather of every copy, compared", lambda w: w.steps["all_gather"]
)

GROUP_ROUND = Way(
    "group_round",
    "the group round alone (same size, same group)",
    lambda w: w.steps["group_round"],
)
WORLD_ROUND = Way(
    "world_round",
    "the world's all_reduce alone (same size)",
    lambda w: w.steps["world_round"],
)
BOTH_ROUNDS = Way(
    "both_rounds",
    "both all_reduces alone, one after the other",
    lambda w: w.steps["both_rounds"],
)

SCALING_SIZES = (500, 2000, 8000)

# Where the copies of a gradient meet in a process group of their own (dp >= 2 x tp = 2; HSDP's
# replicas over shards of at least 2), the norm compares them there first: a group round.
COPY_GROUP_LAYOUTS = {
    "fsdp-tp": ("fsdp_tp", "FSDP2 + TP", "dp = world / 2 >= 2 beside tp = 2"),
    "hsdp": ("hsdp", "HSDP", "shard = world / 2 >= 2 beside replicate = 2"),
}

CASES: tuple[Case, ...] = (
    Case(
        "dense",
        "dense averaging",
        workloads.dense,
        (OURS_AVG, OURS_ZERO_COPY, FLAT_FLOOR, FLAT_SUM, FRESH_BUFFER, COALESCED, LOOP),
        ratios=(
            Ratio(OURS_AVG, FLAT_FLOOR, 1.15),
            Ratio(OURS_ZERO_COPY, FLAT_FLOOR, 1.15),
            Ratio(OURS_AVG, FLAT_FLOOR, paired=True),
            Ratio(OURS_AVG, FLAT_SUM),
            Ratio(OURS_AVG, FRESH_BUFFER),
            Ratio(OURS_AVG, COALESCED),
            Ratio(OURS_AVG, LOOP),
        ),
        counts=(Count(OURS_AVG, per_bucket=True), Count(OURS_ZERO_COPY, 1)),
        memory=True,
    ),
    Case(
        "tiny",
        "many tiny grads",
        workloads.tiny,
        (OURS_AVG, LOOP, FRESH_BUFFER, FLAT_FLOOR),
        ratios=(
            Ratio(OURS_AVG, LOOP, 1 / 20, goal="at least 20x faster"),
            Ratio(OURS_AVG, FRESH_BUFFER),
            Ratio(OURS_AVG, FLAT_FLOOR),
        ),
        counts=(Count(OURS_AVG, per_bucket=True),),
    ),
    Case(
        "dtensor",
        "DTensor averaging",
        workloads.dtensor,
        (OURS_AVG, PER_SHARD, LOOP, FLAT_FLOOR),
        ratios=(Ratio(OURS_AVG, PER_SHARD, 0.3), Ratio(OURS_AVG, FLAT_FLOOR)),
        counts=(Count(OURS_AVG, per_bucket=True),),
        even_world=True,
    ),
    Case(
        "clip",
        "clip on one mesh",
        workloads.clip,
        (OURS_CLIP, TORCH_CLIP, CLIP_PER_GROUP, KERNELS, OURS_NORM, TORCH_NORM),
        ratios=(
            Ratio(OURS_CLIP, TORCH_CLIP, 0.3),
            Ratio(KERNELS, TORCH_CLIP),
            Ratio(OURS_CLIP, KERNELS),
            Ratio(OURS_CLIP, CLIP_PER_GROUP),
            Ratio(OURS_NORM, TORCH_NORM),
        ),
        counts=(Count(OURS_CLIP, 1),),
    ),
    Case(
        "ddp",
        "clip on DDP's layout",
        workloads.ddp,
        (OURS_CLIP, TORCH_CLIP, OURS_NORM, TORCH_NORM),
        ratios=(Ratio(OURS_CLIP, TORCH_CLIP), Ratio(OURS_NORM, TORCH_NORM)),
        counts=(Count(OURS_CLIP, 1), Count(TORCH_CLIP, 0)),
    ),
    Case(
        "mixed",
        "clip on FSDP2 + TP",
        workloads.mixed,
        (OURS_CLIP, CLIP_PER_GROUP, OURS_NORM, NORM_PER_GROUP, OURS_NORM_CHECKED),
        ratios=(
            Ratio(OURS_CLIP, CLIP_PER_GROUP),
            Ratio(OURS_NORM, NORM_PER_GROUP),
            Ratio(OURS_NORM_CHECKED, OURS_NORM),
        ),
        counts=(
            Count(OURS_NORM, 1),
            Count(OURS_CLIP, 1),
            Count(NORM_PER_GROUP, None),
            Count(OURS_NORM_CHECKED, 4),
        ),
        even_world=True,
    ),
    Case(
        "pipeline",
        "clip across pipeline stages",
        workloads.pipeline,
        (OURS_PIPELINE_CLIP, PIPELINE_CLIP),
        ratios=(Ratio(OURS_PIPELINE_CLIP, PIPELINE_CLIP),),
        counts=(Count(OURS_PIPELINE_CLIP, 1), Count(PIPELINE_CLIP, 1)),
        even_world=True,
    ),
    *(
        Case(
            f"scaling-{size}",
            "clip scaling",
            functools.partial(workloads.scaling, count=size),
            (OURS_CLIP, TORCH_CLIP, KERNELS),
            ratios=(
                Ratio(OURS_CLIP, KERNELS, 1.5 if size == max(SCALING_SIZES) else None),
                Ratio(OURS_CLIP, TORCH_CLIP),
            ),
            counts=(Count(OURS_CLIP, 1),),
            family="scaling",
        )
        for size in SCALING_SIZES
    ),
    Case(
        "in-backward",
        "domain average inside backward",
        workloads.in_backward,
        (IN_BACKWARD_STEP, EXPLICIT_STEP, FORWARD_ALONE),
        ratios=(
            Ratio(IN_BACKWARD_STEP, EXPLICIT_STEP),
            Ratio(IN_BACKWARD_STEP, EXPLICIT_STEP, less=FORWARD_ALONE),
            Ratio(IN_BACKWARD_STEP, EXPLICIT_STEP, paired=True),
        ),
        even_world=True,
    ),
    Case(
        "amp",
        "AMP step",
        workloads.amp,
        (OURS_AMP, SPIKES_AMP, SPIKES_LOSS_AMP, TORCH_AMP, SHARDED_AMP, NO_SCALER),
        ratios=(
            Ratio(OURS_AMP, TORCH_AMP, 1.0, goal="no slower than torch"),
            Ratio(OURS_AMP, SHARDED_AMP, 1.0, goal="no slower than torch"),
            Ratio(OURS_AMP, NO_SCALER),
            Ratio(SPIKES_AMP, OURS_AMP, 1.03, goal="at most 3% slower than without the policy"),
            Ratio(SPIKES_LOSS_AMP, OURS_AMP),
        ),
        counts=(
            Count(OURS_AMP, 1),
            Count(SPIKES_AMP, 1),
            Count(SPIKES_LOSS_AMP, 2),
            Count(TORCH_AMP, None),
            Count(SHARDED_AMP, None),
        ),
    ),
    Case(
        "replicas",
        "replica check",
        workloads.replicas,
        (OURS_REPLICAS, SHA1_REPLICAS, GATHER_REPLICAS),
        ratios=(Ratio(OURS_REPLICAS, SHA1_REPLICAS), Ratio(OURS_REPLICAS, GATHER_REPLICAS)),
        counts=(
            Count(OURS_REPLICAS, 1),
            Count(SHA1_REPLICAS, None),
            Count(GATHER_REPLICAS, None),
        ),
    ),
    *(
        Case(
            f"copy-groups-{name}",
            f"copies compared in their own groups, {title}",
            functools.partial(workloads.copy_groups, layout=layout),
            (OURS_CLIP, GROUP_ROUND, WORLD_ROUND, BOTH_ROUNDS),
            ratios=(
                Ratio(GROUP_ROUND, OURS_CLIP),
                Ratio(WORLD_ROUND, OURS_CLIP),
                Ratio(BOTH_ROUNDS, OURS_CLIP),
            ),
            counts=(
                Count(OURS_CLIP, 2),
                Count(GROUP_ROUND, 1),
                Count(WORLD_ROUND, 1),
                Count(BOTH_ROUNDS, 2),
            ),
            even_world=True,
            min_world=4,
            needs=f"{needs}: on fewer, every copy is in one group over the world, compared in the "
            "world's all_reduce, and no group round runs",
            family="copy-groups",
        )
        for name, (layout, title, needs) in COPY_GROUP_LAYOUTS.items()
    ),
    Case(
        "setup",
        "norm setup cost",
        workloads.setup,
        (FIRST_CALL, LATER_CALL),
        ratios=(Ratio(FIRST_CALL, LATER_CALL),),
        counts=(Count(FIRST_CALL, 2), Count(LATER_CALL, 1)),
        even_world=True,
    ),
)
