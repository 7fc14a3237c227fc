"""Replicas that stay replicas: prove every copy of every parameter, buffer and optimizer state
bit-identical, on any mix of meshes, in one small collective, and repair the copies that differ.

Legitimate replicas (DDP, HSDP's replicate dim, TP-replicated norms, domain peers) are
bit-identical after every optimizer step. They drift apart through a scaler that decides per mesh,
a rank restored from the wrong checkpoint shard, a nondeterministic kernel or silent data
corruption, and from then on every step is wrong on some ranks while the loss says nothing.

Which ranks hold copies of what is read from the rank maps, as the norm reads them
(``_ownership``): a DTensor's placements on its mesh, plain tensors as copies over the stage, and
what ``distinct_along`` declares rank-local. Each rank digests the local tensors that have copies
elsewhere (``_digests``: four 64-bit lanes of their raw bits, on their device). In every group of
copies one is the reference (the copy the rank maps place in the stage's lowest rank's mesh copy,
at coordinate 0 of its Replicate dims); it sends ``w (c - 1) D`` and the other ``c - 1`` members
``-w D``, ``w`` an odd pseudo-random weight of the group, so the group's sum is ``w`` times the
sum of the members' differences from the reference: zero when every copy has the reference's
bits. One all_reduce of six int64 numbers (those sums, the layout's self-check, an error count)
proves every copy of every tensor at once. Only a failure gathers what each rank holds, to name
the tensors and ranks, or to repair them in one more all_reduce.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from credit.parallel import _digests, _inputs, _ownership, _replica_failures
from credit.parallel._compat import local_tensor
from credit.parallel._groups import (
    GroupLike,
    collective_device,
    group_size,
    is_distributed,
    moves_data,
    resolve_group,
)
from credit.parallel._ownership import CopyGroup, Holding, Stages
from credit.parallel._replica_failures import WHAT, Mismatch

__all__ = ["Mismatch", "ReplicaMismatchError", "ReplicaReport", "verify_replicas"]

logger = logging.getLogger(__name__)

# Layouts whose plans are kept (a trainer checks one model, or a few).
_MAX_PLANS = 16


class ReplicaMismatchError(RuntimeError):
    """Copies of parameters, buffers or optimizer state differ: raised on every rank alike.

    Attributes:
        mismatches: every tensor whose copies differ, with the ranks.
    """

    def __init__(self, message: str, mismatches: tuple[Mismatch, ...]) -> None:
        super().__init__(message)
        self.mismatches = mismatches


@dataclass(frozen=True)
class ReplicaReport:
    """What :func:`verify_replicas` looked at on this rank, and what it repaired.

    Attributes:
        tensors: parameters, buffers and optimizer state tensors of this rank's stage.
        compared: those with copies on other ranks, whose bits were proven equal.
        compared_bytes: the bytes of this rank's copies that were read.
        buffers: whether buffers were checked.
        repaired: the tensors whose copies differed and now hold the reference's bits (empty
            when every copy agreed), the same on every rank.
    """

    tensors: int
    compared: int
    compared_bytes: int
    buffers: bool
    repaired: tuple[Mismatch, ...] = ()


@torch.no_grad()
def verify_replicas(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    distinct_along: _inputs.DistinctAlong | None = None,
    pp_group: GroupLike = None,
    buffers: bool | None = None,
    repair: bool = False,
) -> ReplicaReport:
    """Prove that every copy of every parameter, buffer and optimizer state holds the same bits.

    Copies are found as the norm finds them: DTensors by their placements on their meshes (FSDP2,
    HSDP's replicate dim, TP, any mix, meshes built any way), plain tensors as copies over the
    world, or over the pipeline stage with ``pp_group``, unless ``distinct_along`` declares them
    rank-local. Optimizer state follows its parameter's layout; a plain state of a DTensor
    parameter (AdamW's 0-dim ``step``) is a copy on every rank that holds the parameter. The
    comparison is bit-exact: one flipped bit in any element of any copy, or two elements swapped
    (elements of at most 4 bytes), is detected with certainty; any other difference escapes with
    a probability of about 2^-48 (see the guide).

    Costs one all_reduce of six int64 numbers and about two passes over the local tensors that
    have copies (sharded tensors without copies are not read), on their device, with one host
    sync for the verdict; under ``pp_group`` the first call also learns the stage's lowest rank
    (one more small all_reduce, once). Call it on every rank, between optimizer steps.

    Args:
        model: the model (FSDP2, DDP, TP or plain); its parameters and buffers are checked.
        optimizer: its state tensors are checked too (exp_avg, exp_avg_sq, step, ...).
        distinct_along: ``(tensors, group)`` pairs declaring parameters (or buffers) whose copies
            differ along ``group``, as for :func:`~credit.parallel.collectives.total_grad_norm`:
            experts held per expert-parallel rank. Their state follows them.
        pp_group: ProcessGroup or 1D DeviceMesh of this rank's pipeline peers (one rank per
            stage): copies are then sought within each stage.
        buffers: check the buffers. Default: yes, unless ``model`` is a DistributedDataParallel
            that broadcasts them at every forward (``broadcast_buffers=True``), whose running
            statistics legitimately differ across ranks between forwards.
        repair: instead of raising, copy over the copies that differ the copy a strict majority
            of their group holds, or else the reference copy (of two copies, nothing tells which
            is right); one more all_reduce, of those tensors only. The report lists them.

    Returns:
        A :class:`ReplicaReport`; its ``repaired`` is empty unless ``repair`` found differences.

    Raises:
        TypeError: ``model`` is not a module, or ``optimizer`` not an optimizer.
        ValueError: a tensor is sparse or on the meta device, or a mesh, ``pp_group`` or
            ``distinct_along`` group does not fit the others (raised on every rank).
        ReplicaMismatchError: copies differ (and ``repair`` is off), raised on every rank with
            the same message, naming each differing tensor and its ranks. Nothing is modified.
        RuntimeError: the ranks of a stage hold different tensors, or a tensor's copies do not
            add up to whole copies on every rank (raised on every rank).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    with_buffers = buffers if buffers is not None else not _broadcasts_buffers(model)
    entries = _entries(model, optimizer, with_buffers)
    tensors = [tensor for _, tensor, _ in entries]
    if not is_distributed() or dist.get_world_size() == 1:
        return ReplicaReport(len(entries), 0, 0, with_buffers)
    process_group = resolve_group(pp_group, "pp_group")
    pp = process_group if group_size(process_group) > 1 else None
    owners = [owner for _, _, owner in entries]
    distinct = _inputs.distinct_groups(distinct_along, owners)
    plan = _plan(entries, distinct, pp)
    local = [local_tensor(tensor) for tensor in tensors]
    compared = [local[i] for i in plan.compared]
    device = collective_device(local[:1])
    vector = torch.zeros(_digests.LANES + 2, dtype=torch.int64, device=device)
    prints = _digests.digests(compared).to(device)
    if compared:
        weights = torch.tensor(plan.coefficients, dtype=torch.int64, device=device)
        vector[: _digests.LANES] = (weights[:, None] * prints).sum(0)
    vector[_digests.LANES] = plan.coverage
    vector[_digests.LANES + 1] = plan.error is not None
    dist.all_reduce(vector, op=dist.ReduceOp.SUM)
    compared_bytes = sum(t.numel() * t.element_size() for t in compared)
    report = ReplicaReport(len(entries), len(compared), compared_bytes, with_buffers)
    if not bool(vector.any()) or not moves_data():  # the verdict: the one host sync
        return report
    names = [name for name, _, _ in entries]
    slots, total = _replica_failures.diagnose(
        _replica_failures.Held(names, local, plan.held, plan.groups, plan.at),
        dict(zip(plan.compared, prints.tolist(), strict=True)),
        plan.error,
    )
    mismatches = tuple(slot.mismatch for slot in slots)
    if not repair:
        buffer_names = {name for name, _ in model.named_buffers()} if with_buffers else set()
        message = _replica_failures.describe(mismatches, total, buffer_names)
        raise ReplicaMismatchError(message, mismatches)
    _replica_failures.repair(slots, local, plan.at.index, device)
    if dist.get_rank() == 0:
        logger.warning("%s repaired %s", WHAT, _replica_failures.listed(mismatches))
    return ReplicaReport(len(entries), len(compared), compared_bytes, with_buffers, mismatches)


# ---------------------------------------------------------------------------------------------
# what is checked


def _broadcasts_buffers(model: nn.Module) -> bool:
    return isinstance(model, DistributedDataParallel) and bool(model.broadcast_buffers)


def _entries(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, with_buffers: bool
) -> list[tuple[str, Tensor, Tensor]]:
    """``(name, tensor, owner)`` of every parameter, buffer and optimizer state tensor, in an
    order every rank of a stage shares; the owner is the parameter a state belongs to (itself
    for parameters and buffers), which ``distinct_along`` names.

    Raises:
        ValueError: a tensor is sparse or on the meta device.
    """
    named = list(model.named_parameters())
    entries: list[tuple[str, Tensor, Tensor]] = [(name, param, param) for name, param in named]
    if with_buffers:
        entries += [(name, buffer, buffer) for name, buffer in model.named_buffers()]
    if optimizer is not None:
        names = {id(param): name for name, param in named}
        for group_index, group in enumerate(optimizer.param_groups):
            for index, param in enumerate(group["params"]):
                state = optimizer.state.get(param, {})
                owner = names.get(id(param), f"param_groups[{group_index}][{index}]")
                for key in sorted(state, key=str):
                    if isinstance(state[key], Tensor):
                        entries.append((f"{key} of {owner}", state[key], param))
    for name, tensor, _ in entries:
        local = local_tensor(tensor)
        if local.layout != torch.strided or local.is_meta:
            where = "on the meta device" if local.is_meta else f"of layout {local.layout}"
            raise ValueError(f"{WHAT}: {name} is {where}; only dense tensors with data")
    return entries


# ---------------------------------------------------------------------------------------------
# the plan of one layout, kept between calls


@dataclass(eq=False)
class _Plan:
    """How this rank's tensors enter the comparison, computed on a layout's first call.

    ``held`` keeps the Holding objects alive, so the ids in the cache key stay theirs.
    """

    held: list[Holding]
    at: Stages
    groups: list[CopyGroup | None]
    compared: list[int]  # the tensors with copies (groups larger than one)
    coefficients: list[int]  # per compared tensor: w (c - 1) on the reference, -w elsewhere
    coverage: int  # the self-check's term, weighted; the stage's terms sum to zero
    error: str | None


_plans: OrderedDict[tuple, _Plan] = OrderedDict()


def _plan(
    entries: list[tuple[str, Tensor, Tensor]],
    distinct: list[frozenset[int] | None] | None,
    pp_group: ProcessGroup | None,
) -> _Plan:
    held = [_ownership.holding(tensor) for _, tensor, _ in entries]
    at = _ownership.stages_of(pp_group)
    marks = distinct if distinct is not None else [None] * len(entries)
    names = tuple(name for name, _, _ in entries)
    key = (tuple(map(id, held)), at, tuple(marks), names)
    found = _plans.get(key)
    if found is not None:
        _plans.move_to_end(key)
        return found
    device = collective_device([local_tensor(entries[0][1])] if entries else [])
    lowest = _ownership.lowest_rank_of_stage(at, pp_group, device)
    errors = (_ownership.layout_error(h, at, d) for h, d in zip(held, marks, strict=True))
    error = next((e for e in errors if e is not None), None)
    groups = [
        None if error is not None else _ownership.copy_group(h, at, lowest, d)
        for h, d in zip(held, marks, strict=True)
    ]
    compared = [i for i, group in enumerate(groups) if group is not None and group.size > 1]
    coefficients = []
    for index in compared:
        group = groups[index]
        assert group is not None
        weight = _digests.odd_weight("copies", at.index, index, *group.key)
        coefficients.append(_wrap(weight * (group.size - 1 if group.is_reference else -1)))
    coverage = sum(
        _wrap(_digests.odd_weight("coverage", at.index, i) * _ownership.coverage(h, at))
        for i, h in enumerate(held)
    )
    plan = _Plan(
        held=held,
        at=at,
        groups=groups,
        compared=compared,
        coefficients=coefficients,
        coverage=_wrap(coverage),
        error=error,
    )
    _plans[key] = plan
    if len(_plans) > _MAX_PLANS:
        _plans.popitem(last=False)
    return plan


def _wrap(value: int) -> int:
    """``value`` mod 2^64, as the int64 with the same bits."""
    value %= 1 << 64
    return value - (1 << 64) if value >= 1 << 63 else value
