"""The replica check's plan of a layout: how this rank's tensors enter the one all_reduce.

A :class:`ReplicaPlan` holds what depends on the layout alone (what this rank holds of each tensor, its
group of copies, the pipeline stages, ``distinct_along``, the tensors' names, kinds, shapes and
dtypes): built on the layout's first call, complete and frozen when built, and kept, so that a
later call only digests its tensors and adds them to a clone of the plan's constant.

- what the rank maps say (``ownership``): the ranks of the stage, each tensor's group of copies,
  the tensors compared (those with copies elsewhere, no Partial dims), and why a layout cannot be
  compared, which a failed call names;
- each compared copy's weights per lane (``weights``), on the device;
- the constant part of the vector: the presence terms of every group, the self-check of the
  tensors every rank of the stage holds, and the error flag;
- the digests' plan of the compared tensors (``digests``).

Host syncs of a layout's first call, and only of it: under ``pp_group``, learning the ranks of
the stage (one all_reduce, once per pipeline group), and one host-to-device copy each of the
weights and the constant (beside the digests' plan's own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from credit.parallel._common import copy_groups as _copy_groups
from credit.parallel._common import holdings as _holdings
from credit.parallel._common import ownership as _ownership
from credit.parallel._common import stages as _stages
from credit.parallel._common.copy_groups import CopyGroup
from credit.parallel._common.holdings import Holding
from credit.parallel._common.scoped import ScopedCache
from credit.parallel._common.stages import Stages
from credit.parallel._replicas import digests as _digests
from credit.parallel._replicas import weights as _weights
from credit.parallel._replicas.arguments import Request
from credit.parallel._replicas.weights import Member

# Layouts whose plans are kept (a trainer checks one model, or a few).
_MAX_PLANS = 16


@dataclass(frozen=True, eq=False)
class ReplicaPlan:
    """How this rank's tensors enter the comparison, for one layout.

    Attributes:
        held: what this rank holds of each tensor (keeps the Holding objects alive, so that the
            ids in the cache key stay theirs).
        at: the pipeline stages.
        stage: the ranks of this rank's stage.
        groups: each tensor's group of copies (None where it has none, or the layout cannot be
            compared).
        compared: the tensors with copies (groups larger than one, no Partial dims).
        digests: the compared tensors' digests, planned for their layout.
        coefficients: ``(compared, LANES)`` int64 on the device: each member's weights.
        constant: the vector before the digests: presence terms, self-check, error count.
        device: where the vector lives.
        error: why the layout cannot be compared, or None.
    """

    held: tuple[Holding, ...]
    stages: Stages
    stage: frozenset[int]
    groups: tuple[CopyGroup | None, ...]
    compared: tuple[int, ...]
    digests: _digests.DigestPlan
    coefficients: Tensor
    constant: Tensor
    device: torch.device
    error: str | None


# The plans of the layouts met under the current process group, the most recent kept.
_plans: ScopedCache[tuple, ReplicaPlan] = ScopedCache(_MAX_PLANS)


def plan(request: Request) -> ReplicaPlan:
    """The plan of the layout of ``request``'s tensors: built on its first call, then kept."""
    held = tuple(_holdings.holding(entry.tensor) for entry in request.entries)
    stages = _stages.stages_of(request.pp_group)
    marks = request.distinct if request.distinct is not None else (None,) * len(held)
    names = tuple((entry.name, entry.kind) for entry in request.entries)
    key = (tuple(map(id, held)), stages, marks, names, request.invalid)
    found = _plans.get(key)
    if found is None:
        found = _plans.put(key, _build(request, held, stages, marks))
    return found


class _Layout(NamedTuple):
    """What the rank maps say of this rank's tensors (:mod:`~credit.parallel._common.ownership`)."""

    stage: frozenset[int]  # the ranks of this rank's stage
    groups: tuple[CopyGroup | None, ...]
    members: tuple[tuple[int, Member], ...]  # each compared tensor's index, and as a member
    counts: tuple[tuple[str, int], ...]  # the self-check's count of each parameter and buffer
    error: str | None


def _build(
    request: Request,
    held: tuple[Holding, ...],
    stages: Stages,
    marks: tuple[frozenset[int] | None, ...],
) -> ReplicaPlan:
    layout = _layout(request, held, stages, marks)
    members = [member for _, member in layout.members]
    compared = tuple(index for index, _ in layout.members)
    coefficients, presence = _weights.weights(members, stages.index)
    coverage = _weights.coverage_term(layout.counts, stages.index)
    error = layout.error
    constant = torch.tensor([*presence, _digests.signed(coverage), int(error is not None)])
    device = request.device
    return ReplicaPlan(
        held=held,
        stages=stages,
        stage=layout.stage,
        groups=layout.groups,
        compared=compared,
        digests=_digests.plan([request.local[i] for i in compared], device),
        coefficients=coefficients.to(device),
        constant=constant.to(device),
        device=device,
        error=error,
    )


def _layout(
    request: Request,
    held: tuple[Holding, ...],
    stages: Stages,
    marks: tuple[frozenset[int] | None, ...],
) -> _Layout:
    """Each tensor's group of copies, the tensors compared, the self-check's counts, and why the
    layout cannot be compared (then no tensor has a group), or None."""
    stage = _stage_ranks(stages, request.pp_group, request.device)
    entries = request.entries
    counts = tuple(
        (entry.name, _ownership.coverage(h, stages))
        for entry, h in zip(entries, held, strict=True)
        if entry.kind != "state"
    )
    errors = (_ownership.layout_error(h, stages, d) for h, d in zip(held, marks, strict=True))
    error = request.invalid or next((e for e in errors if e is not None), None)
    if error is not None:
        return _Layout(stage, (None,) * len(held), (), counts, error)
    groups = tuple(
        _copy_groups.copy_group(h, min(stage), d, _ownership.copies(h, stages, d))
        for h, d in zip(held, marks, strict=True)
    )
    members = []
    for i, (h, group) in enumerate(zip(held, groups, strict=True)):
        if group is None or group.size < 2 or h.partial_dims:
            continue
        universe = _copy_groups.universe(group, h, stage)
        if not group.share <= universe:  # its share cannot be weighed
            error = (
                f"{entries[i].name} ({h.description}): its distinct_along group holds ranks of "
                f"other pipeline stages (ranks {sorted(group.share)}; this stage: ranks "
                f"{sorted(stage)})"
            )
            return _Layout(stage, (None,) * len(held), (), counts, error)
        member = Member(
            entries[i].name, group.key, group.size, group.is_reference, group.share, universe
        )
        members.append((i, member))
    return _Layout(stage, groups, tuple(members), counts, None)


# The ranks of this rank's stage, learned once per pipeline group.
_stage_by_pp_group: ScopedCache[ProcessGroup, frozenset[int]] = ScopedCache(64)


def _stage_ranks(
    stages: Stages, pp_group: ProcessGroup | None, device: torch.device
) -> frozenset[int]:
    """The ranks of this rank's pipeline stage: the world within a single stage; under pipeline
    stages one all_reduce of a world-size vector (each rank writes its stage), once per pp_group.
    """
    if pp_group is None:
        return frozenset(range(dist.get_world_size()))
    ranks = _stage_by_pp_group.get(pp_group)
    if ranks is None:
        stage_of = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
        stage_of[dist.get_rank()].fill_(stages.index + 1)  # 0: a rank not heard from
        dist.all_reduce(stage_of, op=dist.ReduceOp.SUM)
        mine = stages.index + 1
        # This rank is of its stage whatever the backend moved (the fake backend moves nothing).
        ranks = frozenset(r for r, s in enumerate(stage_of.tolist()) if s == mine)
        ranks |= {dist.get_rank()}
        _stage_by_pp_group.put(pp_group, ranks)
    return ranks
