"""The replica check's records: what it looks at, what each rank holds, and what differs.

Plain data, passed down the check's steps and gathered across ranks on a failure: an
:class:`Entry` per tensor the check looks at; :class:`Held`, what this rank holds of them; a
:class:`TensorRecord` per tensor and rank, and an :class:`Owner` per optimizer parameter, which every
rank gathers from every other when the proof fails (``diagnosis``); a :class:`Slot` per
group of copies that differ, with its public :class:`Mismatch`; and the :class:`Failure` that a
repair (``repair``) or an error message (``messages``) is made from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from credit.parallel._common.copy_groups import CopyGroup
from credit.parallel._common.holdings import Holding
from credit.parallel._common.stages import Stages

# How a group's source was decided (:attr:`Mismatch.decided_by`).
MAJORITY = "majority"
REPAIR_FROM = "repair_from"


class Entry(NamedTuple):
    """One tensor the check looks at (a named tuple: thousands are made per call).

    Attributes:
        name: a parameter's or buffer's name, or ``"exp_avg of blocks.0.q.weight"``.
        tensor: the tensor.
        kind: ``"parameter"``, ``"buffer"`` or ``"state"`` (optimizer state).
        owner: the parameter a state belongs to (the tensor itself for parameters and buffers),
            which ``distinct_along`` names.
        owner_name: the owner's name.
        state_key: the key of a state in its optimizer's ``state[owner]`` (None otherwise).
    """

    name: str
    tensor: Tensor
    kind: str
    owner: Tensor
    owner_name: str
    state_key: object = None


@dataclass(frozen=True)
class Mismatch:
    """One group of copies of a tensor that do not all hold the same bits.

    Attributes:
        name: the tensor: a parameter's or buffer's name, or ``"exp_avg of blocks.0.q.weight"``.
        reference: the rank whose copy is taken as right, and which a repair copies: the lowest
            rank of a strict majority of identical copies, else the first rank of
            ``repair_from`` that holds a copy; None where nothing tells which copy is right.
        ranks: the ranks whose copy differs from the reference's or is missing; where
            ``reference`` is None, every rank of the group.
        decided_by: how the reference was chosen: ``"majority"``, ``"repair_from"``, or None.
        copies: the ranks holding each distinct copy, the most widely held first.
        missing: the ranks of the group that hold no copy at all (optimizer state created on
            some copies only).
    """

    name: str
    reference: int | None
    ranks: tuple[int, ...]
    decided_by: str | None
    copies: tuple[tuple[int, ...], ...]
    missing: tuple[int, ...] = ()


@dataclass(frozen=True)
class Held:
    """What this rank holds: each tensor's entry, local tensor, holding and copy group, the
    tensors with copies, the stages, and the optimizer's parameters by name with the
    ``distinct_along`` group of each (None where it has none)."""

    entries: tuple[Entry, ...]
    local: tuple[Tensor, ...]
    held: tuple[Holding, ...]
    groups: tuple[CopyGroup | None, ...]
    compared: tuple[int, ...]
    stages: Stages
    lowest: int
    params: Mapping[str, Tensor]
    param_marks: Mapping[str, frozenset[int] | None]


@dataclass(frozen=True)
class TensorRecord:
    """What one rank holds of one tensor, gathered only when the proof fails."""

    name: str
    kind: str
    description: str  # its global layout: the same on every rank of the stage that holds it
    key: tuple[int, ...] | None  # its copy group, where it has copies (None: no copies)
    size: int  # the copies in that group
    digest: tuple[int, ...] | None
    coverage: int
    nbytes: int
    # How a missing copy is made elsewhere: like its parameter, or a plain tensor.
    owner: str
    state_key: object
    like_owner: bool
    is_dtensor: bool
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    on_cpu: bool
    # The other tensors of its rank that share memory with it, each with the distance in bytes
    # from the other's first element to its own (in their storage).
    shares: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Owner:
    """Where a copy of a parameter's state would sit on this rank: the group key of a state laid
    out like the parameter, and of a plain state."""

    description: str
    key: tuple[int, ...] | None
    plain_key: tuple[int, ...] | None


@dataclass(frozen=True)
class Slot:
    """One group of copies that differ: where the repair reads and writes it.

    ``broadcast`` maps each dim along which some target's copy broadcasts (stride 0) to those
    targets: the source's values must not vary along it. ``shared`` holds the strides of each
    target's copy whose elements may share memory otherwise, which no write can give arbitrary
    values.
    """

    stage: int
    name: str
    nbytes: int
    targets: frozenset[int]  # the ranks whose copy is replaced (or created)
    template: TensorRecord  # the source's record: how a missing copy is made
    mismatch: Mismatch
    broadcast: dict[int, tuple[int, ...]]
    shared: dict[int, tuple[int, ...]]


@dataclass(frozen=True)
class Failure:
    """The groups of copies that differ, the tensors with copies in every stage, why writing the
    sources would change other bits than the copies' (through memory that a copy shares with
    another tensor of its rank), and the differing tensors that share memory with another on
    some of their ranks only."""

    slots: list[Slot]
    compared: int
    written_through: list[str]
    aliases: list[str]


# Each stage's records, by rank and name.
RecordsByStage = dict[int, dict[int, dict[str, TensorRecord]]]
