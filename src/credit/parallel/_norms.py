"""Gradient norms over any mix of meshes with one collective.

torch takes the norm of DTensor gradients as ``vector_norm(stack(per-gradient norms))`` where each
per-gradient norm is a partial norm that DTensor completes with an all_reduce of p-th powers. Here
every rank stacks the norms of its local shards in torch's order, with zeros for the shards it does
not count (see ``_ownership``), one all_reduce completes the whole vector (SUM of p-th powers, or
MAX for the inf norm), and the vector's norm is the total. On a homogeneous 1D mesh these are
torch's operations in torch's order, so the result has torch's bits. Pipeline stages hold different
gradients, so under a ``pp_group`` each rank contributes one scalar instead.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from credit.parallel import _ownership
from credit.parallel._foreach import group_indices_by_device_and_dtype, use_foreach
from credit.parallel._groups import GroupLike, group_ranks, is_distributed, resolve_group


def stacked_norms(
    tensors: list[Tensor],
    counted: list[bool],
    norm_type: float,
    foreach: bool | None,
    dtype: torch.dtype | None,
) -> Tensor | None:
    """Each tensor's norm, stacked as torch's ``get_total_norm`` stacks them (None for none).

    Tensors this rank does not count get a zero, and so do empty tensors under the inf norm (torch's
    kernels raise on them), so every rank of one layout stacks the same entries in the same order.
    """
    if not tensors:
        return None
    first_device = tensors[0].device
    norms: list[Tensor] = []
    groups = group_indices_by_device_and_dtype(tensors)
    for (device, tensor_dtype), indices in groups.items():
        keep = [counted[i] and (norm_type != math.inf or tensors[i].numel() > 0) for i in indices]
        kept = [tensors[i] for i, k in zip(indices, keep, strict=True) if k]
        kept_norms = iter(_norms_of(kept, norm_type, foreach, dtype, device) if kept else [])
        zero = torch.zeros((), dtype=dtype or tensor_dtype.to_real(), device=device)
        norms.extend(next(kept_norms) if k else zero for k in keep)
    if any(device != first_device for device, _ in groups):  # .to() is a dispatch per norm
        norms = [n.to(first_device) for n in norms]
    return torch.stack(norms)


def local_norm(
    tensors: list[Tensor], norm_type: float, foreach: bool | None, dtype: torch.dtype | None
) -> Tensor | None:
    """torch's ``get_total_norm`` on plain tensors (None for none), accumulating in ``dtype``."""
    norms = stacked_norms(tensors, [True] * len(tensors), norm_type, foreach, dtype)
    return None if norms is None else torch.linalg.vector_norm(norms, norm_type)


def _norms_of(
    tensors: list[Tensor],
    norm_type: float,
    foreach: bool | None,
    dtype: torch.dtype | None,
    device: torch.device,
) -> list[Tensor]:
    if use_foreach(foreach, tensors, device):
        return list(torch._foreach_norm(tensors, norm_type, dtype=dtype))
    return [torch.linalg.vector_norm(t, norm_type, dtype=dtype) for t in tensors]


@dataclass(frozen=True)
class NormPlan:
    """How one call's gradients reduce: what this rank counts, and over which groups.

    Attributes:
        local: each gradient's local tensor (DTensors unwrapped), in input order.
        counted: for each gradient, whether this rank counts it in the global sum.
        groups: the process groups to all_reduce over, in order (None is the world).
        layout_groups: the groups whose ranks must pass the same layout (for the check mode).
    """

    local: list[Tensor]
    counted: list[bool]
    groups: list[ProcessGroup | None]
    layout_groups: list[ProcessGroup | None]
    device: torch.device

    def counted_local(self) -> list[Tensor]:
        return [t for t, counted in zip(self.local, self.counted, strict=True) if counted]


def plan(grads: list[Tensor], pp_group: GroupLike) -> NormPlan:
    """Decide, for this rank, which local shards to count and which groups to reduce over.

    The root mesh comes from the DTensor gradients or, on a stage without any (frozen, or with
    plain gradients only), from ``pp_group`` when it is a dim of a larger mesh, so that every stage
    reduces over the same groups.
    """
    pp_process_group = resolve_group(pp_group, "pp_group")
    dtensors = [g for g in grads if isinstance(g, DTensor)]
    root = _common_root(dtensors) if dtensors else _sliced_from(pp_group)
    if root is None or not is_distributed():
        # Plain gradients: a local norm, as torch takes it, summed over the stages if any.
        pp_groups: list[ProcessGroup | None] = []
        if pp_process_group is not None and is_distributed():
            pp_groups.append(pp_process_group)
        device = grads[0].device if grads else torch.device("cpu")
        return NormPlan(grads, [True] * len(grads), pp_groups, layout_groups=[], device=device)

    pp_ranks = tuple(group_ranks(pp_process_group)) if pp_process_group is not None else None
    distinct = _ownership.distinct_root_dims(root, pp_ranks)
    root_groups = _root_groups(root)
    groups = list(root_groups)
    if pp_ranks is not None and not distinct:
        _check_pp_outside_root(root, pp_ranks)
        groups.append(pp_process_group)

    counts_plain = _ownership.counts_replicated(root, distinct)
    # Keyed by spec object: FSDP2 and TP share a few specs among hundreds of gradients.
    counts_by_spec: dict[int, bool] = {}
    local, counted = [], []
    for index, grad in enumerate(grads):
        if not isinstance(grad, DTensor):
            local.append(grad)
            counted.append(counts_plain)
            continue
        spec = grad._spec
        if id(spec) not in counts_by_spec:
            placements = tuple(spec.placements)
            _check_not_partial(index, placements)
            counts_by_spec[id(spec)] = _ownership.counts_shard(spec.mesh, placements, distinct)
        # _local_tensor skips to_local()'s autograd bookkeeping, microseconds per gradient.
        local.append(grad._local_tensor)
        counted.append(counts_by_spec[id(spec)])
    device = grads[0].device if grads else torch.device(root.device_type)
    return NormPlan(local, counted, groups, layout_groups=root_groups, device=device)


def _check_not_partial(index: int, placements: tuple[Placement, ...]) -> None:
    if any(placement.is_partial() for placement in placements):
        raise ValueError(
            f"grads[{index}] is a DTensor with a Partial placement {placements}: its local values "
            "are unreduced, so their norm is not the gradient's. Reduce it first, e.g. "
            "grad.redistribute(placements=[Replicate() ...])"
        )


def _sliced_from(group: GroupLike) -> DeviceMesh | None:
    """The mesh ``group`` was sliced from, when it is a dim of a larger DeviceMesh."""
    if not isinstance(group, DeviceMesh):
        return None
    root = _ownership.root_mesh(group)
    return root if root is not group else None


def result_dtype(grads: list[Tensor], dtype: torch.dtype | None) -> torch.dtype:
    """The dtype torch's stacked norm would have; the same on every rank of one layout."""
    if dtype is not None:
        return dtype
    if not grads:
        return torch.get_default_dtype()
    return functools.reduce(torch.promote_types, (g.dtype for g in grads)).to_real()


def _common_root(dtensors: list[DTensor]) -> DeviceMesh:
    meshes = {id(g.device_mesh): g.device_mesh for g in dtensors}
    roots = {id(root): root for root in map(_ownership.root_mesh, meshes.values())}
    if len(roots) != 1:
        described = ", ".join(str(root) for root in roots.values())
        raise ValueError(
            "gradients live on DeviceMeshes sliced from different root meshes "
            f"({described}); build every mesh from one init_device_mesh(...) and slice it"
        )
    return next(iter(roots.values()))


def _root_groups(root: DeviceMesh) -> list[ProcessGroup | None]:
    """Groups whose successive sums cover the root mesh: the world alone when it spans the world."""
    if root.size() == dist.get_world_size():
        return [None]
    return [root.get_group(dim) for dim in range(root.ndim) if root.size(dim) > 1]


def _check_pp_outside_root(root: DeviceMesh, pp_ranks: tuple[int, ...]) -> None:
    shared = set(pp_ranks) & set(root.mesh.flatten().tolist())
    if len(shared) > 1:
        raise ValueError(
            f"pp_group (ranks {list(pp_ranks)}) overlaps the gradients' mesh {root} without being "
            "one of its dims; slice pp_group from the same mesh (e.g. mesh['pp']) or use a "
            "separate mesh per stage"
        )


def global_norm(
    local: Tensor | None,
    norm_type: float,
    groups: list[ProcessGroup | None],
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor:
    """Complete this rank's norms (a scalar, or a vector from :func:`stacked_norms`) over ``groups``.

    Each entry is reduced as DTensor reduces a partial norm: p-th power, SUM, p-th root (MAX for
    inf), one all_reduce per group; a vector's norm is then taken. ``dtype`` must be the same on
    every rank (see :func:`result_dtype`), even one without gradients, or the collectives would not
    match.
    """
    norms = torch.zeros((), dtype=dtype, device=device) if local is None else local.to(dtype)
    if groups and norm_type == math.inf:
        # gloo's MAX keeps its first operand when the other is NaN, so a NaN held by any rank but
        # the first would vanish: each entry's NaN flag travels beside it, in the same collective.
        nan = torch.isnan(norms)
        both = torch.stack([torch.where(nan, 0.0, norms), nan.to(norms.dtype)])
        for group in groups:
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        norms = torch.where(both[1] > 0, math.nan, both[0])
    elif groups:
        # DTensor skips the power for p=1, and so do we, to keep its bits.
        powered = norms**norm_type if norm_type != 1 else norms
        for group in groups:
            dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=group)
        norms = powered ** (1.0 / norm_type) if norm_type != 1 else powered
    return torch.linalg.vector_norm(norms, norm_type) if norms.ndim else norms
