"""Proof by value that the ranks the rank maps call copies of a shard hold the same values.

The norm weights each shard by one over its number of copies, read from rank maps
(``ownership``). A rank map cannot tell a replica from a rank that holds other values in the same
place: experts kept per expert-parallel rank, pipeline stages passed without ``pp_group``, ranks
that train independent models. Averaged as copies, their values would give a wrong norm, the
same on every rank. So the first call for a layout (and every call in check mode) compares the
copies by value, in the all_reduce that verifies the layout; every later call compares them
again with the local norms alone as fingerprints (:func:`norm_terms`), in the norm's own
all_reduce, since the tensors of a later call may be others of the same shapes.

Each rank takes a fingerprint of each local shard ``x`` (in float64): its L2 norm and
``_PROJECTIONS`` random projections on +-1 patterns. Copies with the same values have the same
fingerprints. Shards whose values differ by ``d`` (in L2) have projections that differ by about
``d`` each, whatever their norms: a random projection keeps distances.

The copies that meet in process groups of their own are compared there (``group_comparison``,
with the same test); the others, a group of ``c`` copies at a time, each in a slot of the world's
all_reduce (``ownership.copy_slot``), where each member adds ``f`` and ``f**2`` per fingerprint
column. From the sums, every rank computes the spread
``sqrt(sum (f - mean f)**2) = sqrt(S2 - S1**2 / c)`` of each column and compares it with ``tau``
times the copies' mean norm (:func:`grouped_differ`). One copy that differs from the others by
``e`` has spread ``e * sqrt((c - 1) / c)``: it is caught whenever ``e > sqrt(2) * tau * mean
norm``, whichever copy it is and however many copies there are.

Within a stage every rank knows each slot's ``c`` and ``tau`` (the plan keeps them). Under
pipeline stages a rank knows its own stage's slots only, so the limits travel in the sums: each
member also adds 1 and its ``tau``, and every rank reads ``c`` and ``tau`` of every slot of every
stage from the reduced vector (a slot no rank wrote is empty and passes). Each stage writes into a
region of its own (``pipeline``); the test is the same, slot by slot.

Tolerance ``tau = max(2**-16, 8 eps)`` of the gradient's dtype (float32 and float64: 1.5e-5;
float16: 7.8e-3; bfloat16: 6.3e-2). Copies reduced by an all_reduce are bit-identical; copies
computed apart differ by a few roundings of the reduce dtype (measured in
``tests/test_copies_bound.py``: at most 2 eps, a margin of 3.5x to 75x); ranks that hold other
values differ by about the size of the values, 1.4 times the norm for independent draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from credit.parallel._common.compat import foreach_norm, group_indices_by_device_and_dtype
from credit.parallel._common.copy_groups import CopyGroup
from credit.parallel._common.scoped import ScopedCache
from credit.parallel._norm.pipeline import Regions

_PERIOD = 1021  # the patterns repeat with this prime period, which no tensor dim is likely to share
_PROJECTIONS = 4
_COLUMNS = 1 + _PROJECTIONS  # the norm and the projections
_TOLERANCE = 2.0**-16
_ROUNDINGS = 8
# The float64 sums of c addends err by at most about 3 c 2**-53 of the sum of squares (see
# grouped_differ); this allowance covers it.
_SUMMATION = 2.0**-51


@dataclass(frozen=True)
class Slots:
    """Where the gradients' sums go within this rank's stage: a slot per group of copies.

    Attributes:
        of: the slot of each gradient (this rank's group's; 0 where it has no slot).
        tau: the tolerance of each gradient's copies (0 where it has no slot).
        per_gradient: per gradient with slots, in slot order: how many slots (groups) it has,
            their number of copies and their tolerance; the same on every rank of the stage.
    """

    of: list[int]
    tau: list[float]
    per_gradient: list[tuple[int, float, float]]

    @property
    def count(self) -> int:
        return sum(groups for groups, _, _ in self.per_gradient)


@dataclass(frozen=True)
class Comparison:
    """How this rank's gradients enter the comparison of copies, fixed per layout.

    Attributes:
        groups: each gradient's copy group on this rank (None where it holds nothing).
        compared: the gradients with copies (groups larger than one), the only ones fingerprinted.
        slot_count: how many slots this rank's stage has.
        limits: per slot, its copies and their tolerance (shape (slot_count, 2)), float64 on the
            device.
        carried: under pipeline stages, what each compared gradient adds to carry its slot's
            limits, 1 and ``tau`` (shape (len(compared), 2)), float64 on the device; None within
            a stage, whose ranks all know the limits.
        slots: per compared gradient, the slot it adds into, an index tensor on the device.
        positions: per compared gradient, the place of its norm among the call's stacked norms,
            an index tensor on the device (for the comparison of every call).
    """

    groups: list[CopyGroup | None]
    compared: list[int]
    slot_count: int
    limits: Tensor
    carried: Tensor | None
    slots: Tensor
    positions: Tensor


def plan(
    groups: list[CopyGroup | None],
    slots: Slots,
    slotted: list[bool],
    position_of: list[int],
    device: torch.device,
    *,
    carry_limits: bool,
) -> Comparison:
    """The :class:`Comparison` of one layout, its constants on ``device`` in one host-to-device copy.

    Args:
        groups: each gradient's copy group on this rank.
        slots: where each gradient's sums go.
        slotted: per gradient, whether it is compared in slots (not in process groups).
        position_of: the place of each gradient's norm among the stacked norms of a call.
        device: where the comparison's tensors live.
        carry_limits: whether the sums carry each slot's limits (under pipeline stages).
    """
    compared = [
        i for i, group in enumerate(groups) if group is not None and group.size > 1 and slotted[i]
    ]
    places = [[float(slots.of[i]), float(position_of[i])] for i in compared]
    carried = [[1.0, slots.tau[i]] for i in compared] if carry_limits else []
    per_gradient = [[float(count), c, tau] for count, c, tau in slots.per_gradient]
    rows = [places, carried, per_gradient]
    widths = [2, 2, 3]
    flat = [value for table in rows for row in table for value in row]
    packed = torch.zeros(0, dtype=torch.float64, device=device)
    if flat:  # one copy, where some gradient has copies
        packed = torch.tensor(flat, dtype=torch.float64).to(device)
    on_device = packed.split([w * len(t) for w, t in zip(widths, rows, strict=True)])
    places_on_device, carried_on_device, constants = (
        part.view(-1, w) for part, w in zip(on_device, widths, strict=True)
    )
    # Each gradient's constants repeated for its slots, on the device: no list the size of the
    # world on the host.
    limits = constants[:, 1:].repeat_interleave(
        constants[:, 0].long(), dim=0, output_size=slots.count
    )
    return Comparison(
        groups=groups,
        compared=compared,
        slot_count=slots.count,
        limits=limits,
        carried=carried_on_device if carry_limits else None,
        slots=places_on_device[:, 0].long(),
        positions=places_on_device[:, 1].long(),
    )


def tolerance(dtype: torch.dtype) -> float:
    """``tau``: how far copies may differ, relative to the shard's norm (see the module docstring)."""
    return max(_TOLERANCE, _ROUNDINGS * torch.finfo(dtype).eps)


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


# The patterns per device (a process uses one or two).
_patterns_on: ScopedCache[torch.device, Tensor] = ScopedCache(8)


def _patterns(device: torch.device) -> Tensor:
    """The +-1 patterns, one per column, the same in every process."""
    found = _patterns_on.get(device)
    if found is None:
        generator = torch.Generator().manual_seed(0x5EED)
        signs = torch.randint(0, 2, (_PERIOD, _PROJECTIONS), generator=generator)
        found = _patterns_on.put(device, (2 * signs - 1).to(torch.float64).to(device))
    return found


def width(plan: Comparison, columns: int) -> int:
    """How many sums a slot holds for fingerprints of ``columns`` columns."""
    return 2 * columns + (2 if plan.carried is not None else 0)


def terms(
    plan: Comparison,
    local: list[Tensor],
    device: torch.device,
    regions: Regions | None,
    stage: int,
) -> tuple[Tensor, Tensor]:
    """This rank's addends of the first call's comparison (full fingerprints of ``local``),
    shape (rows, width), and whether a fingerprint was not finite (1.0, else 0.0; then the
    addends are zeros: NaN and inf cannot be compared), both float64 on ``device``. Nothing is
    read on the host. ``regions`` and ``stage``: as for :func:`norm_terms`.
    """
    rows, offset = _section(regions, stage, plan.slot_count)
    prints = torch.zeros(0, _COLUMNS, dtype=torch.float64, device=device)
    nonfinite = torch.zeros((), dtype=torch.float64, device=device)
    if plan.compared and offset is not None:
        prints = fingerprints([local[i] for i in plan.compared], device)
        found = ~torch.isfinite(prints).all()
        prints, nonfinite = torch.where(found, 0.0, prints), found.to(torch.float64)
    return _addends(plan, prints, rows, offset), nonfinite


def norm_terms(
    plan: Comparison, stacked: Tensor | None, regions: Regions | None, stage: int
) -> Tensor:
    """This rank's addends of a later call's comparison, the local norms alone as fingerprints:
    shape (rows, width), zeros without local norms (``stacked``, in stacking order).

    Args:
        plan: the layout's comparison.
        stacked: this rank's local norms, or None.
        regions: under pipeline stages, every stage's slots, as every rank agreed them
            (``pipeline.Regions``); None within a stage.
        stage: this rank's stage.
    """
    rows, offset = _section(regions, stage, plan.slot_count)
    norms = torch.zeros(0, 1, dtype=torch.float64, device=plan.limits.device)
    if stacked is None:
        offset = None  # nothing to compare: zeros
    elif offset is not None and plan.compared:
        norms = stacked.to(torch.float64).index_select(0, plan.positions)[:, None]
    return _addends(plan, norms, rows, offset)


def _section(regions: Regions | None, stage: int, count: int) -> tuple[int, int | None]:
    """The rows of the comparison a rank sends, and where its stage's ``count`` slots start among
    them: its stage's slots alone within a single stage (``regions`` None); under pipeline stages
    every stage's regions, with its own at its region's start where they fit (else None: it
    sends zeros)."""
    if regions is None:
        return count, 0
    sizes = regions.sizes
    return sum(sizes), sum(sizes[:stage]) if regions.fits(stage, count) else None


def _addends(plan: Comparison, prints: Tensor, rows: int, offset: int | None) -> Tensor:
    """This rank's addends of the comparison of fingerprints ``prints`` (one row per compared
    gradient, in float64: full fingerprints, or the local norms alone), shape (rows, width): each
    column ``f`` and ``f**2`` in the gradient's slot, and under pipeline stages 1 and ``tau``
    beside them (see :func:`slots_differ`), this stage's slots from ``offset`` (None: nowhere, the
    addends are zeros). A NaN or inf fingerprint makes its slot's sums NaN or inf.
    """
    columns = prints.shape[1]
    summed = torch.zeros(rows, width(plan, columns), dtype=torch.float64, device=prints.device)
    if not plan.compared or offset is None:
        return summed
    addends = [prints, prints**2]
    if plan.carried is not None:
        addends.append(plan.carried)
    mine = summed.narrow(0, offset, plan.slot_count)
    mine.index_add_(0, plan.slots, torch.cat(addends, dim=1))
    return summed


def slots_differ(summed: Tensor, limits: Tensor | None) -> Tensor:
    """Whether any slot of :func:`terms` or :func:`norm_terms`, reduced over the world, holds
    copies that differ beyond the tolerance (a NaN too): a boolean scalar beside the sums, not
    read on the host.

    Args:
        summed: the reduced sums.
        limits: each slot's copies and tolerance (:attr:`Comparison.limits`); None where the sums
            carry them (under pipeline stages). A slot that no rank wrote then counts no copy,
            and passes.
    """
    if limits is None:
        summed, copies, taus = summed.split([summed.shape[1] - 2, 1, 1], dim=1)
        copies = copies.clamp_min(1.0)
        return grouped_differ(summed, copies, taus / copies)
    return grouped_differ(summed, limits[:, :1], limits[:, 1:])


def grouped_differ(summed: Tensor, copies: Tensor, tau: Tensor) -> Tensor:
    """The test of a slot per group of ``c`` copies (``copies``, and ``tau``, one row per slot),
    column by column: the spread of the copies'
    fingerprints about their mean, ``sqrt(sum (f - mean f)**2) = sqrt(S2 - S1**2 / c)``, must not
    exceed ``tau`` times the copies' mean norm. Beside it, the float64 rounding of the sums: ``S1``
    errs by at most ``(c - 1) 2**-53 sum |f| <= (c - 1) 2**-53 sqrt(c S2)``, so ``S1**2 / c`` by
    about ``2 (c - 1) 2**-53 S2``, ``S2`` by ``(c - 1) 2**-53 S2``: ``c 2**-51 S2`` covers both.
    """
    first, second = summed.split(summed.shape[1] // 2, dim=1)
    mean = first / copies
    spread = second - first * mean  # the sum of squared deviations from the mean
    allowed = (tau * mean[:, :1]) ** 2 + copies * _SUMMATION * second
    return ~(spread <= allowed).all()
