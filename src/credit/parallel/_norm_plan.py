"""The plan of a gradient layout for the norm: everything a norm call needs besides the values.

A norm call (``_norms``) is split in two. The plan holds what depends on the layout alone (the
gradients' shapes, dtypes, devices, meshes and placements, the pipeline group, ``distinct_along``),
built on the layout's first call and kept:

- :class:`Order`: the order torch stacks per-gradient norms in (by device and dtype), and index
  tensors into it (a report's groups, the gradients of a GradScaler's flag), each built on the
  device the first time a call asks for it;
- :class:`Plan`, for a norm over ranks: what this rank holds of each gradient and how many copies
  of each shard the world holds (``_ownership``), as weights in stacking order on the device; the
  gradients' dtype; the Partial gradients completed together (``_partial``); the constants a
  pipeline norm's vector carries; and whether the layout was verified;
- :func:`verify`, on the layout's first call (and every call in check mode): the self-check of the
  copy counts and the comparison of the copies' values (``_copies``), in one all_reduce.

The hot path then reads straight through: local norms, one collective, the result.

Host syncs of a layout's first call, and only of it: one blocking host-to-device copy of the plan's
constants, one of the copies' constants (where a shard has copies), one of the projection patterns
(once per process and device), and one read of the verification's verdict. An index tensor costs
one copy the first time a call asks for it (a report's grouping, a scaler's set of gradients).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from credit.parallel import _copies, _ownership, _partial
from credit.parallel._foreach import group_indices_by_device_and_dtype
from credit.parallel._groups import collective_device, moves_data
from credit.parallel._ownership import Holding, Stages
from credit.parallel._scoped import ScopedCache

# Layouts whose plans are kept (a training loop uses a few: the clip's, the report's, a norm over
# part of the gradients).
_MAX_LAYOUTS = 64
# Index tensors kept per layout (a report's grouping, the gradients of each scaler's flags).
_MAX_INDICES = 16

# The result dtypes a pipeline stage can vote for; the stages agree on their promotion, so that
# every rank returns the same dtype and bits even where stages hold gradients of different dtypes
# (or none).
RESULT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(eq=False)
class Order:
    """The order torch stacks per-gradient norms in, and index tensors into it.

    Attributes:
        groups: the input indices by (device, dtype), in torch's order, with the device.
        stacked: the input index of each stacked norm.
        device: where the stacked norms live.
    """

    groups: list[tuple[torch.device, list[int]]]
    stacked: list[int]
    device: torch.device
    _indices: ScopedCache[Hashable, list[Tensor]] = field(
        default_factory=lambda: ScopedCache(_MAX_INDICES)
    )

    def positions(self, inputs: list[int]) -> Tensor:
        """The places of the norms of gradients ``inputs`` (input indices) in the stacked order,
        as an index tensor on the device."""

        def build() -> list[list[int]]:
            place = {index: position for position, index in enumerate(self.stacked)}
            return [[place[index] for index in inputs]]

        return self.indices(("inputs", tuple(inputs)), build)[0]

    def indices(self, key: Hashable, build: Callable[[], list[list[int]]]) -> list[Tensor]:
        """The index lists that ``build`` returns (positions in the stacked order, or a segment
        per stacked norm), as index tensors on the device: built once per ``key``, in one
        host-to-device copy, then kept."""
        found = self._indices.get(key)
        if found is None:
            lists = build()
            flat = [position for positions in lists for position in positions]
            packed = torch.zeros(0, dtype=torch.int64, device=self.device)
            if flat:
                packed = torch.tensor(flat, dtype=torch.int64, device=self.device)
            found = self._indices.put(key, list(packed.split([len(p) for p in lists])))
        return found


@dataclass(eq=False)
class Plan:
    """What a norm over ranks needs besides the values, for one layout on this rank.

    Attributes:
        order: the stacking order of the gradients' norms.
        held: what this rank holds of each gradient (keeps the Holding objects alive, so the ids
            in the cache key stay theirs).
        at: the pipeline stages.
        distinct: per gradient, the ranks along which its copies differ, or None.
        grads_dtype: the promotion of the gradients' dtypes, as torch's stacked norm has it.
        replicas: plain replicas within one stage (DDP): each rank's own norm is the norm, once
            the world agrees (``_norms``).
        error: why the layout cannot be reduced (raised on every rank), or None.
        coverage: this rank's terms of the self-check, per gradient (``_ownership.coverage``).
        partial: the Partial gradients completed together (``_partial.batches``).
        weights: ``1 / copies`` per stacked norm, float64 on the device; None when every weight
            is 1.
        votes: under pipeline stages, this stage's vote for the result dtype: one-hot over
            :data:`RESULT_DTYPES`, zeros without gradients or with an error.
        checks: under pipeline stages, the self-check's sum over this rank's gradients and the
            error flag, carried by every norm's all_reduce.
        verification: the self-check's terms (per gradient within a stage, per stage across
            stages) and the error flag, sent by :func:`verify`.
        copies: how this rank's shards enter the comparison of copies, from the first
            verification on.
        verified: the layout passed its verification.
    """

    order: Order
    held: list[Holding]
    at: Stages
    distinct: list[frozenset[int] | None]
    grads_dtype: torch.dtype
    replicas: bool
    error: str | None
    coverage: list[int]
    partial: list[list[int]]
    weights: Tensor | None
    votes: Tensor
    checks: Tensor
    verification: Tensor
    copies: _copies.Plan | None = None
    verified: bool = False
    _weights_as: dict[torch.dtype, Tensor] = field(default_factory=dict)

    def weights_as(self, dtype: torch.dtype) -> Tensor | None:
        """:attr:`weights` in ``dtype``, cast on the device once per dtype."""
        if self.weights is None:
            return None
        if dtype not in self._weights_as:
            self._weights_as[dtype] = self.weights.to(dtype)
        return self._weights_as[dtype]


_orders: ScopedCache[Hashable, Order] = ScopedCache(_MAX_LAYOUTS)
_plans: ScopedCache[Hashable, Plan] = ScopedCache(_MAX_LAYOUTS)


def order_of(local: list[Tensor]) -> Order:
    """The :class:`Order` of tensors reduced on this rank alone, kept per (dtype, device) list."""
    key = tuple((t.dtype, t.device) for t in local)
    order = _orders.get(key)
    if order is None:
        device = local[0].device if local else torch.device("cpu")
        order = _orders.put(key, _order(local, device))
    return order


def _order(local: list[Tensor], device: torch.device) -> Order:
    groups = []
    if local:
        grouped = group_indices_by_device_and_dtype(local)
        groups = [(where, indices) for (where, _), indices in grouped.items()]
    return Order(groups, [index for _, indices in groups for index in indices], device)


def promoted(dtypes: set[torch.dtype]) -> torch.dtype:
    """The dtype torch's stacked norm of tensors of ``dtypes`` would have."""
    if not dtypes:
        return torch.get_default_dtype()
    return functools.reduce(torch.promote_types, dtypes).to_real()


def plan_of(
    held: list[Holding],
    local: list[Tensor],
    at: Stages,
    distinct: list[frozenset[int] | None] | None,
) -> Plan:
    """The :class:`Plan` of a layout, built on its first call and kept.

    Args:
        held: what this rank holds of each gradient.
        local: each gradient's local tensor.
        at: the pipeline stages.
        distinct: per gradient, the ranks along which its copies differ, or None for none.
    """
    key = (tuple(map(id, held)), at, tuple(distinct) if distinct is not None else None)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans.put(key, _plan(held, local, at, distinct))
    return plan


def _plan(
    held: list[Holding],
    local: list[Tensor],
    at: Stages,
    declared: list[frozenset[int] | None] | None,
) -> Plan:
    distinct: list[frozenset[int] | None] = declared if declared is not None else [None] * len(held)
    errors = (_ownership.layout_error(h, at, d) for h, d in zip(held, distinct, strict=True))
    error = next((e for e in errors if e is not None), None) or _partial.unsupported(held)
    order = _order(local, collective_device(local))
    weights = [_ownership.weight(h, at, d) for h, d in zip(held, distinct, strict=True)]
    stacked_weights = [weights[i] for i in order.stacked]
    coverage = [_ownership.coverage(h, at) for h in held]
    grads_dtype = promoted({h.dtype for h in held})
    votes, checks, slots = [], [], [float(c) for c in coverage]
    if at.count > 1:
        votes = [0.0] * len(RESULT_DTYPES)
        if held and error is None:
            votes[RESULT_DTYPES.index(grads_dtype)] = 1.0
        checks = [float(sum(coverage)), float(error is not None)]
        slots = [float(sum(coverage)) if stage == at.index else 0.0 for stage in range(at.count)]
    verification = [*slots, float(error is not None)]
    # Every constant of the layout reaches the device in one copy.
    rows = [stacked_weights, votes, checks, verification]
    packed = torch.tensor(
        [value for row in rows for value in row], dtype=torch.float64, device=order.device
    )
    on_device = packed.split([len(row) for row in rows])
    return Plan(
        order=order,
        held=held,
        at=at,
        distinct=distinct,
        grads_dtype=grads_dtype,
        replicas=at.count == 1 and declared is None and all(h.mesh is None for h in held),
        error=error,
        coverage=coverage,
        partial=_partial.batches(held),
        weights=None if all(w == 1.0 for w in stacked_weights) else on_device[0],
        votes=on_device[1],
        checks=on_device[2],
        verification=on_device[3],
    )


# ---------------------------------------------------------------------------------------------
# the first call for a layout: the self-check and the copies


def verify(
    plan: Plan,
    local: list[Tensor],
    pp_group: ProcessGroup | None,
    what: str,
    label: Callable[[int], str],
) -> None:
    """Prove the layout in one float64 all_reduce, raising on every rank when it fails.

    Two things are proven: the self-check (every rank of a stage holds a shard of every gradient
    on its own copy of the mesh: the terms of ``_ownership.coverage`` sum to zero), and that the
    ranks taken for copies of a shard hold the same values (``_copies``). Sums run per gradient
    within a stage, per stage across stages. A NaN or inf leaves the copies unproven until a
    later call: the norm is not finite then anyway. Every rank must call it together: within a
    stage on the first call for the layout they share, across stages when any stage asks (see
    ``_norms``). The verdict is read on the host once.

    Args:
        plan: the layout's plan.
        local: each gradient's local tensor.
        pp_group: the pipeline group, or None.
        what: the public function, for messages.
        label: names gradient ``i`` in messages.

    Raises:
        ValueError: the layout cannot be reduced, or copies differ (on every rank).
        RuntimeError: the ranks' shards do not add up to whole gradients (on every rank).
    """
    device = plan.order.device
    # Every rank asks, whether or not it has its copies' plan yet: the first time per pipeline
    # group, this is a collective.
    lowest = _ownership.lowest_rank_of_stage(plan.at, pp_group, device)
    if plan.copies is None and plan.error is None:
        plan.copies = _copies_plan(plan, lowest)
    # A broken layout sends zeros of the same size beside its flag.
    copies = plan.copies or _copies_plan(plan, lowest, compare=False)
    sums, nonfinite = _copies.terms(copies, local, device)
    slot_count = plan.verification.numel() - 1
    vector = torch.cat([plan.verification, nonfinite.reshape(1), sums.flatten()])
    dist.all_reduce(vector, op=dist.ReduceOp.SUM)
    if not moves_data():
        plan.verified = True
        return
    coverage, flags, summed = vector.split([slot_count, 2, sums.numel()])
    verdict = torch.stack(
        [
            coverage.abs().ge(0.5).any() | (flags[0] > 0),  # integers, exact in float64
            flags[1] > 0,
            _copies.differ(summed.view_as(sums), None if copies.pooled else copies.limits),
        ]
    )
    broken, nonfinite_anywhere, differ = verdict.tolist()  # the first call's one read
    if broken:
        raise_layout_failure(plan, what)
    if nonfinite_anywhere:
        return
    if differ:
        raise_copies_differ(plan, local, what, label)
    plan.verified = True


def raise_copies_differ(
    plan: Plan, local: list[Tensor], what: str, label: Callable[[int], str]
) -> None:
    """Describe the copies that differ and raise the same ValueError on every rank; every rank
    must call it together (it gathers each rank's fingerprints)."""
    assert plan.copies is not None
    mine = _copies.records(plan.copies, plan.held, local, plan.at.index, label)
    _copies.raise_mismatch(mine, plan.at.index, len(plan.held), what)


def _copies_plan(plan: Plan, lowest: int, compare: bool = True) -> _copies.Plan:
    """How this rank's shards enter the comparison of copies: within a stage, a slot per group
    of copies; across pipeline stages, whose layouts the other stages cannot see, a slot per
    stage. Without ``compare``, the same slots and no gradient in them."""
    at = plan.at
    groups: list[_ownership.CopyGroup | None] = [None] * len(plan.held)
    if compare:
        groups = [
            _ownership.copy_group(held, at, lowest, distinct)
            for held, distinct in zip(plan.held, plan.distinct, strict=True)
        ]
    position_of = [0] * len(plan.held)
    for position, index in enumerate(plan.order.stacked):
        position_of[index] = position
    slots = (
        _group_slots(plan) if at.count == 1 else _copies.Slots([at.index] * len(groups), at.count)
    )
    return _copies.plan(plan.held, groups, slots, position_of, plan.order.device)


def _group_slots(plan: Plan) -> _copies.Slots:
    """A slot per group of copies, gradients in stacking order: the same on every rank of a
    single stage that passed the layout (``_ownership.copy_slot``)."""
    slot_of = [0] * len(plan.held)
    limits: list[tuple[float, float]] = []
    for index in plan.order.stacked:
        held, distinct = plan.held[index], plan.distinct[index]
        copies = _ownership.copies(held, plan.at, distinct)
        if copies > 1:
            group, count = _ownership.copy_slot(held, plan.at, distinct)
            slot_of[index] = len(limits) + group
            limits += [(float(copies), _copies.tolerance(held.dtype))] * count
    return _copies.Slots(slot_of, len(limits), limits)


# ---------------------------------------------------------------------------------------------
# failures, described the same way on every rank


def raise_layout_failure(plan: Plan, what: str) -> None:
    """Gather every rank's view of the layout and raise the same error on every rank."""
    at = plan.at
    mine = (
        at.index,
        at.is_reference,
        plan.error,
        [(h.description, len(h.mesh_ranks), h.replicas, h.global_numel) for h in plan.held],
        plan.coverage,
    )
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for rank, (_, _, error, _, _) in enumerate(everyone):
        if error is not None:
            raise ValueError(f"{what}: {error} (rank {rank}). No gradient was modified.")
    raise RuntimeError(_describe_missing_copies(everyone, at, what))


def _describe_missing_copies(everyone: list, at: Stages, what: str) -> str:
    for stage in range(at.count):
        ranks = [view for view in everyone if view[0] == stage]
        reference = next((view for view in ranks if view[1]), ranks[0] if ranks else None)
        if reference is None:
            continue
        for index, (description, mesh_size, replicas, numel) in enumerate(reference[3]):
            held = sum(
                view[4][index] + (at.size * replicas * numel if view[1] else 0)
                for view in ranks
                if index < len(view[4])
            )
            expected = at.size * replicas * numel
            if held != expected:
                return (
                    f"{what}: cannot count gradient {index} ({description}) exactly once: "
                    f"its mesh has {mesh_size} ranks, so the {at.size} ranks of "
                    f"{'stage ' + str(stage) if at.count > 1 else 'the world'} should hold "
                    f"{at.size // max(mesh_size, 1)} copies of it, but they hold "
                    f"{held / (mesh_size * replicas * numel) if numel else 0:g}. Every rank "
                    "of a stage must hold every gradient of the stage, each on its own copy of "
                    "the mesh; pass pipeline stages as pp_group. No gradient was modified."
                )
    return (
        f"{what}: the ranks' gradients do not add up to whole copies of each gradient. "
        "No gradient was modified."
    )
