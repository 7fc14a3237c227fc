"""Memory that the replica check's copies share, and what a repair's writes through it would do.

A copy may share memory with another tensor of its rank (a view, a tied weight, ``m.ema =
m.w.detach()``), found from storage offsets on the host, no value read; or its own elements may
share memory (a broadcast dim, overlapping strides). A repair writes its source's elements into
each differing copy, so before anything is written every rank decides, from every rank's records,
whether each write leaves every tensor sharing that memory with the bits it should hold.
"""

from __future__ import annotations

from torch import Tensor

from credit.parallel._common import aliasing as _aliasing
from credit.parallel._replicas.messages import name_ranks, through
from credit.parallel._replicas.records import Held, RecordsByStage, Slot, TensorRecord


def shared_memory(mine: Held) -> list[tuple[tuple[str, int], ...]]:
    """Per tensor, the other tensors of this rank that share memory with it, each with the
    distance in bytes from the other's first element to its own (read from their storage
    offsets, on the host: no value is read)."""
    found: list[list[tuple[str, int]]] = [[] for _ in mine.local]
    for i, j in _aliasing.sharing(list(mine.local)):
        distance = _first_byte(mine.local[i]) - _first_byte(mine.local[j])
        found[i].append((mine.entries[j].name, distance))
        found[j].append((mine.entries[i].name, -distance))
    return [tuple(sorted(shared)) for shared in found]


def _first_byte(tensor: Tensor) -> int:
    """Where a tensor's first element lies in its storage, in bytes."""
    return int(tensor.storage_offset()) * tensor.element_size()


def broadcast_dims(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...]:
    """The dims along which a tensor repeats one element (stride 0, an expanded tensor)."""
    return tuple(
        d
        for d, (size, stride) in enumerate(zip(shape, strides, strict=True))
        if not stride and size > 1
    )


def may_share_memory(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
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


def written_through(slots: list[Slot], stages: RecordsByStage) -> list[str]:
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
    return [through(*key, tuple(ranks)) for key, ranks in found.items()]


def _clash(
    records: dict[int, dict[str, TensorRecord]],
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


def aliases(slots: list[Slot], stages: RecordsByStage) -> list[str]:
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
                where = f"on {name_ranks(having)}, not on {name_ranks(lacking)}"
            elif len(at) > 1:
                where = f"at different offsets on {' / '.join(map(name_ranks, at.values()))}"
            else:
                continue
            notes.append(f"{slot.name} shares memory with {other} {where}")
    return notes
