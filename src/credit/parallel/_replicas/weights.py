"""The weights of the replica check's copies: how each copy enters the sums that vanish when
every copy holds its group's reference's bits.

Plain numbers and rank sets in, int64 weights out, the same in every process: :func:`weights` of
the members of the groups of copies (:class:`Member`), and :func:`coverage_term`, this rank's term
of the self-check.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from credit.parallel._replicas import digests as _digests
from credit.parallel._replicas.digests import LANES


class Member(NamedTuple):
    """A tensor of this rank with copies on other ranks, as its weights need it.

    Attributes:
        name: the tensor's name.
        key: its group of copies' key, the same on every member.
        size: the copies in its group.
        is_reference: whether this rank holds the group's reference copy.
        share: this member's ranks of the group's universe.
        universe: the ranks that the shares of the group's members cover, each once.
    """

    name: str
    key: tuple[int, ...]
    size: int
    is_reference: bool
    share: frozenset[int]
    universe: frozenset[int]


def weights(members: Sequence[Member], stage: int) -> tuple[Tensor, list[int]]:
    """The coefficients of this rank's copies (the members of their groups, in
    pipeline stage ``stage``),
    int64 ``(len(members), LANES)``, and the presence terms they add to the sums (``LANES``
    ints): ``sum coefficient * p``, ``p = mix(seed)`` per group and lane.

    A member ``i`` of a group of ``c`` copies has weight ``u_i`` per lane; it sends ``-u_i`` times
    its digest, the reference ``U - u_ref`` (``U``: the sum of every member's weight). Lane 0:
    ``u_i = w``, an odd number of the group. Lanes 1 to 3: ``u_i = 2 G(S_i) + 1``, where
    ``G(S) = sum_{r in S} gamma(r)`` over the member's share ``S_i`` of the group's universe,
    with ``gamma(r) = F(pos(r) + 1) - F(pos(r))``, ``pos`` the rank's place in the sorted
    universe, ``F(0) = 0`` and ``F(x) = mix(seed + x * golden)`` (splitmix64) for ``x > 0``. A run
    of consecutive places ``[a, b)`` sums to ``F(b) - F(a)``, and the universe of ``n`` ranks to
    ``F(n)``: the reference computes ``U = 2 F(n) + c`` without visiting the universe.
    """
    count = len(members)
    runs = _runs_of(members)
    seeds = torch.tensor([_seeds(stage, m.name, m.key) for m in members], dtype=torch.int64)
    seeds = seeds.view(count, LANES)
    coefficients = torch.zeros(count, LANES, dtype=torch.int64)
    rows, places, signs, constants = [], [], [], []
    for row, (member, member_runs) in enumerate(zip(members, runs, strict=True)):
        weight = _digests.odd_weight("copies", stage, member.name, *member.key)
        coefficients[row, 0] = _digests.signed(
            weight * (member.size - 1 if member.is_reference else -1)
        )
        # -2 G(S_i) - 1 on every member; the reference adds 2 F(n) + c.
        points = [(b, -1) for _, b in member_runs] + [(a, 1) for a, _ in member_runs if a > 0]
        constant = -1
        if member.is_reference:
            points.append((len(member.universe), 1))
            constant += member.size
        rows += [row] * len(points)
        places += [x for x, _ in points]
        signs += [sign for _, sign in points]
        constants.append(constant)
    if count:
        values = _digests.mix(seeds[rows, 1:] + torch.tensor(places)[:, None] * _digests.GOLDEN)
        sums = torch.zeros(count, LANES - 1, dtype=torch.int64)
        sums.index_add_(0, torch.tensor(rows), values * torch.tensor(signs)[:, None])
        coefficients[:, 1:] = 2 * sums + torch.tensor(constants)[:, None]
    presence = (coefficients * _digests.mix(seeds)).sum(0)
    return coefficients, presence.tolist()


def coverage_term(counts: Sequence[tuple[str, int]], stage: int) -> int:
    """This rank's term of the self-check, from each tensor's name and its count
    (``ownership.coverage``): the counts weighted by name, so that they cannot cancel across
    tensors."""
    return sum(
        _digests.signed(_digests.odd_weight("coverage", stage, name) * count)
        for name, count in counts
    )


def _runs_of(members: Sequence[Member]) -> list[list[tuple[int, int]]]:
    """Each member's share as runs of consecutive places in its sorted universe."""
    positions: dict[frozenset[int], dict[int, int]] = {}
    runs = []
    for member in members:
        if member.universe not in positions:
            positions[member.universe] = {r: i for i, r in enumerate(sorted(member.universe))}
        place = positions[member.universe]
        runs.append(_runs(sorted(place[r] for r in member.share)))
    return runs


def _runs(places: list[int]) -> list[tuple[int, int]]:
    """Sorted ``places`` as maximal runs ``[a, b)`` of consecutive integers."""
    runs = []
    for _, run in itertools.groupby(enumerate(places), key=lambda item: item[1] - item[0]):
        values = [place for _, place in run]
        runs.append((values[0], values[-1] + 1))
    return runs


def _seeds(stage: int, name: str, key: tuple[int, ...]) -> list[int]:
    """``LANES`` 64-bit seeds of one group (as int64s), the same in every process."""
    return [_digests.signed(word) for word in _digests.hashed(("copies", stage, name, key), LANES)]
