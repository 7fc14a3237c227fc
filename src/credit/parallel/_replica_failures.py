"""The replica check's failures: copies that differ or are missing, named the same way on every
rank, told apart from layouts that cannot be compared, and repaired where something tells which
copy is right.

Only a failed proof (``replicas``) comes here. Every rank gathers what every other holds (one
``all_gather_object``: names, layouts, digests, and the arguments that must agree), so every rank
reaches the same verdict and raises the same error; or the differing copies get their source's
bytes in one all_reduce, all or nothing: whatever can fail is done or checked on every rank before
that all_reduce, which carries each rank's failure flag, and nothing is written where one is set.
Copies are read and written as their elements in row-major order, under any strides; a copy that
shares memory with another tensor of its rank is written only where the write leaves that tensor
with the bits it should hold (its own, or its source's), as every rank's records prove. Tensors are
matched by name: rank-local tensors (no copies) need not line up across ranks, so optimizer state
created lazily on some ranks only is no layout error; a copy of optimizer state that one member of
a group lacks is a mismatch like a copy with other bits.

The source of a group of copies is the copy a strict majority of its members holds, else the copy
of the first rank the caller names in ``repair_from`` that holds one. Where neither exists (two
copies that differ, two against two), nothing tells which copy is right: the group is named with
every rank that disagrees, and a repair is refused on every rank, before anything is modified.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from credit.parallel import _aliasing, _ownership
from credit.parallel._compat import local_tensor
from credit.parallel._ownership import CopyGroup, Holding, Stages

WHAT = "verify_replicas"
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

    entries: list[Entry]
    local: list[Tensor]
    held: list[Holding]
    groups: list[CopyGroup | None]
    compared: list[int]
    at: Stages
    lowest: int
    params: dict[str, Tensor]
    param_marks: dict[str, frozenset[int] | None]


@dataclass(frozen=True)
class _Record:
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
class _Owner:
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
    template: _Record  # the source's record: how a missing copy is made
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


def diagnose(
    mine: Held,
    digests: dict[int, list[int]],
    error: str | None,
    repair_from: tuple[int, ...],
    arguments: Mapping[str, object],
) -> Failure:
    """Gather every rank's records and arguments; raise for arguments that differ across ranks or
    a layout that cannot be compared, else return the groups of copies that differ, each with its
    source where one is known (the same on every rank).

    Args:
        mine: what this rank holds.
        digests: the digest of each tensor with copies, by index.
        error: why this rank's layout cannot be counted, or None.
        repair_from: the ranks whose copies are right where a group has no strict majority.
        arguments: this rank's arguments that must be the same on every rank, by name.

    Raises:
        ValueError: the ranks passed different ``arguments``, or a rank's tensors or layout
            cannot be compared (a meta tensor, a mesh across stages, a distinct_along group that
            overlaps its mesh).
        RuntimeError: the ranks of a stage hold different parameters or buffers, a tensor's
            shards do not add up to whole copies, or the ranks disagree on the groups of copies.
    """
    shares = _shared_memory(mine)
    records = [_record(mine, i, digests.get(i), shares[i]) for i in range(len(mine.entries))]
    # Only where this rank's layout can be counted: the others raise its error below.
    owners = {name: _owner(mine, name) for name in mine.params} if error is None else {}
    everyone: list = [None] * dist.get_world_size()
    mine_all = (dist.get_rank(), mine.at.index, error, records, owners, arguments)
    dist.all_gather_object(everyone, mine_all)
    _refuse_different_arguments({rank: theirs for rank, *_, theirs in everyone})
    for rank, _, their_error, *_ in everyone:
        if their_error is not None:
            raise ValueError(f"{WHAT}: {their_error} (rank {rank}). Nothing was modified.")
    by_stage: dict[int, dict[int, tuple[dict[str, _Record], dict[str, _Owner]]]] = {}
    for rank, stage, _, theirs, their_owners, _ in everyone:
        named = {record.name: record for record in theirs}
        by_stage.setdefault(stage, {})[rank] = (named, their_owners)
    for stage, ranks in sorted(by_stage.items()):
        within = f" of pipeline stage {stage}" if len(by_stage) > 1 else ""
        _refuse_different_tensors({rank: named for rank, (named, _) in ranks.items()}, within)
        _refuse_missing_copies({rank: named for rank, (named, _) in ranks.items()}, within)
    compared = 0
    slots = []
    for stage, ranks in sorted(by_stage.items()):
        compared += len(_names_with_copies({rank: named for rank, (named, _) in ranks.items()}))
        slots += _differing(stage, ranks, repair_from)
    if not slots:
        raise RuntimeError(
            f"{WHAT}: the copies' sums did not vanish, yet every copy has the same digest: the "
            "ranks disagree on which ranks hold copies of what (a layout that the rank maps do "
            "not describe, such as distinct_along groups that do not tile the stage). Nothing "
            "was modified."
        )
    stages = {
        stage: {r: named for r, (named, _) in ranks.items()} for stage, ranks in by_stage.items()
    }
    return Failure(slots, compared, _written_through(slots, stages), _aliases(slots, stages))


def _refuse_different_arguments(ranks: dict[int, Mapping[str, object]]) -> None:
    """Every argument that must be the same on every rank is."""
    differing = []
    for name in ranks[min(ranks)]:
        values: dict[str, list[int]] = {}
        for rank in sorted(ranks):
            values.setdefault(repr(ranks[rank][name]), []).append(rank)
        if len(values) > 1:
            held = ", ".join(f"{value} on {_ranks(at)}" for value, at in values.items())
            differing.append(f"{name}: {held}")
    if differing:
        raise ValueError(
            f"{WHAT}: the ranks passed different arguments, which must be the same on every "
            f"rank: {'; '.join(differing)}. Nothing was modified."
        )


def _record(
    mine: Held, index: int, digest: list[int] | None, shares: tuple[tuple[str, int], ...]
) -> _Record:
    entry, local, held = mine.entries[index], mine.local[index], mine.held[index]
    group = mine.groups[index]
    owner = mine.params.get(entry.owner_name)
    like_owner = owner is not None and _ownership.holding(owner).description == held.description
    return _Record(
        name=entry.name,
        kind=entry.kind,
        description=held.description,
        key=group.key if group is not None and digest is not None else None,
        size=group.size if group is not None else 0,
        digest=tuple(digest) if digest is not None else None,
        coverage=_ownership.coverage(held, mine.at),
        nbytes=local.numel() * local.element_size(),
        owner=entry.owner_name,
        state_key=entry.state_key,
        like_owner=like_owner,
        is_dtensor=isinstance(entry.tensor, DTensor),
        shape=tuple(local.shape),
        strides=tuple(local.stride()),
        dtype=local.dtype,
        on_cpu=local.device.type == "cpu",
        shares=shares,
    )


def _shared_memory(mine: Held) -> list[tuple[tuple[str, int], ...]]:
    """Per tensor, the other tensors of this rank that share memory with it, each with the
    distance in bytes from the other's first element to its own (read from their storage
    offsets, on the host: no value is read)."""
    found: list[list[tuple[str, int]]] = [[] for _ in mine.local]
    for i, j in _aliasing.sharing(mine.local):
        distance = _first_byte(mine.local[i]) - _first_byte(mine.local[j])
        found[i].append((mine.entries[j].name, distance))
        found[j].append((mine.entries[i].name, -distance))
    return [tuple(sorted(shared)) for shared in found]


def _first_byte(tensor: Tensor) -> int:
    """Where a tensor's first element lies in its storage, in bytes."""
    return int(tensor.storage_offset()) * tensor.element_size()


def _owner(mine: Held, name: str) -> _Owner:
    held = _ownership.holding(mine.params[name])
    plain = _ownership.holding(torch.empty(()))
    mark = mine.param_marks[name]
    keys = []
    for layout in (held, plain):
        group = None
        if _ownership.layout_error(layout, mine.at, mark) is None:
            group = _ownership.copy_group(layout, mine.at, mine.lowest, mark)
        keys.append(group.key if group is not None else None)
    return _Owner(description=held.description, key=keys[0], plain_key=keys[1])


def _names_with_copies(ranks: dict[int, dict[str, _Record]]) -> list[str]:
    """The tensors that have copies on some rank, in the order the lowest rank holds them."""
    seen: dict[str, None] = {}
    for rank in sorted(ranks):
        for name, record in ranks[rank].items():
            if record.key is not None:
                seen.setdefault(name)
    return list(seen)


def _refuse_different_tensors(ranks: dict[int, dict[str, _Record]], within: str) -> None:
    """Parameters and buffers: every rank of a stage holds each, with the same layout; optimizer
    state with copies: the same layout wherever it exists."""
    first = min(ranks)
    for rank in sorted(ranks):
        ours, theirs = ranks[first], ranks[rank]
        for name in [*ours, *(n for n in theirs if n not in ours)]:
            a, b = ours.get(name), theirs.get(name)
            if (a is None or a.kind == "state") and (b is None or b.kind == "state"):
                continue  # optimizer state may be created lazily: see _missing
            if a is None or b is None or a.description != b.description:
                raise RuntimeError(
                    f"{WHAT}: the ranks{within} hold different tensors, so their copies cannot "
                    f"be compared: rank {first} has {_described(name, a)}, rank {rank} has "
                    f"{_described(name, b)} (rank {first} holds {_lined_up(ours)} parameters "
                    f"and buffers, rank {rank} {_lined_up(theirs)}). Nothing was modified."
                )
    layouts: dict[str, tuple[int, str]] = {}
    with_copies = set(_names_with_copies(ranks))
    for rank in sorted(ranks):
        for name, record in ranks[rank].items():
            if record.kind != "state" or name not in with_copies:
                continue
            seen = layouts.setdefault(name, (rank, record.description))
            if seen[1] != record.description:
                raise RuntimeError(
                    f"{WHAT}: the ranks{within} hold different tensors, so their copies cannot "
                    f"be compared: rank {seen[0]} has {name} ({seen[1]}), rank {rank} has "
                    f"{name} ({record.description}). Nothing was modified."
                )


def _described(name: str, record: _Record | None) -> str:
    return f"{name} ({record.description})" if record is not None else f"no {name}"


def _lined_up(records: dict[str, _Record]) -> int:
    return sum(record.kind != "state" for record in records.values())


def _refuse_missing_copies(ranks: dict[int, dict[str, _Record]], within: str) -> None:
    """The self-check of the parameters and buffers (which every rank of the stage holds, as
    :func:`_refuse_different_tensors` proved)."""
    lined_up = [name for name, record in ranks[min(ranks)].items() if record.kind != "state"]
    for name in lined_up:
        if sum(theirs[name].coverage for theirs in ranks.values()):
            record = ranks[min(ranks)][name]
            where = f"the ranks{within}" if within else "the world"
            raise RuntimeError(
                f"{WHAT}: cannot tell the copies of {name} ({record.description}) apart: its "
                f"shards do not add up to whole copies on {where}. Every rank of a stage must "
                "hold every parameter, each on its own copy of its mesh; pass pipeline stages "
                "as pp_group. Nothing was modified."
            )


def _differing(
    stage: int,
    ranks: dict[int, tuple[dict[str, _Record], dict[str, _Owner]]],
    repair_from: tuple[int, ...],
) -> list[Slot]:
    named = {rank: records for rank, (records, _) in ranks.items()}
    slots = []
    for name in _names_with_copies(named):
        groups: dict[tuple[int, ...], list[tuple[int, _Record]]] = {}
        for rank in sorted(named):
            record = named[rank].get(name)
            if record is not None and record.key is not None:
                groups.setdefault(record.key, []).append((rank, record))
        missing = _missing(name, ranks, groups)
        for key, members in sorted(groups.items()):
            slot = _decide(stage, members, missing.get(key, []), repair_from)
            if slot is not None:
                slots.append(slot)
    return slots


def _missing(
    name: str,
    ranks: dict[int, tuple[dict[str, _Record], dict[str, _Owner]]],
    groups: dict[tuple[int, ...], list[tuple[int, _Record]]],
) -> dict[tuple[int, ...], list[int]]:
    """The ranks of the stage without a copy of ``name`` (optimizer state only: parameters and
    buffers line up), by the group their copy would belong to: laid out like its parameter, or
    plain, as the copies that exist are. A group none of whose members holds a copy is left out:
    its copies agree (that shard has no state yet).

    Raises:
        RuntimeError: a rank's missing copy cannot be placed in a group (its parameter is not in
            that rank's optimizer, or the state is a DTensor laid out unlike its parameter).
    """
    lacking = [rank for rank in sorted(ranks) if name not in ranks[rank][0]]
    if not lacking:
        return {}
    template = next(iter(groups.values()))[0][1]
    found: dict[tuple[int, ...], list[int]] = {}
    for rank in lacking:
        owner = ranks[rank][1].get(template.owner)
        key = None
        if owner is not None and template.like_owner:
            key = owner.key
        elif owner is not None and not template.is_dtensor:
            key = owner.plain_key
        if key is None:
            holders = sorted(r for members in groups.values() for r, _ in members)
            if owner is None:
                why = f"its parameter {template.owner} is not in that rank's optimizer"
            elif template.like_owner:
                why = f"that rank holds no shard of its parameter {template.owner}"
            else:
                why = f"it is laid out unlike its parameter ({template.description})"
            raise RuntimeError(
                f"{WHAT}: {name} exists on {_ranks(holders)} and not on rank {rank}, where "
                f"its copy cannot be placed: {why}. Nothing was modified."
            )
        if key in groups:
            found.setdefault(key, []).append(rank)
    return found


def _decide(
    stage: int,
    members: list[tuple[int, _Record]],
    missing: list[int],
    repair_from: tuple[int, ...],
) -> Slot | None:
    """The group's verdict: None where every member holds the same bits, else its slot, with
    the source a strict majority or ``repair_from`` gives, or none."""
    holders: dict[tuple[int, ...] | None, list[int]] = {}
    for rank, record in members:
        holders.setdefault(record.digest, []).append(rank)
    if len(holders) == 1 and not missing:
        return None
    copies = sorted(holders.values(), key=lambda held: (-len(held), held))
    size = members[0][1].size
    source: int | None = None
    decided_by = None
    if 2 * len(copies[0]) > size:
        source, decided_by = copies[0][0], MAJORITY
    else:
        present = {rank for rank, _ in members}
        source = next((rank for rank in repair_from if rank in present), None)
        decided_by = REPAIR_FROM if source is not None else None
    records = dict(members)
    everyone = sorted([*records, *missing])
    targets: frozenset[int] = frozenset()
    if source is None:
        ranks = tuple(everyone)
    else:
        digest = records[source].digest
        ranks = tuple(r for r in everyone if r in missing or records[r].digest != digest)
        targets = frozenset(ranks)
    template = records[source] if source is not None else members[0][1]
    broadcast: dict[int, tuple[int, ...]] = {}
    shared: dict[int, tuple[int, ...]] = {}
    for rank in sorted(targets - set(missing)):
        record = records[rank]
        for dim in _broadcast_dims(record.shape, record.strides):
            broadcast[dim] = (*broadcast.get(dim, ()), rank)
        if _may_share_memory(record.shape, record.strides):
            shared[rank] = record.strides
    mismatch = Mismatch(
        name=template.name,
        reference=source,
        ranks=ranks,
        decided_by=decided_by,
        copies=tuple(tuple(held) for held in copies),
        missing=tuple(missing),
    )
    return Slot(
        stage, template.name, template.nbytes, targets, template, mismatch, broadcast, shared
    )


def _broadcast_dims(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...]:
    """The dims along which a tensor repeats one element (stride 0, an expanded tensor)."""
    return tuple(
        d
        for d, (size, stride) in enumerate(zip(shape, strides, strict=True))
        if not stride and size > 1
    )


def _may_share_memory(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether elements of a tensor may share memory other than along its broadcast dims: unless
    each stride, in increasing order, reaches past every element the smaller ones address."""
    reach = 0
    for stride, size in sorted(
        (st, n) for n, st in zip(shape, strides, strict=True) if st and n > 1
    ):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


# Each stage's records, by rank and name.
_Stages = dict[int, dict[int, dict[str, _Record]]]


def _written_through(slots: list[Slot], stages: _Stages) -> list[str]:
    """Why writing each group's source into its copies would leave other bits than every tensor
    should then hold, in memory that a copy shares with another tensor of its rank (each reason
    once, with the ranks it holds on); empty where every such write puts there the bits that
    each tensor sharing it takes or keeps.

    The source's bytes are its elements. Where the copy shares memory with ``other`` as the
    source does with its rank's ``other`` (the same distance, strides and shapes), the bytes that
    land there are that rank's bits of ``other``, which must be the bits ``other`` holds after
    the repair: its own source's, where it is repaired too, else its own. Digests tell, as they
    tell copies apart. Memory shared otherwise, or not on the source's rank, is refused.
    """
    takes = {(s.stage, r, s.name): s.mismatch.reference for s in slots for r in s.targets}
    found: dict[tuple[str, str, int, str, int | None], list[int]] = {}
    for slot in slots:
        records, source = stages[slot.stage], slot.mismatch.reference
        if source is None:  # no targets: refused before any repair
            continue
        for rank in sorted(slot.targets - set(slot.mismatch.missing)):
            for other, distance in records[rank][slot.name].shares:
                repaired_from = takes.get((slot.stage, rank, other))
                kept = rank if repaired_from is None else repaired_from
                why = _clash(records, rank, source, slot.name, (other, distance), kept)
                if why is not None:
                    key = (slot.name, other, source, why, repaired_from)
                    found.setdefault(key, []).append(rank)
    return [_through(*key, tuple(ranks)) for key, ranks in found.items()]


def _clash(
    records: dict[int, dict[str, _Record]],
    rank: int,
    source: int,
    name: str,
    shared: tuple[str, int],
    kept: int,
) -> str | None:
    """Why writing rank ``source``'s copy of ``name`` into rank ``rank``'s, which shares memory
    with ``shared`` (a tensor's name, and the distance from its first byte), would change that
    tensor there from the bits of rank ``kept``'s copy, which it should hold; or None."""
    other = shared[0]
    here, there = records[rank], records[source]
    if all(theirs != other for theirs, _ in there[name].shares):
        return "absent"
    layout = (here[name].strides, here[other].strides, here[other].shape, here[other].dtype)
    alike = (there[name].strides, there[other].strides, there[other].shape, there[other].dtype)
    if shared not in there[name].shares or layout != alike:
        return "otherwise"
    should, written = records[kept][other].digest, there[other].digest
    if should is None or written is None:
        return "uncompared"
    return None if should == written else "differs"


def _through(
    name: str,
    other: str,
    source: int,
    why: str,
    repaired_from: int | None,
    ranks: tuple[int, ...],
) -> str:
    """A write through shared memory that would change another tensor, in words."""
    copy = f"rank {source}'s copy (the source)"
    theirs = "theirs" if len(ranks) > 1 else f"rank {ranks[0]}'s"
    if repaired_from is not None:
        theirs = f"rank {repaired_from}'s, which {other} takes there"
    reason = {
        "absent": f"and {copy} does not",
        "otherwise": f"otherwise than {copy} does",
        "uncompared": f"as {copy} does, but {other} has no copies to compare with {theirs}",
        "differs": f"as {copy} does, but rank {source}'s {other} differs from {theirs}",
    }[why]
    verb = "shares" if len(ranks) == 1 else "share"
    would = "could" if why == "uncompared" else "would"
    return (
        f"{_whose(ranks)} of {name} {verb} memory with {other}, {reason}: writing {name} {would} "
        f"change {other} on {_ranks(ranks)}"
    )


def _aliases(slots: list[Slot], stages: _Stages) -> list[str]:
    """The differing tensors that share memory with another tensor on some of their copies'
    ranks only, or at different offsets on some (a tensor assigned by reference on some ranks,
    ``m.ema = m.w.detach()``)."""
    notes = []
    for slot in slots:
        records = stages[slot.stage]
        members = sorted(rank for ranks in slot.mismatch.copies for rank in ranks)
        offsets: dict[str, dict[int, list[int]]] = {}
        for rank in members:
            for other, distance in records[rank][slot.name].shares:
                offsets.setdefault(other, {}).setdefault(distance, []).append(rank)
        for other, at in offsets.items():
            having = sorted(rank for ranks in at.values() for rank in ranks)
            lacking = [rank for rank in members if rank not in having]
            if lacking:
                where = f"on {_ranks(having)}, not on {_ranks(lacking)}"
            elif len(at) > 1:
                where = f"at different offsets on {' / '.join(map(_ranks, at.values()))}"
            else:
                continue
            notes.append(f"{slot.name} shares memory with {other} {where}")
    return notes


def repair(
    failure: Failure,
    mine: Held,
    states: MutableMapping[Tensor, dict],
    device: torch.device,
) -> str | None:
    """Each group's source copy over its other copies, all or nothing, in one all_reduce of their
    bytes: the source sends them, every other rank zeros. A missing copy of optimizer state is
    created (like its parameter, a DTensor for a DTensor parameter, or as a plain tensor like the
    source's) and put into the optimizer's state.

    Whatever can fail comes before any write: from every rank's records, the copies that
    cannot take arbitrary bits and the writes through memory shared with another tensor that
    would change it; then on each rank its sources' bytes and the new state tensors. The
    all_reduce carries each rank's failure flag beside the bytes; where any is set, the ranks
    gather why (one ``all_gather_object``) and none writes.

    Args:
        failure: the groups of copies that differ, each with a source, and what writing them
            through shared memory would change: the same on every rank.
        mine: what this rank holds.
        states: the optimizer's ``state`` (where missing copies are put).
        device: where the collective's buffer lives.

    Returns:
        Why the repair cannot be done, the same on every rank, nothing modified; or None, every
        copy then holding its source's bits.
    """
    slots = failure.slots
    refused = [why for slot in slots if (why := _unwritable(slot)) is not None]
    refused += failure.written_through
    if refused:
        return _cannot(refused, failure)
    offsets = [0]
    for slot in slots:  # 16-byte aligned, so that each slot can be viewed as its dtype
        offsets.append(offsets[-1] + -(-slot.nbytes // 16) * 16)
    buffer = torch.zeros(offsets[-1] // 8 + 1, dtype=torch.int64, device=device)
    data = buffer[:-1].view(torch.uint8)
    writes, problem = _prepare(slots, offsets, mine, data)
    if problem is not None:
        buffer[-1] = 1
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
    if bool(buffer[-1]):
        problems: list = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        return _cannot([why for why in problems if why is not None], failure)
    for slot, start, target, new in writes:
        if new is not None:
            states.setdefault(mine.params[slot.template.owner], {})[slot.template.state_key] = new
        _write(target, data[start : start + slot.nbytes].to(target.device))
    return None


_Write = tuple[Slot, int, Tensor, Tensor | None]  # slot, offset, local target, state to put


def _prepare(
    slots: list[Slot], offsets: list[int], mine: Held, data: Tensor
) -> tuple[list[_Write], str | None]:
    """This rank's part of a repair, modifying nothing: its sources' bytes in ``data``, and its
    targets (with the state tensors to put into the optimizer); or why it cannot do its part."""
    rank, stage = dist.get_rank(), mine.at.index
    index = {entry.name: i for i, entry in enumerate(mine.entries)}
    writes: list[_Write] = []
    try:
        for slot, start in zip(slots, offsets, strict=False):
            if slot.stage != stage:
                continue
            if slot.mismatch.reference == rank:
                source = mine.local[index[slot.name]]
                varies = _varies(source, slot)
                if varies is not None:
                    return [], varies
                data[start : start + slot.nbytes] = _bytes(source).to(data.device)
            elif rank in slot.targets and rank in slot.mismatch.missing:
                new = _new_state(slot.template, mine.params[slot.template.owner])
                writes.append((slot, start, local_tensor(new), new))
            elif rank in slot.targets:
                writes.append((slot, start, mine.local[index[slot.name]], None))
    except Exception as error:  # raised on this rank only: every rank must hear of it
        return [], f"rank {rank} failed: {type(error).__name__}: {error}"
    return writes, None


def _unwritable(slot: Slot) -> str | None:
    """Why a target of ``slot`` cannot take its source's bits whatever they are, or None."""
    if not slot.shared:
        return None
    rank, strides = next(iter(slot.shared.items()))
    return (
        f"{_whose(tuple(slot.shared))} of {slot.name} may hold elements that share memory "
        f"(rank {rank}'s strides: {strides}), so it cannot take its source's bits element by "
        "element"
    )


def _varies(source: Tensor, slot: Slot) -> str | None:
    """Why ``source`` cannot be written into the targets of ``slot`` that broadcast some dims (its
    values vary along one), or None."""
    words = _integers(source)
    for dim, ranks in sorted(slot.broadcast.items()):
        if not torch.equal(words, words.narrow(dim, 0, 1).expand_as(words)):
            verb = "broadcasts" if len(ranks) == 1 else "broadcast"
            return (
                f"rank {slot.mismatch.reference}'s copy of {slot.name} (the source) varies along "
                f"dim {dim}, which {_whose(ranks)} {verb} (stride 0): it cannot hold those values"
            )
    return None


def _whose(ranks: tuple[int, ...]) -> str:
    return f"rank {ranks[0]}'s copy" if len(ranks) == 1 else f"the copies of {_ranks(ranks)}"


def _cannot(problems: list[str], failure: Failure) -> str:
    """The error of a repair that cannot be done."""
    shared = _shared_on_some(failure.aliases)
    return (
        f"{WHAT}: cannot repair the copies that differ: {'; '.join(problems)}. Nothing was "
        f"modified: {listed(slot.mismatch for slot in failure.slots)}.{shared} "
        f"{'Otherwise reload' if shared else 'Reload'} the last checkpoint on every rank. "
        f"{_CAUSES}"
    )


def _new_state(template: _Record, param: Tensor) -> Tensor:
    """A new state tensor for ``param`` shaped as ``template`` says."""
    if template.like_owner:
        return torch.empty_like(param.detach(), dtype=template.dtype)
    device = torch.device("cpu") if template.on_cpu else local_tensor(param).device
    return torch.empty(template.shape, dtype=template.dtype, device=device)


_INTEGERS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _integers(tensor: Tensor) -> Tensor:
    """The elements of ``tensor`` as integers of their size, bit for bit: a view under any
    strides, for every dtype (a 16-byte complex128 as two int64s along a last dim). Copies of
    integers keep every bit, where a bool copy would not."""
    if tensor.element_size() == 16:
        return torch.view_as_real(tensor).view(torch.int64)
    return tensor.view(_INTEGERS[tensor.element_size()])


def _bytes(tensor: Tensor) -> Tensor:
    """The raw bytes of ``tensor``'s elements in row-major order, flat (a view where ``tensor``
    is contiguous)."""
    return _integers(tensor).contiguous().view(-1).view(torch.uint8)


def _write(target: Tensor, data: Tensor) -> None:
    """``data`` (raw bytes in row-major order, at an offset aligned to 16 bytes) into
    ``target``, bit for bit, under any strides: along a dim that ``target`` broadcasts, the
    element it holds once (``data`` does not vary along it)."""
    words = _integers(target)
    once = tuple(slice(0, 1) if stride == 0 else slice(None) for stride in words.stride())
    words[once].copy_(data.view(words.dtype).view(words.shape)[once])


# ---------------------------------------------------------------------------------------------
# messages


_LISTED = 8


def _ranks(ranks: Iterable[int]) -> str:
    ranks = list(ranks)
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}"


def _phrase(m: Mismatch) -> str:
    """What differs in one group, and how its source was decided."""
    if m.reference is None:
        present = " / ".join(_ranks(ranks) for ranks in m.copies)
        held = f"{len(m.copies)} different copies: {present}" if len(m.copies) > 1 else present
        if m.missing:
            held = f"{held if len(m.copies) > 1 else 'on ' + held}, missing on {_ranks(m.missing)}"
        size = sum(map(len, m.copies)) + len(m.missing)
        if 2 * len(m.missing) > size:
            return f"{held}; missing on most copies"
        return f"{held}; no strict majority"
    wrong = [rank for rank in m.ranks if rank not in m.missing]
    parts = []
    if wrong:
        verb = "differs" if len(wrong) == 1 else "differ"
        parts.append(f"{_ranks(wrong)} {verb} from rank {m.reference}")
    elif m.missing:  # the copies that exist agree
        parts.append(f"on {_ranks(m.copies[0])}")
    if m.missing:
        parts.append(f"missing on {_ranks(m.missing)}")
    how = (
        f"a strict majority holds rank {m.reference}'s copy"
        if m.decided_by == MAJORITY
        else f"repair_from names rank {m.reference}"
    )
    return f"{', '.join(parts)}; {how}"


def listed(mismatches: Iterable[Mismatch]) -> str:
    """Each group that differs, with its ranks, in one line (the first few)."""
    items = [f"{m.name} ({_phrase(m)})" for m in mismatches]
    shown = "; ".join(items[:_LISTED])
    return shown + (f"; and {len(items) - _LISTED} more" if len(items) > _LISTED else "")


_CAUSES = (
    "Find the cause first: a scaler that decides per mesh, a wrong checkpoint shard, a "
    "nondeterministic kernel, a faulty device."
)


def _shared_on_some(aliases: list[str]) -> str:
    """The sentence naming the differing tensors that share memory on some ranks only."""
    if not aliases:
        return ""
    more = f"; and {len(aliases) - _LISTED} more" if len(aliases) > _LISTED else ""
    return (
        f" Memory shared on some ranks only: {'; '.join(aliases[:_LISTED])}{more}. A tensor "
        "assigned by reference (m.ema = m.w.detach()) holds no copy of its own: give it one "
        "(.clone()) before a repair."
    )


def describe(failure: Failure, buffer_names: set[str]) -> str:
    """The error of a check without repair: every differing group, named, and the differing
    tensors that share memory with another on some ranks only."""
    mismatches = [slot.mismatch for slot in failure.slots]
    tensors = len({m.name for m in mismatches})
    verb = "holds" if tensors == 1 else "hold"
    what = (
        "different bits, or no copy at all,"
        if any(m.missing for m in mismatches)
        else ("different bits")
    )
    repair = (
        "pass repair=True to copy over the others the copy a strict majority of each group holds"
    )
    if any(m.reference is None for m in mismatches):
        repair += (
            "; where no strict majority exists, nothing tells which copy is right: reload the "
            "last checkpoint on every rank, or name the ranks whose copies are right with "
            "repair_from (the ranks that just reloaded a checkpoint)"
        )
    hint = ""
    if any(m.name in buffer_names for m in mismatches):
        hint = (
            " If a buffer is rank-local by design (a per-band latitude weight under domain "
            "parallelism), declare it: distinct_along=[(buffers, group)]. If these are running "
            "statistics that each rank updates from its own batch (BatchNorm without "
            "SyncBatchNorm), pass buffers=False."
        )
    return (
        f"{WHAT}: {tensors} of the {failure.compared} tensors with copies {verb} {what} on "
        f"ranks that hold copies of them: {listed(mismatches)}."
        f"{_shared_on_some(failure.aliases)} Nothing was modified: {repair}. {_CAUSES}{hint}"
    )


def refusal(failure: Failure, repair_from: tuple[int, ...]) -> str:
    """The error of a repair refused: the groups where nothing tells which copy is right, and
    the differing tensors that share memory with another on some ranks only."""
    mismatches = [slot.mismatch for slot in failure.slots]
    refused = [m for m in mismatches if m.reference is None]
    others = [m for m in mismatches if m.reference is not None]
    tensors = len({m.name for m in mismatches})
    named = ""
    if repair_from:
        named = f" (repair_from={list(repair_from)} names no rank of theirs that holds a copy)"
    rest = f" The others could be repaired: {listed(others)}." if others else ""
    return (
        f"{WHAT}: cannot repair {len({m.name for m in refused})} of the {tensors} tensors whose "
        f"copies differ, as nothing tells which copy is right{named}: {listed(refused)}."
        f"{_shared_on_some(failure.aliases)} Nothing was modified. Reload the last checkpoint "
        "on every rank, or name the ranks whose copies are right with repair_from (for "
        f"instance the ranks that just reloaded a checkpoint). {_CAUSES}{rest}"
    )
