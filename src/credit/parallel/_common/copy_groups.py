"""Where the copies of a gradient's shard are, read from the meshes' rank maps alone.

The copies of a shard (``ownership.copies`` counts them) are the ranks at the same place of the
other copies of its mesh in the stage, times the mesh's Replicate dims. This module names them:
this rank's :class:`CopyGroup` (its reference copy, the shard's key, its share of the stage), the
group's slot among the gradient's groups, and the process groups in which the copies meet.

Each member of those copies can reach all the others through process groups it already holds:
the mesh's own dim groups for the Replicate dims, and, for the copies of the mesh (the tp peers
of an FSDP2 dp mesh), the dim groups of a mesh the gradient's mesh was sliced from, or of another
gradient's mesh of the call, whose grid through this rank meets the gradient's mesh in this rank
alone (and, under pipeline stages, leaves out the mesh's dim along the pipeline group, so that it
stays in the stage). A sum over those groups one after the other is a sum over the copies: every
rank of a group runs the same sequence.

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
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from credit.parallel._common.compat import dtensor_spec, root_mesh
from credit.parallel._common.holdings import Holding, flat_index, ranks_of
from credit.parallel._common.ownership import Counts
from credit.parallel._common.stages import Stages

# The meshes searched for a gradient's copies (the call's meshes and their roots), at most this
# many: a model's gradients lie on a few meshes.
_MAX_MESHES = 16


@dataclass(frozen=True)
class CopyGroup:
    """The ranks that the rank maps say hold the same values as this rank's shard of a gradient.

    Attributes:
        size: how many ranks hold those values (1: no copies to compare).
        is_reference: whether this rank's copy is the one the others are compared with; every
            group has exactly one.
        key: names the shard among the gradient's shards, the same on all of its copies.
        share: this copy's part of the group's universe (see :func:`universe`): the ranks of its
            own mesh copy at its coordinates along the Replicate dims, or its ``distinct`` group
            for a plain gradient declared distinct. The shares of a group's members are disjoint
            and cover its universe.
        confined: whether the copies are sought in this rank's own mesh copy only (a gradient
            on a mesh of several ranks declared distinct: the other blocks cannot be seen).
    """

    size: int
    is_reference: bool
    key: tuple[int, ...]
    share: frozenset[int] = frozenset()
    confined: bool = False


def copy_group(
    holding: Holding, lowest: int, distinct: frozenset[int] | None, size: int
) -> CopyGroup | None:
    """This rank's :class:`CopyGroup` for ``holding``, or None where it holds nothing of it.

    The copies are the ranks at the same place of the other copies of the mesh in the stage
    (cosets, as ``ownership.weight`` counts them), times the Replicate dims inside the mesh. The
    reference is the copy at coordinate 0 along the Replicate dims in the mesh copy that holds the
    stage's lowest rank ``lowest``, which every member of that copy can see in its own rank map.
    With ``distinct``, the copies of the mesh run across blocks made of ``distinct`` groups: the
    block holding ``lowest`` is visible from a plain gradient (its block is its group) or when
    the stage holds one block only; otherwise the group shrinks to the Replicate dims, and copies
    across blocks are not compared.

    Args:
        holding: what this rank holds of the gradient, for a layout without ``layout_error``.
        lowest: the lowest rank of this rank's stage.
        distinct: ranks of the group along which the gradient's copies differ, or None.
        size: how many ranks hold its values (``ownership.copies``).
    """
    if dist.get_rank() not in holding.mesh_ranks:
        return None
    key = holding.shard_key
    in_reference_block = lowest in holding.mesh_ranks
    share = holding.replicate_slice
    confined = False
    if distinct is not None:
        key += (sorted(distinct).index(dist.get_rank()),)
        if len(holding.mesh_ranks) == 1:
            in_reference_block = lowest in distinct
            share = distinct
        else:  # the group shrinks to the Replicate dims of this rank's own mesh copy
            in_reference_block, confined = True, True
    return CopyGroup(
        size=size,
        is_reference=in_reference_block and holding.replica_index == 0,
        key=key,
        share=share,
        confined=confined,
    )


def copy_slot(holding: Holding, stages: Stages, distinct: frozenset[int] | None) -> tuple[int, int]:
    """``(index, count)``: where this rank's copy group of ``holding`` sits among the gradient's
    groups, and how many groups the gradient has in a stage; the count is the same on every rank
    that passed the same layout, the index the same on every member of a group.

    A group is named by its shard (the coordinates along the dims that split the gradient), its
    place in ``distinct``, and, where it is confined to a mesh copy, that copy's lowest rank.

    Args:
        holding: what this rank holds of the gradient.
        at: the stages of the world.
        distinct: ranks of the group along which the gradient's copies differ, or None.
    """
    rank = dist.get_rank()
    count = math.prod(holding.shard_sizes)
    index = (
        flat_index(list(holding.shard_key), list(holding.shard_sizes)) if holding.shard_key else 0
    )
    if distinct is not None:
        count *= len(distinct)
        index = index * len(distinct) + (sorted(distinct).index(rank) if rank in distinct else 0)
        if len(holding.mesh_ranks) > 1 and stages.size > len(holding.mesh_ranks) * len(distinct):
            count *= dist.get_world_size()  # confined to its mesh copy (see copy_group)
            index = index * dist.get_world_size() + min(holding.mesh_ranks)
    return index, count


def universe(group: CopyGroup, holding: Holding, stage: frozenset[int]) -> frozenset[int]:
    """The ranks that the shares of ``group``'s members cover, each exactly once: the stage's
    ranks ``stage``, or this rank's mesh copy where the group is confined to it.

    Every member names the same set: the members of a group confined to a mesh copy all lie in
    it.
    """
    return holding.mesh_ranks if group.confined else stage


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


def _groups_in_hand(
    holding: Holding, stages: Stages, meshes: Sequence[DeviceMesh]
) -> tuple[ProcessGroup, ...] | None:
    """The process groups whose grid through this rank holds exactly the copies of its shard of
    ``holding`` (a DTensor on a mesh this rank is in, with copies in several groups), in the
    order every member reduces over them; None where no such groups are in hand.

    Args:
        holding: what this rank holds of the gradient.
        stages: the stages of the world.
        meshes: the meshes to search for the copies of the mesh (:func:`candidate_meshes`).
    """
    mesh = holding.mesh
    assert mesh is not None
    inside = tuple(mesh.get_group(d) for d in holding.replicate_dims if mesh.size(d) > 1)
    mesh_copies = stages.size // len(holding.mesh_ranks)
    if mesh_copies == 1:
        return inside or None
    across = _across_mesh_copies(holding.mesh_ranks, mesh_copies, stages.pp_ranks, meshes)
    return None if across is None else inside + across


@dataclass(frozen=True)
class Copies:
    """Where the copies of this rank's shard of one gradient are.

    Attributes:
        count: how many ranks of the stage hold its values (1: nothing to compare).
        group: this rank's :class:`CopyGroup`; None where it holds nothing of the gradient, or
            where the layout cannot be reduced (nothing is compared then).
        slot: ``(index, count)`` of its group among the gradient's groups (:func:`copy_slot`).
        process_groups: the process groups in which the copies meet, or None where they are
            compared in slots of the world's all_reduce (no copies, a single group of copies, a
            plain tensor, ``distinct_along``, a layout that cannot be reduced, or no such groups
            in hand).
    """

    count: int
    group: CopyGroup | None
    slot: tuple[int, int]
    process_groups: tuple[ProcessGroup, ...] | None


def copies_of(
    holdings: Sequence[Holding],
    stages: Stages,
    lowest: int,
    distinct: Sequence[frozenset[int] | None],
    grads: Sequence[Tensor],
    counts: Counts,
    reducible: bool,
) -> list[Copies]:
    """The :class:`Copies` of each gradient, decided once per distinct holding; a process group
    is named by its ranks (equal groups of other meshes are one).

    Args:
        holdings: what this rank holds of each gradient.
        stages: the stages of the world.
        lowest: the lowest rank of this rank's stage.
        distinct: per gradient, the ranks along which its copies differ, or None.
        grads: the gradients, whose meshes are searched (:func:`candidate_meshes`).
        counts: what the rank maps count of each gradient (``ownership.counts``).
        reducible: whether the layout can be reduced (else no gradient has a group).
    """
    meshes = candidate_meshes(grads)
    decided: dict[tuple[int, frozenset[int] | None], Copies] = {}
    by_ranks: dict[tuple[int, ...], ProcessGroup] = {}
    found = []
    for index, (holding, marked) in enumerate(zip(holdings, distinct, strict=True)):
        key = (id(holding), marked)
        if key not in decided:
            count, slot = counts.copies[index], copy_slot(holding, stages, marked)
            groups = None
            if _meets_in_groups(holding, marked, counts.errors[index], count, slot[1]):
                groups = _groups_in_hand(holding, stages, meshes)
            decided[key] = Copies(
                count=count,
                group=copy_group(holding, lowest, marked, count) if reducible else None,
                slot=slot,
                process_groups=groups
                and tuple(
                    by_ranks.setdefault(tuple(dist.get_process_group_ranks(g)), g) for g in groups
                ),
            )
        found.append(decided[key])
    return found


def _meets_in_groups(
    holding: Holding, distinct: frozenset[int] | None, error: str | None, count: int, groups: int
) -> bool:
    """Whether the copies of ``holding`` may meet in process groups: a DTensor on a mesh this
    rank is in, not declared distinct, its layout sound (the proof says why otherwise, before any
    group could meet another stage's ranks), with copies in more than one group (else nothing
    to compare, or one slot of the world's all_reduce)."""
    return (
        holding.mesh is not None
        and distinct is None
        and dist.get_rank() in holding.mesh_ranks
        and error is None
        and count > 1
        and groups > 1
    )


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
