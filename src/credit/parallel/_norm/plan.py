"""The norm's second step: the plan of a gradient layout, everything a call needs besides the values.

The plan holds what depends on the layout alone (the gradients' shapes, dtypes, devices, meshes and
placements, the pipeline group, ``distinct_along``). It is built on the layout's first call, complete,
and kept:

- :class:`Stacking`: the order torch stacks per-gradient norms in (by device and dtype), and index
  tensors into it (a report's segments, the gradients of a GradScaler's flag), each built on the
  device the first time a caller asks for it;
- :class:`NormPlan`, for a norm over ranks: what this rank holds of each gradient and how many copies
  of each shard the world holds (``ownership``), as weights in stacking order on the device in
  every dtype a call multiplies them in; the kind of layout; the gradients' dtype; the Partial
  gradients completed together (``partial``); how the copies are compared (``copies.Comparison``);
  the constants a pipeline norm's vector carries; and the layout's :class:`Proof`, which the
  proof step (``proof``) alone writes.

Host syncs of a layout's first call, and only of it: one blocking host-to-device copy of the plan's
constants, and one of each comparison's (``copies``, ``group_comparison``) where it compares
anything. Under pipeline stages the first call with a pipeline group also learns the lowest rank
of its stage, in one all_reduce of one number per stage that every rank joins
(``ownership.lowest_rank_of_stage``). An index tensor costs one copy the first time a caller
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
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from credit.parallel._common import copy_groups as _copy_groups
from credit.parallel._common import ownership as _ownership
from credit.parallel._common.groups import collective_device
from credit.parallel._common.layout_check import verify_same_layout
from credit.parallel._common.ownership import CopyGroup, Holding, Stages
from credit.parallel._common.scoped import ScopedCache
from credit.parallel._norm import copies as _copies
from credit.parallel._norm import group_comparison as _group_comparison
from credit.parallel._norm import partial as _partial
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
class NormPlan:
    """What a norm over ranks needs besides the values, for one layout on this rank.

    Attributes:
        order: the stacking order of the gradients' norms.
        held: what this rank holds of each gradient (keeps the Holding objects alive, so the ids
            in the cache key stay theirs).
        at: the pipeline stages.
        lowest: the lowest rank of this rank's stage (0 within a single stage).
        distinct: per gradient, the ranks along which its copies differ, or None.
        kind: how the layout is reduced.
        grads_dtype: the promotion of the gradients' dtypes, as torch's stacked norm has it.
        error: why the layout cannot be reduced (raised on every rank), or None.
        coverage: this rank's terms of the self-check, per gradient (``ownership.coverage``).
        partial: the Partial gradients completed together (``partial.batches``).
        weights: ``1 / copies`` per stacked norm, float64 on the device; None when every weight
            is 1. Under pipeline stages, a stage of plain replicas weights its lowest rank's
            copy 1 and the others 0: the reference copy's norm, as without stages.
        weights_in: :attr:`weights` in float32 and float64 (the dtypes a call multiplies in).
        votes: under pipeline stages, this stage's vote for the result dtype: one-hot over
            :data:`RESULT_DTYPES`, zeros without gradients or with an error.
        checks: under pipeline stages, the self-check's sum over this rank's gradients and the
            error flag, carried by every norm's all_reduce.
        slot_counts: under pipeline stages, one number per stage: this stage's count of slots of
            copies on its reference rank (``Stages.is_reference``), zeros elsewhere; carried by
            every norm's all_reduce, so that every rank learns every stage's count
            (``stage_slots``).
        copies: how this rank's shards enter the comparison of copies in the world's
            all_reduce, a slot per group of copies (``copies``).
        groups: how they enter it in their copies' own process groups (``group_comparison``).
        verification: the self-check's terms (per gradient within a stage, per stage across
            stages) and the error flag, sent by the proof.
        proof: what the layout's proof found (see :class:`Proof`).
    """

    stacking: Stacking
    held: list[Holding]
    at: Stages
    lowest: int
    distinct: list[frozenset[int] | None]
    kind: Kind
    grads_dtype: torch.dtype
    error: str | None
    coverage: list[int]
    partial: list[list[int]]
    weights: Tensor | None
    weights_in: dict[torch.dtype, Tensor]
    votes: Tensor
    checks: Tensor
    slot_counts: Tensor
    verification: Tensor
    copies: _copies.Comparison
    groups: _group_comparison.GroupComparison
    proof: Proof = field(default_factory=Proof)


_plans: ScopedCache[Hashable, NormPlan] = ScopedCache(_MAX_LAYOUTS)


def planned(request: NormRequest) -> NormPlan:
    """The plan of the request's layout, kept per layout; in the check mode, the layout is first
    verified to be the same on every rank of each stage (one small all_reduce).

    Raises:
        RuntimeError: in the check mode, the ranks of a stage passed different layouts.
    """
    at = _ownership.stages_of(request.pp_group)
    held = _ownership.holdings(request.grads)
    device = collective_device(request.local)
    # Under pipeline stages, one all_reduce the first time per pipeline group: every rank asks
    # on every call, so that all ask together.
    lowest = _ownership.lowest_rank_of_stage(at, request.pp_group, device)
    if request.check:
        verify_same_layout(
            [h.description for h in held],
            None,
            device,
            request.what,
            f"norm_type={request.norm_type} dtype={request.dtype} stages={at.count} "
            f"per_rank={request.per_rank}",
            stage=(at.index, at.count),
        )
    plan = _plan_of(held, request.grads, request.local, at, lowest, request.distinct, device)
    return plan


def _plan_of(
    held: list[Holding],
    grads: list[Tensor],
    local: list[Tensor],
    at: Stages,
    lowest: int,
    distinct: list[frozenset[int] | None] | None,
    device: torch.device,
) -> NormPlan:
    """The :class:`NormPlan` of a layout, built on its first call and kept.

    Args:
        held: what this rank holds of each gradient.
        grads: the gradients.
        local: each gradient's local tensor.
        at: the pipeline stages.
        lowest: the lowest rank of this rank's stage.
        distinct: per gradient, the ranks along which its copies differ, or None for none.
        device: where the plan's tensors live (``groups.collective_device``).
    """
    key = (tuple(map(id, held)), at, lowest, tuple(distinct) if distinct is not None else None)
    plan = _plans.get(key)
    if plan is None:
        plan = _plan(held, grads, local, at, lowest, distinct, device)
        _plans.put(key, plan)
    return plan


def _plan(
    held: list[Holding],
    grads: list[Tensor],
    local: list[Tensor],
    at: Stages,
    lowest: int,
    declared: list[frozenset[int] | None] | None,
    device: torch.device,
) -> NormPlan:
    distinct: list[frozenset[int] | None] = declared if declared is not None else [None] * len(held)
    grads_dtype = _promoted({h.dtype for h in held})
    stacking = stacking_on(local, device)
    counts = _ownership.counts(held, at, distinct, stacking.stacked)
    partial, refusal = _partial.batches(held)
    error = counts.error or refusal
    stacked_weights = counts.weights
    if at.count > 1 and _plain_replicas(held, declared):  # the reference copy's norm
        stacked_weights = [float(dist.get_rank() == lowest)] * len(stacked_weights)
    in_groups = _groups_of_copies(held, _copy_groups.candidate_meshes(grads), at, distinct)
    slots = _copy_slots(held, at, distinct, stacking, in_groups)
    rows = _stage_rows(at, counts.coverage, error, slots, grads_dtype)
    weights, votes, checks, slot_counts, verification = _on_device([stacked_weights, *rows], device)
    unweighted = all(w == 1.0 for w in stacked_weights)
    return NormPlan(
        stacking=stacking,
        held=held,
        at=at,
        lowest=lowest,
        distinct=distinct,
        kind=_kind(held, at, declared),
        grads_dtype=grads_dtype,
        error=error,
        coverage=counts.coverage,
        partial=partial,
        weights=None if unweighted else weights,
        weights_in={} if unweighted else {d: weights.to(d) for d in _WEIGHT_DTYPES},
        votes=votes,
        checks=checks,
        slot_counts=slot_counts,
        verification=verification,
        copies=_comparison(held, at, lowest, distinct, error, stacking, slots, in_groups, device),
        groups=_compared_in_groups(held, at, in_groups, stacking, device),
    )


def _promoted(dtypes: set[torch.dtype]) -> torch.dtype:
    """The dtype torch's stacked norm of tensors of ``dtypes`` would have."""
    if not dtypes:
        return torch.get_default_dtype()
    return functools.reduce(torch.promote_types, dtypes).to_real()


def _copy_slots(
    held: list[Holding],
    at: Stages,
    distinct: list[frozenset[int] | None],
    stacking: Stacking,
    in_groups: list[tuple[ProcessGroup, ...] | None],
) -> _copies.Slots:
    """A slot per group of copies of this rank's stage, for the gradients not compared in
    process groups, with their copies and tolerance: the same on every rank of the stage, even
    where the layout cannot be reduced (the proof's vector has the same length on every rank)."""
    elsewhere = [groups is not None for groups in in_groups]
    slot_of, per_gradient = _ownership.copy_slots(held, at, distinct, stacking.stacked, elsewhere)
    tau = [0.0 if elsewhere[i] else _copies.tolerance(h.dtype) for i, h in enumerate(held)]
    constants = [(groups, float(c), _copies.tolerance(d)) for groups, c, d in per_gradient]
    return _copies.Slots(slot_of, tau, constants)


def _comparison(
    held: list[Holding],
    at: Stages,
    lowest: int,
    distinct: list[frozenset[int] | None],
    error: str | None,
    stacking: Stacking,
    slots: _copies.Slots,
    in_groups: list[tuple[ProcessGroup, ...] | None],
    device: torch.device,
) -> _copies.Comparison:
    """How the layout's copies are compared (``copies``); nothing is compared where the layout
    cannot be reduced (its ranks send zeros beside their flag)."""
    groups: list[CopyGroup | None] = [None] * len(held)
    if error is None:
        groups = [
            _ownership.copy_group(h, at, lowest, d) for h, d in zip(held, distinct, strict=True)
        ]
    position_of = [0] * len(held)
    for position, index in enumerate(stacking.stacked):
        position_of[index] = position
    slotted = [found is None for found in in_groups]
    return _copies.plan(groups, slots, slotted, position_of, device, carry_limits=at.count > 1)


def _groups_of_copies(
    held: list[Holding],
    meshes: list[DeviceMesh],
    at: Stages,
    distinct: list[frozenset[int] | None],
) -> list[tuple[ProcessGroup, ...] | None]:
    """Per gradient, the process groups its copies are compared in (``copy_groups``), found
    among the call's ``meshes``, or None where they take slots in the world's all_reduce;
    decided once per distinct holding, each group named by its ranks (equal groups of other
    meshes are one round)."""
    decided: dict[tuple[int, frozenset[int] | None], tuple[ProcessGroup, ...] | None] = {}
    by_ranks: dict[tuple[int, ...], ProcessGroup] = {}
    found = []
    for h, d in zip(held, distinct, strict=True):
        key = (id(h), d)
        if key not in decided:
            groups = _copy_groups.groups_of_copies(h, at, d, meshes)
            decided[key] = groups and tuple(
                by_ranks.setdefault(tuple(dist.get_process_group_ranks(g)), g) for g in groups
            )
        found.append(decided[key])
    return found


def _compared_in_groups(
    held: list[Holding],
    at: Stages,
    in_groups: list[tuple[ProcessGroup, ...] | None],
    stacking: Stacking,
    device: torch.device,
) -> _group_comparison.GroupComparison:
    """How the gradients compared in process groups enter the comparison
    (``group_comparison``): each one's copies, tolerance and shard's key."""
    per_gradient = [
        (
            float(_ownership.copies(h, at, None)),
            _copies.tolerance(h.dtype),
            float(_ownership.copy_slot(h, at, None)[0]),
        )
        if found is not None
        else (0.0, 0.0, 0.0)
        for h, found in zip(held, in_groups, strict=True)
    ]
    return _group_comparison.plan(in_groups, stacking.stacked, per_gradient, device)


def _on_device(rows: list[list[float]], device: torch.device) -> list[Tensor]:
    """``rows`` as float64 tensors on ``device``, in one host-to-device copy."""
    packed = torch.tensor(
        [value for row in rows for value in row], dtype=torch.float64, device=device
    )
    return list(packed.split([len(row) for row in rows]))


def _stage_rows(
    at: Stages,
    coverage: list[int],
    error: str | None,
    slots: _copies.Slots,
    grads_dtype: torch.dtype,
) -> list[list[float]]:
    """The votes, checks and slot counts a pipeline norm's vector carries (empty within a
    stage), and the verification's terms (per gradient within a stage, per stage across
    stages) with the error flag."""
    if at.count == 1:
        return [[], [], [], [*map(float, coverage), float(error is not None)]]
    votes = [0.0] * len(RESULT_DTYPES)
    if coverage and error is None:
        votes[RESULT_DTYPES.index(grads_dtype)] = 1.0
    mine = [stage == at.index for stage in range(at.count)]
    return [
        votes,
        [float(sum(coverage)), float(error is not None)],
        [float(slots.count) if is_mine and at.is_reference else 0.0 for is_mine in mine],
        [float(sum(coverage)) if is_mine else 0.0 for is_mine in mine] + [float(error is not None)],
    ]


def _plain_replicas(held: list[Holding], declared: list[frozenset[int] | None] | None) -> bool:
    """Whether every gradient is a plain tensor that no ``distinct_along`` declares rank-local:
    replicas, whose reference copy gives the norm (DDP)."""
    return declared is None and all(h.mesh is None for h in held)


def _kind(held: list[Holding], at: Stages, declared: list[frozenset[int] | None] | None) -> Kind:
    if at.count > 1:
        return Kind.STAGES
    if _plain_replicas(held, declared):
        return Kind.REPLICAS
    return Kind.SHARDS
