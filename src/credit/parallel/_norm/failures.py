"""The norm's failures that every rank raises the same way, from what every rank holds.

A layout's proof, or a later call's comparison of copies, finds out that something failed on some
rank; every rank then gathers every rank's view (one ``all_gather_object``, on the failure path
only) and raises the same error, naming the gradient, the ranks and the likely fix:

- :func:`raise_layout_failure`: a layout that cannot be reduced, or shards that do not add up to
  whole gradients;
- :func:`raise_copies_differ`: ranks taken for copies of a shard that hold different values,
  described from each copy's fingerprint (``copies.fingerprints``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from credit.parallel._common.holdings import Holding
from credit.parallel._common.stages import Stages
from credit.parallel._norm import copies as _copies
from credit.parallel._norm.plan import NormPlan


def raise_copies_differ(
    plan: NormPlan, local: list[Tensor], what: str, label: Callable[[int], str]
) -> None:
    """Describe the copies that differ and raise the same ValueError on every rank; every rank
    must call it together (it gathers each rank's fingerprints)."""
    compared = sorted(plan.copies.compared + plan.groups.compared)
    _raise_mismatch(
        _records(plan.copies, compared, plan.holdings, local, plan.stages.index, label),
        plan.stages.index,
        len(plan.holdings),
        what,
    )


def raise_groups_misfit(plan: NormPlan, misfit: Tensor, what: str) -> None:
    """Name the gradients whose process groups, taken for their copies from the meshes' rank
    maps, hold other shards (``misfit``, per row of ``plan.groups``), and raise the same
    RuntimeError on every rank; every rank must call it together (it gathers each rank's)."""
    rows = misfit.tolist()
    mine = [i for i, bad in zip(plan.groups.compared, rows, strict=True) if bad]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (dist.get_rank(), mine))
    rank, indices = next((rank, found) for rank, found in everyone if found)
    held = plan.holdings[indices[0]]
    raise RuntimeError(
        f"{what}: gradient {indices[0]} ({held.description}) is held, on rank {rank}, by "
        "process groups of its meshes that the rank maps take for its copies, yet their ranks "
        "hold other shards of it (or count other than its copies). Build the meshes of one "
        "model as slices of one DeviceMesh (init_device_mesh, then mesh['dp'], mesh['tp']), "
        "with the same rank order on every rank. No gradient was modified."
    )


def raise_layout_failure(plan: NormPlan, what: str) -> None:
    """Gather every rank's view of the layout and raise the same error on every rank."""
    stages = plan.stages
    mine = (
        stages.index,
        stages.is_reference,
        plan.error,
        [(h.description, len(h.mesh_ranks), h.replicas, h.global_numel) for h in plan.holdings],
        plan.coverage,
    )
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for rank, (_, _, error, _, _) in enumerate(everyone):
        if error is not None:
            raise ValueError(f"{what}: {error} (rank {rank}). No gradient was modified.")
    raise RuntimeError(_describe_missing_copies(everyone, stages, what))


def _describe_missing_copies(everyone: list, stages: Stages, what: str) -> str:
    for stage in range(stages.count):
        ranks = [view for view in everyone if view[0] == stage]
        reference = next((view for view in ranks if view[1]), ranks[0] if ranks else None)
        if reference is None:
            continue
        for index, (description, mesh_size, replicas, numel) in enumerate(reference[3]):
            held = sum(
                view[4][index] + (stages.size * replicas * numel if view[1] else 0)
                for view in ranks
                if index < len(view[4])
            )
            expected = stages.size * replicas * numel
            if held != expected:
                return (
                    f"{what}: cannot count gradient {index} ({description}) exactly once: "
                    f"its mesh has {mesh_size} ranks, so the {stages.size} ranks of "
                    f"{'stage ' + str(stage) if stages.count > 1 else 'the world'} should hold "
                    f"{stages.size // max(mesh_size, 1)} copies of it, but they hold "
                    f"{held / (mesh_size * replicas * numel) if numel else 0:g}. Every rank "
                    "of a stage must hold every gradient of the stage, each on its own copy of "
                    "the mesh; pass pipeline stages as pp_group. No gradient was modified."
                )
    return (
        f"{what}: the ranks' gradients do not add up to whole copies of each gradient. "
        "No gradient was modified."
    )


@dataclass(frozen=True)
class GradientRecord:
    """What one rank holds of one compared gradient, gathered only to describe a mismatch."""

    stage: int
    index: int
    key: tuple[int, ...]
    is_reference: bool
    fingerprint: tuple[float, ...]
    tolerance: float
    label: str


def _records(
    plan: _copies.Comparison,
    compared: list[int],
    held: list[Holding],
    local: list[Tensor],
    stage: int,
    label: Callable[[int], str],
) -> list[GradientRecord]:
    """This rank's :class:`GradientRecord` of every compared gradient."""
    prints = _copies.fingerprints([local[i] for i in compared], torch.device("cpu")).tolist()
    found = []
    for index, fingerprint in zip(compared, prints, strict=True):
        group = plan.groups[index]
        assert group is not None
        found.append(
            GradientRecord(
                stage=stage,
                index=index,
                key=group.key,
                is_reference=group.is_reference,
                fingerprint=tuple(fingerprint),
                tolerance=_copies.tolerance(held[index].dtype),
                label=f"{label(index)} ({held[index].description})",
            )
        )
    return found


def _raise_mismatch(mine: list[GradientRecord], stage: int, gradients: int, what: str) -> None:
    """Gather every rank's records and raise the same ValueError on every rank.

    Args:
        mine: this rank's records.
        stage: this rank's pipeline stage (0 without stages).
        gradients: how many gradients this rank passed, compared or not.
        what: the public function, for the message.
    """
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (dist.get_rank(), mine, stage, gradients))
    records = {rank: found for rank, found, _, _ in everyone}
    per_stage = {stage: count for _, _, stage, count in everyone}
    raise ValueError(_describe(records, sum(per_stage.values()), what))


@dataclass(frozen=True)
class _Difference:
    gradient: tuple[int, int]  # (stage, index)
    label: str
    reference: int  # the rank whose copy the others are compared with
    rank: int
    relative: float


def _describe(everyone: dict[int, list[GradientRecord]], total: int, what: str) -> str:
    """The message for copies that differ, the same on every rank.

    Args:
        everyone: every rank's records.
        total: how many gradients the stages hold, compared or not.
        what: the public function, for the message.
    """
    groups: dict[tuple, list[tuple[int, GradientRecord]]] = {}
    for rank in sorted(everyone):
        for record in everyone[rank]:
            groups.setdefault((record.stage, record.index, record.key), []).append((rank, record))
    differences = []
    for members in groups.values():
        reference_rank, reference = next(
            ((rank, r) for rank, r in members if r.is_reference), members[0]
        )
        for rank, record in members:
            relative = _relative_difference(record, reference)
            if relative > record.tolerance:
                gradient = (record.stage, record.index)
                differences.append(
                    _Difference(gradient, reference.label, reference_rank, rank, relative)
                )
    compared = {(stage, index) for stage, index, _ in groups}
    if not differences:
        return (
            f"{what}: gradients that the rank maps take for copies of each other hold values that "
            "differ by about the tolerance of the comparison; averaged, they would give a wrong "
            f"norm. {_likely_fix(differs_everywhere=False, largest=0.0)} No gradient was modified."
        )
    named = min(d.gradient for d in differences)
    pairs = sorted((d.rank, d.reference) for d in differences if d.gradient == named)
    shown = ", ".join(f"rank {rank} differs from rank {reference}" for rank, reference in pairs[:4])
    label = next(d.label for d in differences if d.gradient == named)
    largest = max(d.relative for d in differences if d.gradient == named)
    differing = {d.gradient for d in differences}
    return (
        f"{what}: {label} holds different values on ranks that the rank maps take for copies "
        f"of each other: {shown}{', ...' if len(pairs) > 4 else ''} (relative difference up to "
        f"{largest:.2g}). The norm would average them into a wrong number. {len(differing)} of "
        f"the {len(compared)} gradients with copies differ ({total} gradients in all). "
        f"{_likely_fix(len(differing) == total, max(d.relative for d in differences))} "
        "No gradient was modified."
    )


def _relative_difference(record: GradientRecord, reference: GradientRecord) -> float:
    norm = max(record.fingerprint[0], reference.fingerprint[0], math.ulp(0.0))
    return (
        max(abs(a - b) for a, b in zip(record.fingerprint, reference.fingerprint, strict=True))
        / norm
    )


# Below this relative difference, copies look like replicas that drifted apart.
_DRIFT = 2.0**-6

_AVERAGE = (
    "if they are replicas not averaged yet (a missing sync_domain_gradients or "
    "sync_replicated_gradients) or drifted apart, average them first (allreduce_grads_avg over "
    "the ranks that hold them)"
)
_LOCAL = (
    "if they are rank-local parameters, such as experts held per expert-parallel rank, declare "
    "them: distinct_along=[(expert_params, ep_group)]"
)
_STAGES = "if the ranks hold different pipeline stages, pass pp_group"
_INDEPENDENT = "if they train models of their own, pass per_rank=True for each rank's own norm"


def _likely_fix(differs_everywhere: bool, largest: float) -> str:
    """The fixes in the order of their likelihood, judged from what differs and by how much."""
    if 0.0 < largest < _DRIFT:
        fixes = [_AVERAGE, _LOCAL, _STAGES, _INDEPENDENT]
    elif differs_everywhere:
        fixes = [_STAGES, _INDEPENDENT, _AVERAGE, _LOCAL]
    else:
        fixes = [_LOCAL, _AVERAGE, _STAGES, _INDEPENDENT]
    first, *others = fixes
    return f"Likely fix: {first}. Otherwise: {'; '.join(others)}."
