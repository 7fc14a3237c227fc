"""Shared gradient all-reduce machinery for the parallel package.

Used by both :func:`~credit.parallel.domain.sync_domain_gradients` and
:func:`~credit.parallel.tensor_parallel.sync_replicated_gradients` so the subtle DTensor handling
lives in exactly one place. Also home to the mixed-mesh-safe gradient clipping used by the trainer.

Every function works without ``torch.distributed`` initialised, as on a world of one.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from credit.parallel import _buckets, _inputs, _norms
from credit.parallel._foreach import group_by_device_and_dtype, use_foreach
from credit.parallel._groups import (
    GroupLike,
    group_size,
    resolve_group,
    supports_native_avg,
)
from credit.parallel._inputs import TensorOrTensors
from credit.parallel._layout_check import check_enabled, verify_same_layout

__all__ = [
    "all_reduce_avg",
    "allreduce_grads_avg",
    "clip_grad_norm_",
    "contiguous_grads_",
    "total_grad_norm",
]

DEFAULT_BUCKET_CAP_MB = 25.0


def all_reduce_avg(tensor: Tensor, group: GroupLike = None) -> None:
    """In-place all_reduce average that also works on gloo.

    Uses ``ReduceOp.AVG`` where the backend has it (NCCL; gloo from torch 2.8) and SUM followed by
    a division elsewhere. A DTensor is averaged on its local shard. Without an initialised process
    group, or with a group of one, the tensor is left as it is.

    Args:
        tensor: floating-point tensor to average in place (for example a loss, for logging).
        group: ProcessGroup or 1D DeviceMesh to average over. Default: the world.

    Raises:
        TypeError: ``tensor`` is not a tensor, or is not floating point.
    """
    if not isinstance(tensor, Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    _inputs.check_grads([tensor], "tensor")
    process_group = resolve_group(group)
    if group_size(process_group) == 1:
        return
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    if supports_native_avg(process_group, local.device):
        dist.all_reduce(local, op=dist.ReduceOp.AVG, group=process_group)
    else:
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=process_group)
        local.div_(dist.get_world_size(process_group))


@torch.no_grad()
def allreduce_grads_avg(
    grads: Iterable[Tensor | None],
    group: GroupLike,
    *,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    check: bool | None = None,
) -> None:
    """Average gradients across a process group with few, large all_reduces.

    Dense gradients and the local shards of DTensor gradients (FSDP2, TP) are packed, per
    (dtype, device), into buckets of at most ``bucket_cap_mb``, so the sync costs one all_reduce per
    bucket instead of one per parameter; copies into a bucket overlap the previous bucket's
    all_reduce. Shards that are empty or oddly strided are copied back exactly. A contiguous
    gradient at least as large as a bucket, or gradients laid out by :func:`contiguous_grads_`, are
    reduced in place without a copy. Two bucket buffers per (dtype, device) are kept between calls.

    ``group`` must be orthogonal to any sharding of the DTensors (a domain or tp group), so that
    every rank of it holds local shards of the same shapes.

    Args:
        grads: iterable of gradient tensors (dense or DTensor); None entries are skipped.
        group: ProcessGroup or 1D DeviceMesh to average over (None for the world).
        bucket_cap_mb: largest bucket, in MiB. Default: 25.
        check: verify first, in one small collective, that every rank passed the same layout, and
            raise RuntimeError on every rank naming the first difference. Default: on when the
            environment variable ``CREDIT_PARALLEL_CHECK=1`` is set.

    Raises:
        TypeError: an entry is not a tensor, or a gradient is not floating point.
        ValueError: a gradient is sparse, or ``bucket_cap_mb`` is not positive.
        RuntimeError: with the check on, ranks passed different layouts.
    """
    grad_list = _inputs.tensor_list(grads, "grads")
    _inputs.check_grads(grad_list, "grads")
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
    process_group = resolve_group(group)
    if group_size(process_group) == 1 or not grad_list:
        return
    # _local_tensor skips to_local()'s autograd bookkeeping, microseconds per gradient.
    local = [g._local_tensor if isinstance(g, DTensor) else g for g in grad_list]
    if check_enabled(check):
        layout = [f"local shape={tuple(t.shape)} dtype={t.dtype}" for t in local]
        settings = f"bucket_cap_mb={bucket_cap_mb}"  # a different cap packs different buckets
        verify_same_layout(layout, process_group, local[0].device, "allreduce_grads_avg", settings)
    _buckets.average_(local, process_group, int(bucket_cap_mb * 2**20))


@torch.no_grad()
def total_grad_norm(
    grads: TensorOrTensors,
    norm_type: float | str = 2.0,
    *,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    pp_group: GroupLike = None,
    dtype: torch.dtype | None = None,
    check: bool | None = None,
) -> Tensor:
    """Total p-norm of a set of gradients that may live on different meshes.

    ``torch.nn.utils.get_total_norm`` stacks every per-gradient norm, and DTensor dispatch rejects
    operands on different meshes (and plain/DTensor mixes): with TP composed under FSDP2 the TP'd
    projections carry grads on the 2D (dp, tp) mesh while the rest live on the 1D dp mesh, and the
    stack raises. Here each rank takes the norm of the local shards it counts (each distinct shard
    is counted by exactly one rank of the gradients' root mesh; replicated copies once, the other
    ranks contribute zeros), one all_reduce of that vector of per-gradient p-th powers (MAX for
    inf) completes every gradient's norm, and their norm is the total. One collective of one
    number per gradient, whatever the mix of meshes; with ``pp_group``, one number per rank.

    Plain tensors alone are reduced locally, exactly as torch does. On a homogeneous 1D mesh the
    result has the same bits as torch's ``clip_grad_norm_(...).full_tensor()``.

    Args:
        grads: tensor or iterable of gradient tensors (dense or DTensor); None entries are skipped.
        norm_type: p-norm exponent, a positive float or ``inf``. Default: 2.
        error_if_nonfinite: raise RuntimeError (on every rank) when the total norm is nan or inf.
        foreach: use the foreach kernels; None uses them where the device supports them.
        pp_group: ProcessGroup or 1D DeviceMesh of pipeline stages. With it the norm covers every
            stage's gradients; when it is a dim of the gradients' mesh this costs no extra
            collective.
        dtype: accumulate per-gradient norms in this dtype (e.g. ``torch.float32`` for bf16
            grads). On CUDA the foreach kernels read the low-precision gradients directly; on CPU
            each gradient is upcast in turn (a transient copy of one gradient at a time).
        check: verify the gradient layout across ranks first (see :func:`allreduce_grads_avg`).

    Returns:
        The total norm as a plain scalar tensor (never a DTensor), the same on every rank.

    Raises:
        TypeError: an entry is not a tensor, a gradient is not floating point, or ``norm_type`` is
            not a number.
        ValueError: a gradient is sparse or a DTensor with a Partial placement, ``norm_type`` is
            not positive for distributed gradients, or the gradients' meshes share no root.
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite, or the check failed.
    """
    grad_list = _inputs.tensor_list(grads, "grads")
    return _total_norm(grad_list, norm_type, error_if_nonfinite, foreach, pp_group, dtype, check)


@torch.no_grad()
def clip_grad_norm_(
    parameters: TensorOrTensors,
    max_norm: float | Tensor,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    pp_group: GroupLike = None,
    dtype: torch.dtype | None = None,
    check: bool | None = None,
) -> Tensor:
    """Mixed-mesh-safe drop-in for ``torch.nn.utils.clip_grad_norm_``.

    The total norm comes from :func:`total_grad_norm`; every gradient, plain or DTensor, is then
    scaled on its local shard by ``min(max_norm / (total_norm + 1e-6), 1)``, as torch does. The
    coefficient depends only on the global norm, so scaling shard by shard is exact. For a
    homogeneous parameter set (plain tensors, or DTensors on one 1D mesh) the result and the
    clipped gradients have the same bits as torch's.

    Args:
        parameters: tensor or iterable of tensors whose ``.grad`` is clipped in place.
        max_norm: max norm of the gradients (float or scalar tensor).
        norm_type: p-norm exponent, a positive float or ``inf``. Default: 2.
        error_if_nonfinite: raise RuntimeError, leaving every gradient unmodified, when the total
            norm is nan or inf. The norm is the same on every rank, so every rank raises.
        foreach: use the foreach kernels; None uses them where the device supports them.
        pp_group: pipeline-stage group, see :func:`total_grad_norm`.
        dtype: accumulation dtype of the norm, see :func:`total_grad_norm`.
        check: verify the gradient layout across ranks first (see :func:`allreduce_grads_avg`).

    Returns:
        The total norm of the gradients (before clipping) as a plain scalar tensor, matching the
        ``torch.nn.utils.clip_grad_norm_`` contract.

    Raises:
        TypeError: as :func:`total_grad_norm`, or ``max_norm`` is not a number.
        ValueError: as :func:`total_grad_norm`, or ``max_norm`` is NaN or negative.
        RuntimeError: as :func:`total_grad_norm`.
    """
    params = _inputs.parameter_list(parameters)
    _inputs.check_max_norm(max_norm)
    grads = [p.grad for p in params if p.grad is not None]
    total_norm = _total_norm(grads, norm_type, error_if_nonfinite, foreach, pp_group, dtype, check)
    _scale_(grads, max_norm, total_norm, foreach)
    return total_norm


def _total_norm(
    grads: list[Tensor],
    norm_type: float | str,
    error_if_nonfinite: bool,
    foreach: bool | None,
    pp_group: GroupLike,
    dtype: torch.dtype | None,
    check: bool | None,
) -> Tensor:
    order = _inputs.norm_order(norm_type)
    _inputs.check_grads(grads, "grads")
    plan = _norms.plan(grads, pp_group)
    if plan.groups and not order > 0:
        raise ValueError(f"norm_type must be positive or inf for distributed grads, got {order}")
    if plan.groups and check_enabled(check):
        layout = [_global_layout(g) for g in grads]
        settings = f"norm_type={order} dtype={dtype}"
        verify_same_layout(layout, plan.layout_groups, plan.device, "total_grad_norm", settings)
    result_dtype = _norms.result_dtype(grads, dtype)
    if pp_group is None:
        local = _norms.stacked_norms(plan.local, plan.counted, order, foreach, dtype)
        reduce_dtype = result_dtype
    else:
        # Stages hold different gradients, maybe of different dtypes (or none): each rank sends
        # one scalar, in float64 on every stage so that the collectives match.
        local = _norms.local_norm(plan.counted_local(), order, foreach, dtype)
        reduce_dtype = torch.float64
    total = _norms.global_norm(local, order, plan.groups, reduce_dtype, plan.device)
    total = total.to(result_dtype)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {order} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite "
            "norm anyway, set `error_if_nonfinite=False`"
        )
    return total


def _global_layout(grad: Tensor) -> str:
    if isinstance(grad, DTensor):
        mesh = grad.device_mesh
        return (
            f"DTensor shape={tuple(grad.shape)} dtype={grad.dtype} "
            f"placements={tuple(grad.placements)} mesh={mesh.mesh_dim_names}{tuple(mesh.shape)}"
        )
    return f"tensor shape={tuple(grad.shape)} dtype={grad.dtype}"


def _scale_(
    grads: list[Tensor], max_norm: float | Tensor, total_norm: Tensor, foreach: bool | None
) -> None:
    """torch's ``clip_grads_with_norm_`` on the local shards of ``grads``."""
    if not grads:
        return
    local = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]
    clip_coef = float(max_norm) / (total_norm + 1e-6)  # float(), as torch: it decides the bits
    clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
    grouped = group_by_device_and_dtype(local)
    for (device, _), device_grads in grouped.items():
        if use_foreach(foreach, device_grads, device):
            torch._foreach_mul_(device_grads, clip_coef_clamped.to(device))
        else:
            coef = clip_coef_clamped.to(device)
            for grad in device_grads:
                grad.mul_(coef)


@torch.no_grad()
def contiguous_grads_(parameters: TensorOrTensors) -> list[Tensor]:
    """Lay out the parameters' gradients as views of one contiguous buffer per (device, dtype).

    :func:`allreduce_grads_avg` then averages each buffer in place with no copy. Existing
    gradient values are kept; parameters without a gradient get zeros. Autograd accumulates into
    the views as long as the gradients are zeroed in place
    (``optimizer.zero_grad(set_to_none=False)``); setting them to None drops the layout.
    Only plain (non-DTensor) parameters can be laid out this way.

    Args:
        parameters: tensor or iterable of tensors that require grad.

    Returns:
        The buffers, one per (device, dtype), in order of first appearance.

    Raises:
        TypeError: an entry is not a tensor, or is a DTensor.
    """
    params = [p for p in _inputs.tensor_list(parameters, "parameters") if p.requires_grad]
    for index, param in enumerate(params):
        if isinstance(param, DTensor):
            raise TypeError(
                f"parameters[{index}] is a DTensor; its gradient layout belongs to FSDP2/TP, "
                "which already reduce shards without a copy"
            )
    buffers = []
    for (device, dtype), group in group_by_device_and_dtype(params).items():
        buffer = torch.zeros(sum(p.numel() for p in group), device=device, dtype=dtype)
        for param, view in zip(group, buffer.split([p.numel() for p in group]), strict=False):
            grad_view = view.view(param.shape)
            if param.grad is not None:
                grad_view.copy_(param.grad)
            param.grad = grad_view
        buffers.append(buffer)
    return buffers
