"""The replica check's failures: copies that differ, named the same way on every rank, told
apart from layouts that cannot be compared, and repaired.

Only a failed proof (``replicas``) comes here. Every rank gathers what every other holds (one
``all_gather_object``: names, layouts, digests), so every rank raises the same error; or the
differing copies get their source's bytes in one all_reduce. The source of a group of copies is
the copy a strict majority holds, else the reference (of two copies that differ, nothing tells
which is right).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from credit.parallel import _ownership
from credit.parallel._ownership import CopyGroup, Holding, Stages

WHAT = "verify_replicas"


@dataclass(frozen=True)
class Mismatch:
    """One tensor whose copies differ from the reference copy.

    Attributes:
        name: the tensor: a parameter's or buffer's name, or ``"exp_avg of blocks.0.q.weight"``.
        reference: the rank whose copy the others are compared with, and a repair copies: the
            lowest rank of a strict majority of identical copies, else the reference copy.
        ranks: the ranks whose copy differs from it.
    """

    name: str
    reference: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class _Record:
    """What one rank holds of one tensor, gathered only when the proof fails."""

    index: int
    description: str  # its name and global layout: the same on every rank of the stage
    key: tuple[int, ...] | None  # its copy group (None: no copies)
    is_reference: bool
    digest: tuple[int, ...] | None
    coverage: int
    nbytes: int


@dataclass(frozen=True)
class Slot:
    """One group of copies that differ: where the repair reads and writes it."""

    stage: int
    index: int
    key: tuple[int, ...]
    nbytes: int
    members: frozenset[int]
    mismatch: Mismatch


@dataclass(frozen=True)
class Held:
    """What this rank holds: each tensor's name, local tensor, holding and copy group, in the
    order every rank of the stage shares, and the stages."""

    names: list[str]
    local: list[Tensor]
    held: list[Holding]
    groups: list[CopyGroup | None]
    at: Stages


def diagnose(
    mine: Held, digests: dict[int, list[int]], error: str | None
) -> tuple[list[Slot], int]:
    """Gather every rank's records; raise for a layout that cannot be compared, else return the
    groups of copies that differ and the number of tensors with copies in every stage (the same
    on every rank).

    Args:
        mine: what this rank holds.
        digests: the digest of each tensor with copies, by index.
        error: why this rank's layout cannot be counted, or None.

    Raises:
        ValueError: a rank's layout has an error (a mesh across stages, a distinct_along group
            that overlaps its mesh).
        RuntimeError: the ranks of a stage hold different tensors, a tensor's shards do not add
            up to whole copies, or the ranks disagree on the references.
    """
    records = []
    for index, (name, local, held, group) in enumerate(
        zip(mine.names, mine.local, mine.held, mine.groups, strict=True)
    ):
        compared = index in digests
        records.append(
            _Record(
                index=index,
                description=f"{name} ({held.description})",
                key=group.key if group is not None and compared else None,
                is_reference=group is not None and group.is_reference,
                digest=tuple(digests[index]) if compared else None,
                coverage=_ownership.coverage(held, mine.at),
                nbytes=local.numel() * local.element_size(),
            )
        )
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (dist.get_rank(), mine.at.index, error, records))
    for rank, _, their_error, _ in everyone:
        if their_error is not None:
            raise ValueError(f"{WHAT}: {their_error} (rank {rank}). Nothing was modified.")
    by_stage: dict[int, dict[int, list[_Record]]] = {}
    for rank, stage, _, theirs in everyone:
        by_stage.setdefault(stage, {})[rank] = theirs
    _refuse_different_tensors(by_stage)
    _refuse_missing_copies(by_stage)
    total = sum(
        1 for ranks in by_stage.values() for r in next(iter(ranks.values())) if r.key is not None
    )
    slots = [slot for stage, ranks in sorted(by_stage.items()) for slot in _differing(stage, ranks)]
    if not slots:
        raise RuntimeError(
            f"{WHAT}: the copies' sums did not vanish, yet every copy has its reference's "
            "digest: the ranks disagree on which copy is the reference. Nothing was modified."
        )
    return slots, total


def _refuse_different_tensors(by_stage: dict[int, dict[int, list[_Record]]]) -> None:
    for stage, ranks in sorted(by_stage.items()):
        first = min(ranks)
        for rank in sorted(ranks):
            ours, theirs = ranks[first], ranks[rank]
            for index in range(max(len(ours), len(theirs))):
                a = ours[index].description if index < len(ours) else "nothing"
                b = theirs[index].description if index < len(theirs) else "nothing"
                if a != b:
                    within = f" of pipeline stage {stage}" if len(by_stage) > 1 else ""
                    raise RuntimeError(
                        f"{WHAT}: the ranks{within} hold different tensors, so their copies "
                        f"cannot be compared: at position {index}, rank {first} has {a}, rank "
                        f"{rank} has {b} (rank {first} holds {len(ours)} tensors, rank {rank} "
                        f"{len(theirs)}). Nothing was modified."
                    )


def _refuse_missing_copies(by_stage: dict[int, dict[int, list[_Record]]]) -> None:
    for stage, ranks in sorted(by_stage.items()):
        records = list(ranks.values())
        for index, record in enumerate(records[0]):
            if sum(theirs[index].coverage for theirs in records):
                where = f"stage {stage}" if len(by_stage) > 1 else "the world"
                raise RuntimeError(
                    f"{WHAT}: cannot tell the copies of {record.description} apart: its shards "
                    f"do not add up to whole copies on the ranks of {where}. Every rank of a "
                    "stage must hold every parameter, each on its own copy of its mesh; pass "
                    "pipeline stages as pp_group. Nothing was modified."
                )


def _differing(stage: int, ranks: dict[int, list[_Record]]) -> list[Slot]:
    groups: dict[tuple, list[tuple[int, _Record]]] = {}
    for rank in sorted(ranks):
        for record in ranks[rank]:
            if record.key is not None:
                groups.setdefault((record.index, record.key), []).append((rank, record))
    slots = []
    for (index, key), members in sorted(groups.items()):
        source_rank, source = _source(members)
        differ = tuple(rank for rank, r in members if r.digest != source.digest)
        if differ:
            name = source.description.split(" (", 1)[0]
            slots.append(
                Slot(
                    stage=stage,
                    index=index,
                    key=key,
                    nbytes=source.nbytes,
                    members=frozenset(rank for rank, _ in members),
                    mismatch=Mismatch(name, source_rank, differ),
                )
            )
    return slots


def _source(members: list[tuple[int, _Record]]) -> tuple[int, _Record]:
    """The copy the others are compared with and repaired from: the one a strict majority of the
    group holds, else the reference (of two copies that differ, nothing tells which is right)."""
    counts = Counter(record.digest for _, record in members)
    digest, count = counts.most_common(1)[0]
    if 2 * count > len(members):
        return next((rank, r) for rank, r in members if r.digest == digest)
    return next((m for m in members if m[1].is_reference), members[0])


def repair(slots: list[Slot], local: list[Tensor], stage: int, device: torch.device) -> None:
    """Each group's source copy (see :func:`_source`) over its other copies, in one all_reduce
    of their bytes: the source sends its bytes, every other rank zeros.

    Args:
        slots: the groups of copies that differ, the same list on every rank.
        local: this rank's local tensors, by index.
        stage: this rank's pipeline stage.
        device: where the collective's buffer lives.
    """
    offsets = [0]
    for slot in slots:
        offsets.append(offsets[-1] + slot.nbytes)
    buffer = torch.zeros(offsets[-1], dtype=torch.uint8, device=device)
    rank = dist.get_rank()
    for slot, start in zip(slots, offsets, strict=False):
        if slot.stage == stage and slot.mismatch.reference == rank:
            buffer[start : start + slot.nbytes] = _bytes(local[slot.index]).to(device)
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
    for slot, start in zip(slots, offsets, strict=False):
        if slot.stage == stage and rank in slot.members and slot.mismatch.reference != rank:
            target = local[slot.index]
            source = buffer[start : start + slot.nbytes].to(target.device)
            target.copy_(source.view(target.dtype).view(target.shape))


def _bytes(tensor: Tensor) -> Tensor:
    flat = tensor.reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(torch.uint8)


_LISTED = 8


def listed(mismatches: Iterable[Mismatch]) -> str:
    items = [
        f"{m.name} ({', '.join(f'rank {r}' for r in m.ranks)} "
        f"{'differs' if len(m.ranks) == 1 else 'differ'} from rank {m.reference})"
        for m in mismatches
    ]
    shown = "; ".join(items[:_LISTED])
    return shown + (f"; and {len(items) - _LISTED} more" if len(items) > _LISTED else "")


def describe(mismatches: tuple[Mismatch, ...], compared: int, buffer_names: set[str]) -> str:
    tensors = len({m.name for m in mismatches})
    hint = ""
    if any(m.name in buffer_names for m in mismatches):
        hint = (
            " If these are running statistics that each rank updates from its own batch "
            "(BatchNorm without SyncBatchNorm), pass buffers=False."
        )
    verb = "holds" if tensors == 1 else "hold"
    return (
        f"{WHAT}: {tensors} of the {compared} tensors with copies {verb} different bits on ranks "
        f"that hold copies of them: {listed(mismatches)}. Nothing was modified: pass "
        "repair=True to copy each reference copy over the copies that differ (after finding "
        "the cause: a scaler that decides per mesh, a wrong checkpoint shard, a nondeterministic "
        f"kernel, a faulty device).{hint}"
    )
