"""Gradient synchronisation over the domain and tensor-parallel groups.

Domain parallelism splits the globe into latitude bands, one per rank of the *domain* group. Every
domain rank holds the same parameters but backpropagates only through its own band, so its
gradient is a partial view of the full one; averaging over the domain group gives every rank the
gradient of the whole globe (the mean over bands, as the loss is a mean).

With TP, a parallelised layer's weight is sharded over the *tp* group and each rank computes the
gradient of its own shard. Every other parameter (norms, embeddings, layers left out of the TP
plan, the Replicate-placed bias of a rowwise layer, FSDP2-only parameters on the dp mesh) is held
whole by every tp rank, and its gradients, computed from the same data, agree only up to
non-deterministic kernels. Averaging them over the tp group keeps the replicas from drifting.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from credit.parallel import _inputs
from credit.parallel._compat import is_shard
from credit.parallel._groups import GroupLike, peer_group
from credit.parallel._inputs import TensorOrTensors
from credit.parallel.collectives import allreduce_grads_avg

__all__ = ["is_tp_sharded", "sync_domain_gradients", "sync_replicated_gradients"]

DEFAULT_TP_DIM = "tp"


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


def is_tp_sharded(tensor: Tensor, tp_dim: str = DEFAULT_TP_DIM) -> bool:
    """Whether tensor parallelism shards ``tensor`` (a parameter or a gradient).

    Args:
        tensor: the tensor to inspect.
        tp_dim: name of the tensor-parallel dim of the DTensor's mesh. Default: ``"tp"``.

    Returns:
        True when ``tensor`` is a DTensor with a ``Shard`` placement (``_StridedShard``
        included) on the mesh dim named ``tp_dim``: a 1D ``("tp",)`` mesh under TP alone, a 2D
        ``("dp", "tp")`` mesh under FSDP2 + TP. False for plain tensors, for a ``Replicate`` or
        ``Partial`` placement on that dim, and for DTensors whose mesh has no such dim (FSDP2
        alone).
    """
    if not isinstance(tensor, DTensor):
        return False
    names = tensor.device_mesh.mesh_dim_names
    if names is None or tp_dim not in names:
        return False
    return is_shard(tensor.placements[names.index(tp_dim)])


@torch.no_grad()
def sync_replicated_gradients(
    model_or_params: nn.Module | TensorOrTensors,
    tp_group: GroupLike,
    *,
    tp_dim: str | None = None,
    check: bool | None = None,
) -> None:
    """Average over the tp group the gradients of the parameters that TP does not shard.

    A parameter is TP-sharded when :func:`is_tp_sharded` holds for it (for the gradient, when
    the parameter is a plain tensor); the gradients of those are left untouched, every other
    gradient is averaged in place with
    :func:`~credit.parallel.collectives.allreduce_grads_avg`. tp peers share a data-parallel
    coordinate, so under FSDP2 their local shards have the same shapes.

    Call it on every rank of the group, after the backward of the last micro-step (and after
    :func:`~credit.parallel.domain.sync_domain_gradients`) and before clipping.

    Args:
        model_or_params: a module, or a tensor or iterable of parameters, whose ``.grad`` is
            averaged; parameters without a gradient are skipped.
        tp_group: the tensor-parallel group: a ProcessGroup or a 1D DeviceMesh (e.g.
            ``build_device_mesh(...).tp``). With None, or a group of one rank, nothing is done.
        tp_dim: name of the tensor-parallel dim of the parameters' meshes. Default: the name of
            ``tp_group`` when it is a named DeviceMesh, else ``"tp"``.
        check: verify first that every rank passes the same gradient layout (see
            :func:`~credit.parallel.collectives.allreduce_grads_avg`). Default: on when the
            environment variable ``CREDIT_PARALLEL_CHECK=1`` is set.

    Raises:
        TypeError: ``model_or_params`` holds something that is not a tensor, ``tp_group`` is
            not a group, or a gradient is not floating point.
        ValueError: ``tp_group`` is a DeviceMesh with more than one dim, or a gradient is sparse.
        RuntimeError: with the check on, ranks passed different layouts.
    """
    params = _inputs.module_parameters(model_or_params)
    process_group = peer_group(tp_group, "tp_group")
    if process_group is None:
        return
    dim = tp_dim if tp_dim is not None else _group_dim_name(tp_group)
    replicated = [p.grad for p in params if p.grad is not None and not _param_sharded(p, dim)]
    allreduce_grads_avg(replicated, process_group, check=check)


def _param_sharded(param: Tensor, tp_dim: str) -> bool:
    """Shardedness of the parameter; of its gradient when the parameter is a plain tensor."""
    if isinstance(param, DTensor):
        return is_tp_sharded(param, tp_dim)
    return param.grad is not None and is_tp_sharded(param.grad, tp_dim)


def _group_dim_name(tp_group: GroupLike) -> str:
    if isinstance(tp_group, DeviceMesh) and tp_group.mesh_dim_names:
        return tp_group.mesh_dim_names[0]
    return DEFAULT_TP_DIM
