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

Every element is averaged exactly once, whatever the list holds. Aliasing is resolved before any
collective, from each tensor's storage, offset, shape and strides: a tensor listed twice, or a view
whose elements all belong to another listed tensor, is averaged through that tensor and not on its
own; two tensors that share some elements without one holding the other make the call raise. The
tensors that remain share no element, so in-place collectives and bucket copies never touch the
same memory at once.

Ranks must issue the same collectives. The first call for each layout (the shapes, dtypes and the
path each tensor takes) and group verifies it across the group in one small all_reduce (see
``layout_check``) and raises on every rank when the ranks differ; later calls for that layout
issue only the data collectives.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from credit.parallel._common import aliasing as _aliasing
from credit.parallel._common.compat import group_indices_by_device_and_dtype
from credit.parallel._common.groups import Averaging, averaging
from credit.parallel._common.layout_check import verify_same_layout
from credit.parallel._common.scoped import ScopedCache

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
class _InFlight:
    work: dist.Work
    flat: Tensor
    views: list[Tensor]
    tensors: list[Tensor]


@dataclass
class _Bucket:
    tensors: list[Tensor] = field(default_factory=list)
    shapes: list[torch.Size] = field(default_factory=list)
    numel: int = 0


@dataclass
class _KindPlan:
    """The collectives of one (device, dtype): one buffer tiled by the tensors, or the tensors
    reduced in place plus buckets."""

    kind: _Kind
    tiled: Tensor | None
    direct: list[Tensor]
    buckets: list[_Bucket]


@dataclass
class BucketPlan:
    """What a call averages and how, decided before any collective.

    ``notes`` maps a tensor's index to what sets it apart from a bucketed tensor (reduced in
    place, averaged through another tensor, overlapping another); with the shapes, dtypes and the
    cap they decide every collective, so ranks that agree on them issue the same collectives.
    ``refusal`` is why the call must not average at all (the message raised on every rank).
    """

    kinds: list[_KindPlan]
    tensors: list[Tensor]
    notes: dict[int, str]
    cap_bytes: int
    refusal: str | None = None

    def refuse(self, index: int, note: str, message: str) -> None:
        """Refuse the call because of tensor ``index``: nothing will be averaged."""
        self.kinds, self.refusal = [], message
        self.notes[index] = note

    def key(self) -> tuple[object, ...]:
        """The collectives and the notes, as a key for the verified-layout cache."""
        collectives = tuple(
            (
                k.kind[1],
                None if k.tiled is None else k.tiled.numel(),
                tuple(t.shape for t in k.direct),
                *(tuple(bucket.shapes) for bucket in k.buckets),
            )
            for k in self.kinds
        )
        return self.cap_bytes, len(self.tensors), collectives, tuple(self.notes.items())

    def describe(self) -> list[str]:
        """One line per tensor for the layout check (and its error message)."""
        lines = []
        for index, tensor in enumerate(self.tensors):
            line = f"local shape={tuple(tensor.shape)} dtype={tensor.dtype}"
            note = self.notes.get(index)
            lines.append(line if note is None else f"{line} ({note})")
        return lines


def plan(tensors: list[Tensor], bucket_cap_bytes: int) -> BucketPlan:
    """Resolve aliasing and choose each tensor's path; no collective, nothing modified.

    Args:
        tensors: plain tensors (DTensors already unwrapped to their local shards).
        bucket_cap_bytes: the largest bucket, in bytes.
    """
    groups = group_indices_by_device_and_dtype(tensors)
    tiled = _tiled_buffers(tensors, groups)
    # Tensors that tile one buffer share no element: only the others need comparing, unless
    # they reach a tiled buffer too.
    loose = [i for kind, indices in groups.items() if kind not in tiled for i in indices]
    covered, overlap, addresses = _aliasing.covering(tensors, loose)
    if any(base.untyped_storage().data_ptr() in addresses for base in tiled.values()):
        tiled = {}
        covered, overlap, _ = _aliasing.covering(tensors, range(len(tensors)))
    notes = {index: f"averaged through gradient {owner}" for index, owner in covered.items()}
    if overlap is not None:
        first, second = overlap
        refused = BucketPlan([], tensors, notes, bucket_cap_bytes)
        refused.refuse(
            second,
            f"shares memory with gradient {first}",
            f"grads[{first}] and grads[{second}] (counting the gradients that are not None) share "
            "memory, but neither holds every element of the other, so the average of the shared "
            "elements is undefined. Pass memory once: the tensor that holds the other, or views "
            "that do not overlap. No gradient was modified.",
        )
        return refused
    kinds = []
    for kind, indices in groups.items():
        base = tiled.get(kind)
        if base is not None:
            notes.update(dict.fromkeys(indices, "tiles one buffer"))
            kinds.append(_KindPlan(kind, base, [], []))
            continue
        kept = [i for i in indices if i not in covered]
        cap = max(1, bucket_cap_bytes // kind[1].itemsize)
        kinds.append(_plan_kind(kind, kept, tensors, cap, notes))
    return BucketPlan(kinds, tensors, notes, bucket_cap_bytes)


def _tiled_buffers(tensors: list[Tensor], groups: dict[_Kind, list[int]]) -> dict[_Kind, Tensor]:
    """The buffer each (device, dtype) of tensors exactly tiles, for those that tile one."""
    tiled = {}
    for kind, indices in groups.items():
        base = _tiled_buffer([tensors[i] for i in indices])
        if base is not None:
            tiled[kind] = base
    return tiled


def _plan_kind(
    kind: _Kind, indices: list[int], tensors: list[Tensor], cap: int, notes: dict[int, str]
) -> _KindPlan:
    direct: list[Tensor] = []
    packed: list[Tensor] = []
    for index in indices:
        tensor = tensors[index]
        numel = tensor.numel()
        if numel >= cap and tensor.is_contiguous():
            notes[index] = "in place"
            direct.append(tensor)
        elif numel > 0:
            packed.append(tensor)
    return _KindPlan(kind, None, direct, _pack(packed, cap))


# (group, layout key) of the layouts verified across their group, under the current process group.
_verified: ScopedCache[tuple[object, ...], bool] = ScopedCache(64)


def verify(
    plan: BucketPlan, group: ProcessGroup | None, every_call: bool, what: str, hint: str = ""
) -> None:
    """Verify that every rank of ``group`` has ``plan``'s layout: on its first call for the
    layout, or on every call with ``every_call``; then raise if the plan refuses the call.

    Both errors are raised on every rank, before any data collective.

    Args:
        plan: from :func:`plan`.
        group: the process group to average over (None for the world).
        every_call: verify even a layout verified before (the check mode).
        what: the calling function, for the messages.
        hint: a likely cause, appended to the message when the layouts differ.

    Raises:
        RuntimeError: the ranks' layouts differ.
        ValueError: the plan refuses the call (two tensors share memory without one holding the
            other, or the group mixes a gradient's shards).
    """
    key = (dist.group.WORLD if group is None else group, plan.key())
    known = _verified.get(key) is not None
    if every_call or plan.refusal is not None or not known:
        verify_same_layout(
            plan.describe(),
            group,
            plan.tensors[0].device,
            what,
            f"bucket_cap_mb={plan.cap_bytes / 2**20:g}",  # a different cap packs other buckets
            hint=hint,
        )
    if plan.refusal is not None:
        raise ValueError(f"{what}: {plan.refusal}")
    if not known:
        _verified.put(key, True)


def average_(plan: BucketPlan, group: ProcessGroup | None) -> None:
    """Average in place over ``group`` every tensor of a verified ``plan``.

    Args:
        plan: from :func:`plan`, verified with :func:`verify`.
        group: the process group to average over (None for the world).
    """
    in_place: list[tuple[dist.Work, Tensor, int]] = []
    for kind_plan in plan.kinds:
        reduction = _averaging(group, kind_plan.kind[0])
        if kind_plan.tiled is not None:
            in_place.append(_launch(kind_plan.tiled, reduction, group))
            continue
        in_place.extend(_launch(tensor, reduction, group) for tensor in kind_plan.direct)
        _reduce_in_buckets(kind_plan.buckets, kind_plan.kind, reduction, group)
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


def _reduce_in_buckets(
    buckets: list[_Bucket],
    kind: _Kind,
    reduction: Averaging,
    group: ProcessGroup | None,
) -> None:
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
