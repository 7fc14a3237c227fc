"""The replica check's diagnosis: which copies differ or are missing, named the same way on every
rank, told apart from layouts that cannot be compared, each with the source a repair would take.

Only a failed proof comes here. Every rank gathers what every other holds (one
``all_gather_object``: names, layouts, digests, and the arguments that must agree), so every rank
reaches the same verdict and raises the same error. Tensors are matched by name: rank-local
tensors (no copies) need not line up across ranks, so optimizer state created lazily on some ranks
only is no layout error; a copy of optimizer state that one member of a group lacks is a mismatch
like a copy with other bits.

The source of a group of copies is the copy a strict majority of its members holds, else the copy
of the first rank the caller names in ``repair_from`` that holds one. Where neither exists (two
copies that differ, two against two), nothing tells which copy is right: the group is named with
every rank that disagrees, and a repair is refused on every rank, before anything is modified.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from credit.parallel._common import copy_groups as _copy_groups
from credit.parallel._common import holdings as _holdings
from credit.parallel._common import ownership as _ownership
from credit.parallel._replicas import sharing as _sharing
from credit.parallel._replicas.messages import WHAT, name_ranks
from credit.parallel._replicas.records import (
    MAJORITY,
    REPAIR_FROM,
    Failure,
    Held,
    Mismatch,
    Owner,
    Slot,
    TensorRecord,
)


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
    shares = _sharing.shared_memory(mine)
    records = [_record(mine, i, digests.get(i), shares[i]) for i in range(len(mine.entries))]
    # Only where this rank's layout can be counted: the others raise its error below.
    owners = {name: _owner(mine, name) for name in mine.params} if error is None else {}
    everyone: list = [None] * dist.get_world_size()
    mine_all = (dist.get_rank(), mine.stages.index, error, records, owners, arguments)
    dist.all_gather_object(everyone, mine_all)
    _refuse_different_arguments({rank: theirs for rank, *_, theirs in everyone})
    for rank, _, their_error, *_ in everyone:
        if their_error is not None:
            raise ValueError(f"{WHAT}: {their_error} (rank {rank}). Nothing was modified.")
    by_stage: dict[int, dict[int, tuple[dict[str, TensorRecord], dict[str, Owner]]]] = {}
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
    written = _sharing.written_through(slots, stages)
    return Failure(slots, compared, written, _sharing.aliases(slots, stages))


def _refuse_different_arguments(ranks: dict[int, Mapping[str, object]]) -> None:
    """Every argument that must be the same on every rank is."""
    differing = []
    for name in ranks[min(ranks)]:
        values: dict[str, list[int]] = {}
        for rank in sorted(ranks):
            values.setdefault(repr(ranks[rank][name]), []).append(rank)
        if len(values) > 1:
            held = ", ".join(f"{value} on {name_ranks(at)}" for value, at in values.items())
            differing.append(f"{name}: {held}")
    if differing:
        raise ValueError(
            f"{WHAT}: the ranks passed different arguments, which must be the same on every "
            f"rank: {'; '.join(differing)}. Nothing was modified."
        )


def _record(
    mine: Held, index: int, digest: list[int] | None, shares: tuple[tuple[str, int], ...]
) -> TensorRecord:
    entry, local, held = mine.entries[index], mine.local[index], mine.held[index]
    group = mine.groups[index]
    owner = mine.params.get(entry.owner_name)
    like_owner = owner is not None and _holdings.holding(owner).description == held.description
    return TensorRecord(
        name=entry.name,
        kind=entry.kind,
        description=held.description,
        key=group.key if group is not None and digest is not None else None,
        size=group.size if group is not None else 0,
        digest=tuple(digest) if digest is not None else None,
        coverage=_ownership.coverage(held, mine.stages),
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


def _owner(mine: Held, name: str) -> Owner:
    held = _holdings.holding(mine.params[name])
    plain = _holdings.holding(torch.empty(()))
    mark = mine.param_marks[name]
    keys = []
    for layout in (held, plain):
        group = None
        if _ownership.layout_error(layout, mine.stages, mark) is None:
            copies = _ownership.copies(layout, mine.stages, mark)
            group = _copy_groups.copy_group(layout, mine.lowest, mark, copies)
        keys.append(group.key if group is not None else None)
    return Owner(description=held.description, key=keys[0], plain_key=keys[1])


def _names_with_copies(ranks: dict[int, dict[str, TensorRecord]]) -> list[str]:
    """The tensors that have copies on some rank, in the order the lowest rank holds them."""
    seen: dict[str, None] = {}
    for rank in sorted(ranks):
        for name, record in ranks[rank].items():
            if record.key is not None:
                seen.setdefault(name)
    return list(seen)


def _refuse_different_tensors(ranks: dict[int, dict[str, TensorRecord]], within: str) -> None:
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


def _described(name: str, record: TensorRecord | None) -> str:
    return f"{name} ({record.description})" if record is not None else f"no {name}"


def _lined_up(records: dict[str, TensorRecord]) -> int:
    return sum(record.kind != "state" for record in records.values())


def _refuse_missing_copies(ranks: dict[int, dict[str, TensorRecord]], within: str) -> None:
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
    ranks: dict[int, tuple[dict[str, TensorRecord], dict[str, Owner]]],
    repair_from: tuple[int, ...],
) -> list[Slot]:
    named = {rank: records for rank, (records, _) in ranks.items()}
    slots = []
    for name in _names_with_copies(named):
        groups: dict[tuple[int, ...], list[tuple[int, TensorRecord]]] = {}
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
    ranks: dict[int, tuple[dict[str, TensorRecord], dict[str, Owner]]],
    groups: dict[tuple[int, ...], list[tuple[int, TensorRecord]]],
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
                f"{WHAT}: {name} exists on {name_ranks(holders)} and not on rank {rank}, where "
                f"its copy cannot be placed: {why}. Nothing was modified."
            )
        if key in groups:
            found.setdefault(key, []).append(rank)
    return found


def _decide(
    stage: int,
    members: list[tuple[int, TensorRecord]],
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
        for dim in _sharing.broadcast_dims(record.shape, record.strides):
            broadcast[dim] = (*broadcast.get(dim, ()), rank)
        if _sharing.may_share_memory(record.shape, record.strides):
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
