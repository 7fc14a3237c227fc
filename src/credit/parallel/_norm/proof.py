"""The norm's third step: the layout's proof, on its first call (and every call in check mode).

Two things are proven, in one float64 all_reduce: the self-check (every rank of a stage holds a
shard of every gradient on its own copy of the mesh: the terms of ``ownership.coverage`` sum to
zero), and that the ranks taken for copies of a shard hold the same values (``copies``, with full
fingerprints, a slot per group of copies). The self-check's sums run per gradient within a stage,
per stage across stages. Where the copies meet in process groups of their own
(``group_comparison``), they are compared there next, with the shards' keys beside the
fingerprints, and one more small all_reduce tells the world; this runs only once the layout
holds, so that the groups' collectives never meet a rank whose layout differs. A NaN or inf
leaves the copies unproven until a later call: the norm is not finite then anyway.

Within a stage every rank meets a layout on the same call, so the proof runs before the norm's
collective. Under pipeline stages a rank cannot know when another stage meets a new layout: every
norm's all_reduce carries the question (and each stage's count of slots, ``pipeline``), and
the proof runs after it, on every rank, when any stage asks (:func:`act_on_decisions`), each
stage's groups in its region of the regions that call agreed.

This module alone writes the layout's :class:`~credit.parallel._norm.plan.Proof` and keeps the
stages' regions. Its host syncs: one read of the verdict per proof, and one more where copies
are compared in process groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from credit.parallel._common.groups import moves_data
from credit.parallel._norm import copies as _copies
from credit.parallel._norm import failures as _failures
from credit.parallel._norm import group_comparison as _group_comparison
from credit.parallel._norm import pipeline as _pipeline
from credit.parallel._norm.pipeline import Regions
from credit.parallel._norm.plan import NormPlan
from credit.parallel._norm.request import NormRequest
from credit.parallel._norm.results import StageDecisions


def prove_if_due(plan: NormPlan, request: NormRequest) -> None:
    """Within a single stage, prove the layout on its first call, or on every call in the check
    mode (the same on every rank: the ranks of a stage share the layout)."""
    if plan.stages.count == 1 and (not plan.proof.verified or request.check):
        prove(plan, request)


def act_on_decisions(plan: NormPlan, request: NormRequest, decided: StageDecisions) -> None:
    """Under pipeline stages, act on what the stages decided in the norm's all_reduce
    (``Reduced.stages``): keep the regions every rank grew by the same counts; a layout that failed raises on every
    rank; a stage that met a new layout has every rank prove it."""
    assert request.pp_group is not None
    regions = decided.regions.grown(decided.slot_counts)
    _pipeline.keep(request.pp_group, regions)
    if decided.layout_failed:
        _failures.raise_layout_failure(plan, request.what)
    if decided.unverified_anywhere:
        prove(plan, request, regions)


def prove(plan: NormPlan, request: NormRequest, regions: Regions | None = None) -> None:
    """Prove the layout in one float64 all_reduce, raising on every rank when it fails; where
    copies are compared in their own process groups, prove them there next
    (:func:`_prove_in_groups`). Every rank must call it together. The verdict is read on the host
    once per all_reduce.

    Args:
        plan: the layout's plan.
        request: the call's arguments.
        regions: under pipeline stages, every stage's slots of copies, as every rank agreed them.

    Raises:
        ValueError: the layout cannot be reduced, or copies differ (on every rank).
        RuntimeError: the ranks' shards do not add up to whole gradients, or a process group
            taken for copies holds other shards (on every rank).
    """
    copies, device = plan.copies, plan.stacking.device
    sums, nonfinite = _copies.terms(copies, request.local, device, regions, plan.stages.index)
    # A stage whose ranks count other slots than its reference rank passed other layouts; a
    # stage with copies in process groups proves them next, and every rank must join.
    unplaced = regions is not None and not regions.fits(plan.stages.index, copies.slot_count)
    asked = [float(unplaced), float(bool(plan.groups.compared))]
    stated = [torch.full((1,), value, dtype=torch.float64, device=device) for value in asked]
    slot_count = plan.verification.numel() - 1
    vector = torch.cat([plan.verification, nonfinite.reshape(1), *stated, sums.flatten()])
    dist.all_reduce(vector, op=dist.ReduceOp.SUM)
    coverage, flags, summed = vector.split([slot_count, 4, sums.numel()])
    verdict = torch.stack(
        [
            coverage.abs().ge(0.5).any() | (flags[0] > 0) | (flags[2] > 0),  # exact integers
            flags[1] > 0,
            _copies.slots_differ(summed.view_as(sums), copies.limits if regions is None else None),
            flags[3] > 0,
        ]
    )
    broken, nonfinite_anywhere, differ, in_groups = verdict.tolist()  # the proof's one read
    if not moves_data():  # nothing moved: the groups' proof is issued, for its count
        broken, nonfinite_anywhere, differ = False, False, False
    if broken:
        _failures.raise_layout_failure(plan, request.what)
    if nonfinite_anywhere:
        return
    if differ:
        _failures.raise_copies_differ(plan, request.local, request.what, request.label)
    if in_groups and not _prove_in_groups(plan, request):
        return
    plan.proof.verified = True


def _prove_in_groups(plan: NormPlan, request: NormRequest) -> bool:
    """Compare the copies in their process groups with full fingerprints and the shards' keys,
    then tell the world what each rank found, in one more all_reduce and one read: whether every
    copy was proven (False: a NaN or inf leaves them unproven until a later call).

    Raises:
        ValueError: copies differ (on every rank).
        RuntimeError: a process group taken for copies holds other shards (on every rank).
    """
    rows = [request.local[i] for i in plan.groups.compared]
    prints = _copies.fingerprints(rows, plan.stacking.device)
    flags, misfit = _group_comparison.proof_flags(plan.groups, prints)
    dist.all_reduce(flags, op=dist.ReduceOp.SUM)
    if not moves_data():
        return True
    nonfinite, differ, misplaced = (flags > 0).tolist()  # the read of the groups' proof
    if misplaced:
        _failures.raise_groups_misfit(plan, misfit, request.what)
    if nonfinite:
        return False
    if differ:
        _failures.raise_copies_differ(plan, request.local, request.what, request.label)
    return True
