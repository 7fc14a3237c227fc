"""Proof by value that the ranks the rank maps call copies of a shard hold the same values.

The norm weights each shard by one over its number of copies, read from rank maps
(``_ownership``). A rank map cannot tell a replica from a rank that holds other values in the same
place: experts kept per expert-parallel rank, pipeline stages passed without ``pp_group``, ranks
that train independent models. Averaged as copies, their values would give a wrong norm, the
same on every rank. So the first call for a layout (and every call in check mode) compares the
copies by value, in the all_reduce that verifies the layout; every later call compares them
again with the local norms alone as fingerprints (:func:`terms_of`), in the norm's own
all_reduce, since the tensors of a later call may be others of the same shapes.

Each rank takes a fingerprint of each local shard ``x`` (in float64): its L2 norm and
``_PROJECTIONS`` random projections on +-1 patterns. Copies with the same values have the same
fingerprints. Shards whose values differ by ``d`` (in L2) have projections that differ by about
``d`` each, whatever their norms: a random projection keeps distances.

Within a stage each group of ``c`` copies has a slot of its own (``_ownership.copy_slot``), where
each member adds ``f`` and ``f**2`` per fingerprint column (the plan keeps each slot's ``c`` and
``tau``). From the sums, every rank computes the spread ``sqrt(sum (f - mean f)**2) =
sqrt(S2 - S1**2 / c)`` of each column and compares it with ``tau`` times the copies' mean norm
(:func:`_grouped_differ`). One copy that differs from the others by ``e`` has spread
``e * sqrt((c - 1) / c)``: it is caught whenever ``e > sqrt(2) * tau * mean norm``, whichever
copy it is and however many copies there are.

Under pipeline stages a rank cannot see the other stages' groups, so each stage has one slot,
pooled over its groups: the member ``i`` of a group sends ``rho * (ref_i - 1 / c) * (f_i,
f_i**2)``, ``ref_i`` being 1 on the group's reference (``_ownership.copy_group``) and 0 elsewhere,
so the group adds ``rho * (f_ref - mean f, f_ref**2 - mean f**2)``, zero exactly when every copy
equals the reference; ``rho``, a pseudo-random weight in [1, 2) per group, keeps groups from
cancelling out. A looser test: its bound grows with ``c``.

Tolerance ``tau = max(2**-16, 8 eps)`` of the gradient's dtype (float32 and float64: 1.5e-5;
float16: 7.8e-3; bfloat16: 6.3e-2). Copies reduced by an all_reduce are bit-identical; copies
computed apart differ by a few roundings of the reduce dtype (measured in
``tests/test_copies_bound.py``: at most 2 eps, a margin of 3.5x to 75x); ranks that hold other
values differ by about the size of the values, 1.4 times the norm for independent draws.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from credit.parallel._compat import foreach_norm
from credit.parallel._foreach import group_indices_by_device_and_dtype
from credit.parallel._ownership import CopyGroup, Holding

_PERIOD = 1021  # the patterns repeat with this prime period, which no tensor dim is likely to share
_PROJECTIONS = 4
_COLUMNS = 1 + _PROJECTIONS  # the norm and the projections
_TOLERANCE = 2.0**-16
_ROUNDINGS = 8
# The float64 sums of c addends err by at most about 3 c 2**-53 of the sum of squares (see
# _grouped_differ); this allowance covers it.
_SUMMATION = 2.0**-51


@dataclass(frozen=True)
class Slots:
    """Where the gradients' sums go: a slot per group of copies within a stage, or one slot per
    pipeline stage, pooled over its groups.

    Attributes:
        of: the slot of each gradient (this rank's group's, or its stage's).
        count: the number of slots, the same on every rank.
        limits: per slot, the number of copies of its group and their tolerance; None where the
            slots are pooled (each group's tolerance then travels in the sums).
    """

    of: list[int]
    count: int
    limits: list[tuple[float, float]] | None = None

    @property
    def pooled(self) -> bool:
        return self.limits is None


@dataclass(frozen=True)
class Plan:
    """How this rank's gradients enter the comparison of copies, fixed per layout.

    Attributes:
        groups: each gradient's copy group on this rank (None where it holds nothing).
        compared: the gradients with copies (groups larger than one), the only ones fingerprinted.
        slot_count: how many slots of sums, the same on every rank.
        pooled: whether a slot pools the groups of many gradients (see :class:`Slots`).
        factors: per compared gradient, ``rho * (ref - 1 / c)`` and ``rho * (ref + 1 / c) * tau``
            where the slots are pooled (shape (len(compared), 2)), float64 on the device; empty
            otherwise.
        limits: per slot, its copies and their tolerance (shape (slot_count, 2)), float64 on the
            device; empty where the slots are pooled.
        slots: per compared gradient, the slot it adds into, an index tensor on the device.
        positions: per compared gradient, the place of its norm among the call's stacked norms,
            an index tensor on the device (for the comparison of every call).
    """

    groups: list[CopyGroup | None]
    compared: list[int]
    slot_count: int
    pooled: bool
    factors: Tensor
    limits: Tensor
    slots: Tensor
    positions: Tensor


def plan(
    held: list[Holding],
    groups: list[CopyGroup | None],
    slots: Slots,
    position_of: list[int],
    device: torch.device,
) -> Plan:
    """The :class:`Plan` of one layout, its constants on ``device`` in one host-to-device copy.

    Args:
        held: what this rank holds of each gradient.
        groups: each gradient's copy group on this rank.
        slots: where each gradient's sums go.
        position_of: the place of each gradient's norm among the stacked norms of a call.
        device: where the comparison's tensors live.
    """
    compared = [i for i, group in enumerate(groups) if group is not None and group.size > 1]
    rows = []
    for index in compared:
        group = groups[index]
        assert group is not None
        factors = []
        if slots.pooled:
            rho = _pseudo_random(index, *group.key)
            ref = 1.0 if group.is_reference else 0.0
            tau = tolerance(held[index].dtype)
            factors = [rho * (ref - 1.0 / group.size), rho * (ref + 1.0 / group.size) * tau]
        rows.append([*factors, float(slots.of[index]), float(position_of[index])])
    width = 4 if slots.pooled else 2
    limits = slots.limits or []
    flat = [value for row in rows for value in row] + [value for pair in limits for value in pair]
    packed = torch.zeros(0, dtype=torch.float64, device=device)
    if flat:  # one copy, where some gradient has copies
        packed = torch.tensor(flat, dtype=torch.float64, device=device)
    constants, on_device = packed.split([len(rows) * width, 2 * len(limits)])
    constants = constants.view(len(rows), width)
    return Plan(
        groups=groups,
        compared=compared,
        slot_count=slots.count,
        pooled=slots.pooled,
        factors=constants[:, : width - 2],
        limits=on_device.view(len(limits), 2),
        slots=constants[:, width - 2].long(),
        positions=constants[:, width - 1].long(),
    )


def tolerance(dtype: torch.dtype) -> float:
    """``tau``: how far copies may differ, relative to the shard's norm (see the module docstring)."""
    return max(_TOLERANCE, _ROUNDINGS * torch.finfo(dtype).eps)


def _pseudo_random(*key: int) -> float:
    """A number in [1, 2) that depends on ``key`` only, the same in every process."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return 1.0 + int.from_bytes(digest, "little") / 2.0**64


def fingerprints(tensors: list[Tensor], device: torch.device) -> Tensor:
    """Each tensor's L2 norm and projections, in float64 on ``device``: shape (len, _COLUMNS)."""
    if not tensors:
        return torch.zeros(0, _COLUMNS, dtype=torch.float64, device=device)
    flats = [(torch.view_as_real(t) if t.is_complex() else t).reshape(-1) for t in tensors]
    # Each row is put in its place on the host (a list), not through an index tensor.
    norms: list[Tensor] = [torch.empty(0)] * len(flats)
    for indices in group_indices_by_device_and_dtype(flats).values():
        found = foreach_norm([flats[i] for i in indices], 2.0, torch.float64)
        for index, norm in zip(indices, found, strict=True):
            norms[index] = norm.to(device)
    projections: list[Tensor] = [torch.empty(0)] * len(flats)
    # Shorter than a period: the projections are the products with the patterns' first rows, for
    # all such tensors of a device in one padded product.
    short: dict[torch.device, list[int]] = {}
    for index, flat in enumerate(flats):
        if flat.numel() <= _PERIOD:
            short.setdefault(flat.device, []).append(index)
        else:
            projections[index] = _long_projections(flat).to(device)
    for where, indices in short.items():
        padded = pad_sequence([flats[i] for i in indices], batch_first=True)
        products = padded.to(torch.float64) @ _patterns(where)[: padded.shape[1]]
        for index, row in zip(indices, products.to(device).unbind(0), strict=True):
            projections[index] = row
    return torch.cat([torch.stack(norms)[:, None], torch.stack(projections)], dim=1)


def _long_projections(flat: Tensor) -> Tensor:
    """The projections of a tensor longer than a period: its elements at positions congruent
    modulo ``_PERIOD`` are summed first."""
    patterns = _patterns(flat.device)
    whole = flat.numel() - flat.numel() % _PERIOD
    sums = flat[:whole].view(-1, _PERIOD).sum(0, dtype=torch.float64)
    tail = flat[whole:].to(torch.float64)
    return sums @ patterns + tail @ patterns[: tail.numel()]


@functools.cache
def _patterns(device: torch.device) -> Tensor:
    """The +-1 patterns, one per column, the same in every process."""
    generator = torch.Generator().manual_seed(0x5EED)
    signs = torch.randint(0, 2, (_PERIOD, _PROJECTIONS), generator=generator)
    return (2 * signs - 1).to(torch.float64).to(device)


def width(plan: Plan, columns: int) -> int:
    """How many sums a slot holds for fingerprints of ``columns`` columns."""
    return 4 * columns if plan.pooled else 2 * columns


def terms(plan: Plan, local: list[Tensor], device: torch.device) -> tuple[Tensor, Tensor]:
    """This rank's addends of the first call's comparison (full fingerprints), shape
    (slot_count, width), and whether a fingerprint was not finite (1.0, else 0.0; then the
    addends are zeros: NaN and inf cannot be compared), both float64 on ``device``. Nothing is
    read on the host.
    """
    if not plan.compared:
        summed = torch.zeros(
            plan.slot_count, width(plan, _COLUMNS), dtype=torch.float64, device=device
        )
        return summed, torch.zeros((), dtype=torch.float64, device=device)
    prints = fingerprints([local[i] for i in plan.compared], device)
    nonfinite = ~torch.isfinite(prints).all()
    summed = terms_of(plan, torch.where(nonfinite, 0.0, prints))
    return summed, nonfinite.to(torch.float64)


def terms_of(plan: Plan, prints: Tensor) -> Tensor:
    """This rank's addends of the comparison of fingerprints ``prints`` (one row per compared
    gradient, in float64: full fingerprints, or the local norms alone), shape (slot_count,
    width). A NaN or inf fingerprint makes its slot's sums NaN or inf.

    A slot per group of copies sums, over its members, each column ``f`` and ``f**2`` (see
    :func:`differ`). Pooled slots sum ``coefficient * f``, ``coefficient * f**2`` and their
    tolerances, ``scale * (|x| + |f|)`` and ``scale * (|x| + |f|)**2``, ``|x|`` being the norm
    (the first column): the difference between each group's reference and its mean.
    """
    columns = prints.shape[1]
    summed = torch.zeros(
        plan.slot_count, width(plan, columns), dtype=torch.float64, device=prints.device
    )
    if not plan.compared:
        return summed
    if plan.pooled:
        coefficients, scales = plan.factors[:, :1], plan.factors[:, 1:]
        bound = prints[:, :1] + prints.abs()
        addends = [
            coefficients * prints,
            coefficients * prints**2,
            scales * bound,
            scales * bound**2,
        ]
    else:
        addends = [prints, prints**2]
    return summed.index_add_(0, plan.slots, torch.cat(addends, dim=1))


def differ(summed: Tensor, limits: Tensor | None) -> Tensor:
    """Whether any slot of :func:`terms_of`, reduced over the world, holds copies that differ
    beyond the tolerance (a NaN too): a boolean scalar beside the sums, not read on the host.

    Args:
        summed: the reduced sums.
        limits: each slot's copies and tolerance (:attr:`Plan.limits`); None for pooled slots.
    """
    if limits is None:
        first, second, first_bound, second_bound = summed.split(summed.shape[1] // 4, dim=1)
        within = (first.abs() <= first_bound).all() & (second.abs() <= second_bound).all()
        return ~within
    return _grouped_differ(summed, limits)


def _grouped_differ(summed: Tensor, limits: Tensor) -> Tensor:
    """The test of a slot per group of ``c`` copies, column by column: the spread of the copies'
    fingerprints about their mean, ``sqrt(sum (f - mean f)**2) = sqrt(S2 - S1**2 / c)``, must not
    exceed ``tau`` times the copies' mean norm. Beside it, the float64 rounding of the sums: ``S1``
    errs by at most ``(c - 1) 2**-53 sum |f| <= (c - 1) 2**-53 sqrt(c S2)``, so ``S1**2 / c`` by
    about ``2 (c - 1) 2**-53 S2``, ``S2`` by ``(c - 1) 2**-53 S2``: ``c 2**-51 S2`` covers both.
    """
    first, second = summed.split(summed.shape[1] // 2, dim=1)
    copies, tau = limits[:, :1], limits[:, 1:]
    mean = first / copies
    spread = second - first * mean  # the sum of squared deviations from the mean
    allowed = (tau * mean[:, :1]) ** 2 + copies * _SUMMATION * second
    return ~(spread <= allowed).all()
