"""In-place averaging of many tensors in few, large all_reduces.

Tensors are packed, in order, into buckets of at most ``bucket_cap_bytes`` per (device, dtype).
Two bucket buffers per (device, dtype) are kept between calls and used in turn: while bucket k is
in flight, bucket k+1 is being filled. A contiguous tensor as large as a bucket is reduced in
place, and tensors that already tile one contiguous buffer (see ``contiguous_grads_``) reduce that
buffer directly: neither costs a copy.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from credit.parallel._foreach import group_by_device_and_dtype
from credit.parallel._groups import supports_native_avg

logger = logging.getLogger(__name__)

# Kept between calls, as DDP keeps its buckets: two per (device, dtype), each at most the cap.
_bucket_buffers: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}


@dataclass
class _Bucket:
    tensors: list[Tensor] = field(default_factory=list)
    numel: int = 0


def average_(tensors: list[Tensor], group: ProcessGroup | None, bucket_cap_bytes: int) -> None:
    """Average every tensor in ``tensors`` in place over ``group`` (all ranks pass the same layout)."""
    world = dist.get_world_size(group)
    for (device, dtype), same_kind in group_by_device_and_dtype(tensors).items():
        native_avg = supports_native_avg(group, device)
        op = dist.ReduceOp.AVG if native_avg else dist.ReduceOp.SUM
        divisor = 1 if native_avg else world
        base = _tiled_buffer(same_kind)
        if base is not None:
            _reduce(base, op, group, divisor)
            continue
        cap = max(1, bucket_cap_bytes // dtype.itemsize)
        direct = [t for t in same_kind if t.numel() >= cap and t.is_contiguous()]
        for tensor in direct:
            _reduce(tensor, op, group, divisor)
        packed = [
            t for t in same_kind if t.numel() > 0 and not (t.numel() >= cap and t.is_contiguous())
        ]
        _reduce_in_buckets(packed, (device, dtype), cap, op, group, divisor)


def _reduce(tensor: Tensor, op: dist.ReduceOp.RedOpType, group: ProcessGroup | None, divisor: int) -> None:
    dist.all_reduce(tensor, op=op, group=group)
    if divisor != 1:
        tensor.div_(divisor)


def _reduce_in_buckets(
    tensors: list[Tensor],
    kind: tuple[torch.device, torch.dtype],
    cap: int,
    op: dist.ReduceOp.RedOpType,
    group: ProcessGroup | None,
    divisor: int,
) -> None:
    buckets = list(_pack(tensors, cap))
    if not buckets:
        return
    buffers = _buffers(kind, max(b.numel for b in buckets), count=min(2, len(buckets)))
    in_flight: tuple[dist.Work, Tensor, _Bucket] | None = None
    for index, bucket in enumerate(buckets):
        flat = buffers[index % 2][: bucket.numel]
        torch._foreach_copy_(_views(flat, bucket.tensors), bucket.tensors)
        work = dist.all_reduce(flat, op=op, group=group, async_op=True)
        if in_flight is not None:
            _finish(*in_flight, divisor)
        in_flight = (work, flat, bucket)
    assert in_flight is not None
    _finish(*in_flight, divisor)


def _finish(work: dist.Work, flat: Tensor, bucket: _Bucket, divisor: int) -> None:
    work.wait()
    if divisor != 1:
        flat.div_(divisor)
    torch._foreach_copy_(bucket.tensors, _views(flat, bucket.tensors))


def _pack(tensors: list[Tensor], cap: int) -> Iterator[_Bucket]:
    bucket = _Bucket()
    for tensor in tensors:
        if bucket.tensors and bucket.numel + tensor.numel() > cap:
            yield bucket
            bucket = _Bucket()
        bucket.tensors.append(tensor)
        bucket.numel += tensor.numel()
    if bucket.tensors:
        yield bucket


def _views(flat: Tensor, tensors: list[Tensor]) -> list[Tensor]:
    pieces = flat.split([t.numel() for t in tensors])
    return [piece.view(t.shape) for piece, t in zip(pieces, tensors, strict=False)]


def _buffers(kind: tuple[torch.device, torch.dtype], numel: int, count: int) -> list[Tensor]:
    buffers = _bucket_buffers.setdefault(kind, [])
    for index in range(count):
        if index == len(buffers):
            buffers.append(torch.empty(0, device=kind[0], dtype=kind[1]))
        if buffers[index].numel() < numel:
            logger.debug("bucket buffer %d for %s grows to %d elements", index, kind, numel)
            buffers[index] = torch.empty(numel, device=kind[0], dtype=kind[1])
    return buffers


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
