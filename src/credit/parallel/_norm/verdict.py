"""The norm's sixth step: the verdict, read where reading is free or already paid for.

Copies that differ leave the total NaN on every rank, and a boolean beside it on the device
(``Reduced.differ``). It is read, and the same ValueError raised on every rank before any gradient
changes (``failures``), where the read costs nothing more: at once where the collective ran
on the CPU, in the pipeline stages' one read, at ``error_if_nonfinite``'s read, and at a report's
read. On a GPU without those, nothing is read: the NaN total answers.
"""

from __future__ import annotations

import dataclasses

import torch

from credit.parallel._norm import failures as _failures
from credit.parallel._norm.request import NormRequest
from credit.parallel._norm.results import Reduced


def raise_where_free(reduced: Reduced, request: NormRequest) -> Reduced:
    """Raise on every rank where the copies differed and the verdict is free to read (the stages'
    decisions, or a collective on the CPU); the result, with the verdict marked as read there.
    Every rank must call it together."""
    if reduced.differ is not None and reduced.differ.device.type == "cpu":
        return raise_if_copies_differ(reduced, request)  # reading costs no sync there
    if reduced.stages is not None and reduced.stages.decisions.copies_differ:
        _raise_copies_differ(reduced, request)
    return reduced


def raise_if_copies_differ(reduced: Reduced, request: NormRequest) -> Reduced:
    """Read the copies' verdict of the call and raise the same ValueError on every rank, naming
    the gradient and the ranks, when they differed; else the result, its verdict marked as read.
    Every rank must call it together (the verdict is the same on every rank); the gradients must
    be as the call found them.
    """
    if reduced.differ is not None and bool(reduced.differ):
        _raise_copies_differ(reduced, request)
    return dataclasses.replace(reduced, differ=None)


def raise_if_nonfinite(reduced: Reduced, request: NormRequest) -> None:
    """``error_if_nonfinite``: raise on every rank when the total is not finite; copies that
    differed (their total is NaN) raise their own error (see :func:`raise_if_copies_differ`).
    Both answers come from one read. Every rank must call it together.
    """
    is_finite, copies_differ = _finite_and_differ(reduced)
    if is_finite:
        return
    if copies_differ:
        _raise_copies_differ(reduced, request)
    raise RuntimeError(
        f"The total norm of order {request.norm_type} for gradients from `parameters` is "
        "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
        "by the non-finite norm anyway, set `error_if_nonfinite=False`"
    )


def _finite_and_differ(reduced: Reduced) -> tuple[bool, bool]:
    """Whether the total is finite, and whether copies differed, from the call's one read: under
    pipeline stages the stages' read, which brought the total back (their copies' verdict was
    acted on already, in :func:`raise_where_free`); elsewhere one read of the device."""
    if reduced.stages is not None:
        read = reduced.stages.numbers[len(reduced.entries)]
        total = torch.tensor(read, dtype=torch.float64, device="cpu")
        return bool(total.to(reduced.total.dtype).isfinite()), False  # the result's rounding
    finite = torch.isfinite(reduced.total)
    differ = reduced.differ if reduced.differ is not None else torch.zeros_like(finite)
    is_finite, copies_differ = torch.stack([finite, differ]).tolist()  # the call's one read
    return is_finite, copies_differ


def _raise_copies_differ(reduced: Reduced, request: NormRequest) -> None:
    assert reduced.plan is not None
    _failures.raise_copies_differ(reduced.plan, reduced.local, request.what, request.label)
