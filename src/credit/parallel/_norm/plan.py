"""The norm's second step: the plan of a gradient layout, everything a call needs besides the values.

The plan holds what depends on the layout alone (the gradients' shapes, dtypes, devices, meshes and
placements, the pipeline group, ``distinct_along``). It is built on the layout's first call, complete,
and kept:

- :class:`Stacking`: the order torch stacks per-gradient norms in (by device and dtype), and index
  tensors into it (a report's segments, the gradients of a GradScaler's flag), each built on the
  device the first time a caller asks for it;
- :class:`NormPlan`, for a norm over ranks: what this rank holds of each gradient (``holdings``)
  and how many copies of each shard the world holds (``ownership``), as weights in stacking order
  on the device in every dtype a call multiplies them in; the kind of layout; the gradients'
  dtype; the Partial gradients completed together (``partial``); where the copies are
  (``copy_groups``) and how they are compared (``copies.Comparison``,
  ``group_comparison.GroupComparison``); under pipeline stages, the constants the stages' vector
  carries (:class:`PipelinePart`); and the layout's :class:`Proof`, which the proof step
  (``proof``) alone writes.

The rank maps are read in one pass per concern (the stages, the holdings, the counts, the
copies), each handing the plan a named result; the plan then only orders and packs them.

Host syncs of a layout's first call, and only of it: one blocking host-to-device copy of the plan's
own constants, and one of each comparison's (``copies``, ``group_comparison``) where it compares
anything. Under pipeline stages the first call with a pipeline group also learns the lowest rank
of its stage, in one all_reduce of one number per stage that every rank joins
(``pipeline.lowest_rank_of_stage``). An index tensor costs one copy the first time a caller
asks for it (a report's segments, a scaler's set of gradients).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from credit.parallel._common import copy_groups as _copy_groups
from credit.parallel._common import holdings as _holdings
from credit.parallel._common import ownership as _ownership
from credit.parallel._common import stages as _stages
from credit.parallel._common.copy_groups import Copies
from credit.parallel._common.groups import collective_device
from credit.parallel._common.holdings import Holding
from credit.parallel._common.layout_check import verify_same_layout
from credit.parallel._common.scoped import ScopedCache
from credit.parallel._common.stages import Stages
from credit.parallel._norm import copies as _copies
from credit.parallel._norm import group_comparison as _group_comparison
from credit.parallel._norm import partial as _partial
from credit.parallel._norm import pipeline as _pipeline
from credit.parallel._norm.request import NormRequest
from credit.parallel._norm.stacking import Stacking, stacking_on

# Layouts whose plans are kept (a training loop uses a few: the clip's, the report's, a norm over
# part of the gradients).
_MAX_LAYOUTS = 64

# The result dtypes a pipeline stage can vote for; the stages agree on their promotion, so that
# every rank returns the same dtype and bits even where stages hold gradients of different dtypes
# (or none).
RESULT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The dtypes the weights are multiplied in: the result dtype promoted with float32.
_WEIGHT_DTYPES = (torch.float32, torch.float64)


class Kind(enum.Enum):
    """The kinds of layout, each reduced by a collective of its own (``collective``)."""

    SHARDS = "shards"  # one stage, DTensors or distinct gradients: the per-gradient vector
    REPLICAS = "replicas"  # one stage of plain replicas (DDP): the reference copy's norms
    STAGES = "stages"  # pipeline stages: one number per segment, and the stages' decisions


@dataclass(eq=False)
class Proof:
    """What the layout's proof found on this rank; written by ``proof`` alone.

    Attributes:
        verified: the layout passed its proof.
    """

    verified: bool = False


@dataclass(frozen=True, eq=False)
class PipelinePart:
    """What a norm across pipeline stages carries beside its values, on every call.

    Attributes:
        votes: this stage's vote for the result dtype: one-hot over :data:`RESULT_DTYPES`, zeros
            without gradients or with an error.
        checks: the self-check's sum over this rank's gradients and the error flag.
        slot_counts: one number per stage: this stage's count of slots of copies on its
            reference rank (``Stages.is_reference``), zeros elsewhere, so that every rank learns
            every stage's count (``pipeline.Regions``).
    """

    votes: Tensor
    checks: Tensor
    slot_counts: Tensor


@dataclass(frozen=True, eq=False)
class NormPlan:
    """What a norm over ranks needs besides the values, for one layout on this rank.

    Attributes:
        stacking: the stacking order of the gradients' norms.
        holdings: what this rank holds of each gradient (keeps the Holding objects alive, so
            the ids in the cache key stay theirs).
        stages: the pipeline stages.
        kind: how the layout is reduced.
        grads_dtype: the promotion of the gradients' dtypes, as torch's stacked norm has it.
        error: why the layout cannot be reduced (raised on every rank), or None.
        coverage: this rank's terms of the self-check, per gradient (``ownership.coverage``).
        partial: the Partial gradients completed together (``partial.batches``).
        weights: ``1 / copies`` per stacked norm, float64 on the device; None when every weight
            is 1. Under pipeline stages, a stage of plain replicas weights its lowest rank's
            copy 1 and the others 0: the reference copy's norm, as without stages.
        weights_in: :attr:`weights` in float32 and float64 (the dtypes a call multiplies in).
        verification: the self-check's terms (per gradient within a stage, per stage across
            stages) and the error flag, sent by the proof.
        copies: how this rank's shards enter the comparison of copies in the world's
            all_reduce, a slot per group of copies (``copies``).
        groups: how they enter it in their copies' own process groups (``group_comparison``).
        pipeline: under pipeline stages, what the stages' vector carries; None within a stage.
        proof: what the layout's proof found (see :class:`Proof`).
    """

    stacking: Stacking
    holdings: list[Holding]
    stages: Stages
    kind: Kind
    grads_dtype: torch.dtype
    error: str | None
    coverage: list[int]
    partial: list[list[int]]
    weights: Tensor | None
    weights_in: dict[torch.dtype, Tensor]
    verification: Tensor
    copies: _copies.Comparison
    groups: _group_comparison.GroupComparison
    pipeline: PipelinePart | None
    proof: Proof = field(default_factory=Proof)


_plans: ScopedCache[Hashable, NormPlan] = ScopedCache(_MAX_LAYOUTS)


def planned(request: NormRequest) -> NormPlan:
    """The plan of the request's layout, kept per layout; in the check mode, the layout is first
    verified to be the same on every rank of each stage (one small all_reduce).

    Raises:
        RuntimeError: in the check mode, the ranks of a stage passed different layouts.
    """
    stages = _stages.stages_of(request.pp_group)
    holdings = _holdings.holdings(request.grads)
    device = collective_device(request.local)
    # Under pipeline stages, one all_reduce the first time per pipeline group: every rank asks
    # on every call, so that all ask together.
    lowest = _pipeline.lowest_rank_of_stage(stages, request.pp_group, device)
    if request.check:
        verify_same_layout(
            [h.description for h in holdings],
            None,
            device,
            request.what,
            f"norm_type={request.norm_type} dtype={request.dtype} stages={stages.count} "
            f"per_rank={request.per_rank}",
            stage=(stages.index, stages.count),
        )
    distinct = tuple(request.distinct) if request.distinct is not None else None
    key = (tuple(map(id, holdings)), stages, lowest, distinct)
    plan = _plans.get(key)
    if plan is None:
        plan = _plan(request, holdings, stages, lowest, device)
        _plans.put(key, plan)
    return plan


def _plan(
    request: NormRequest,
    holdings: list[Holding],
    stages: Stages,
    lowest: int,
    device: torch.device,
) -> NormPlan:
    """The :class:`NormPlan` of a layout, built on its first call: the rank maps read once per
    concern, then ordered by the stacking and packed on ``device``."""
    declared = request.distinct
    distinct: list[frozenset[int] | None] = (
        declared if declared is not None else [None] * len(holdings)
    )
    stacking = stacking_on(request.local, device)
    counts = _ownership.counts(holdings, stages, distinct, stacking.stacked)
    partial, refusal = _partial.batches(holdings)
    error = counts.error or refusal
    copies = _copy_groups.copies_of(
        holdings, stages, lowest, distinct, request.grads, counts, reducible=error is None
    )
    kind = _kind(holdings, stages, declared)
    stacked_weights = _stacked_weights(counts.weights, holdings, stages, declared, lowest)
    grads_dtype = _promoted({h.dtype for h in holdings})
    slots = _copy_slots(copies, holdings, stacking.stacked)
    rows = _stage_rows(stages, counts.coverage, error, slots, grads_dtype)
    weights, votes, checks, slot_counts, verification = _on_device([stacked_weights, *rows], device)
    unweighted = all(w == 1.0 for w in stacked_weights)
    in_groups = [found.process_groups for found in copies]
    positions, in_groups_constants = _positions(stacking.stacked), _constants(copies, holdings)
    return NormPlan(
        stacking=stacking,
        holdings=holdings,
        stages=stages,
        kind=kind,
        grads_dtype=grads_dtype,
        error=error,
        coverage=counts.coverage,
        partial=partial,
        weights=None if unweighted else weights,
        weights_in={} if unweighted else {d: weights.to(d) for d in _WEIGHT_DTYPES},
        verification=verification,
        copies=_copies.plan(
            [found.group for found in copies],
            slots,
            [groups is None for groups in in_groups],
            positions,
            device,
            carry_limits=stages.count > 1,
        ),
        groups=_group_comparison.plan(in_groups, stacking.stacked, in_groups_constants, device),
        pipeline=PipelinePart(votes, checks, slot_counts) if kind is Kind.STAGES else None,
    )


def _promoted(dtypes: set[torch.dtype]) -> torch.dtype:
    """The dtype torch's stacked norm of tensors of ``dtypes`` would have."""
    if not dtypes:
        return torch.get_default_dtype()
    return functools.reduce(torch.promote_types, dtypes).to_real()


def _stacked_weights(
    weights: list[float],
    holdings: list[Holding],
    stages: Stages,
    declared: list[frozenset[int] | None] | None,
    lowest: int,
) -> list[float]:
    """The weights of the stacked norms: ``1 / copies`` (``ownership.weight``); under pipeline
    stages, a stage of plain replicas weights its lowest rank's copy 1 and the others 0 (the
    reference copy's norm, as without stages)."""
    if stages.count > 1 and _plain_replicas(holdings, declared):
        return [float(dist.get_rank() == lowest)] * len(weights)
    return weights


def _kind(
    holdings: list[Holding], stages: Stages, declared: list[frozenset[int] | None] | None
) -> Kind:
    """Pipeline stages; else plain replicas; else shards."""
    if stages.count > 1:
        return Kind.STAGES
    if _plain_replicas(holdings, declared):
        return Kind.REPLICAS
    return Kind.SHARDS


def _plain_replicas(holdings: list[Holding], declared: list[frozenset[int] | None] | None) -> bool:
    """Whether every gradient is a plain tensor that no ``distinct_along`` declares rank-local:
    replicas, whose reference copy gives the norm (DDP)."""
    return declared is None and all(h.mesh is None for h in holdings)


def _copy_slots(copies: list[Copies], holdings: list[Holding], order: list[int]) -> _copies.Slots:
    """A slot per group of copies of this rank's stage, gradients in the stacking order
    ``order``, except those compared in their copies' own process groups: each gradient's
    slot, tolerance and constants. The same on every rank of the stage, even where the layout
    cannot be reduced (the proof's vector has the same length on every rank)."""
    slot_of, tau = [0] * len(copies), [0.0] * len(copies)
    per_gradient: list[tuple[int, float, float]] = []
    first = 0
    for index in order:
        found = copies[index]
        if found.process_groups is not None:
            continue
        tau[index] = _copies.tolerance(holdings[index].dtype)
        if found.count > 1:
            index_in_gradient, groups = found.slot
            slot_of[index] = first + index_in_gradient
            per_gradient.append((groups, float(found.count), tau[index]))
            first += groups
    return _copies.Slots(slot_of, tau, per_gradient)


def _positions(order: list[int]) -> list[int]:
    """The place of each gradient's norm among a call's stacked norms, from the stacking order
    ``order`` (input indices)."""
    position_of = [0] * len(order)
    for position, index in enumerate(order):
        position_of[index] = position
    return position_of


def _constants(copies: list[Copies], holdings: list[Holding]) -> list[tuple[float, float, float]]:
    """Per gradient compared in process groups, its copies, their tolerance and its shard's key
    (zeros for the others), as the group comparison takes them (``group_comparison.plan``)."""
    return [
        (float(found.count), _copies.tolerance(h.dtype), float(found.slot[0]))
        if found.process_groups is not None
        else (0.0, 0.0, 0.0)
        for found, h in zip(copies, holdings, strict=True)
    ]


def _on_device(rows: list[list[float]], device: torch.device) -> list[Tensor]:
    """``rows`` as float64 tensors on ``device``, in one host-to-device copy."""
    packed = torch.tensor(
        [value for row in rows for value in row], dtype=torch.float64, device=device
    )
    return list(packed.split([len(row) for row in rows]))


def _stage_rows(
    stages: Stages,
    coverage: list[int],
    error: str | None,
    slots: _copies.Slots,
    grads_dtype: torch.dtype,
) -> list[list[float]]:
    """The votes, checks and slot counts a pipeline norm's vector carries (empty within a
    stage), and the verification's terms (per gradient within a stage, per stage across
    stages) with the error flag."""
    if stages.count == 1:
        return [[], [], [], [*map(float, coverage), float(error is not None)]]
    votes = [0.0] * len(RESULT_DTYPES)
    if coverage and error is None:
        votes[RESULT_DTYPES.index(grads_dtype)] = 1.0
    mine = [stage == stages.index for stage in range(stages.count)]
    return [
        votes,
        [float(sum(coverage)), float(error is not None)],
        [float(slots.count) if is_mine and stages.is_reference else 0.0 for is_mine in mine],
        [float(sum(coverage)) if is_mine else 0.0 for is_mine in mine] + [float(error is not None)],
    ]
