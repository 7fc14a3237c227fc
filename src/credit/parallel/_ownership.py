"""Which rank counts which gradient in a world-wide sum, so every distinct shard counts once.

A DTensor on a submesh of a larger root mesh is held identically by every rank that differs from
this one only along root dims outside the DTensor's mesh (a dp-sharded grad on the tp peers of a
(dp, tp) mesh), and a Replicate placement repeats a shard along its own mesh dim. In a sum over the
root mesh, a rank counts a shard only when its coordinate is 0 along each of those dims. Plain
tensors are replicated along every root dim. Dims named as "distinct" (pipeline stages) hold
different parameters and are never deduplicated.
"""

from __future__ import annotations

import functools

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh that ``mesh`` was sliced from (itself when it was not sliced)."""
    get_root = getattr(mesh, "_get_root_mesh", None)
    if get_root is not None:
        return get_root()
    from torch.distributed.device_mesh import _mesh_resources  # torch < 2.9

    return _mesh_resources.get_root_mesh(mesh)


def _root_dims_inside(mesh: DeviceMesh, root: DeviceMesh) -> set[int]:
    """Root dims along which a step from this rank stays inside ``mesh`` (works for flattened dims)."""
    members = set(mesh.mesh.flatten().tolist())
    coordinate = root.get_coordinate()
    assert coordinate is not None, "the calling rank must belong to the root mesh"
    inside = set()
    for dim in range(root.ndim):
        if root.size(dim) == 1:
            continue
        neighbour = list(coordinate)
        neighbour[dim] = (coordinate[dim] + 1) % root.size(dim)
        if int(root.mesh[tuple(neighbour)]) in members:
            inside.add(dim)
    return inside


def distinct_root_dims(root: DeviceMesh, pp_ranks: tuple[int, ...] | None) -> frozenset[int]:
    """The root dim whose groups are the pipeline groups, if ``pp_ranks`` is one of them."""
    if pp_ranks is None:
        return frozenset()
    for dim in range(root.ndim):
        if tuple(dist.get_process_group_ranks(root.get_group(dim))) == pp_ranks:
            return frozenset({dim})
    return frozenset()


@functools.lru_cache(maxsize=1024)
def counts_shard(
    mesh: DeviceMesh, placements: tuple[Placement, ...], distinct_dims: frozenset[int]
) -> bool:
    """Whether this rank counts its local shard of a DTensor on ``mesh`` with ``placements``."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return False
    for dim, placement in enumerate(placements):
        if placement.is_replicate() and coordinate[dim] != 0:
            return False
    root = root_mesh(mesh)
    root_coordinate = root.get_coordinate()
    assert root_coordinate is not None
    inside = _root_dims_inside(mesh, root) if mesh is not root else set(range(root.ndim))
    return all(
        root_coordinate[dim] == 0
        for dim in range(root.ndim)
        if dim not in inside and dim not in distinct_dims
    )


@functools.lru_cache(maxsize=64)
def counts_replicated(root: DeviceMesh, distinct_dims: frozenset[int]) -> bool:
    """Whether this rank counts plain (replicated) tensors in a sum over ``root``."""
    coordinate = root.get_coordinate()
    assert coordinate is not None
    return all(coordinate[dim] == 0 for dim in range(root.ndim) if dim not in distinct_dims)
