"""Averaging over a process group: one tensor, or many gradients in few, large all_reduces.

The work behind :func:`~credit.parallel.collectives.all_reduce_avg` and
:func:`~credit.parallel.collectives.allreduce_grads_avg`, which document it, shared with the
averaging inside backward (``in_backward``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from credit.parallel._averaging import buckets as _buckets
from credit.parallel._common import inputs as _inputs
from credit.parallel._common import ownership as _ownership
from credit.parallel._common.compat import local_tensor
from credit.parallel._common.groups import GroupLike, averaging, group_size, resolve_group
from credit.parallel._common.layout_check import check_enabled

DEFAULT_BUCKET_CAP_MB = 25.0


def average_tensor(tensor: Tensor, group: GroupLike) -> None:
    """``tensor`` averaged in place over ``group`` (see ``all_reduce_avg``)."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    _inputs.check_grads([tensor], "tensor")
    process_group = resolve_group(group)
    if group_size(process_group) == 1:
        return
    local = local_tensor(tensor)
    how = averaging(process_group, local.device)
    dist.all_reduce(local, op=how.op, group=process_group)
    if how.divisor != 1:
        local.div_(how.divisor)


@torch.no_grad()  # for allreduce_grads_avg and for the hooks of in_backward alike
def average_grads(
    grads: Iterable[Tensor | None],
    group: GroupLike,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    check: bool | None = None,
) -> None:
    """``grads`` averaged in place over ``group`` in buckets (see ``allreduce_grads_avg``)."""
    grad_list = _inputs.tensor_list(grads, "grads")
    _inputs.check_grads(grad_list, "grads")
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
    process_group = resolve_group(group)
    if group_size(process_group) == 1 or not grad_list:
        return
    local = [local_tensor(g) for g in grad_list]
    plan = _buckets.plan(local, int(bucket_cap_mb * 2**20))
    hint = ""
    if any(isinstance(g, DTensor) for g in grad_list):
        hint = _NOT_ORTHOGONAL
        _refuse_mixed_shards(plan, grad_list, process_group)
    _buckets.verify(plan, process_group, check_enabled(check), "allreduce_grads_avg", hint)
    _buckets.average_(plan, process_group)


_NOT_ORTHOGONAL = (
    "The group must be orthogonal to the sharding of the DTensor gradients (a domain or tp group, "
    "not the group FSDP2 shards them over), so that its ranks hold the same elements."
)


def _refuse_mixed_shards(
    plan: _buckets.BucketPlan, grads: list[Tensor], group: ProcessGroup | None
) -> None:
    """Refuse the call when ``group`` holds two ranks with different shards of one gradient."""
    ranks = frozenset(
        dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    )
    verdicts: dict[tuple[int, object], bool] = {}
    for index, grad in enumerate(grads):
        if not isinstance(grad, DTensor):
            continue
        key = (id(grad.device_mesh), grad.placements)
        if key not in verdicts:
            verdicts[key] = _ownership.mixes_shards(grad, ranks)
        if verdicts[key]:
            plan.refuse(
                index,
                "its shards differ across the group",
                f"averaging grads[{index}] over this group would mix different shards of it "
                f"(placements {grad.placements} on {grad.device_mesh}). {_NOT_ORTHOGONAL} "
                "No gradient was modified.",
            )
            return
