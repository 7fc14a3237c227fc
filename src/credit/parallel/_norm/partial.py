"""Completing Partial gradients before their norm, in one all_reduce per reduction group.

Sequence parallelism leaves the gradients of the norms it covers as ``Partial(sum)`` DTensors:
each rank holds an addend of the gradient, not a shard of it, and the norm needs the sum. The
addends of every Partial gradient that reduces over the same mesh dims are added up together, in a
copy: the gradients themselves are left as they are, and clipping scales the addends, which scales
their sum by the same coefficient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from credit.parallel._common.holdings import Holding

_REDUCE_OPS = ("sum", "avg")


def batches(held: list[Holding]) -> tuple[list[list[int]], str | None]:
    """The Partial gradients completed together, by input index: those that reduce over the same
    mesh dims, with the same dtype and device, in order of first appearance (empty without any);
    and why one of them cannot be completed here, naming it, or None.

    Every rank of a reduction group holds the same Partial gradients (they belong to the same
    parameters), so their all_reduces match.
    """
    found: dict[tuple, list[int]] = {}
    refusal = None
    for index, holding in enumerate(held):
        if not holding.partial_dims:
            continue
        key = (id(holding.mesh), holding.partial_dims, holding.dtype, holding.device)
        found.setdefault(key, []).append(index)
        unknown = [op for _, op in holding.partial_dims if op not in _REDUCE_OPS]
        if unknown and refusal is None:
            refusal = (
                f"grads[{index}] is a {holding.description} whose values reduce by "
                f"{unknown[0]!r}; only Partial('sum') and Partial('avg') gradients can be "
                "normed: redistribute it to Replicate first"
            )
    return list(found.values()), refusal


def complete(local: list[Tensor], held: list[Holding], batched: list[list[int]]) -> list[Tensor]:
    """``local`` with every Partial gradient's addends replaced by their reduced sum (a copy), in
    one all_reduce per batch of :func:`batches` and per Partial mesh dim."""
    if not batched:
        return local
    completed = list(local)
    for indices in batched:
        first = held[indices[0]]
        assert first.mesh is not None
        flat = torch.cat([local[i].reshape(-1) for i in indices])
        for dim, reduce_op in first.partial_dims:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=first.mesh.get_group(dim))
            if reduce_op == "avg":
                flat.div_(first.mesh.size(dim))
        pieces = flat.split([local[i].numel() for i in indices])
        for index, piece in zip(indices, pieces, strict=True):
            completed[index] = piece.view(local[index].shape)
    return completed
