"""Which tensors of a list share memory, from each one's storage, offset, shape and strides.

A tensor listed twice, or a view whose elements all belong to another listed tensor, is averaged
through that tensor; two tensors that share some elements without one holding the other cannot be
averaged (the mean of the shared elements is undefined). A repair of replicas writes no copy that
shares memory with another tensor unless the write leaves that tensor's bits as they should be
(:func:`sharing` finds the pairs). Only tensors on a storage that holds more than one of them are
compared, so the common case (one storage per tensor) costs a dict over storage pointers. Nothing
here reads a tensor's values: only its metadata, on the host.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def covering(
    tensors: list[Tensor], indices: Iterable[int]
) -> tuple[dict[int, int], tuple[int, int] | None, set[int]]:
    """Which of ``tensors[indices]`` share memory: those whose elements all belong to another,
    and the first pair that overlaps otherwise.

    Only tensors on a storage that holds more than one of them are compared, so the common case
    (one storage per gradient) costs a dict over storage pointers.

    Returns:
        ``{index: index of the tensor it is averaged through}``; the first pair ``(i, j)``,
        ``i < j``, of tensors that share elements without one holding the other (or None); the
        storage addresses seen.
    """
    by_address: dict[int, list[int]] = {}
    for index in indices:
        tensor = tensors[index]
        if tensor.numel():
            by_address.setdefault(tensor.untyped_storage().data_ptr(), []).append(index)
    covered: dict[int, int] = {}
    for same_address in by_address.values():
        if len(same_address) == 1:
            continue
        by_device: dict[torch.device, list[int]] = {}
        for index in same_address:
            by_device.setdefault(tensors[index].device, []).append(index)
        for same_storage in by_device.values():
            overlap = _resolve_storage(tensors, same_storage, covered)
            if overlap is not None:
                return covered, overlap, set(by_address)
    return covered, None, set(by_address)


def sharing(tensors: list[Tensor]) -> list[tuple[int, int]]:
    """Every pair ``(i, j)``, ``i < j``, of ``tensors`` that have a byte of memory in common
    (the same tensor listed twice among them), in order.

    Tensors of one storage are swept in the order of their spans, each compared with those whose
    span it meets: views cut one after the other from a buffer cost a sort.
    """
    by_storage: dict[tuple[torch.device, int], list[int]] = {}
    for index, tensor in enumerate(tensors):
        if tensor.numel():
            key = (tensor.device, tensor.untyped_storage().data_ptr())
            by_storage.setdefault(key, []).append(index)
    pairs = []
    for indices in by_storage.values():
        spans = {index: _span(tensors[index]) for index in indices}
        reaching: list[int] = []  # the tensors swept so far whose span reaches past this start
        for index in sorted(indices, key=lambda i: spans[i]):
            reaching = [i for i in reaching if spans[i][1] > spans[index][0]]
            tensor, span = tensors[index], spans[index]
            pairs += [
                (min(i, index), max(i, index))
                for i in reaching
                if _share_elements(tensors[i], spans[i], tensor, span)
            ]
            reaching.append(index)
    return sorted(pairs)


_Span = tuple[int, int]  # [first byte, last byte + 1) of a tensor in its storage


def _span(tensor: Tensor) -> _Span:
    size = tensor.element_size()
    start = int(tensor.storage_offset()) * size
    if tensor.is_contiguous():
        return start, start + tensor.numel() * size
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return start, start + (last + 1) * size


def _resolve_storage(
    tensors: list[Tensor], indices: list[int], covered: dict[int, int]
) -> tuple[int, int] | None:
    """Resolve the tensors of one storage, in runs of overlapping spans; adds to ``covered``."""
    spans = {index: _span(tensors[index]) for index in indices}
    ends = [spans[i][1] for i in indices[:-1]]
    if all(end <= spans[i][0] for end, i in zip(ends, indices[1:], strict=True)):
        return None  # in order and apart, as views cut one after the other from a buffer
    # A holder sorts before what it holds: first by start, then the longest, then the dense one.
    order = sorted(
        indices,
        key=lambda i: (spans[i][0], -spans[i][1], not _is_dense(tensors[i]), i),
    )
    run: list[int] = []
    end = -1
    for index in [*order, -1]:
        if index == -1 or spans[index][0] >= end:
            overlap = _resolve_run(tensors, run, spans, covered) if len(run) > 1 else None
            if overlap is not None or index == -1:
                return overlap
            run, end = [], -1
        run.append(index)
        end = max(end, spans[index][1])
    return None


def _resolve_run(
    tensors: list[Tensor], run: list[int], spans: dict[int, _Span], covered: dict[int, int]
) -> tuple[int, int] | None:
    kept: list[int] = []
    for index in run:
        tensor = tensors[index]
        holder = next((j for j in kept if _holds(tensors[j], spans[j], tensor, spans[index])), None)
        if holder is not None:
            covered[index] = holder
            continue
        for other in kept:
            if _share_elements(tensors[other], spans[other], tensor, spans[index]):
                return min(other, index), max(other, index)
        kept.append(index)
    return None


def _holds(outer: Tensor, outer_span: _Span, inner: Tensor, inner_span: _Span) -> bool:
    """Whether every element of ``inner`` is an element of ``outer`` (same dtype)."""
    if outer.dtype != inner.dtype:
        return False
    if not (outer_span[0] <= inner_span[0] and inner_span[1] <= outer_span[1]):
        return False
    if _is_dense(outer):
        return True
    outer_at, inner_at = _positions(outer, inner)
    return bool(torch.isin(inner_at, outer_at).all())


def _share_elements(a: Tensor, a_span: _Span, b: Tensor, b_span: _Span) -> bool:
    """Whether ``a`` and ``b`` have a byte in common (interleaved strided views need not)."""
    if a_span[1] <= b_span[0] or b_span[1] <= a_span[0]:
        return False
    if a.dtype != b.dtype:
        return True  # elements of different sizes: any overlap of the spans is taken as one
    if _ends_within(b, b_span, a, a_span) or _ends_within(a, a_span, b, b_span):
        return True  # without listing the elements of a buffer for each of its views
    a_at, b_at = _positions(a, b)
    return bool(torch.isin(b_at, a_at).any())


def _ends_within(a: Tensor, a_span: _Span, b: Tensor, b_span: _Span) -> bool:
    """Whether ``b`` fills its span and the first or the last element of ``a`` lies in it."""
    last = a_span[1] - a.element_size()
    return _is_dense(b) and any(b_span[0] <= at < b_span[1] for at in (a_span[0], last))


def _positions(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """The storage positions of the elements of ``a`` and ``b`` (same dtype), flattened."""
    low = int(min(a.storage_offset(), b.storage_offset()))
    extent = max(_span(a)[1], _span(b)[1]) // a.element_size() - low
    numbers = torch.arange(low, low + extent)

    def at(tensor: Tensor) -> Tensor:
        return numbers.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset() - low)

    return at(a).reshape(-1), at(b).reshape(-1)


def _is_dense(tensor: Tensor) -> bool:
    """Whether the tensor's elements fill its span with no gap and no repeat (any dim order)."""
    if tensor.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted(
        (s, n) for n, s in zip(tensor.shape, tensor.stride(), strict=True) if n > 1
    ):
        if stride != expected:
            return False
        expected *= size
    return True
