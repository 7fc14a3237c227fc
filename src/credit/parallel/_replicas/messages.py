"""The replica check's messages: its errors and its log, the same words on every rank.

Each is made from the :class:`~credit.parallel._replicas.records.Failure` that every rank diagnosed
alike, so every rank raises the same message: a check without repair (:func:`describe`), a repair
refused where nothing tells which copy is right (:func:`refusal`) or that cannot be written
(:func:`cannot`, with :func:`through` for a write through shared memory), and the groups repaired
or differing in one line (:func:`listed`).
"""

from __future__ import annotations

from collections.abc import Iterable

from credit.parallel._replicas.records import MAJORITY, Failure, Mismatch

WHAT = "verify_replicas"

# Groups and tensors named in one message, the others counted.
_LISTED = 8
_CAUSES = (
    "Find the cause first: a scaler that decides per mesh, a wrong checkpoint shard, a "
    "nondeterministic kernel, a faulty device."
)


def name_ranks(ranks: Iterable[int]) -> str:
    """``"rank 3"`` or ``"ranks 0, 1"``."""
    ranks = list(ranks)
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}"


def whose_copy(ranks: tuple[int, ...]) -> str:
    """``"rank 3's copy"`` or ``"the copies of ranks 0, 1"``."""
    return f"rank {ranks[0]}'s copy" if len(ranks) == 1 else f"the copies of {name_ranks(ranks)}"


def _phrase(m: Mismatch) -> str:
    """What differs in one group, and how its source was decided."""
    if m.reference is None:
        present = " / ".join(name_ranks(ranks) for ranks in m.copies)
        held = f"{len(m.copies)} different copies: {present}" if len(m.copies) > 1 else present
        if m.missing:
            held = held if len(m.copies) > 1 else f"on {held}"
            held = f"{held}, missing on {name_ranks(m.missing)}"
        size = sum(map(len, m.copies)) + len(m.missing)
        if 2 * len(m.missing) > size:
            return f"{held}; missing on most copies"
        return f"{held}; no strict majority"
    wrong = [rank for rank in m.ranks if rank not in m.missing]
    parts = []
    if wrong:
        verb = "differs" if len(wrong) == 1 else "differ"
        parts.append(f"{name_ranks(wrong)} {verb} from rank {m.reference}")
    elif m.missing:  # the copies that exist agree
        parts.append(f"on {name_ranks(m.copies[0])}")
    if m.missing:
        parts.append(f"missing on {name_ranks(m.missing)}")
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


def cannot(problems: list[str], failure: Failure) -> str:
    """The error of a repair that cannot be done."""
    shared = _shared_on_some(failure.aliases)
    return (
        f"{WHAT}: cannot repair the copies that differ: {'; '.join(problems)}. Nothing was "
        f"modified: {listed(slot.mismatch for slot in failure.slots)}.{shared} "
        f"{'Otherwise reload' if shared else 'Reload'} the last checkpoint on every rank. "
        f"{_CAUSES}"
    )


def through(
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
        f"{whose_copy(ranks)} of {name} {verb} memory with {other}, {reason}: writing {name} "
        f"{would} change {other} on {name_ranks(ranks)}"
    )
