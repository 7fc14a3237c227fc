"""The norm's third step: the layout's proof, on its first call (and every call in check mode).

Two things are proven, in one float64 all_reduce: the self-check (every rank of a stage holds a
shard of every gradient on its own copy of the mesh: the terms of ``_ownership.coverage`` sum to
zero), and that the ranks taken for copies of a shard hold the same values (``_copies``, with full
fingerprints). Sums run per gradient within a stage, per stage across stages. A NaN or inf leaves
the copies unproven until a later call: the norm is not finite then anyway.

Within a stage every rank meets a layout on the same call, so the proof runs before the norm's
collective. Under pipeline stages a rank cannot know when another stage meets a new layout: every
norm's all_reduce carries the question, and the proof runs after it, on every rank, when any
stage asks (:func:`settle_stages`).

This module alone writes the layout's :class:`~credit.parallel._norm_plan.Proof`. Its host syncs:
one copy of the copies' constants where a shard has copies, once per layout; one read of the
verdict per proof.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from credit.parallel import _copies, _norm_failures, _ownership
from credit.parallel._groups import moves_data
from credit.parallel._inputs import NormRequest
from credit.parallel._norm_plan import Plan
from credit.parallel._norm_results import StageDecisions


def prove_if_due(plan: Plan, request: NormRequest) -> None:
    """Within a single stage, prove the layout on its first call, or on every call in the check
    mode (the same on every rank: the ranks of a stage share the layout)."""
    if plan.at.count == 1 and (not plan.proof.verified or request.check):
        prove(plan, request)


def settle_stages(plan: Plan | None, request: NormRequest, decided: StageDecisions | None) -> None:
    """Under pipeline stages, act on what the stages decided in the norm's all_reduce
    (``Reduced.stages``): a layout that failed raises on every rank; a stage that met a new
    layout has every rank prove it."""
    if decided is None or plan is None:
        return
    if decided.layout_failed:
        _norm_failures.raise_layout_failure(plan, request.what)
    if decided.unverified_anywhere:
        prove(plan, request)


def prove(plan: Plan, request: NormRequest) -> None:
    """Prove the layout in one float64 all_reduce, raising on every rank when it fails. Every
    rank must call it together. The verdict is read on the host once.

    Raises:
        ValueError: the layout cannot be reduced, or copies differ (on every rank).
        RuntimeError: the ranks' shards do not add up to whole gradients (on every rank).
    """
    copies = _comparison_of(plan, request)
    sums, nonfinite = _copies.terms(copies, request.local, plan.order.device)
    slot_count = plan.verification.numel() - 1
    vector = torch.cat([plan.verification, nonfinite.reshape(1), sums.flatten()])
    dist.all_reduce(vector, op=dist.ReduceOp.SUM)
    if not moves_data():
        plan.proof.verified = True
        return
    coverage, flags, summed = vector.split([slot_count, 2, sums.numel()])
    verdict = torch.stack(
        [
            coverage.abs().ge(0.5).any() | (flags[0] > 0),  # integers, exact in float64
            flags[1] > 0,
            _copies.differ(summed.view_as(sums), None if copies.pooled else copies.limits),
        ]
    )
    broken, nonfinite_anywhere, differ = verdict.tolist()  # the proof's one read
    if broken:
        _norm_failures.raise_layout_failure(plan, request.what)
    if nonfinite_anywhere:
        return
    if differ:
        _norm_failures.raise_copies_differ(plan, request.local, request.what, request.label)
    plan.proof.verified = True


def _comparison_of(plan: Plan, request: NormRequest) -> _copies.Plan:
    """The layout's comparison of copies, built on its first proof and kept; a broken layout
    sends zeros of the same size beside its flag.

    Within a stage, a slot per group of copies; across pipeline stages, whose layouts the other
    stages cannot see, a slot per stage.
    """
    at = plan.at
    compare = plan.proof.copies is None and plan.error is None
    # Every rank asks for the stage's lowest rank on every proof, whether or not it has its
    # comparison yet: the first time per pipeline group, this is a collective.
    groups = _ownership.copy_groups(
        plan.held, at, request.pp_group, plan.order.device, plan.distinct, compare=compare
    )
    if plan.proof.copies is not None:
        return plan.proof.copies
    slots = _copies.Slots([at.index] * len(groups), at.count)
    if at.count == 1:
        slot_of, per_slot = _ownership.copy_slots(plan.held, at, plan.distinct, plan.order.stacked)
        limits = [(float(copies), _copies.tolerance(dtype)) for copies, dtype in per_slot]
        slots = _copies.Slots(slot_of, len(limits), limits)
    position_of = [0] * len(plan.held)
    for position, index in enumerate(plan.order.stacked):
        position_of[index] = position
    copies = _copies.plan(plan.held, groups, slots, position_of, plan.order.device)
    if compare:
        plan.proof.copies = copies
    return copies
