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

The domain average runs in one of two modes. Explicit: :func:`sync_domain_gradients` after the
backward of the last micro-step, one more pass of all_reduces over every gradient. In backward:
:func:`sync_domain_gradients_in_backward` hooks the average into the model's own gradient
reduction (FSDP2's all-reduce hook, DDP's comm hook, or the end of backward for a plain model),
so that nothing is left to run once ``backward()`` returns.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from credit.parallel import _averaging
from credit.parallel._common import inputs as _inputs
from credit.parallel._common.compat import is_shard
from credit.parallel._common.groups import GroupLike, peer_group
from credit.parallel._common.inputs import TensorOrTensors

__all__ = [
    "DomainSyncHandle",
    "is_tp_sharded",
    "sync_domain_gradients",
    "sync_domain_gradients_in_backward",
    "sync_replicated_gradients",
]

DEFAULT_TP_DIM = "tp"


@torch.no_grad()
def sync_domain_gradients(
    model_or_params: nn.Module | TensorOrTensors,
    group: GroupLike,
    *,
    check: bool | None = None,
) -> None:
    """Average every gradient over the domain group, in place (the explicit mode).

    Each domain rank holds every parameter but backpropagates through its own latitude band only,
    so every gradient differs across the group until averaged. Domain peers share a data-parallel
    coordinate, so under FSDP2 their local shards have the same shapes and are averaged shard by
    shard; plain gradients (DDP, or no data parallelism) and TP DTensor gradients are averaged
    the same way. The work is done by
    :func:`~credit.parallel.collectives.allreduce_grads_avg`, in a few bucketed all_reduces.

    Call it on every rank of the group, after the backward of the last micro-step and before
    clipping. :func:`sync_domain_gradients_in_backward` does the same work inside backward
    instead.

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
        RuntimeError: with the check on, ranks passed different layouts; or a parameter's
            gradients are averaged inside backward already by a
            :func:`sync_domain_gradients_in_backward` handle (raised before any collective).
    """
    params = _inputs.module_parameters(model_or_params)
    _refuse_averaged_in_backward(params)
    process_group = peer_group(group, "group")
    if process_group is None:
        return
    _averaging.average_grads([p.grad for p in params], process_group, check=check)


def _refuse_averaged_in_backward(params: list[Tensor]) -> None:
    """RuntimeError when a handle already averages these gradients inside backward."""
    index = _averaging.first_averaged_in_backward(params)
    if index is not None:
        raise RuntimeError(
            f"sync_domain_gradients: parameter {index} is averaged over the domain group "
            "inside backward already (sync_domain_gradients_in_backward); averaging it again "
            "would redo the work, and with more than two domain ranks change its bits. Drop "
            "this call, or call remove() on the handle to go back to the explicit sync"
        )


def sync_domain_gradients_in_backward(model: nn.Module, group: GroupLike) -> DomainSyncHandle:
    """Average every gradient over the domain group inside backward, from now on.

    Registers the average of :func:`sync_domain_gradients` on ``model``'s own gradient reduction,
    so that once ``backward()`` returns on an accumulation boundary the gradients are averaged
    and no domain collective is left to run:

    * **FSDP2** (``model`` is an ``FSDPModule``): a hook on every FSDP unit
      (``FSDPModule.set_all_reduce_hook``) averages the unit's reduce-scatter output, already
      averaged over dp, while backward goes on through the units before it.
    * **DDP** (``model`` is a ``DistributedDataParallel``): a comm hook averages each bucket over
      DDP's group as DDP does (divide, then sum), then over the domain group.
    * **A plain model** (TP alone, or no data parallelism): when the last gradient of a backward
      has been accumulated, the gradients are averaged with
      :func:`~credit.parallel.collectives.allreduce_grads_avg`, as the explicit call would, at
      the end of backward. Nothing overlaps with the backward itself.

    All three apply the explicit mode's element-wise operations to the same values, so with two
    domain ranks the gradients have its bits exactly; with more, the order in which the backend
    adds an element's addends may depend on its position in the buffer, a few ULPs (a plain
    model, which makes the explicit call itself, has its bits always). Under an FSDP2
    ``reduce_dtype`` lower than the parameters' dtype the average is rounded in ``reduce_dtype``.

    Micro-steps that skip the data-parallel reduction skip the domain average too, and average
    the accumulated gradients on the boundary: FSDP2's ``set_requires_gradient_sync(False)``,
    DDP's ``no_sync()``, or for any kind of model the handle's
    :meth:`DomainSyncHandle.set_requires_gradient_sync`. Calling :func:`sync_domain_gradients`
    on the model's parameters while the handle is live raises instead of averaging twice.
    :func:`sync_replicated_gradients` and the clip are called as before.

    Call it on every rank, once, after wrapping the model (``fully_shard`` of the root, or
    ``DistributedDataParallel``) and before the first backward that should be averaged.

    Args:
        model: the wrapped model: an ``FSDPModule`` root (every parameter managed by
            ``fully_shard``; a unit with ``ignored_params`` is not supported), a
            ``DistributedDataParallel``, or a module without data parallelism.
        group: the domain group: a ProcessGroup or a 1D DeviceMesh (e.g.
            ``build_device_mesh(...).domain``). With None, or a group of one rank, nothing is
            registered and the handle only switches the data-parallel sync on and off.

    Returns:
        A :class:`DomainSyncHandle`; its ``remove()`` goes back to the explicit mode.

    Raises:
        TypeError: ``model`` is not a module, or ``group`` is not a group.
        ValueError: ``model`` holds FSDP2 units but is not one itself (the root must be
            ``fully_shard``-ed, so that every parameter is reduced by a unit), or ``group`` is a
            DeviceMesh with more than one dim.
        RuntimeError: a handle already averages some of ``model``'s parameters; DDP has a comm
            hook of its own already.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    process_group = peer_group(group, "group")
    backend = _averaging.backend_for(model, process_group)
    params: list[Tensor] = [param for param in model.parameters() if param.requires_grad]
    if process_group is not None:
        index = _averaging.first_averaged_in_backward(params)
        if index is not None:
            raise RuntimeError(
                f"sync_domain_gradients_in_backward: parameter {index} is averaged inside "
                "backward already by another handle; call remove() on that handle first"
            )
        backend.attach()
    return DomainSyncHandle(backend, params if process_group is not None else [])


class DomainSyncHandle:
    """The domain average that :func:`sync_domain_gradients_in_backward` registered on a model.

    Attributes:
        kind: ``"fsdp2"``, ``"ddp"`` or ``"plain"``: how the model is averaged.
        active: whether backward averages over the domain group (False with no group or a group
            of one, and after :meth:`remove`).
    """

    def __init__(self, backend: _averaging.Backend, params: list[Tensor]) -> None:
        self._backend = backend
        self._params = params
        self.kind = backend.kind
        self.active = bool(params)
        _averaging.register_averaged_in_backward(params, self)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Whether the next backward reduces gradients (False on micro-steps before a boundary).

        One switch for every kind of model: FSDP2's ``set_requires_gradient_sync`` on the
        whole model, DDP's ``require_backward_grad_sync`` (what ``no_sync()`` sets; read at the
        next forward), the domain average alone for a plain model. Skipped steps accumulate
        their gradients locally; the next synced backward averages the sum.

        Args:
            requires_gradient_sync: False to skip every gradient collective of the following
                backward passes, True (the default at registration) to reduce again.
        """
        self._backend.set_requires_gradient_sync(requires_gradient_sync)

    def remove(self) -> None:
        """Stop averaging inside backward: :func:`sync_domain_gradients` works again.

        Call it on every rank, between steps. Removing twice does nothing.
        """
        if not self.active:
            return
        self._backend.detach()
        _averaging.unregister_averaged_in_backward(self._params)
        self._params, self.active = [], False


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
    :func:`sync_domain_gradients`) and before clipping.

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
    _averaging.average_grads(replicated, process_group, check=check)


def _param_sharded(param: Tensor, tp_dim: str) -> bool:
    """Shardedness of the parameter; of its gradient when the parameter is a plain tensor."""
    if isinstance(param, DTensor):
        return is_tp_sharded(param, tp_dim)
    return param.grad is not None and is_tp_sharded(param.grad, tp_dim)


def _group_dim_name(tp_group: GroupLike) -> str:
    if isinstance(tp_group, DeviceMesh) and tp_group.mesh_dim_names:
        return tp_group.mesh_dim_names[0]
    return DEFAULT_TP_DIM
