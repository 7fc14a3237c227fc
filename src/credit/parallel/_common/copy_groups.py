"""The process groups in which the copies of a shard meet, read from the meshes' rank maps.

The copies of a shard (``ownership.copy_group``) are the ranks of its mesh along the Replicate
dims, times the copies of the mesh in the stage. Each member of those copies can reach all the
others through process groups it already holds: the mesh's own dim groups for the Replicate dims,
and, for the copies of the mesh (the tp peers of an FSDP2 dp mesh), the dim groups of a mesh the
gradient's mesh was sliced from, or of another gradient's mesh of the call, whose grid through
this rank meets the gradient's mesh in this rank alone (and, under pipeline stages, leaves out
the mesh's dim along the pipeline group, so that it stays in the stage). A sum over those groups
one after the other is a sum over the copies: every rank of a group runs the same sequence.

Where no such groups are found (a mesh built from a process group of its own, a plain tensor
declared distinct, a gradient whose copies span the whole stage), the copies are compared in the
world's all_reduce instead, a slot per group of copies (``_norm.copies``). Which groups a
gradient uses is decided from rank maps alone, by the same rule on every rank, so the members of
a group agree; the layout's proof then checks that every member of each group holds the same
shard (``_norm.group_comparison``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Sequence

import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from credit.parallel._common.compat import dtensor_spec, root_mesh
from credit.parallel._common.ownership import (
    Holding,
    Stages,
    copies,
    copy_slot,
    layout_error,
    ranks_of,
)

# The meshes searched for a gradient's copies (the call's meshes and their roots), at most this
# many: a model's gradients lie on a few meshes.
_MAX_MESHES = 16


def candidate_meshes(grads: Sequence[Tensor]) -> list[DeviceMesh]:
    """The meshes whose dim groups may join a gradient's copies: each DTensor gradient's mesh
    and the mesh it was sliced from (a view unflattened from a 1-D world has the dims its root
    lacks), in the order the gradients first name them: the call's own, the same on every rank
    of a stage."""
    found: list[DeviceMesh] = []
    for grad in grads:
        if not isinstance(grad, DTensor):
            continue
        mesh = dtensor_spec(grad).mesh
        for candidate in (mesh, root_mesh(mesh)):
            if len(found) < _MAX_MESHES and all(candidate is not other for other in found):
                found.append(candidate)
    return found


def groups_of_copies(
    held: Holding,
    at: Stages,
    distinct: frozenset[int] | None,
    meshes: Sequence[DeviceMesh],
) -> tuple[ProcessGroup, ...] | None:
    """The process groups whose grid through this rank holds exactly the copies of its shard of
    ``held``, in the order every member reduces over them; None where the copies are compared in
    the world's all_reduce (no copies, a single group of copies, or no such groups in hand).

    Args:
        held: what this rank holds of the gradient.
        at: the stages of the world.
        distinct: ranks of the group along which the gradient's copies differ, or None.
        meshes: the meshes to search for the copies of the mesh (:func:`candidate_meshes`).
    """
    mesh = held.mesh
    if mesh is None or distinct is not None or dist.get_rank() not in held.mesh_ranks:
        return None
    if layout_error(held, at, distinct) is not None:
        return None  # the proof says why, before any group could meet another stage's ranks
    if copies(held, at, distinct) == 1 or copy_slot(held, at, distinct)[1] == 1:
        return None  # nothing to compare, or one group: a slot of the world's all_reduce
    inside = tuple(mesh.get_group(d) for d in held.replicate_dims if mesh.size(d) > 1)
    mesh_copies = at.size // len(held.mesh_ranks)
    if mesh_copies == 1:
        return inside or None
    across = _across_mesh_copies(held.mesh_ranks, mesh_copies, at.pp_ranks, meshes)
    return None if across is None else inside + across


def _across_mesh_copies(
    mesh_ranks: frozenset[int],
    mesh_copies: int,
    pp_ranks: frozenset[int],
    meshes: Sequence[DeviceMesh],
) -> tuple[ProcessGroup, ...] | None:
    """The dim groups of one of ``meshes`` whose grid through this rank has ``mesh_copies``
    ranks and meets ``mesh_ranks`` in this rank alone: one rank of each copy of the gradient's
    mesh. Under pipeline stages only a mesh with a dim along the pipeline group ``pp_ranks``
    serves, without that dim: its grid then stays in the stage. The fewest dims first, then the
    first mesh."""
    rank = dist.get_rank()
    for mesh in meshes:
        if mesh.get_coordinate() is None:
            continue
        pipeline = _pipeline_dim(mesh, pp_ranks)
        if pipeline is None:
            continue
        for dims in _dim_sets(mesh, mesh_copies, pipeline):
            if all(r == rank or r not in mesh_ranks for r in _grid(mesh, dims)):
                return tuple(mesh.get_group(d) for d in dims)
    return None


def _pipeline_dim(mesh: DeviceMesh, pp_ranks: frozenset[int]) -> int | None:
    """The dim of ``mesh`` along the pipeline group (-1 without stages), or None without one."""
    if len(pp_ranks) == 1:
        return -1
    for dim in range(mesh.ndim):
        if frozenset(_grid(mesh, (dim,))) == pp_ranks:
            return dim
    return None


def _grid(mesh: DeviceMesh, dims: tuple[int, ...]) -> Collection[int]:
    """The ranks of ``mesh`` through this rank along ``dims``: one dim's from its process
    group, several dims' from the rank map (``ownership.ranks_of``, the others fixed)."""
    if len(dims) == 1:
        return dist.get_process_group_ranks(mesh.get_group(dims[0]))
    return ranks_of(mesh, tuple(d for d in range(mesh.ndim) if d not in dims) or None)


def _dim_sets(mesh: DeviceMesh, size: int, pipeline: int) -> list[tuple[int, ...]]:
    """The sets of ``mesh``'s dims (each larger than one, the pipeline's excluded) whose sizes
    multiply to ``size``, fewest first."""
    dims = [d for d in range(mesh.ndim) if mesh.size(d) > 1 and d != pipeline]
    return [
        chosen
        for count in range(1, len(dims) + 1)
        for chosen in itertools.combinations(dims, count)
        if math.prod(mesh.size(d) for d in chosen) == size
    ]
