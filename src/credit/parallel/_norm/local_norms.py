"""The norm's fourth step: this rank's norm of each local tensor, torch's kernels in torch's order.

Partial gradients (sequence parallelism) are completed first (``partial``). The norms are
stacked in torch's (device, dtype) order (``stacking.Stacking``), so that a layout without copies
gives torch's bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from credit.parallel._common.compat import foreach_norm, use_foreach
from credit.parallel._norm import partial as _partial
from credit.parallel._norm import stacking as _stacking
from credit.parallel._norm.plan import Kind, NormPlan
from credit.parallel._norm.request import NormRequest
from credit.parallel._norm.stacking import Stacking


@dataclass(frozen=True)
class LocalNorms:
    """This rank's norms of its local tensors.

    Attributes:
        stacking: the stacking order (the plan's, or torch's for a norm on one rank).
        stacked: each local tensor's norm in that order; None without any, or where a stage's
            layout is broken (it sends zeros beside its flag; within a stage the proof has
            raised).
        segments: under pipeline stages, the segment of each stacked norm, as an index tensor.
    """

    stacking: Stacking
    stacked: Tensor | None
    segments: Tensor | None = None


def norms_of(
    request: NormRequest, plan: NormPlan | None, segment_of: list[int] | None = None
) -> LocalNorms:
    """The local norms of the request's gradients, in the plan's order after completing its
    Partial gradients, or (without a plan: a norm on one rank) in torch's order; under pipeline
    stages, with the segment of each (``segment_of``, default: all in one)."""
    if plan is not None and (
        not request.local or (plan.kind is Kind.STAGES and plan.error is not None)
    ):
        return LocalNorms(plan.stacking, None)
    if plan is not None:
        local = _partial.complete(request.local, plan.holdings, plan.partial)
        stacking = plan.stacking
        segments = stacking.segments(segment_of) if plan.kind is Kind.STAGES else None
    else:
        stacking = _stacking.stacking_of(request.local)
        local, segments = request.local, None
    return LocalNorms(stacking, stacked_norms(local, stacking, request), segments)


def stacked_norms(local: list[Tensor], stacking: Stacking, request: NormRequest) -> Tensor | None:
    """Each local tensor's norm, stacked in torch's order (None without any).

    Empty tensors get a zero under the inf norm, where torch's kernels raise on them: a 1-row
    weight sharded over two ranks leaves one of them an empty shard.
    """
    if not local:
        return None
    norms: list[Tensor] = []
    for device, indices in stacking.groups:
        tensors = local if stacking.whole else [local[i] for i in indices]
        empty = request.norm_type == math.inf and any(t.numel() == 0 for t in tensors)
        found = _norms_of([t for t in tensors if t.numel()] if empty else tensors, request, device)
        if empty:
            zero = torch.zeros((), dtype=request.dtype or tensors[0].dtype.to_real(), device=device)
            kept = iter(found)
            found = [next(kept) if t.numel() else zero for t in tensors]
        norms.extend(found)
    first_device = local[0].device
    if any(device != first_device for device, _ in stacking.groups):  # .to() is a dispatch per norm
        norms = [n.to(first_device) for n in norms]
    return torch.stack(norms)


def _norms_of(tensors: list[Tensor], request: NormRequest, device: torch.device) -> list[Tensor]:
    if not tensors:
        return []
    norm_type, dtype = request.norm_type, request.dtype
    if use_foreach(request.foreach, tensors, device):
        return foreach_norm(tensors, norm_type, dtype)
    return [torch.linalg.vector_norm(t, norm_type, dtype=dtype) for t in tensors]
