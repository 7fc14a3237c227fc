"""Gradient averaging, and the mixed-mesh-safe gradient norm and clipping.

The averaging functions are the public face of the package's averaging machinery
(``_averaging``), which :func:`~credit.parallel.grad_sync.sync_domain_gradients` and
:func:`~credit.parallel.grad_sync.sync_replicated_gradients` go through as well, so the subtle
DTensor handling lives in exactly one place. The norm functions take torch's arguments, gather the
norm's options into one value (``_norm.NormOptions``) by keyword, and hand it to the norm, which
checks every argument before any collective.

Every function works without ``torch.distributed`` initialised, as on a world of one.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from credit.parallel import _averaging, _norm
from credit.parallel._common import inputs as _inputs
from credit.parallel._common.compat import (
    group_by_device_and_dtype,
    local_tensor,
)
from credit.parallel._common.groups import (
    GroupLike,
)
from credit.parallel._common.inputs import DistinctAlong, TensorOrTensors

__all__ = [
    "all_reduce_avg",
    "allreduce_grads_avg",
    "clip_grad_norm_",
    "clip_grads_with_norm_",
    "contiguous_grads_",
    "get_total_norm",
    "total_grad_norm",
]

DEFAULT_BUCKET_CAP_MB = _averaging.DEFAULT_BUCKET_CAP_MB


def all_reduce_avg(tensor: Tensor, group: GroupLike = None) -> None:
    """In-place all_reduce average that also works on gloo.

    Uses ``ReduceOp.AVG`` where the backend has it (gloo, NCCL) and SUM followed by
    a division elsewhere. A DTensor is averaged on its local shard. Without an initialised process
    group, or with a group of one, the tensor is left as it is.

    Args:
        tensor: floating-point tensor to average in place (for example a loss, for logging).
        group: ProcessGroup or 1D DeviceMesh to average over. Default: the world.

    Raises:
        TypeError: ``tensor`` is not a tensor, or is not floating point.
    """
    _averaging.average_tensor(tensor, group)


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

    Every element is averaged exactly once, whatever the list holds: a tensor listed twice, or a
    view whose elements all belong to another listed tensor (a tied weight reached through two
    modules, a view of a larger gradient), is averaged through that tensor. Two tensors that share
    elements without one holding the other raise ValueError, before anything is modified.

    ``group`` must be orthogonal to any sharding of the DTensors (a domain or tp group), so that
    every rank of it holds local shards of the same shapes. The first call for each layout and
    group verifies, in one more small all_reduce, that every rank of ``group`` has the same layout
    (the shapes and dtypes, and how each tensor is reduced), and raises RuntimeError on every rank
    when they differ; later calls with that layout issue only the averaging all_reduces.

    Args:
        grads: iterable of gradient tensors (dense or DTensor); None entries are skipped.
        group: ProcessGroup or 1D DeviceMesh to average over (None for the world).
        bucket_cap_mb: largest bucket, in MiB. Default: 25.
        check: verify the layout on every call, not only on the first call for each layout
            (one small collective per call), to catch a layout that changes on some ranks only.
            Default: on when the environment variable ``CREDIT_PARALLEL_CHECK=1`` is set.

    Raises:
        TypeError: an entry is not a tensor, or a gradient is not floating point.
        ValueError: a gradient is sparse, ``bucket_cap_mb`` is not positive, or two gradients
            share memory without one holding the other (raised on every rank).
        RuntimeError: the ranks' layouts differ (raised on every rank, naming the first
            difference).
    """
    _averaging.average_grads(grads, group, bucket_cap_mb, check)


@torch.no_grad()
def total_grad_norm(
    grads: TensorOrTensors,
    norm_type: float | str = 2.0,
    *,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    pp_group: GroupLike = None,
    distinct_along: DistinctAlong | None = None,
    dtype: torch.dtype | None = None,
    check: bool | None = None,
    per_rank: bool = False,
) -> Tensor:
    """Total p-norm of a set of gradients that may live on different meshes.

    ``torch.nn.utils.get_total_norm`` stacks every per-gradient norm, and DTensor dispatch rejects
    operands on different meshes (and plain/DTensor mixes): with TP composed under FSDP2 the TP'd
    projections carry grads on the 2D (dp, tp) mesh while the rest live on the 1D dp mesh, and the
    stack raises. Here each rank takes the norms of its local shards, weights each by one over
    the number of identical copies of that shard in the world (read from the meshes' rank maps:
    the tp peers of a dp-sharded gradient, a Replicate dim, the ranks of a plain replicated
    gradient), and one all_reduce of the vector of per-gradient p-th powers (MAX for inf)
    completes every gradient's norm; their norm is the total. One collective of one number per
    gradient, whatever the mix of meshes and however they were built; with ``pp_group``, one
    number per rank. A NaN or inf in any copy of any gradient reaches every rank.

    Every rank of the world must call it, and within a pipeline stage every rank must pass the
    same gradients in the same order (see ``check``). The first call for a layout verifies, in
    one more small all_reduce, that the ranks' shards add up to exactly one count of every
    element, and that the ranks taken for copies of a shard hold the same values (compared by
    fingerprints: the norm and four projections, within a tolerance of rounding); it raises on
    every rank when either fails, rather than average values that are not copies. Every later
    call compares the copies again, by their local norms, inside its one all_reduce: copies
    that differ (another model of the same shapes, replicas that drifted) make the returned norm
    NaN on every rank, never a number, and raise the same ``ValueError`` on every rank where the
    call reads: at once where the collective runs on the CPU, at ``error_if_nonfinite``'s read
    on a GPU (or with ``pp_group``, or in the check mode). The inf norm needs no comparison: the
    largest copy is the largest element. Later calls read nothing back to the host and copy
    nothing from it (with ``pp_group``, one read; see the guide's "Host syncs").

    Plain tensors alone are replicas (DDP): every rank returns the norm of the reference copy
    (the lowest rank's), torch's bits where the copies are bit-identical, after one small
    all_reduce that compares the copies and carries a NaN or inf on any rank to every rank.
    Ranks that train models of their own pass ``per_rank=True`` instead. DTensors on a mesh
    spanning the world (FSDP2 over every rank) give the same bits as torch's
    ``clip_grad_norm_(...).full_tensor()``.

    A gradient refused on one rank only (left on the meta device, sparse, or of an integer dtype
    there alone) raises on that rank before any collective; outside the check mode the other
    ranks cannot know it without a collective of its own on every call (the norm's all_reduce
    cannot carry it: one more element moves gloo's chunking, and with it the bits of the others),
    so they wait in the norm's all_reduce until the process group's timeout. In the check mode
    one more small all_reduce, before the others, makes every rank raise that rank's error.

    Args:
        grads: tensor or iterable of gradient tensors (dense or DTensor); None entries are skipped.
        norm_type: p-norm exponent, a positive float or ``inf``. Default: 2.
        error_if_nonfinite: raise RuntimeError (on every rank) when the total norm is nan or inf,
            or the ValueError of copies that differ.
        foreach: use the foreach kernels; None uses them where the device supports them.
        pp_group: ProcessGroup or 1D DeviceMesh of this rank's pipeline peers (one rank per
            stage). With it the norm covers every stage's gradients, at no extra collective, and
            reads a few numbers back to the host once per call (what the stages decide
            together: the result's dtype, a first call's verification).
        distinct_along: ``(tensors, group)`` pairs declaring gradients whose copies differ along
            ``group`` instead of being replicas: experts held per expert-parallel rank as plain
            tensors or as DTensors on a mesh without the ep dim. Each copy then counts once.
            Pass the same pairs on every rank.
        dtype: accumulate per-gradient norms in this dtype (e.g. ``torch.float32`` for bf16
            grads). On CUDA the foreach kernels read the low-precision gradients directly; on CPU
            each gradient is upcast in turn (a transient copy of one gradient at a time).
        check: verify first that no rank refuses a gradient and that the ranks of each stage
            passed the same layout, and verify the copy counts and the copies' values on every
            call (three small collectives). It never changes the result. Default: on when the
            environment variable ``CREDIT_PARALLEL_CHECK=1`` is set.
        per_rank: each rank trains a model of its own: return the norm of this rank's plain
            gradients alone, as torch does without a process group, with no collective.

    Returns:
        The total norm as a plain scalar tensor (never a DTensor), the same on every rank (with
        ``per_rank``, this rank's); NaN on every rank when copies differed on a GPU and nothing
        read the verdict.

    Raises:
        TypeError: an entry is not a tensor, a gradient is not floating point, or ``norm_type`` is
            not a number.
        ValueError: a gradient is sparse or on the meta device (on the ranks that hold it; on
            every rank in the check mode), ``norm_type`` is not positive for distributed
            gradients, a mesh, ``pp_group`` or ``distinct_along`` group does not fit the
            others, ranks taken for copies of a gradient hold different values (raised on every
            rank, naming the gradient, the ranks and the likely fix), or ``per_rank`` is passed
            with DTensor gradients, ``pp_group`` or ``distinct_along``.
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite, the ranks' shards do not
            add up to whole gradients, or the check failed (raised on every rank).
    """
    options = _norm.NormOptions(
        norm_type=norm_type,
        error_if_nonfinite=error_if_nonfinite,
        foreach=foreach,
        pp_group=pp_group,
        distinct_along=distinct_along,
        dtype=dtype,
        check=check,
        per_rank=per_rank,
    )
    return _total_norm(grads, options, "total_grad_norm", "grads")


@torch.no_grad()
def get_total_norm(
    tensors: TensorOrTensors,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    pp_group: GroupLike = None,
    distinct_along: DistinctAlong | None = None,
    dtype: torch.dtype | None = None,
    check: bool | None = None,
    per_rank: bool = False,
) -> Tensor:
    """Mixed-mesh-safe drop-in for ``torch.nn.utils.get_total_norm``.

    :func:`total_grad_norm` under torch's name and signature (``error_if_nonfinite`` and
    ``foreach`` may be passed by position), for trainers that take the norm first and clip with
    :func:`clip_grads_with_norm_` after, logging or reducing the norm in between. It costs the
    clip's collectives, answers a :class:`~credit.parallel.amp.GradScaler`'s pending flag as
    the clip does (when it covers the optimizer's gradients), and where torch works it returns
    torch's bits: the same as torch's ``get_total_norm(...)`` on plain tensors, and as its
    ``.full_tensor()`` on DTensors on a mesh spanning the world.

    Args:
        tensors: tensor or iterable of gradient tensors (dense or DTensor); None entries are
            skipped.
        norm_type: p-norm exponent, a positive float or ``inf``. Default: 2.
        error_if_nonfinite: raise RuntimeError (on every rank) when the total norm is nan or inf.
        foreach: use the foreach kernels; None uses them where the device supports them.
        pp_group, distinct_along, dtype, check, per_rank: see :func:`total_grad_norm`.

    Returns:
        The total norm as a plain scalar tensor (never a DTensor), the same on every rank (with
        ``per_rank``, this rank's): pass it to :func:`clip_grads_with_norm_`.

    Raises:
        TypeError, ValueError, RuntimeError: as :func:`total_grad_norm`, in the same cases (a
            gradient refused on one rank only raises on every rank in the check mode alone).
    """
    options = _norm.NormOptions(
        norm_type=norm_type,
        error_if_nonfinite=error_if_nonfinite,
        foreach=foreach,
        pp_group=pp_group,
        distinct_along=distinct_along,
        dtype=dtype,
        check=check,
        per_rank=per_rank,
    )
    return _total_norm(tensors, options, "get_total_norm", "tensors")


def _total_norm(
    grads: TensorOrTensors, options: _norm.NormOptions, what: str, argument: str
) -> Tensor:
    """The total norm of ``grads`` for the public function ``what``, whose argument ``argument``
    holds them (named in messages)."""
    tensors = _inputs.tensor_list(grads, argument)
    return _norm.reduce(_norm.norm_request(tensors, options, what, argument=argument)).total


@torch.no_grad()
def clip_grad_norm_(
    parameters: TensorOrTensors | nn.Module | Iterable[tuple[str, Tensor]],
    max_norm: float | Tensor,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    pp_group: GroupLike = None,
    distinct_along: DistinctAlong | None = None,
    dtype: torch.dtype | None = None,
    check: bool | None = None,
    per_rank: bool = False,
) -> Tensor:
    """Mixed-mesh-safe drop-in for ``torch.nn.utils.clip_grad_norm_``.

    The total norm comes from :func:`total_grad_norm`; every gradient, plain or DTensor, is then
    scaled on its local shard by ``min(max_norm / (total_norm + 1e-6), 1)``, as torch does. The
    coefficient depends only on the global norm, so scaling shard by shard is exact. For plain
    tensors, and DTensors on a mesh spanning the world, the result and the clipped gradients have
    the same bits as torch's. :func:`get_total_norm` followed by :func:`clip_grads_with_norm_`
    leaves exactly the same gradients.

    Args:
        parameters: tensor or iterable of tensors whose ``.grad`` is clipped in place; or a
            module, or ``(name, parameter)`` pairs (``model.named_parameters()``), so that errors
            name the parameters.
        max_norm: max norm of the gradients: every form torch takes (a float or an int, or a
            real tensor of one element, of any shape, dtype and device). A tensor on the CPU or
            on the gradients' device is never read on the host nor copied: it may be computed on
            the device from the gradients themselves, and a CPU tensor enters the CUDA kernel as
            a scalar operand, as torch's float does (only a CUDA tensor for CPU gradients is
            copied to them, where torch's ``float()`` reads it too). A NaN or negative tensor
            makes every gradient NaN (a GradScaler then skips the step), where torch's clip would
            flip their signs.
        norm_type: p-norm exponent, a positive float or ``inf``. Default: 2.
        error_if_nonfinite: raise RuntimeError, leaving every gradient unmodified, when the total
            norm is nan or inf (or the ValueError of copies that differ, see
            :func:`total_grad_norm`). The norm is the same on every rank, so every rank raises.
        foreach: use the foreach kernels; None uses them where the device supports them.
        pp_group: pipeline group, see :func:`total_grad_norm`.
        distinct_along: ``(parameters, group)`` pairs, see :func:`total_grad_norm`.
        dtype: accumulation dtype of the norm, see :func:`total_grad_norm`.
        check: verify the layout across ranks first, see :func:`total_grad_norm`.
        per_rank: each rank clips its own model's plain gradients alone, see
            :func:`total_grad_norm`.

    Returns:
        The total norm of the gradients (before clipping) as a plain scalar tensor, matching the
        ``torch.nn.utils.clip_grad_norm_`` contract.

    Raises:
        TypeError: as :func:`total_grad_norm`, or ``max_norm`` is not a real number (a bool, a
            string, a complex tensor) or is a DTensor that is not replicated.
        ValueError: as :func:`total_grad_norm` (a gradient refused on one rank only raises on
            every rank in the check mode alone), or a number ``max_norm`` is NaN or negative, or
            a tensor ``max_norm`` has more than one element.
        RuntimeError: as :func:`total_grad_norm`, or ``max_norm`` is on the meta device.
    """
    bound = _inputs.clip_bound(max_norm)
    options = _norm.NormOptions(
        norm_type=norm_type,
        error_if_nonfinite=error_if_nonfinite,
        foreach=foreach,
        pp_group=pp_group,
        distinct_along=distinct_along,
        dtype=dtype,
        check=check,
        per_rank=per_rank,
    )
    request = _norm.parameters_request(parameters, options, "clip_grad_norm_")
    reduced = _norm.reduce(request)
    _norm.scale_(reduced.local, reduced.stacking, reduced.total, bound, foreach)
    return reduced.total


@torch.no_grad()
def clip_grads_with_norm_(
    parameters: TensorOrTensors | nn.Module | Iterable[tuple[str, Tensor]],
    max_norm: float | Tensor,
    total_norm: Tensor,
    foreach: bool | None = None,
) -> None:
    """Mixed-mesh-safe drop-in for ``torch.nn.utils.clip_grads_with_norm_``.

    Scales every gradient, plain or DTensor, on its local shard by
    ``min(max_norm / (total_norm + 1e-6), 1)``, as torch does, with no collective and no host
    sync. With the norm of :func:`get_total_norm` (or :func:`total_grad_norm`) it leaves exactly
    the gradients :func:`clip_grad_norm_` leaves, on any mix of meshes; with plain tensors, and
    DTensors on a mesh spanning the world, the same bits as torch's. A
    :class:`~credit.parallel.amp.GradScaler` learns of the scaling as it does from the clip: a
    coefficient that is not finite (a NaN or negative tensor ``max_norm``, a NaN norm) makes the
    gradients it scales NaN, and their optimizers skip the step.

    It issues no collective, so a rank that raises here leaves no other rank waiting; every
    rank must pass the same ``max_norm`` and ``total_norm`` for the ranks to stay in step.

    Args:
        parameters: tensor or iterable of tensors whose ``.grad`` is scaled in place; or a module,
            or ``(name, parameter)`` pairs.
        max_norm: max norm of the gradients, in every form :func:`clip_grad_norm_` takes.
        total_norm: the total norm of the gradients, a tensor of one element: the plain tensor
            :func:`get_total_norm` returns. A DTensor whose placements are all Replicate (torch's
            ``get_total_norm`` of a p-norm on one mesh) gives its local value, the one torch's
            clip would use; one with a pending reduction (Partial: torch's inf norm) is refused.
        foreach: use the foreach kernels; None uses them where the device supports them.

    Raises:
        TypeError: an entry is not a tensor, a gradient is not floating point, ``max_norm`` is
            not a real number, ``total_norm`` is not a tensor, or either is a DTensor that is
            not replicated (``total_norm.full_tensor()`` or the norm of
            :func:`get_total_norm` is what to pass).
        ValueError: a gradient is sparse or on the meta device, a number ``max_norm`` is NaN or
            negative, or ``max_norm`` or ``total_norm`` has more than one element.
        RuntimeError: ``max_norm`` or ``total_norm`` is on the meta device, or ``foreach=True``
            on a device without foreach kernels.
    """
    params, _ = _inputs.parameter_list(parameters, warn_if_empty_generator=False)
    bound = _inputs.clip_bound(max_norm)
    grads = [grad for p in params if (grad := p.grad) is not None]
    if not grads:  # torch returns before it looks at total_norm
        if params:
            _inputs.warn_no_grads(params, "clip_grads_with_norm_")
        return
    if not isinstance(total_norm, Tensor):
        raise TypeError(
            "total_norm must be a tensor (the norm get_total_norm returns), "
            f"got {type(total_norm).__name__}"
        )
    total = _inputs.scalar_view(total_norm, "total_norm")
    _inputs.check_grads(grads, "grads")
    local = [local_tensor(grad) for grad in grads]
    _norm.scale_(local, _norm.stacking_of(local), total, bound, foreach)


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
