"""The norm's fifth step: the one collective of each kind of layout, side by side.

Each kind sends a vector of its own, because bit parity with torch depends on it (one element more
moves gloo's chunking, and with it the bits of the others):

- shards within one stage (:func:`_shards`): each contribution weighted by ``1 / copies`` of its
  shard (``_ownership``), the all_reduce completes the vector of per-gradient p-th powers (MAX for
  inf) and the norm of that vector is the total: torch's operations in torch's order, so a layout
  without copies (FSDP2 over the whole world) gives torch's bits. Where shards have copies, the
  sum runs in float64 and carries the comparison of the copies' local norms (``_copies``);
- plain replicas (:func:`_replicas`, DDP): the reference copy's per-gradient norms beside the
  comparison, so every rank returns the same number, torch's bits where the copies are
  bit-identical;
- pipeline stages (:func:`_stages`): one float64 number per segment, and what the stages decide
  together, read on the host once per call.

Nothing is read on a GPU except under pipeline stages, and nothing is copied to it. Copies that
differ make the total NaN on every rank, never a number; the verdict (``_norm_verdict``) raises.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch import Tensor

from credit.parallel import _copies, _norm_hooks
from credit.parallel._groups import moves_data
from credit.parallel._inputs import NormRequest
from credit.parallel._local_norms import LocalNorms
from credit.parallel._norm_order import promoted
from credit.parallel._norm_plan import RESULT_DTYPES, Kind, Plan
from credit.parallel._norm_results import Reduced, StageDecisions


def reduce(
    norms: LocalNorms,
    request: NormRequest,
    plan: Plan | None,
    segment_count: int,
) -> Reduced:
    """The norm over ranks of this rank's local norms ``norms``; without a plan, the norm of this
    rank's tensors alone (no collective), as torch computes it without a process group.

    Args:
        norms: this rank's local norms (``_local_norms.norms_of``).
        request: the call's arguments.
        plan: the layout's plan; None for a norm on one rank.
        segment_count: under pipeline stages, the number of segments, the same on every rank.
    """
    stacked = norms.stacked
    if plan is None:
        return _alone(norms, request)
    if plan.kind is Kind.STAGES:
        return _stages(plan, stacked, request, norms.segments, segment_count)
    result_dtype = request.dtype or plan.grads_dtype
    if stacked is None and plan.kind is Kind.REPLICAS:  # torch's norm of no tensors
        zero = torch.zeros((), dtype=result_dtype)
        return Reduced(zero, zero.new_zeros(0), None, request.local, plan.order)
    if stacked is None:  # no gradients on any rank (the layout is shared)
        zero = torch.zeros((), dtype=result_dtype, device=plan.order.device)
        return Reduced(zero, zero.new_zeros(0), None, request.local, plan.order, plan=plan)
    if plan.kind is Kind.REPLICAS:
        return _replicas(plan, stacked, request)
    return _shards(plan, stacked, request, result_dtype)


def _alone(norms: LocalNorms, request: NormRequest) -> Reduced:
    """torch's ``get_total_norm`` of this rank's tensors."""
    if norms.stacked is None:
        zero = torch.zeros((), dtype=request.dtype or promoted(set()))
        return Reduced(zero, zero.new_zeros(0), None, request.local, norms.order)
    total = torch.linalg.vector_norm(norms.stacked, request.order)
    return Reduced(
        total, norms.stacked, None, request.local, norms.order, local_norms=norms.stacked
    )


def _shards(
    plan: Plan, stacked: Tensor, request: NormRequest, result_dtype: torch.dtype
) -> Reduced:
    order = request.order
    weights = None
    if plan.weights is not None:
        weights = plan.weights_in[torch.promote_types(result_dtype, torch.float32)]
    compared = None
    if order == math.inf:  # the largest copy is the largest element, copies or not
        entries = _max_over_ranks(stacked.to(result_dtype))
    elif weights is None:  # no shard has copies: torch's reduction, in torch's dtype
        powered = _power(stacked.to(result_dtype), order)
        dist.all_reduce(powered, op=dist.ReduceOp.SUM)
        entries = _root(powered, order)
    else:  # weighted copies summed in float64, their local norms compared alongside
        powered = _power(stacked.to(weights.dtype), order) * weights
        sums, compared = _reduced_with_comparison(powered, stacked, plan)
        entries = _root(sums.to(weights.dtype), order)
    total = torch.linalg.vector_norm(entries, order).to(result_dtype)
    differ = None if compared is None else _differ(compared, total, plan)
    if differ is not None:
        total = torch.where(differ, math.nan, total)
    return Reduced(
        total,
        entries,
        None,
        request.local,
        plan.order,
        local_norms=stacked,
        answers_world=True,
        plan=plan,
        differ=differ,
    )


def _replicas(plan: Plan, stacked: Tensor, request: NormRequest) -> Reduced:
    """Plain replicas (DDP): the reference copy's norms on every rank, torch's bits.

    One all_reduce carries the reference's per-gradient norms (the stage's lowest rank sends
    them, every other rank zeros) and the comparison of every copy's local norms. Every rank
    returns the norm of the reference's entries: torch's bits where the copies are bit-identical,
    the same number on every rank where they differ within the tolerance. A NaN or inf in any
    rank's copy makes that gradient's comparison sums, and so its entry, non-finite on every
    rank; copies that differ make the total NaN on every rank.
    """
    copies = plan.proof.copies
    assert copies is not None  # built by the layout's proof
    # One group per gradient, the same ranks in each: the lowest rank holds every reference.
    first = copies.groups[copies.compared[0]]
    mine = stacked.to(torch.float64) * float(first is not None and first.is_reference)
    reference, compared = _reduced_with_comparison(mine, stacked, plan)
    # Each gradient has one group, its slot at its stacking position: the sum of its copies'
    # norms (the first column) is non-finite where any copy is.
    summed = compared[:, 0]
    entries = torch.where(torch.isfinite(summed), reference, summed).to(stacked.dtype)
    total = torch.linalg.vector_norm(entries, request.order)
    differ = _differ(compared, total, plan)
    return Reduced(
        torch.where(differ, math.nan, total),
        entries,
        None,
        request.local,
        plan.order,
        local_norms=stacked,
        plan=plan,
        differ=differ,
    )


def _reduced_with_comparison(values: Tensor, stacked: Tensor, plan: Plan) -> tuple[Tensor, Tensor]:
    """``values`` summed over the world in float64, and the comparison's sums of the local norms
    ``stacked`` of the copies (``_copies``), shape (slots, 4), in one all_reduce."""
    comparison = _comparison(stacked, plan)
    vector = torch.cat([values.to(torch.float64), comparison.flatten()])
    dist.all_reduce(vector, op=dist.ReduceOp.SUM)
    sums, compared = vector.split([values.numel(), comparison.numel()])
    return sums, compared.view_as(comparison)


def _differ(compared: Tensor, total: Tensor, plan: Plan) -> Tensor:
    """Whether the copies differed (the comparison's reduced sums ``compared`` out of their
    tolerance) while the norm ``total`` is finite: a NaN or inf leaves the sums non-finite and
    is answered by the norm itself. False on the fake backend, which moves no data."""
    if not moves_data():
        return torch.zeros((), dtype=torch.bool, device=compared.device)
    limits = None  # across stages the slots are pooled (a rank may not have its plan yet)
    if plan.at.count == 1:
        assert plan.proof.copies is not None  # built by the layout's proof
        limits = plan.proof.copies.limits
    return _copies.differ(compared, limits) & torch.isfinite(total)


def _comparison(stacked: Tensor, plan: Plan) -> Tensor:
    """This rank's addends of the comparison of the copies' local norms ``stacked`` (stacking
    order), shape (slots, 4): ``_copies.terms_of`` with the norms as fingerprints."""
    copies = plan.proof.copies
    assert copies is not None  # built by the layout's proof
    norms = stacked.to(torch.float64).index_select(0, copies.positions)
    return _copies.terms_of(copies, norms[:, None])


def _power(norms: Tensor, order: float) -> Tensor:
    """The p-th powers of ``norms``; DTensor skips the power for p=1, and so do we, to keep its
    bits."""
    return norms**order if order != 1.0 else norms


def _root(sums: Tensor, order: float) -> Tensor:
    return sums ** (1.0 / order) if order != 1.0 else sums


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
# pipeline stages: one float64 number per segment, and the stages' decisions


def _stages(
    plan: Plan,
    norms: Tensor | None,
    request: NormRequest,
    segments: Tensor | None,
    segment_count: int,
) -> Reduced:
    """The norm across pipeline stages, in one all_reduce and one read of a few numbers.

    Beside each segment's sum (MAX for inf), the all_reduce carries what the stages must decide
    together, and the reduced numbers are read on the host once. A rank cannot know them
    otherwise: the other stages' gradients may change layout or dtype on any call, seen only
    by their own ranks. The result's dtype (host metadata, the promotion of the stages' votes)
    must be the same on every rank; a stage meeting a layout for the first time makes every rank
    prove it together (``_norm_proof.settle_stages``); the listeners answer only if no rank left a
    question unanswered, which decides whether a scaler issues a collective of its own later.
    """
    values, present, comparison = _stage_terms(plan, norms, request, segments, segment_count)
    # Host numbers enter the vector through fill kernels, never a copy from host memory: whether
    # this rank meets its layout for the first time (or checks it), and how many of the
    # listeners' questions its gradients leave unanswered (zero without listeners).
    unverified = float(not plan.proof.verified or request.check)
    asked = [
        torch.full((1,), value, dtype=torch.float64, device=plan.order.device)
        for value in (unverified, float(_norm_hooks.unanswered(request.local)))
    ]
    if request.order == math.inf:
        entries, total, present, tail = _max_of_stages(values, present, plan, asked)
        differ = torch.zeros((), dtype=torch.bool, device=plan.order.device)
    else:
        entries, total, present, tail, summed = _sum_of_stages(
            values, present, comparison, plan, asked, request.order
        )
        differ = _differ(summed.view_as(comparison), total, plan)
    # The call's one read: the stages' decisions, and the norms (which a report reads).
    read = torch.cat([tail, differ.to(tail).reshape(1), entries, total.reshape(1), present])
    numbers = read.tolist()
    decided, host = numbers[: len(tail) + 1], numbers[len(tail) + 1 :]
    votes, checks = decided[: len(RESULT_DTYPES)], decided[len(RESULT_DTYPES) : -3]
    unverified_anywhere, unanswered_anywhere, differ_anywhere = decided[-3:]
    stages = StageDecisions(
        layout_failed=any(checks) and moves_data(),
        unverified_anywhere=unverified_anywhere > 0,
        copies_differ=differ_anywhere > 0,
    )
    return Reduced(
        total.to(request.dtype or _voted_dtype(votes, plan.grads_dtype)),
        entries,
        present,
        request.local,
        plan.order,
        local_norms=norms,
        answers_world=not unanswered_anywhere > 0,
        host=host,
        plan=plan,
        stages=stages,
    )


def _stage_terms(
    plan: Plan,
    norms: Tensor | None,
    request: NormRequest,
    segments: Tensor | None,
    segment_count: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's sums per segment (MAX for inf), whether it holds gradients of each segment,
    and its addends of the comparison of copies (zeros until the stage's layout is proven; the
    inf norm has nothing to compare: the largest copy is the largest element)."""
    device = plan.order.device
    values = torch.zeros(segment_count, dtype=torch.float64, device=device)
    present = torch.zeros_like(values)
    comparison = torch.zeros(plan.at.count, 4, dtype=torch.float64, device=device)
    if norms is None or segments is None:
        return values, present, comparison
    stacked = norms.to(values)
    if plan.proof.copies is not None and request.order != math.inf:
        comparison = _comparison(norms, plan)
    present.index_fill_(0, segments, 1.0)
    if request.order == math.inf:
        values.scatter_reduce_(0, segments, stacked, reduce="amax")
    else:
        powered = stacked**request.order
        values.index_add_(0, segments, powered if plan.weights is None else powered * plan.weights)
    return values, present, comparison


def _max_of_stages(
    values: Tensor, present: Tensor, plan: Plan, asked: list[Tensor]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The inf norm's all_reduce (MAX): each segment's max with its NaN flag beside it."""
    count = values.numel()
    nan = torch.isnan(values)
    clean = torch.where(nan, 0.0, values)
    vector = torch.cat([clean, nan.to(values), present, plan.votes, plan.checks[1:], *asked])
    dist.all_reduce(vector, op=dist.ReduceOp.MAX)
    values, nan, present, tail = vector.split([count] * 3 + [len(vector) - 3 * count])
    entries = torch.where(nan > 0, math.nan, values)
    return entries, entries.max(), present, tail  # the max is NaN if any entry is


def _sum_of_stages(
    values: Tensor,
    present: Tensor,
    comparison: Tensor,
    plan: Plan,
    asked: list[Tensor],
    order: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The p-norm's all_reduce (SUM). The self-check's terms sum to zero over the world when
    every stage holds whole copies."""
    count = values.numel()
    vector = torch.cat([values, present, plan.votes, plan.checks, *asked, comparison.flatten()])
    dist.all_reduce(vector, op=dist.ReduceOp.SUM)
    values, present, tail, summed = vector.split(
        [count] * 2 + [len(vector) - 2 * count - comparison.numel()] + [comparison.numel()]
    )
    return values ** (1.0 / order), values.sum() ** (1.0 / order), present, tail, summed


def _voted_dtype(votes: list[float], default: torch.dtype) -> torch.dtype:
    """The promotion of the stages' votes for the result dtype (``default`` without any)."""
    voted = [dtype for dtype, vote in zip(RESULT_DTYPES, votes, strict=True) if vote]
    return functools.reduce(torch.promote_types, voted, voted[0]) if voted else default
