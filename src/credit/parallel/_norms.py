"""Gradient norms over any mix of meshes and pipeline stages, in one collective: the hot path.

The one norm pipeline, behind ``total_grad_norm``, ``clip_grad_norm_`` and ``grad_norm_report``.
What depends on the layout alone comes from its plan (``_norm_plan``), built and verified on the
layout's first call; a call then runs straight through :func:`reduce`:

1. Each rank takes the norm of each of its local shards with torch's kernels, in torch's
   (device, dtype) order, after completing Partial gradients (``_partial``).
2. Each contribution is weighted by ``1 / copies`` of its shard (``_ownership``), so one all_reduce
   over the world counts every distinct element once, and a NaN or inf in any copy reaches every
   rank. The inf norm needs no weights: the largest copy is the largest element.
3. Within a single stage every rank holds the same gradients, so the all_reduce completes the vector
   of per-gradient p-th powers (MAX for inf) and the norm of that vector is the total: torch's
   operations in torch's order, so a layout without copies (FSDP2 over the whole world) gives
   torch's bits. Where shards have copies, the same all_reduce (in float64) carries the
   comparison of the copies' local norms (``_copies``): tensors of a proven shape that are not
   copies make the total NaN on every rank, never a number. Plain replicas (DDP) send the
   reference copy's per-gradient norms beside the comparison: every rank returns the same
   number, torch's bits where the copies are bit-identical, and a NaN or inf on any rank
   reaches every rank. Nothing is read on a GPU and nothing is copied to it.
4. Pipeline stages hold different gradients, so each rank sends one float64 number per segment
   (the whole norm, or one per report group) and, in the same all_reduce, what the stages decide
   together and the comparison; those few numbers are read on the host once per call (see
   :func:`_pipeline`).
5. The copies' verdict is read where reading is free (the collective on the CPU) or already paid
   for (``error_if_nonfinite``, pipeline stages): copies that differ raise the same ValueError on
   every rank, before any gradient changes.
6. Listeners (``_norm_hooks``) read every norm's result, the GradScaler's flags among them; they
   never change what the norm computes.

Every rank issues the same collectives, decided by the world, ``pp_group`` and the layout that all
ranks of a stage share, never by what one rank happens to hold.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from credit.parallel import _copies, _inputs, _norm_hooks, _norm_plan, _ownership, _partial
from credit.parallel._compat import foreach_norm, local_tensor
from credit.parallel._foreach import use_foreach
from credit.parallel._groups import (
    GroupLike,
    collective_device,
    group_size,
    is_distributed,
    moves_data,
    resolve_group,
)
from credit.parallel._inputs import DistinctAlong
from credit.parallel._layout_check import check_enabled, refuse_on_every_rank, verify_same_layout
from credit.parallel._norm_plan import RESULT_DTYPES, Order, Plan
from credit.parallel._ownership import Holding, Stages


@dataclass(frozen=True)
class NormRequest:
    """The arguments of one norm call, checked and resolved.

    Attributes:
        order: the p of the p-norm (``math.inf`` for the max norm).
        foreach: use the foreach kernels (None: where the device supports them).
        dtype: accumulation dtype of the per-gradient norms, or None for torch's.
        pp_group: this rank's pipeline group, or None.
        distinct: for each gradient, the ranks along which its copies differ (None: replicas),
            or None when no gradient is declared distinct.
        check: verify the layout across ranks and the copies on this call.
        per_rank: each rank norms its own gradients alone (ranks that train independent models).
        what: the public function, for messages.
        label: names gradient ``i`` in messages (its parameter's name, or its place in the call).
    """

    order: float
    foreach: bool | None
    dtype: torch.dtype | None
    pp_group: ProcessGroup | None
    distinct: list[frozenset[int] | None] | None
    check: bool
    per_rank: bool
    what: str
    label: Callable[[int], str]


def request(
    grads: list[Tensor],
    norm_type: float | str,
    foreach: bool | None,
    pp_group: GroupLike,
    distinct_along: DistinctAlong | None,
    dtype: torch.dtype | None,
    check: bool | None,
    what: str = "total_grad_norm",
    *,
    per_rank: bool = False,
    label: Callable[[int], str] | None = None,
    argument: str = "grads",
) -> NormRequest:
    """The norm arguments, checked before any collective and resolved.

    Args:
        grads: the gradients to norm.
        norm_type, foreach, pp_group, distinct_along, dtype, check, per_rank: as for
            ``total_grad_norm``.
        what: the public function, for messages.
        label: names gradient ``i`` in messages. Default: ``{argument}[i]``.
        argument: the public function's argument that holds the gradients, for messages.

    Raises:
        TypeError, ValueError: as for ``total_grad_norm``.
    """
    order = _inputs.norm_order(norm_type)
    check_mode = check_enabled(check) and is_distributed()
    _refuse(grads, argument, what, on_every_rank=check_mode and not per_rank)
    if per_rank:
        _inputs.check_per_rank(grads, pp_group, distinct_along)
    pp_process_group = resolve_group(pp_group, "pp_group")
    return NormRequest(
        order=order,
        foreach=foreach,
        dtype=dtype,
        pp_group=pp_process_group if group_size(pp_process_group) > 1 else None,
        distinct=_inputs.distinct_groups(distinct_along, grads),
        check=check_mode,
        per_rank=per_rank,
        what=what,
        label=label if label is not None else functools.partial(_grad_label, argument),
    )


def _refuse(grads: list[Tensor], argument: str, what: str, *, on_every_rank: bool) -> None:
    """Raise for a gradient no norm can take (``_inputs.grads_refusal``). In the check mode every
    rank raises the refusal of the lowest rank that has one, before any other collective (one
    small all_reduce); otherwise only the ranks that hold such a gradient raise."""
    refusal = _inputs.grads_refusal(grads, argument)
    if on_every_rank and dist.get_world_size() > 1:
        device = collective_device([grad for grad in grads if not grad.is_meta])
        refuse_on_every_rank(refusal, device, what)
    elif refusal is not None:
        kind, message = refusal
        raise kind(message)


def _grad_label(argument: str, index: int) -> str:
    return f"{argument}[{index}]"


@dataclass
class Reduced:
    """The result of a norm.

    Attributes:
        total: the norm of all the gradients, as a plain scalar in the result dtype.
        entries: the global norm of each stacked gradient (in ``order.stacked``), or of each
            segment under pipeline stages.
        present: under pipeline stages, how many ranks hold gradients of each segment; None where
            ``entries`` are per gradient.
        local: each gradient's local tensor, in input order.
        order: the gradients' stacking order, and index tensors into it.
        local_norms: this rank's norm of each local tensor (before any reduction), in stacking
            order; None without any.
        answers_world: whether listeners may read the world's answers from it (see
            ``_norm_hooks.Normed``).
        host: under pipeline stages, ``entries``, the total (before its cast to the result
            dtype) and ``present``, as read on the host with the stages' decisions.
        plan: the layout's plan, for a norm over ranks.
        differ: whether the ranks taken for copies held different values on this call while
            every value was finite (the total is NaN then): a boolean scalar on the device,
            the same on every rank; None where nothing has copies or the verdict was read.
    """

    total: Tensor
    entries: Tensor
    present: Tensor | None
    local: list[Tensor]
    order: Order
    local_norms: Tensor | None = None
    answers_world: bool = False
    host: list[float] | None = None
    plan: Plan | None = None
    differ: Tensor | None = None

    @property
    def groups(self) -> list[tuple[torch.device, list[int]]]:
        """The indices of ``local`` by (device, dtype), in torch's order, with the device."""
        return self.order.groups


def reduce(
    grads: list[Tensor],
    request: NormRequest,
    segment_of: list[int] | None = None,
    segment_count: int = 1,
) -> Reduced:
    """The norm of ``grads`` (see the module docstring).

    Args:
        grads: gradients, plain or DTensor, checked by ``_inputs.check_grads``.
        request: the call's arguments.
        segment_of: under pipeline stages, the segment of each gradient (default: all in one).
        segment_count: the number of segments, the same on every rank.

    Raises:
        ValueError: the gradients' layout cannot be reduced, or copies differ where the verdict
            is read (raised on every rank).
        RuntimeError: the self-check or the check mode failed (raised on every rank).
    """
    local = [local_tensor(g) for g in grads]
    if not is_distributed() or dist.get_world_size() == 1 or request.per_rank:
        dtype = request.dtype or _norm_plan.promoted({t.dtype for t in local})
        reduced = _local_norms(local, _norm_plan.order_of(local), request, dtype)
    else:
        plan = _planned(grads, local, request)
        if plan.at.count > 1:
            reduced = _pipeline(local, plan, request, segment_of, segment_count)
        elif plan.replicas:
            reduced = _replicas(local, plan, request)
        else:
            reduced = _single_stage(local, plan, request)
        if reduced.differ is not None and reduced.differ.device.type == "cpu":
            raise_if_copies_differ(reduced, request)  # reading costs no sync there
    _tell_listeners(reduced)
    return reduced


def raise_if_copies_differ(reduced: Reduced, request: NormRequest) -> None:
    """Read the copies' verdict of the call and raise the same ValueError on every rank, naming
    the gradient and the ranks, when they differed. Every rank must call it together (the
    verdict is the same on every rank); the gradients must be as the call found them.
    """
    differ, reduced.differ = reduced.differ, None
    if differ is not None and bool(differ):
        _raise_copies_differ(reduced, request)


def raise_if_nonfinite(reduced: Reduced, request: NormRequest) -> None:
    """``error_if_nonfinite``: raise on every rank when the total is not finite; copies that
    differed (their total is NaN) raise their own error (see :func:`raise_if_copies_differ`).
    Both answers come from one read. Every rank must call it together.
    """
    finite = torch.isfinite(reduced.total)
    differ = reduced.differ if reduced.differ is not None else torch.zeros_like(finite)
    reduced.differ = None
    is_finite, copies_differ = torch.stack([finite, differ]).tolist()  # the call's one read
    if is_finite:
        return
    if copies_differ:
        _raise_copies_differ(reduced, request)
    raise RuntimeError(
        f"The total norm of order {request.order} for gradients from `parameters` is "
        "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
        "by the non-finite norm anyway, set `error_if_nonfinite=False`"
    )


def _raise_copies_differ(reduced: Reduced, request: NormRequest) -> None:
    assert reduced.plan is not None
    _norm_plan.raise_copies_differ(reduced.plan, reduced.local, request.what, request.label)


def _planned(grads: list[Tensor], local: list[Tensor], request: NormRequest) -> Plan:
    """The plan of the call's layout; within a single stage, verified on its first call."""
    at = _ownership.stages_of(request.pp_group)
    held = _ownership.holdings(grads)
    if request.check:
        _check_same_layout(held, request, at, collective_device(local))
    plan = _norm_plan.plan_of(held, local, at, request.distinct)
    if not plan.replicas and not request.order > 0:
        raise ValueError(
            f"norm_type must be positive or inf for distributed grads, got {request.order}"
        )
    if at.count == 1 and (not plan.verified or request.check):  # the same on every rank
        _norm_plan.verify(plan, local, request.pp_group, request.what, request.label)
    return plan


def _tell_listeners(reduced: Reduced) -> None:
    listeners = _norm_hooks.attached()
    if not listeners:
        return
    per_gradient = reduced.answers_world and reduced.present is None and reduced.order.stacked
    normed = _norm_hooks.Normed(
        local=reduced.local,
        local_norms=reduced.local_norms,
        stacked_inputs=reduced.order.stacked if reduced.local_norms is not None else [],
        entries=reduced.entries if per_gradient else None,
        total=reduced.total,
        answers_world=reduced.answers_world,
        positions=reduced.order.positions,
    )
    for listener in listeners:
        listener.normed(normed)


# ---------------------------------------------------------------------------------------------
# local norms: torch's get_total_norm


def _local_norms(
    local: list[Tensor], order: Order, request: NormRequest, result_dtype: torch.dtype
) -> Reduced:
    stacked = _stacked_norms(local, order, request)
    if stacked is None:
        zero = torch.zeros((), dtype=result_dtype)
        return Reduced(zero, zero.new_zeros(0), None, local, order)
    total = torch.linalg.vector_norm(stacked, request.order)
    return Reduced(total, stacked, None, local, order, local_norms=stacked)


def _stacked_norms(local: list[Tensor], order: Order, request: NormRequest) -> Tensor | None:
    """Each local tensor's norm, stacked in torch's order (None without any).

    Empty tensors get a zero under the inf norm, where torch's kernels raise on them: a 1-row
    weight sharded over two ranks leaves one of them an empty shard.
    """
    if not local:
        return None
    norms: list[Tensor] = []
    for device, indices in order.groups:
        tensors = [local[i] for i in indices]
        if request.order == math.inf and any(t.numel() == 0 for t in tensors):
            keep = [t.numel() > 0 for t in tensors]
            kept = iter(_norms_of([t for t in tensors if t.numel()], request, device))
            dtype = request.dtype or tensors[0].dtype.to_real()
            zero = torch.zeros((), dtype=dtype, device=device)
            norms.extend(next(kept) if k else zero for k in keep)
        else:
            norms.extend(_norms_of(tensors, request, device))
    first_device = local[0].device
    if any(device != first_device for device, _ in order.groups):  # .to() is a dispatch per norm
        norms = [n.to(first_device) for n in norms]
    return torch.stack(norms)


def _norms_of(tensors: list[Tensor], request: NormRequest, device: torch.device) -> list[Tensor]:
    if not tensors:
        return []
    order, dtype = request.order, request.dtype
    if use_foreach(request.foreach, tensors, device):
        return foreach_norm(tensors, order, dtype)
    return [torch.linalg.vector_norm(t, order, dtype=dtype) for t in tensors]


# ---------------------------------------------------------------------------------------------
# a single stage: the per-gradient vector, and the copies compared on every call


def _single_stage(local: list[Tensor], plan: Plan, request: NormRequest) -> Reduced:
    result_dtype = request.dtype or plan.grads_dtype
    completed = _partial.complete(local, plan.held, plan.partial)
    stacked = _stacked_norms(completed, plan.order, request)
    if stacked is None:  # no gradients on any rank (the layout is shared)
        zero = torch.zeros((), dtype=result_dtype, device=plan.order.device)
        return Reduced(zero, zero.new_zeros(0), None, local, plan.order, plan=plan)
    order = request.order
    weights = plan.weights_as(torch.promote_types(result_dtype, torch.float32))
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
    differ = None if compared is None else _verdict(compared, total, plan)
    if differ is not None:
        total = torch.where(differ, math.nan, total)
    return Reduced(
        total,
        entries,
        None,
        local,
        plan.order,
        local_norms=stacked,
        answers_world=True,
        plan=plan,
        differ=differ,
    )


def _replicas(local: list[Tensor], plan: Plan, request: NormRequest) -> Reduced:
    """Plain replicas (DDP): the reference copy's norms on every rank, torch's bits.

    One all_reduce carries the reference's per-gradient norms (the stage's lowest rank sends
    them, every other rank zeros) and the comparison of every copy's local norms. Every rank
    returns the norm of the reference's entries: torch's bits where the copies are bit-identical,
    the same number on every rank where they differ within the tolerance. A NaN or inf in any
    rank's copy makes that gradient's comparison sums, and so its entry, non-finite on every
    rank; copies that differ make the total NaN on every rank.
    """
    reduced = _local_norms(local, plan.order, request, request.dtype or plan.grads_dtype)
    stacked = reduced.local_norms
    if stacked is None:  # no gradients on any rank (the layout is shared)
        return reduced
    copies = plan.copies
    assert copies is not None  # built by the layout's verification
    # One group per gradient, the same ranks in each: the lowest rank holds every reference.
    first = copies.groups[copies.compared[0]]
    mine = stacked.to(torch.float64) * float(first is not None and first.is_reference)
    reference, compared = _reduced_with_comparison(mine, stacked, plan)
    # Each gradient has one group, its slot at its stacking position: the sum of its copies'
    # norms (the first column) is non-finite where any copy is.
    summed = compared[:, 0]
    entries = torch.where(torch.isfinite(summed), reference, summed).to(stacked.dtype)
    total = torch.linalg.vector_norm(entries, request.order)
    differ = _verdict(compared, total, plan)
    reduced.total = torch.where(differ, math.nan, total)
    reduced.entries = entries
    reduced.plan, reduced.differ = plan, differ
    return reduced


def _reduced_with_comparison(values: Tensor, stacked: Tensor, plan: Plan) -> tuple[Tensor, Tensor]:
    """``values`` summed over the world in float64, and the comparison's sums of the local norms
    ``stacked`` of the copies (``_copies``), shape (slots, 4), in one all_reduce."""
    comparison = _comparison(stacked, plan)
    vector = torch.cat([values.to(torch.float64), comparison.flatten()])
    dist.all_reduce(vector, op=dist.ReduceOp.SUM)
    sums, compared = vector.split([values.numel(), comparison.numel()])
    return sums, compared.view_as(comparison)


def _verdict(compared: Tensor, total: Tensor, plan: Plan) -> Tensor:
    """Whether the copies differed (the comparison's reduced sums ``compared`` out of their
    tolerance) while the norm ``total`` is finite: a NaN or inf leaves the sums non-finite and
    is answered by the norm itself. False on the fake backend, which moves no data."""
    if not moves_data():
        return torch.zeros((), dtype=torch.bool, device=compared.device)
    limits = None  # across stages the slots are pooled (a rank may not have its plan yet)
    if plan.at.count == 1:
        assert plan.copies is not None  # built by the layout's verification
        limits = plan.copies.limits
    return _copies.differ(compared, limits) & torch.isfinite(total)


def _comparison(stacked: Tensor, plan: Plan) -> Tensor:
    """This rank's addends of the comparison of the copies' local norms ``stacked`` (stacking
    order), shape (slots, 4): ``_copies.terms_of`` with the norms as fingerprints."""
    copies = plan.copies
    assert copies is not None  # built by the layout's verification
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


def _pipeline(
    local: list[Tensor],
    plan: Plan,
    request: NormRequest,
    segment_of: list[int] | None,
    segment_count: int,
) -> Reduced:
    """The norm across pipeline stages, in one all_reduce and one read of a few numbers.

    Beside each segment's sum (MAX for inf), the all_reduce carries what the stages must decide
    together, and the reduced numbers are read on the host once. A rank cannot know them
    otherwise: the other stages' gradients may change layout or dtype on any call, seen only
    by their own ranks. The result's dtype (host metadata, the promotion of the stages' votes)
    must be the same on every rank; a stage meeting a layout for the first time makes every rank
    verify it together, in one more all_reduce issued by all or none, and a failed layout raises
    on every rank; the listeners answer only if no rank left a question unanswered, which
    decides whether a scaler issues a collective of its own later.
    """
    device = plan.order.device
    order = request.order
    values = torch.zeros(segment_count, dtype=torch.float64, device=device)
    present = torch.zeros_like(values)
    # The p-norm compares the copies' local norms, per stage; zeros until the stage's layout is
    # verified. The inf norm has nothing to compare: the largest copy is the largest element.
    comparison = torch.zeros(plan.at.count, 4, dtype=torch.float64, device=device)
    local_norms = None
    if local and plan.error is None:  # a broken layout sends zeros beside its flag
        completed = _partial.complete(local, plan.held, plan.partial)
        local_norms = _stacked_norms(completed, plan.order, request)
        assert local_norms is not None
        stacked = local_norms.to(values)
        if plan.copies is not None and order != math.inf:
            comparison = _comparison(local_norms, plan)
        segments = _segments(plan.order, segment_of)
        present.index_fill_(0, segments, 1.0)
        if order == math.inf:
            values.scatter_reduce_(0, segments, stacked, reduce="amax")
        else:
            powered = stacked**order
            values.index_add_(
                0, segments, powered if plan.weights is None else powered * plan.weights
            )
    # Host numbers enter the vector through fill kernels, never a copy from host memory: whether
    # this rank meets its layout for the first time (or checks it), and how many of the
    # listeners' questions its gradients leave unanswered (zero without listeners).
    unverified = float(not plan.verified or request.check)
    unanswered = float(sum(listener.unanswered(local) for listener in _norm_hooks.attached()))
    asked = [
        torch.full((1,), value, dtype=torch.float64, device=device)
        for value in (unverified, unanswered)
    ]
    if order == math.inf:
        nan = torch.isnan(values)
        clean = torch.where(nan, 0.0, values)
        vector = torch.cat([clean, nan.to(values), present, plan.votes, plan.checks[1:], *asked])
        dist.all_reduce(vector, op=dist.ReduceOp.MAX)
        values, nan, present, tail = vector.split(
            [segment_count] * 3 + [len(vector) - 3 * segment_count]
        )
        entries = torch.where(nan > 0, math.nan, values)
        total = entries.max()  # NaN if any entry is
        differ = torch.zeros((), dtype=torch.bool, device=device)
    else:
        # The self-check's terms sum to zero over the world when every stage holds whole copies.
        vector = torch.cat([values, present, plan.votes, plan.checks, *asked, comparison.flatten()])
        dist.all_reduce(vector, op=dist.ReduceOp.SUM)
        values, present, tail, summed = vector.split(
            [segment_count] * 2
            + [len(vector) - 2 * segment_count - comparison.numel()]
            + [comparison.numel()]
        )
        entries = values ** (1.0 / order)
        total = values.sum() ** (1.0 / order)
        differ = _verdict(summed.view_as(comparison), total, plan)
    # The call's one read: the stages' decisions, and the norms (which a report reads).
    read = torch.cat([tail, differ.to(tail).reshape(1), entries, total.reshape(1), present])
    numbers = read.tolist()
    decided, host = numbers[: len(tail) + 1], numbers[len(tail) + 1 :]
    votes, checks = decided[: len(RESULT_DTYPES)], decided[len(RESULT_DTYPES) : -3]
    unverified_anywhere, unanswered_anywhere, differ_anywhere = decided[-3:]
    if any(checks) and moves_data():
        _norm_plan.raise_layout_failure(plan, request.what)
    if unverified_anywhere > 0:
        _norm_plan.verify(plan, local, request.pp_group, request.what, request.label)
    if differ_anywhere > 0:
        _norm_plan.raise_copies_differ(plan, local, request.what, request.label)
    result_dtype = request.dtype or plan.grads_dtype
    if request.dtype is None:
        voted = [dtype for dtype, vote in zip(RESULT_DTYPES, votes, strict=True) if vote]
        result_dtype = (
            functools.reduce(torch.promote_types, voted, voted[0]) if voted else result_dtype
        )
    return Reduced(
        total.to(result_dtype),
        entries,
        present,
        local,
        plan.order,
        local_norms=local_norms,
        answers_world=not unanswered_anywhere > 0,
        host=host,
    )


def _segments(order: Order, segment_of: list[int] | None) -> Tensor:
    """The segment of each stacked norm (default: all in segment 0), kept with the order."""
    key = ("segments", tuple(segment_of) if segment_of is not None else None)
    return order.indices(
        key, lambda: [[segment_of[i] if segment_of else 0 for i in order.stacked]]
    )[0]


# ---------------------------------------------------------------------------------------------
# check mode


def _check_same_layout(
    held: list[Holding], request: NormRequest, at: Stages, device: torch.device
) -> None:
    layout = [h.description for h in held]
    settings = (
        f"norm_type={request.order} dtype={request.dtype} stages={at.count} "
        f"per_rank={request.per_rank}"
    )
    verify_same_layout(layout, None, device, request.what, settings, stage=(at.index, at.count))
