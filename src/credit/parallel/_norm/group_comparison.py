"""The comparison of copies in their own process groups, before the norm's collective.

Where the copies of a shard meet in process groups this rank holds (``_common.copy_groups``: tp
within a node, the replica dim of HSDP), its members add their fingerprints ``f`` and ``f**2``
over those groups, one all_reduce per group, each carrying a row per gradient that uses it. Every
member then reads the same sums, and runs the test of ``copies`` (the spread of the copies
about their mean within ``tau`` times their mean norm) on its own rows: one copy off by more than
``sqrt(2) tau`` of its group is caught, whichever it is. What it found travels to the whole world
as one number, this rank's flag, in the norm's own all_reduce (``collective``); so the world's
collective carries no slot per group, and a rank's rows are its own gradients, whatever the size
of the world.

The layout's proof runs the same reduction with full fingerprints, and beside them, per row, 1,
the shard's key and its square: a group whose members do not all hold the same shard of the
gradient, or that counts other than its copies, is refused (every rank's decision of the groups
is from rank maps; this is their proof by value).

Host syncs: none; the constants are built once per layout in one host-to-device copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from credit.parallel._norm import copies as _copies


@dataclass(frozen=True)
class Round:
    """One all_reduce of the comparison: the group, and the rows that sum over it.

    Attributes:
        group: the process group.
        rows: the rows of the gradients whose copies span it, an index tensor on the device;
            None where every row does.
    """

    group: ProcessGroup
    rows: Tensor | None


@dataclass(frozen=True)
class GroupComparison:
    """How this rank's gradients enter the comparison in process groups, fixed per layout.

    Attributes:
        compared: the gradients compared this way (input indices), a row each, in stacking order.
        rounds: the all_reduces, in the order every member of each group issues them.
        positions: per row, the place of its gradient's norm among a call's stacked norms.
        limits: per row, the copies and their tolerance (shape (rows, 2)), float64.
        keys: per row, 1, the shard's key and its square (shape (rows, 3)), float64, for the
            proof.
    """

    compared: list[int]
    rounds: list[Round]
    positions: Tensor
    limits: Tensor
    keys: Tensor


def plan(
    groups: list[tuple[ProcessGroup, ...] | None],
    order: list[int],
    per_gradient: list[tuple[float, float, float]],
    device: torch.device,
) -> GroupComparison:
    """The :class:`GroupComparison` of a layout, its constants on ``device`` in one copy.

    Args:
        groups: per gradient (input order), the process groups of its copies, or None.
        order: the gradients' stacking order (input indices): the place of a gradient's norm
            among a call's stacked norms is its place in it.
        per_gradient: per gradient, its copies, their tolerance, and its shard's key.
        device: where the tensors live.
    """
    placed = [(position, i) for position, i in enumerate(order) if groups[i] is not None]
    compared = [i for _, i in placed]
    per_row = [groups[i] or () for i in compared]
    ordered = _ordered(per_row)
    members = [
        [row for row, found in enumerate(per_row) if any(g is group for g in found)]
        for group in ordered
    ]
    table = [float(value) for position, i in placed for value in (position, *per_gradient[i])]
    rows = [float(row) for found in members for row in found]
    packed = torch.zeros(0, dtype=torch.float64, device=device)
    if table:  # one host-to-device copy for every constant
        packed = torch.tensor(table + rows, dtype=torch.float64).to(device)
    constants, indices = packed.split([len(table), len(rows)])
    constants = constants.view(-1, 4)
    key = constants[:, 3:]
    indices_of = indices.long().split([len(found) for found in members])
    rounds = [
        Round(group, None if len(found) == len(compared) else index)
        for group, found, index in zip(ordered, members, indices_of, strict=True)
    ]
    return GroupComparison(
        compared=compared,
        rounds=rounds,
        positions=constants[:, 0].long(),
        limits=constants[:, 1:3],
        keys=torch.cat([torch.ones_like(key), key, key**2], dim=1),
    )


def _ordered(per_row: list[tuple[ProcessGroup, ...]]) -> list[ProcessGroup]:
    """The groups in the order the rows first name them: the same role in the same place on
    every member, since the ranks of a stage share the layout."""
    ordered: list[ProcessGroup] = []
    for groups in per_row:
        ordered += [g for g in groups if all(g is not seen for seen in ordered)]
    return ordered


def summed(comparison: GroupComparison, columns: Tensor) -> Tensor:
    """``columns`` (a row per compared gradient) summed over each row's copies, round by round:
    every member of a group issues the same all_reduces in the same order."""
    for round_ in comparison.rounds:
        if round_.rows is None:
            dist.all_reduce(columns, group=round_.group)
            continue
        part = columns.index_select(0, round_.rows)
        dist.all_reduce(part, group=round_.group)
        columns = columns.index_copy(0, round_.rows, part)
    return columns


def differ_flag(comparison: GroupComparison, stacked: Tensor | None) -> Tensor:
    """This rank's flag for the norm's all_reduce: 1.0 where the copies of any of its rows
    differ beyond the tolerance (a NaN or inf too), else 0.0: float64 of shape (1,), or (0,)
    where nothing is compared this way. Issues the comparison's all_reduces; a rank without
    local norms sends zeros in them."""
    if not comparison.compared:
        return comparison.limits.new_zeros(0)
    prints = comparison.limits.new_zeros(len(comparison.compared), 1)
    if stacked is not None:
        prints = stacked.to(torch.float64).index_select(0, comparison.positions)[:, None]
    sums = summed(comparison, torch.cat([prints, prints**2], dim=1))
    return _rows_differ(comparison, sums).to(torch.float64).reshape(1)


def _rows_differ(comparison: GroupComparison, sums: Tensor) -> Tensor:
    """Whether the copies of any row differ, from their reduced ``f`` and ``f**2`` columns."""
    return _copies.grouped_differ(sums, comparison.limits[:, :1], comparison.limits[:, 1:])


def proof_flags(comparison: GroupComparison, prints: Tensor) -> tuple[Tensor, Tensor]:
    """The proof's three numbers for the world's all_reduce, from the full fingerprints
    ``prints`` of this rank's rows (``copies.fingerprints``): whether one was not finite, whether
    copies differ, whether a group holds other than the copies of one shard (1.0 or 0.0 each,
    float64); and beside them, per row, whether its group does (a boolean tensor, read on the
    failure path only). Issues the comparison's all_reduces with the fingerprints and the keys."""
    device = comparison.limits.device
    if not comparison.compared:
        return torch.zeros(3, dtype=torch.float64, device=device), comparison.keys[:, 0] > 0
    nonfinite = ~torch.isfinite(prints).all()
    prints = torch.where(nonfinite, 0.0, prints)
    sums = summed(comparison, torch.cat([prints, prints**2, comparison.keys], dim=1))
    prints_summed, (count, key, square) = sums[:, :-3], sums[:, -3:].unbind(1)
    misfit = (count != comparison.limits[:, 0]) | (square * count != key * key)
    flags = [nonfinite, _rows_differ(comparison, prints_summed) & ~nonfinite, misfit.any()]
    return torch.stack(flags).to(torch.float64), misfit
