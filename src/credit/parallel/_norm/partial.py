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

from credit.parallel._common.ownership import Holding

_REDUCE_OPS = ("sum", "avg")


def unsupported(grads_held: list[Holding]) -> str | None:
    """Why a Partial gradient cannot be completed here, naming it, or None."""
    for index, held in enumerate(grads_held):
        for _, reduce_op in held.partial_dims:
            if reduce_op not in _REDUCE_OPS:
                return (
                    f"grads[{index}] is a {held.description} whose values reduce by "
                    f"{reduce_op!r}; only Partial('sum') and Partial('avg') gradients can be "
                    "normed: redistribute it to Replicate first"
                )
    return None


def batches(held: list[Holding]) -> list[list[int]]:
    """The Partial gradients completed together, by input index: those that reduce over the same
    mesh dims, with the same dtype and device, in order of first appearance (empty without any).

    Every rank of a reduction group holds the same Partial gradients (they belong to the same
    parameters), so their all_reduces match.
    """
    found: dict[tuple, list[int]] = {}
    for index, holding in enumerate(held):
        if holding.partial_dims:
            key = (id(holding.mesh), holding.partial_dims, holding.dtype, holding.device)
            found.setdefault(key, []).append(index)
    return list(found.values())


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
