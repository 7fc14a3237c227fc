"""The replica check's repair: each group's source copy over its other copies, all or nothing.

The differing copies get their source's bytes in one all_reduce: whatever can fail is done or
checked on every rank before that all_reduce, which carries each rank's failure flag, and nothing is
written where one is set. Copies are read and written as their elements in row-major order, under
any strides; a copy that shares memory with another tensor of its rank is written only where the
write leaves that tensor with the bits it should hold (its own, or its source's), as every rank's
records prove (``sharing``).
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch
import torch.distributed as dist
from torch import Tensor

from credit.parallel._common.compat import local_tensor
from credit.parallel._replicas.messages import cannot, whose_copy
from credit.parallel._replicas.records import Failure, Held, Slot, TensorRecord


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
        return cannot(refused, failure)
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
        return cannot([why for why in problems if why is not None], failure)
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
    rank, stage = dist.get_rank(), mine.stages.index
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
        f"{whose_copy(tuple(slot.shared))} of {slot.name} may hold elements that share memory "
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
                f"dim {dim}, which {whose_copy(ranks)} {verb} (stride 0): it cannot hold those "
                "values"
            )
    return None


def _new_state(template: TensorRecord, param: Tensor) -> Tensor:
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
