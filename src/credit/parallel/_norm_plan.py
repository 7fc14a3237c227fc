"""The norm's second step: the plan of a gradient layout, everything a call needs besides the values.

The plan holds what depends on the layout alone (the gradients' shapes, dtypes, devices, meshes and
placements, the pipeline group, ``distinct_along``). It is built on the layout's first call, complete,
and kept:

- :class:`Order`: the order torch stacks per-gradient norms in (by device and dtype), and index
  tensors into it (a report's segments, the gradients of a GradScaler's flag), each built on the
  device the first time a caller asks for it;
- :class:`Plan`, for a norm over ranks: what this rank holds of each gradient and how many copies
  of each shard the world holds (``_ownership``), as weights in stacking order on the device in
  every dtype a call multiplies them in; the kind of layout; the gradients' dtype; the Partial
  gradients completed together (``_partial``); the constants a pipeline norm's vector carries;
  and the layout's :class:`Proof`, which the proof step (``_norm_proof``) alone writes.

Host syncs of a layout's first call, and only of it: one blocking host-to-device copy of the plan's
constants. An index tensor costs one copy the first time a caller asks for it (a report's
segments, a scaler's set of gradients).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from credit.parallel import _copies, _ownership, _partial
from credit.parallel._groups import collective_device
from credit.parallel._inputs import NormRequest
from credit.parallel._layout_check import verify_same_layout
from credit.parallel._norm_order import Order, order_on
from credit.parallel._ownership import Holding, Stages
from credit.parallel._scoped import ScopedCache

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
    """The kinds of layout, each reduced by a collective of its own (``_norm_collectives``)."""

    SHARDS = "shards"  # one stage, DTensors or distinct gradients: the per-gradient vector
    REPLICAS = "replicas"  # one stage of plain replicas (DDP): the reference copy's norms
    STAGES = "stages"  # pipeline stages: one number per segment, and the stages' decisions


@dataclass(eq=False)
class Proof:
    """What the layout's proof found on this rank; written by ``_norm_proof`` alone.

    Attributes:
        copies: how this rank's shards enter the comparison of copies, from the first proof on.
        verified: the layout passed its proof.
    """

    copies: _copies.Plan | None = None
    verified: bool = False


@dataclass(frozen=True, eq=False)
class Plan:
    """What a norm over ranks needs besides the values, for one layout on this rank.

    Attributes:
        order: the stacking order of the gradients' norms.
        held: what this rank holds of each gradient (keeps the Holding objects alive, so the ids
            in the cache key stay theirs).
        at: the pipeline stages.
        distinct: per gradient, the ranks along which its copies differ, or None.
        kind: how the layout is reduced.
        grads_dtype: the promotion of the gradients' dtypes, as torch's stacked norm has it.
        error: why the layout cannot be reduced (raised on every rank), or None.
        coverage: this rank's terms of the self-check, per gradient (``_ownership.coverage``).
        partial: the Partial gradients completed together (``_partial.batches``).
        weights: ``1 / copies`` per stacked norm, float64 on the device; None when every weight
            is 1.
        weights_in: :attr:`weights` in float32 and float64 (the dtypes a call multiplies in).
        votes: under pipeline stages, this stage's vote for the result dtype: one-hot over
            :data:`RESULT_DTYPES`, zeros without gradients or with an error.
        checks: under pipeline stages, the self-check's sum over this rank's gradients and the
            error flag, carried by every norm's all_reduce.
        verification: the self-check's terms (per gradient within a stage, per stage across
            stages) and the error flag, sent by the proof.
        proof: what the layout's proof found (see :class:`Proof`).
    """

    order: Order
    held: list[Holding]
    at: Stages
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
    verification: Tensor
    proof: Proof = field(default_factory=Proof)


_plans: ScopedCache[Hashable, Plan] = ScopedCache(_MAX_LAYOUTS)


def planned(request: NormRequest) -> Plan:
    """The plan of the request's layout, kept per layout; in the check mode, the layout is first
    verified to be the same on every rank of each stage (one small all_reduce).

    Raises:
        ValueError: ``norm_type`` is not positive where the layout is not plain replicas.
        RuntimeError: in the check mode, the ranks of a stage passed different layouts.
    """
    at = _ownership.stages_of(request.pp_group)
    held = _ownership.holdings(request.grads)
    device = collective_device(request.local)
    if request.check:
        verify_same_layout(
            [h.description for h in held],
            None,
            device,
            request.what,
            f"norm_type={request.order} dtype={request.dtype} stages={at.count} "
            f"per_rank={request.per_rank}",
            stage=(at.index, at.count),
        )
    plan = _plan_of(held, request.local, at, request.distinct, device)
    if plan.kind is not Kind.REPLICAS and not request.order > 0:
        raise ValueError(
            f"norm_type must be positive or inf for distributed grads, got {request.order}"
        )
    return plan


def _plan_of(
    held: list[Holding],
    local: list[Tensor],
    at: Stages,
    distinct: list[frozenset[int] | None] | None,
    device: torch.device,
) -> Plan:
    """The :class:`Plan` of a layout, built on its first call and kept.

    Args:
        held: what this rank holds of each gradient.
        local: each gradient's local tensor.
        at: the pipeline stages.
        distinct: per gradient, the ranks along which its copies differ, or None for none.
        device: where the plan's tensors live (``_groups.collective_device``).
    """
    key = (tuple(map(id, held)), at, tuple(distinct) if distinct is not None else None)
    plan = _plans.get(key)
    if plan is None:
        plan = _plan(held, local, at, distinct, device)
        _plans.put(key, plan)
    return plan


def _plan(
    held: list[Holding],
    local: list[Tensor],
    at: Stages,
    declared: list[frozenset[int] | None] | None,
    device: torch.device,
) -> Plan:
    distinct: list[frozenset[int] | None] = declared if declared is not None else [None] * len(held)
    kind = _kind(held, at, declared)
    grads_dtype = _promoted({h.dtype for h in held})
    constants = _constants(held, local, at, distinct, grads_dtype, device)
    weights = constants.weights
    return Plan(
        order=constants.order,
        held=held,
        at=at,
        distinct=distinct,
        kind=kind,
        grads_dtype=grads_dtype,
        error=constants.error,
        coverage=constants.coverage,
        partial=_partial.batches(held),
        weights=weights,
        weights_in={} if weights is None else {d: weights.to(d) for d in _WEIGHT_DTYPES},
        votes=constants.votes,
        checks=constants.checks,
        verification=constants.verification,
    )


def _promoted(dtypes: set[torch.dtype]) -> torch.dtype:
    """The dtype torch's stacked norm of tensors of ``dtypes`` would have."""
    if not dtypes:
        return torch.get_default_dtype()
    return functools.reduce(torch.promote_types, dtypes).to_real()


class _Constants(NamedTuple):
    order: Order
    error: str | None
    coverage: list[int]
    weights: Tensor | None
    votes: Tensor
    checks: Tensor
    verification: Tensor


def _constants(
    held: list[Holding],
    local: list[Tensor],
    at: Stages,
    distinct: list[frozenset[int] | None],
    grads_dtype: torch.dtype,
    device: torch.device,
) -> _Constants:
    """What the rank maps and dtypes give the plan: the order, the first error, the self-check's
    terms, and the weights, votes, checks and verification terms on ``device`` in one
    host-to-device copy (the weights None where every one is 1)."""
    order = order_on(local, device)
    counts = _ownership.counts(held, at, distinct, order.stacked)
    error = counts.error or _partial.unsupported(held)
    coverage, stacked_weights = counts.coverage, counts.weights
    votes: list[float] = []
    checks, slots = [], [float(c) for c in coverage]
    if at.count > 1:
        votes = [0.0] * len(RESULT_DTYPES)
        if coverage and error is None:
            votes[RESULT_DTYPES.index(grads_dtype)] = 1.0
        checks = [float(sum(coverage)), float(error is not None)]
        slots = [float(sum(coverage)) if stage == at.index else 0.0 for stage in range(at.count)]
    rows = [stacked_weights, votes, checks, [*slots, float(error is not None)]]
    packed = torch.tensor(
        [value for row in rows for value in row], dtype=torch.float64, device=device
    )
    weights, *on_device = packed.split([len(row) for row in rows])
    unweighted = all(w == 1.0 for w in stacked_weights)
    return _Constants(order, error, coverage, None if unweighted else weights, *on_device)


def _kind(held: list[Holding], at: Stages, declared: list[frozenset[int] | None] | None) -> Kind:
    if at.count > 1:
        return Kind.STAGES
    if declared is None and all(h.mesh is None for h in held):
        return Kind.REPLICAS
    return Kind.SHARDS
