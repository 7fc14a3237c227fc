"""What the library is measured against.

"The spec's scheme" is the design the reference page describes, implemented here as it reads:
dense grads flattened into one fresh buffer per (dtype, device) and copied back; DTensor grads
reduced in place on their local shards by async all_reduces waited together; norms taken per mesh
group with ``get_total_norm``, made global with ``full_tensor()`` and combined with
``vector_norm``; clipping per mesh group with ``clip_grads_with_norm_``. Every baseline averages
with the same reduction the library picks (``ReduceOp.AVG`` where the backend has it), so the
comparison is about the scheme, not the op.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from credit.parallel._foreach import group_by_device_and_dtype
from credit.parallel._groups import supports_native_avg


def _local(tensor: Tensor) -> Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _avg_op(
    group: ProcessGroup | None, device: torch.device
) -> tuple[dist.ReduceOp.RedOpType, int]:
    if supports_native_avg(group, device):
        return dist.ReduceOp.AVG, 1
    return dist.ReduceOp.SUM, dist.get_world_size(group)


def per_parameter_loop(grads: list[Tensor], group: ProcessGroup | None) -> None:
    """One blocking all_reduce per gradient (local shard for a DTensor)."""
    for grad in grads:
        local = _local(grad)
        op, divisor = _avg_op(group, local.device)
        dist.all_reduce(local, op=op, group=group)
        if divisor != 1:
            local.div_(divisor)


def spec_allreduce_grads_avg(grads: list[Tensor], group: ProcessGroup | None) -> None:
    """The spec's averaging: a fresh flat buffer per (dtype, device); async per-shard reduces."""
    shards = [g._local_tensor for g in grads if isinstance(g, DTensor)]
    dense = [g for g in grads if not isinstance(g, DTensor)]
    pending = []
    dense_groups = group_by_device_and_dtype(dense) if dense else {}
    for shard in shards:
        op, divisor = _avg_op(group, shard.device)
        pending.append((dist.all_reduce(shard, op=op, group=group, async_op=True), shard, divisor))
    for (device, _), tensors in dense_groups.items():
        op, divisor = _avg_op(group, device)
        flat = _flatten_dense_tensors(tensors)
        dist.all_reduce(flat, op=op, group=group)
        if divisor != 1:
            flat.div_(divisor)
        for tensor, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
            tensor.copy_(synced)
    for work, shard, divisor in pending:
        work.wait()
        if divisor != 1:
            shard.div_(divisor)


def torch_all_reduce_coalesced(grads: list[Tensor], group: ProcessGroup | None) -> None:
    """torch's own coalesced all_reduce (SUM, then a foreach division), per (device, dtype)."""
    world = dist.get_world_size(group)
    local = [_local(g) for g in grads]
    for _, tensors in group_by_device_and_dtype(local).items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # "will be deprecated"
            dist.all_reduce_coalesced(tensors, op=dist.ReduceOp.SUM, group=group)
        torch._foreach_div_(tensors, world)


def _by_mesh(tensors: Iterable[Tensor]) -> dict[int | None, list[Tensor]]:
    groups: dict[int | None, list[Tensor]] = {}
    for tensor in tensors:
        key = id(tensor.device_mesh) if isinstance(tensor, DTensor) else None
        groups.setdefault(key, []).append(tensor)
    return groups


@torch.no_grad()
def spec_total_grad_norm(grads: list[Tensor], norm_type: float = 2.0) -> Tensor:
    """The spec's norm: ``get_total_norm`` per mesh group, ``full_tensor()``, then combined."""
    norms = []
    for group in _by_mesh(grads).values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


@torch.no_grad()
def spec_clip_grad_norm_(
    params: Sequence[Tensor], max_norm: float, norm_type: float = 2.0
) -> Tensor:
    """The spec's clipping: the norm above, then ``clip_grads_with_norm_`` per mesh group."""
    with_grad = [p for p in params if p.grad is not None]
    total = spec_total_grad_norm([p.grad for p in with_grad], norm_type)  # type: ignore[misc]
    groups: dict[int | None, list[Tensor]] = {}
    for param in with_grad:
        grad = param.grad
        key = id(grad.device_mesh) if isinstance(grad, DTensor) else None
        groups.setdefault(key, []).append(param)
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
