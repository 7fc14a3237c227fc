"""The norm's fifth step: the one collective over the world of each kind of layout, side by side.

Each kind sends a vector of its own, because bit parity with torch depends on it (one element more
moves gloo's chunking, and with it the bits of the others):

- shards within one stage (:func:`_shards`): each contribution weighted by ``1 / copies`` of its
  shard (``ownership``), the all_reduce completes the vector of per-gradient p-th powers (MAX for
  inf) and the norm of that vector is the total: torch's operations in torch's order, so a layout
  without copies (FSDP2 over the whole world) gives torch's bits. Where shards have copies, the
  sum runs in float64 and carries the verdict of the copies compared in their own process groups
  just before (``group_comparison``: the only collectives besides the world's), and the
  comparison of the others' local norms in slots (``copies``);
- plain replicas (:func:`_replicas`, DDP): the reference copy's per-gradient norms beside the
  comparison, so every rank returns the same number, torch's bits where the copies are
  bit-identical;
- pipeline stages (:func:`_stages`): one float64 number per segment, the comparison of every
  stage's groups of copies in slots (each stage in its region, ``pipeline``) and the flag of
  those compared in their process groups, and what the stages
  decide together, read on the host once per call. A stage of plain replicas sends its
  reference copy's norms, as without stages.

Nothing is read on a GPU except under pipeline stages, and nothing is copied to it. Copies that
differ make the total NaN on every rank, never a number; the verdict (``verdict``) raises.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch import Tensor

from credit.parallel._common.groups import moves_data
from credit.parallel._norm import copies as _copies
from credit.parallel._norm import group_comparison as _group_comparison
from credit.parallel._norm import pipeline as _pipeline
from credit.parallel._norm.local_norms import LocalNorms
from credit.parallel._norm.pipeline import Regions
from credit.parallel._norm.plan import RESULT_DTYPES, Kind, NormPlan
from credit.parallel._norm.request import NormRequest
from credit.parallel._norm.results import Reduced, StageDecisions, StagesRead


def reduce(
    norms: LocalNorms,
    request: NormRequest,
    plan: NormPlan | None,
    segment_count: int,
    unanswered: int,
) -> Reduced:
    """The norm over ranks of this rank's local norms ``norms``, by the collective of the plan's
    kind; without a plan, the norm of this rank's tensors alone (no collective), as torch
    computes it without a process group.

    Args:
        norms: this rank's local norms (``local_norms.norms_of``).
        request: the call's arguments.
        plan: the layout's plan; None for a norm on one rank.
        segment_count: under pipeline stages, the number of segments, the same on every rank.
        unanswered: under pipeline stages, how many of the listeners' questions this rank's
            gradients leave unanswered (``hooks.unanswered``).
    """
    if plan is None:
        return _alone(norms, request)
    if plan.kind is Kind.STAGES:
        return _stages(plan, norms, request, segment_count, unanswered)
    if plan.kind is Kind.REPLICAS:
        return _replicas(plan, norms, request)
    return _shards(plan, norms, request)


def _alone(norms: LocalNorms, request: NormRequest) -> Reduced:
    """torch's ``get_total_norm`` of this rank's tensors."""
    if norms.stacked is None:
        zero = torch.zeros((), dtype=request.dtype or torch.get_default_dtype())
        return Reduced(zero, zero.new_zeros(0), request.local, norms.stacking)
    total = torch.linalg.vector_norm(norms.stacked, request.norm_type)
    return Reduced(total, norms.stacked, request.local, norms.stacking, local_norms=norms.stacked)


def _replicas(plan: NormPlan, norms: LocalNorms, request: NormRequest) -> Reduced:
    """Plain replicas (DDP): the reference copy's norms on every rank, torch's bits.

    One all_reduce carries the reference's per-gradient norms (the stage's lowest rank sends
    them, every other rank zeros) and the comparison of every copy's local norms. Every rank
    returns the norm of the reference's entries: torch's bits where the copies are bit-identical,
    the same number on every rank where they differ within the tolerance. A NaN or inf in any
    rank's copy makes that gradient's comparison sums, and so its entry, non-finite on every
    rank; copies that differ make the total NaN on every rank. Without gradients (the same on
    every rank of a stage of replicas), torch's norm of no tensors.
    """
    stacked = norms.stacked
    if stacked is None:
        zero = torch.zeros((), dtype=request.dtype or plan.grads_dtype)
        return Reduced(zero, zero.new_zeros(0), request.local, plan.stacking)
    copies = plan.copies
    # One group per gradient, the same ranks in each: the lowest rank holds every reference.
    first = copies.groups[copies.compared[0]]
    mine = stacked.to(torch.float64) * float(first is not None and first.is_reference)
    reference, compared, copies_differ = _summed_and_compared(mine, stacked, plan)
    # Each gradient has one group, its slot at its stacking position: the sum of its copies'
    # norms (the first column) is non-finite where any copy is.
    summed = compared[:, 0]
    entries = torch.where(torch.isfinite(summed), reference, summed).to(stacked.dtype)
    total = torch.linalg.vector_norm(entries, request.norm_type)
    differ = copies_differ & torch.isfinite(total)
    return Reduced(
        torch.where(differ, math.nan, total),
        entries,
        request.local,
        plan.stacking,
        local_norms=stacked,
        plan=plan,
        differ=differ,
    )


def _summed_and_compared(
    values: Tensor, stacked: Tensor | None, plan: NormPlan, regions: Regions | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``values`` summed over the world in float64 beside the comparison of the copies' local
    norms ``stacked``, in one all_reduce: the sums, the comparison's slots, and whether the
    copies differed beyond their tolerance (a boolean scalar on the device; False on the fake
    backend, which moves no data). The copies compared in their own process groups
    (``group_comparison``) are compared first, and send one flag; the others take slots
    (``copies``). Under pipeline stages (``regions``, as every rank agreed them) the slots hold
    every stage's, this stage's in its region (zeros where they do not fit it yet, or without
    local norms), and every rank sends the flag."""
    copies, device = plan.copies, plan.stacking.device
    flag = _group_comparison.differ_flag(plan.groups, stacked)  # the groups' rounds come first
    comparison = _copies.norm_terms(copies, stacked, regions, plan.stages.index)
    if regions is not None and not flag.numel():
        flag = torch.zeros(1, dtype=torch.float64, device=device)
    vector = torch.cat([values.to(torch.float64), comparison.flatten(), flag])
    dist.all_reduce(vector, op=dist.ReduceOp.SUM)
    sums, compared, flags = vector.split([values.numel(), comparison.numel(), flag.numel()])
    compared = compared.view_as(comparison)
    if not moves_data():
        return sums, compared, torch.zeros((), dtype=torch.bool, device=device)
    differ = _copies.slots_differ(compared, copies.limits if regions is None else None)
    return sums, compared, differ | (flags > 0).any()


def _shards(plan: NormPlan, norms: LocalNorms, request: NormRequest) -> Reduced:
    """Shards within one stage: the per-gradient vector of weighted p-th powers (MAX for inf)
    completed by the all_reduce, and its norm; zero where no rank holds gradients (the layout
    is shared, so every rank knows)."""
    stacked, norm_type = norms.stacked, request.norm_type
    result_dtype = request.dtype or plan.grads_dtype
    if stacked is None:
        zero = torch.zeros((), dtype=result_dtype, device=plan.stacking.device)
        return Reduced(zero, zero.new_zeros(0), request.local, plan.stacking, plan=plan)
    weights = None
    if plan.weights is not None:
        weights = plan.weights_in[torch.promote_types(result_dtype, torch.float32)]
    differ = None
    if norm_type == math.inf:  # the largest copy is the largest element, copies or not
        entries = _max_over_ranks(stacked.to(result_dtype))
    elif weights is None:  # no shard has copies: torch's reduction, in torch's dtype
        powered = _power(stacked.to(result_dtype), norm_type)
        dist.all_reduce(powered, op=dist.ReduceOp.SUM)
        entries = _root(powered, norm_type)
    else:  # weighted copies summed in float64, their local norms compared alongside
        powered = _power(stacked.to(weights.dtype), norm_type) * weights
        sums, _, differ = _summed_and_compared(powered, stacked, plan)
        entries = _root(sums.to(weights.dtype), norm_type)
    total = torch.linalg.vector_norm(entries, norm_type).to(result_dtype)
    if differ is not None:
        differ = differ & torch.isfinite(total)
        total = torch.where(differ, math.nan, total)
    return Reduced(
        total,
        entries,
        request.local,
        plan.stacking,
        local_norms=stacked,
        answers_world=True,
        plan=plan,
        differ=differ,
    )


def _power(norms: Tensor, norm_type: float) -> Tensor:
    """The p-th powers of ``norms``; DTensor skips the power for p=1, and so do we, to keep its
    bits."""
    return norms**norm_type if norm_type != 1.0 else norms


def _root(sums: Tensor, norm_type: float) -> Tensor:
    return sums ** (1.0 / norm_type) if norm_type != 1.0 else sums


def _max_over_ranks(norms: Tensor) -> Tensor:
    """The element-wise max of ``norms`` over the world; NaN wherever any rank has one.

    gloo's MAX keeps its first operand when the other is NaN, so each entry's NaN flag travels
    beside it, in the same collective.
    """
    nan = torch.isnan(norms)
    both = torch.stack([torch.where(nan, 0.0, norms), nan.to(norms.dtype)])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return torch.where(both[1] > 0, math.nan, both[0])


# ---------------------------------------------------------------------------------------------
# pipeline stages: one float64 number per segment, the copies' comparison, the stages' decisions


def _stages(
    plan: NormPlan, norms: LocalNorms, request: NormRequest, segment_count: int, unanswered: int
) -> Reduced:
    """The norm across pipeline stages, in one all_reduce and one read of a few numbers.

    Beside each segment's sum (MAX for inf) and the comparison of copies, the all_reduce carries
    what the stages must decide together (:func:`_decided`), and the reduced numbers are read on
    the host once. A rank cannot know them otherwise: the other stages' gradients may change
    layout or dtype on any call, seen only by their own ranks.
    """
    assert request.pp_group is not None and plan.pipeline is not None
    regions = _pipeline.agreed(request.pp_group, plan.stages.count)
    asked = _asked(plan, request.check, regions, unanswered)
    if request.norm_type == math.inf:
        entries, total, present, tail = _max_of_stages(plan, norms, segment_count, asked)
        differ = torch.zeros((), dtype=torch.bool, device=plan.stacking.device)
    else:
        entries, total, present, tail, differ = _sum_of_stages(
            plan, norms, request.norm_type, segment_count, asked, regions
        )
    # The call's one read: the stages' decisions, and the norms (which a report reads).
    read = torch.cat([tail, differ.to(tail).reshape(1), entries, total.reshape(1), present])
    numbers = read.tolist()
    decisions = _decided(plan, regions, numbers[: len(tail) + 1])
    return Reduced(
        total.to(request.dtype or decisions.result_dtype),
        entries,
        request.local,
        plan.stacking,
        local_norms=norms.stacked,
        answers_world=decisions.listeners_answered,
        plan=plan,
        stages=StagesRead(present, numbers[len(tail) + 1 :], decisions),
    )


def _asked(plan: NormPlan, check: bool, regions: Regions, unanswered: int) -> list[Tensor]:
    """What this rank's stage asks of every rank, as float64 tensors of one number each:
    whether it asks for the proof (a new layout, the check mode, or slots that do not fit its
    region), and how many of the listeners' questions its gradients leave unanswered (zero
    without listeners). Host numbers enter the vector through fill kernels, never a copy from
    host memory."""
    fits = regions.fits(plan.stages.index, plan.copies.slot_count)
    return [
        torch.full((1,), float(value), dtype=torch.float64, device=plan.stacking.device)
        for value in (not plan.proof.verified or check or not fits, unanswered)
    ]


def _decided(plan: NormPlan, regions: Regions, decided: list[float]) -> StageDecisions:
    """What the stages decided together, from the reduced numbers read on the host: the
    promotion of the stages' votes for the result dtype (the same on every rank); whether a
    stage's layout failed, or met a layout for the first time, or did not fit its region (then
    every rank proves it together, ``proof.act_on_decisions``, each stage's region grown to the
    slots it counts); whether copies differed; whether no rank left a listener's question
    unanswered (which decides whether a scaler issues a collective of its own later)."""
    stages = plan.stages
    voting = len(RESULT_DTYPES)
    votes, counts = decided[:voting], decided[voting : voting + stages.count]
    checks = decided[voting + stages.count : -3]
    if not moves_data():  # the vector came back as this rank sent it: its stage's count only
        counts = [
            float(plan.copies.slot_count * (stage == stages.index)) for stage in range(stages.count)
        ]
    unverified_anywhere, unanswered_anywhere, differ_anywhere = decided[-3:]
    voted = [dtype for dtype, vote in zip(RESULT_DTYPES, votes, strict=True) if vote]
    return StageDecisions(
        result_dtype=functools.reduce(
            torch.promote_types, voted, voted[0] if voted else plan.grads_dtype
        ),
        layout_failed=any(checks) and moves_data(),
        unverified_anywhere=unverified_anywhere > 0,
        copies_differ=differ_anywhere > 0,
        listeners_answered=not unanswered_anywhere > 0,
        regions=regions,
        slot_counts=tuple(counts),
    )


def _max_of_stages(
    plan: NormPlan, norms: LocalNorms, segment_count: int, asked: list[Tensor]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The inf norm's all_reduce (MAX): each segment's max with its NaN flag beside it. The inf
    norm has nothing to compare: the largest copy is the largest element."""
    values, present = _segment_terms(norms, math.inf, segment_count, plan)
    nan = torch.isnan(values)
    clean = torch.where(nan, 0.0, values)
    pipeline = plan.pipeline
    assert pipeline is not None
    decided = [pipeline.votes, pipeline.slot_counts, pipeline.checks[1:], *asked]
    vector = torch.cat([clean, nan.to(values), present, *decided])
    dist.all_reduce(vector, op=dist.ReduceOp.MAX)
    values, nan, present, tail = vector.split(
        [segment_count] * 3 + [len(vector) - 3 * segment_count]
    )
    entries = torch.where(nan > 0, math.nan, values)
    return entries, entries.max(), present, tail  # the max is NaN if any entry is


def _sum_of_stages(
    plan: NormPlan,
    norms: LocalNorms,
    norm_type: float,
    segment_count: int,
    asked: list[Tensor],
    regions: Regions,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The p-norm's all_reduce (SUM), with the comparison of every stage's copies (``regions``).
    The self-check's terms sum to zero over the world when every stage holds whole copies."""
    values, present = _segment_terms(norms, norm_type, segment_count, plan)
    pipeline = plan.pipeline
    assert pipeline is not None
    decided = [pipeline.votes, pipeline.slot_counts, pipeline.checks, *asked]
    sums, _, copies_differ = _summed_and_compared(
        torch.cat([values, present, *decided]), norms.stacked, plan, regions
    )
    values, present, tail = sums.split([segment_count] * 2 + [len(sums) - 2 * segment_count])
    total = values.sum() ** (1.0 / norm_type)
    return values ** (1.0 / norm_type), total, present, tail, copies_differ & torch.isfinite(total)


def _segment_terms(
    norms: LocalNorms, norm_type: float, segment_count: int, plan: NormPlan
) -> tuple[Tensor, Tensor]:
    """This rank's sum of weighted p-th powers per segment (MAX for inf), and whether it holds
    gradients of each segment."""
    values = torch.zeros(segment_count, dtype=torch.float64, device=plan.stacking.device)
    present = torch.zeros_like(values)
    if norms.stacked is None or norms.segments is None:
        return values, present
    stacked, segments = norms.stacked.to(values), norms.segments
    present.index_fill_(0, segments, 1.0)
    if norm_type == math.inf:
        values.scatter_reduce_(0, segments, stacked, reduce="amax")
        return values, present
    powered = stacked**norm_type
    if plan.weights is not None:
        # A copy weighted 0 (a plain replica other than its stage's reference) still brings its
        # inf or NaN to the sum, as every copy does without stages.
        powered = torch.where(torch.isfinite(powered), powered * plan.weights, powered)
    values.index_add_(0, segments, powered)
    return values, present
