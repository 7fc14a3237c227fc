"""In-place averaging of many tensors in few, large all_reduces.

Tensors are packed, in order, into buckets of at most ``bucket_cap_bytes`` per (device, dtype).
Two bucket buffers per (device, dtype) are kept between calls and used in turn: while bucket k is
in flight, bucket k+1 is being filled and bucket k-1 copied back. A contiguous tensor as large as a
bucket is reduced in place, and tensors that already tile one contiguous buffer (see
``contiguous_grads_``) reduce that buffer directly: neither costs a copy. Every collective of a
call is issued before the call returns and waited for.

Collectives per call, per (device, dtype): one when the tensors tile one buffer; otherwise one per
contiguous tensor of at least ``cap`` elements plus one per bucket, where the other non-empty
tensors fill buckets greedily in order and a bucket closes when the next tensor would take it past
``cap`` elements (``cap = bucket_cap_bytes // itemsize``). The buffers therefore stay within the
cap, except for a non-contiguous tensor larger than the cap, which gets a bucket of its own size.

On CPU the collective is a SUM and the division by the group size happens while the result is
copied back. gloo's ``ReduceOp.AVG`` is itself a SUM followed by a division pass over the buffer,
so this gives the same bits with one pass over the memory less.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from credit.parallel._foreach import group_by_device_and_dtype
from credit.parallel._groups import Averaging, averaging

logger = logging.getLogger(__name__)

_Kind = tuple[torch.device, torch.dtype]
_Shapes = tuple[torch.Size, ...]


@dataclass
class _Slot:
    """A bucket buffer, with the views of it already cut for the bucket layouts it has served.

    Cutting a view costs microseconds of Python per tensor, more than copying a small tensor, and
    a training loop passes the same shapes every step.
    """

    buffer: Tensor
    views: dict[_Shapes, list[Tensor]] = field(default_factory=dict)


# Kept between calls, as DDP keeps its buckets: two per (device, dtype), each at most the cap.
_bucket_buffers: dict[_Kind, list[_Slot]] = {}

# Bucket layouts whose views each buffer keeps (the oldest is dropped first).
_MAX_LAYOUTS_PER_BUFFER = 16

# Below this many elements per tensor (on average over a bucket), one division of the whole bucket
# followed by one foreach copy beats a division fused into a per-tensor copy (Python overhead).
_FUSED_DIVIDE_MIN_NUMEL = 1 << 14


@dataclass
class _Bucket:
    tensors: list[Tensor] = field(default_factory=list)
    shapes: list[torch.Size] = field(default_factory=list)
    numel: int = 0


@dataclass
class _InFlight:
    work: dist.Work
    flat: Tensor
    views: list[Tensor]
    tensors: list[Tensor]


def average_(tensors: list[Tensor], group: ProcessGroup | None, bucket_cap_bytes: int) -> None:
    """Average every tensor in ``tensors`` in place over ``group`` (all ranks pass the same layout).

    Args:
        tensors: plain tensors (DTensors already unwrapped to their local shards).
        group: the process group to average over (None for the world).
        bucket_cap_bytes: the largest bucket, in bytes.
    """
    in_place: list[tuple[dist.Work, Tensor, int]] = []
    for (device, dtype), same_kind in group_by_device_and_dtype(tensors).items():
        reduction = _averaging(group, device)
        base = _tiled_buffer(same_kind)
        if base is not None:
            in_place.append(_launch(base, reduction, group))
            continue
        cap = max(1, bucket_cap_bytes // dtype.itemsize)
        direct, packed = _split_direct(same_kind, cap)
        in_place.extend(_launch(tensor, reduction, group) for tensor in direct)
        _reduce_in_buckets(packed, (device, dtype), cap, reduction, group)
    for work, tensor, divisor in in_place:
        work.wait()
        if divisor != 1:
            tensor.div_(divisor)


def _averaging(group: ProcessGroup | None, device: torch.device) -> Averaging:
    """On CPU always SUM: the division is then fused into the copy back (see the module doc)."""
    if device.type == "cpu":
        return Averaging(dist.ReduceOp.SUM, dist.get_world_size(group))
    return averaging(group, device)


def _launch(
    tensor: Tensor, reduction: Averaging, group: ProcessGroup | None
) -> tuple[dist.Work, Tensor, int]:
    work = dist.all_reduce(tensor, op=reduction.op, group=group, async_op=True)
    assert work is not None
    return work, tensor, reduction.divisor


def _split_direct(tensors: list[Tensor], cap: int) -> tuple[list[Tensor], list[Tensor]]:
    """(tensors reduced in place, non-empty tensors that go through buckets)."""
    direct: list[Tensor] = []
    packed: list[Tensor] = []
    for tensor in tensors:
        numel = tensor.numel()
        if numel >= cap and tensor.is_contiguous():
            direct.append(tensor)
        elif numel > 0:
            packed.append(tensor)
    return direct, packed


def _reduce_in_buckets(
    tensors: list[Tensor],
    kind: _Kind,
    cap: int,
    reduction: Averaging,
    group: ProcessGroup | None,
) -> None:
    buckets = _pack(tensors, cap)
    if not buckets:
        return
    slots = _slots(kind, max(b.numel for b in buckets), count=min(2, len(buckets)))
    in_flight: _InFlight | None = None
    for index, bucket in enumerate(buckets):
        slot = slots[index % 2]
        flat = slot.buffer[: bucket.numel]
        views = _views(slot, bucket)
        torch._foreach_copy_(views, bucket.tensors)
        work = dist.all_reduce(flat, op=reduction.op, group=group, async_op=True)
        assert work is not None
        if in_flight is not None:
            _copy_back(in_flight, reduction.divisor)
        in_flight = _InFlight(work, flat, views, bucket.tensors)
    assert in_flight is not None
    _copy_back(in_flight, reduction.divisor)


def _copy_back(done: _InFlight, divisor: int) -> None:
    done.work.wait()
    if divisor == 1:
        torch._foreach_copy_(done.tensors, done.views)
    elif done.flat.numel() >= _FUSED_DIVIDE_MIN_NUMEL * len(done.tensors):
        for view, tensor in zip(done.views, done.tensors, strict=True):
            torch.div(view, divisor, out=tensor)
    else:
        done.flat.div_(divisor)
        torch._foreach_copy_(done.tensors, done.views)


def _pack(tensors: list[Tensor], cap: int) -> list[_Bucket]:
    buckets: list[_Bucket] = []
    bucket = _Bucket()
    for tensor in tensors:
        numel = tensor.numel()
        if bucket.tensors and bucket.numel + numel > cap:
            buckets.append(bucket)
            bucket = _Bucket()
        bucket.tensors.append(tensor)
        bucket.shapes.append(tensor.shape)
        bucket.numel += numel
    if bucket.tensors:
        buckets.append(bucket)
    return buckets


def _views(slot: _Slot, bucket: _Bucket) -> list[Tensor]:
    """Views of the start of ``slot``'s buffer, one per tensor of ``bucket``, in order."""
    shapes = tuple(bucket.shapes)
    views = slot.views.get(shapes)
    if views is None:
        pieces = slot.buffer[: bucket.numel].split([t.numel() for t in bucket.tensors])
        views = [piece.view(shape) for piece, shape in zip(pieces, shapes, strict=True)]
        if len(slot.views) >= _MAX_LAYOUTS_PER_BUFFER:
            del slot.views[next(iter(slot.views))]
        slot.views[shapes] = views
    return views


def _slots(kind: _Kind, numel: int, count: int) -> list[_Slot]:
    slots = _bucket_buffers.setdefault(kind, [])
    for index in range(count):
        if index == len(slots):
            slots.append(_Slot(torch.empty(0, device=kind[0], dtype=kind[1])))
        if slots[index].buffer.numel() < numel:
            logger.debug("bucket buffer %d for %s grows to %d elements", index, kind, numel)
            slots[index] = _Slot(torch.empty(0))  # free the old buffer (and its views) first
            slots[index] = _Slot(torch.empty(numel, device=kind[0], dtype=kind[1]))
    return slots


def _tiled_buffer(tensors: list[Tensor]) -> Tensor | None:
    """The contiguous buffer that ``tensors`` exactly tile as consecutive views, if there is one."""
    base = tensors[0]._base
    if base is None or not base.is_contiguous():
        return None
    offset = base.storage_offset()
    for tensor in tensors:
        if tensor._base is not base or not tensor.is_contiguous():
            return None
        if tensor.storage_offset() != offset:
            return None
        offset += tensor.numel()
    return base if offset == base.storage_offset() + base.numel() else None


def kept_buffer_bytes() -> int:
    """Bytes held between calls by the bucket buffers, over every (device, dtype)."""
    return sum(
        slot.buffer.numel() * slot.buffer.element_size()
        for slots in _bucket_buffers.values()
        for slot in slots
    )


def release_buffers() -> None:
    """Drop the kept bucket buffers (the next call allocates them again)."""
    _bucket_buffers.clear()
