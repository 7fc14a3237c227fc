"""Gradient synchronisation for spatial domain parallelism.

Domain parallelism splits the globe into latitude bands, one per rank of the *domain* group. Every
domain rank holds the same parameters but backpropagates only through its own band, so its
gradient is a partial view of the full one; averaging over the domain group gives every rank the
gradient of the whole globe (the mean over bands, as the loss is a mean).
"""

from __future__ import annotations

import torch
from torch import nn

from credit.parallel import _inputs
from credit.parallel._groups import GroupLike, peer_group
from credit.parallel._inputs import TensorOrTensors
from credit.parallel.collectives import allreduce_grads_avg

__all__ = ["sync_domain_gradients"]


@torch.no_grad()
def sync_domain_gradients(
    model_or_params: nn.Module | TensorOrTensors,
    group: GroupLike,
    *,
    check: bool | None = None,
) -> None:
    """Average every gradient over the domain group, in place.

    Each domain rank holds every parameter but backpropagates through its own latitude band only,
    so every gradient differs across the group until averaged. Domain peers share a data-parallel
    coordinate, so under FSDP2 their local shards have the same shapes and are averaged shard by
    shard; plain gradients (DDP, or no data parallelism) and TP DTensor gradients are averaged
    the same way. The work is done by
    :func:`~credit.parallel.collectives.allreduce_grads_avg`, in a few bucketed all_reduces.

    Call it on every rank of the group, after the backward of the last micro-step and before
    clipping.

    Args:
        model_or_params: a module, or a tensor or iterable of parameters, whose ``.grad`` is
            averaged; parameters without a gradient are skipped.
        group: the domain group: a ProcessGroup or a 1D DeviceMesh (e.g.
            ``build_device_mesh(...).domain``). With None, or a group of one rank, nothing is
            done.
        check: verify first that every rank passes the same gradient layout (see
            :func:`~credit.parallel.collectives.allreduce_grads_avg`). Default: on when the
            environment variable ``CREDIT_PARALLEL_CHECK=1`` is set.

    Raises:
        TypeError: ``model_or_params`` holds something that is not a tensor, ``group`` is not a
            group, or a gradient is not floating point.
        ValueError: ``group`` is a DeviceMesh with more than one dim, or a gradient is sparse.
        RuntimeError: with the check on, ranks passed different layouts.
    """
    params = _inputs.module_parameters(model_or_params)
    process_group = peer_group(group, "group")
    if process_group is None:
        return
    allreduce_grads_avg([p.grad for p in params], process_group, check=check)
