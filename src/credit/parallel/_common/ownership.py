"""How many identical copies of each gradient shard the ranks hold, read from rank maps alone.

Every rank of a pipeline stage holds every parameter of that stage: data, tensor, domain and expert
parallelism shard or replicate parameters, they do not split the parameter set among ranks. A
DTensor gradient on a mesh of ``m`` ranks is therefore held by ``stage_size / m`` disjoint copies of
that mesh (the tp peers of an FSDP2 dp mesh, the other half of a mesh built over half the world),
and inside each copy its Replicate dims (and its Partial dims, once reduced) repeat every shard.
Each shard thus exists in

    copies = replicas * stage_size / m

identical copies, and weighting every rank's contribution by ``1 / copies`` counts every distinct
element exactly once in a sum over all ranks; since every copy contributes, a NaN or inf in any
copy reaches the sum. Gradients declared distinct along a group G (experts held per ep rank) are
not copies of each other across G, so their weight is |G| times larger.

Only sizes and rank sets enter, never how a mesh was built: slicing, ``_flatten``, ``_unflatten``
of a 1-D world, ``DeviceMesh.from_group``, equal but distinct mesh objects and separate
``init_device_mesh`` calls all give the same answer. The rule's one assumption, that every rank of
a stage holds the gradient, is what :func:`coverage` lets the norm verify: summed over the stage,
``m * local numel`` must equal ``stage_size * replicas * global numel``, the right side stated by
one reference rank per stage.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from credit.parallel._common.compat import dtensor_spec, is_shard, local_tensor
from credit.parallel._common.scoped import ScopedCache

# Holdings are cached per DTensor spec object (FSDP2 and TP reuse them across steps) and per
# layout, up to this many of each, under the process group they were read under.
_MAX_CACHED = 1 << 16


@dataclass(frozen=True)
class Stages:
    """The pipeline stages of the world as this rank sees them (a single stage without pp).

    Attributes:
        size: ranks per stage.
        count: number of stages.
        index: this rank's stage.
        is_reference: whether this rank states its stage's expected totals in the self-check: the
            member of its stage in the pipeline group of rank 0, so one rank per stage.
        pp_ranks: this rank's pipeline group (itself alone without pp).
    """

    size: int
    count: int
    index: int
    is_reference: bool
    pp_ranks: frozenset[int]


# The stages per pipeline group (None: no pipeline), under the default group read: a group's ranks
# never change, so its object is the key, and a call reads no rank list.
_stages: ScopedCache[ProcessGroup | None, Stages] = ScopedCache(64)


def stages_of(pp_group: ProcessGroup | None) -> Stages:
    """The stages of the world as this rank sees them, from its pipeline group (None: one stage).

    Raises:
        ValueError: the pipeline group's size does not divide the world size.
    """
    found = _stages.get(pp_group)
    if found is not None:
        return found
    pp_ranks = tuple(dist.get_process_group_ranks(pp_group)) if pp_group is not None else None
    world, rank = dist.get_world_size(), dist.get_rank()
    ranks = list(pp_ranks) if pp_ranks is not None else [rank]
    if world % len(ranks):
        raise ValueError(
            f"pp_group has {len(ranks)} ranks, which does not divide the world size {world}: "
            "pass the pipeline group (one rank per stage) that contains this rank"
        )
    at = Stages(
        size=world // len(ranks),
        count=len(ranks),
        index=ranks.index(rank),
        is_reference=0 in ranks,
        pp_ranks=frozenset(ranks),
    )
    return _stages.put(pp_group, at)


# The ranks of this rank's stage, learned once per pipeline group.
_stage_by_pp_group: ScopedCache[ProcessGroup, frozenset[int]] = ScopedCache(64)


def stage_ranks(at: Stages, pp_group: ProcessGroup | None, device: torch.device) -> frozenset[int]:
    """The ranks of this rank's pipeline stage: the world within a single stage; under pipeline
    stages one all_reduce of a world-size vector (each rank writes its stage), once per pp_group.
    """
    if pp_group is None:
        return frozenset(range(dist.get_world_size()))
    ranks = _stage_by_pp_group.get(pp_group)
    if ranks is None:
        stage_of = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
        stage_of[dist.get_rank()].fill_(at.index + 1)  # 0: a rank not heard from
        dist.all_reduce(stage_of, op=dist.ReduceOp.SUM)
        mine = at.index + 1
        # This rank is of its stage whatever the backend moved (the fake backend moves nothing).
        ranks = frozenset(r for r, s in enumerate(stage_of.tolist()) if s == mine)
        ranks |= {dist.get_rank()}
        _stage_by_pp_group.put(pp_group, ranks)
    return ranks


# The lowest rank of this rank's stage, learned once per pipeline group.
_lowest_by_pp_group: ScopedCache[ProcessGroup, int] = ScopedCache(64)


def lowest_rank_of_stage(at: Stages, pp_group: ProcessGroup | None, device: torch.device) -> int:
    """0 within a single stage; under pipeline stages the lowest rank of this rank's stage,
    learned once per pp_group in one all_reduce (MIN) of one number per stage, and one read."""
    if pp_group is None:
        return 0
    lowest = _lowest_by_pp_group.get(pp_group)
    if lowest is None:
        lowest_of = torch.full((at.count,), dist.get_world_size(), dtype=torch.int64, device=device)
        lowest_of[at.index].fill_(dist.get_rank())
        dist.all_reduce(lowest_of, op=dist.ReduceOp.MIN)
        lowest = _lowest_by_pp_group.put(pp_group, int(lowest_of[at.index]))
    return lowest


@dataclass(frozen=True, eq=False)
class Holding:
    """What this rank holds of one gradient; shared by gradients with equal layouts.

    Attributes:
        description: the gradient's global layout, the same text on every rank that holds it.
        mesh: the gradient's DeviceMesh (None for a plain tensor).
        mesh_ranks: the ranks of that mesh (this rank alone for a plain tensor).
        replicas: identical copies of each shard inside the mesh: the sizes of its Replicate and
            Partial dims multiplied.
        global_numel: elements of the whole gradient.
        local_numel: elements of this rank's shard.
        partial_dims: ``(mesh dim, reduce op)`` for each dim along which the local values are
            addends of the gradient rather than a shard of it.
        dtype: the local tensor's dtype.
        device: the local tensor's device.
        shard_key: this rank's coordinates along the mesh dims that split the gradient (Shard and
            Partial dims): the same on every rank that holds the same values.
        replicated: identical copies of the local values inside the mesh: the sizes of its
            Replicate dims multiplied (Partial addends are not copies of each other).
        replica_index: this rank's position among those copies (0 for the first).
        replicate_slice: the ranks of the mesh at this rank's coordinates along its Replicate
            dims, any coordinate along the others (this rank alone for a plain tensor; empty
            where this rank is not in the mesh).
        shard_sizes: the sizes of the mesh dims of ``shard_key``.
        replicate_dims: the mesh dims along which the gradient is replicated.
    """

    description: str
    mesh: DeviceMesh | None
    mesh_ranks: frozenset[int]
    replicas: int
    global_numel: int
    local_numel: int
    partial_dims: tuple[tuple[int, str], ...]
    dtype: torch.dtype
    device: torch.device
    shard_key: tuple[int, ...] = ()
    replicated: int = 1
    replica_index: int = 0
    replicate_slice: frozenset[int] = frozenset()
    shard_sizes: tuple[int, ...] = ()
    replicate_dims: tuple[int, ...] = ()


# id(spec) -> (spec, holding): keeping the spec alive keeps its id from being reused.
_by_spec: ScopedCache[int, tuple[object, Holding]] = ScopedCache(_MAX_CACHED)
_by_value: ScopedCache[tuple, Holding] = ScopedCache(_MAX_CACHED)


def holding(grad: Tensor) -> Holding:
    """The :class:`Holding` of ``grad`` on this rank (cached per layout, under the current
    process group: a group formed again may give this process another rank)."""
    if not isinstance(grad, DTensor):
        key = _plain_key(grad)
        return _by_value.get(key) or _by_value.put(key, _plain_holding(grad))
    spec = dtensor_spec(grad)
    entry = _by_spec.get(id(spec))
    if entry is not None:
        return entry[1]
    dtensor_key = (spec.mesh, tuple(spec.placements), spec.shape, grad.dtype)
    found = _by_value.get(dtensor_key) or _by_value.put(dtensor_key, _dtensor_holding(grad))
    _by_spec.put(id(spec), (spec, found))
    return found


# Holdings per list of layouts (a training loop passes a few lists), each entry with the specs
# of its DTensors: keeping them alive keeps the ids in its key from being reused.
_MAX_LISTS = 16
_by_list: ScopedCache[tuple, tuple[tuple[Holding, ...], tuple[object, ...]]] = ScopedCache(
    _MAX_LISTS
)


def holdings(grads: list[Tensor]) -> list[Holding]:
    """:func:`holding` of each of ``grads``, kept per list: a list whose gradients have the
    layouts of a list seen before costs one lookup. Its key is what :func:`holding` reads of each
    gradient: a plain tensor's shape, dtype and device, a DTensor's spec object."""
    key = _list_key(grads)
    entry = _by_list.get(key)
    if entry is None:
        specs = tuple(dtensor_spec(g) for g in grads if isinstance(g, DTensor))
        entry = _by_list.put(key, (tuple(_holdings_of(grads)), specs))
    return list(entry[0])


def _list_key(grads: list[Tensor]) -> tuple:
    """The key of :data:`_by_list`: each gradient's :func:`_plain_key` or its spec's id. A list
    of plain tensors only, or of DTensors only (the usual lists), is read attribute by attribute
    in C (``map``), without a Python call per gradient."""
    kinds = set(map(type, grads))
    dtensors = [issubclass(kind, DTensor) for kind in kinds]
    if not any(dtensors):
        return ("plain", *(tuple(map(read, grads)) for read in _PLAIN_KEY))
    if all(dtensors):
        return ("dtensor", tuple(map(id, map(dtensor_spec, cast(list[DTensor], grads)))))
    return (
        "mixed",
        *(id(dtensor_spec(g)) if isinstance(g, DTensor) else _plain_key(g) for g in grads),
    )


def _holdings_of(grads: list[Tensor]) -> list[Holding]:
    """:func:`holding` of each of ``grads``: those seen before in one pass over each cache."""
    specs = [dtensor_spec(g) if isinstance(g, DTensor) else None for g in grads]
    by_spec = iter(_by_spec.get_many([id(spec) for spec in specs if spec is not None]))
    plain = [_plain_key(grad) for grad, spec in zip(grads, specs, strict=True) if spec is None]
    by_value = iter(_by_value.get_many(plain))
    found = []
    for grad, spec in zip(grads, specs, strict=True):
        if spec is None:
            known = next(by_value)
        else:
            entry = next(by_spec)
            known = entry[1] if entry is not None else None
        found.append(known or holding(grad))
    return found


# What a plain tensor's holding is read from, and the key of :data:`_by_value` it gives.
_PLAIN_ATTRIBUTES = ("shape", "dtype", "device")
_plain_key = operator.attrgetter(*_PLAIN_ATTRIBUTES)
_PLAIN_KEY = tuple(operator.attrgetter(name) for name in _PLAIN_ATTRIBUTES)


def _plain_holding(grad: Tensor) -> Holding:
    return Holding(
        description=f"tensor shape={tuple(grad.shape)} dtype={grad.dtype}",
        mesh=None,
        mesh_ranks=frozenset({dist.get_rank()}),
        replicas=1,
        global_numel=grad.numel(),
        local_numel=grad.numel(),
        partial_dims=(),
        dtype=grad.dtype,
        device=grad.device,
        replicate_slice=frozenset({dist.get_rank()}),
    )


def _dtensor_holding(grad: DTensor) -> Holding:
    mesh, placements = grad.device_mesh, tuple(grad.placements)
    names = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
    shape = ", ".join(f"{name}={size}" for name, size in zip(names, mesh.shape, strict=True))
    partial_dims = tuple(
        (dim, getattr(placement, "reduce_op", "sum"))
        for dim, placement in enumerate(placements)
        if placement.is_partial() and mesh.size(dim) > 1
    )
    local = local_tensor(grad)
    coordinate = mesh.get_coordinate() or [0] * mesh.ndim  # None: this rank is not in the mesh
    replicate_dims = [d for d, placement in enumerate(placements) if placement.is_replicate()]
    return Holding(
        description=(
            f"DTensor shape={tuple(grad.shape)} dtype={grad.dtype} placements={placements} "
            f"on a mesh ({shape})"
        ),
        mesh=mesh,
        mesh_ranks=ranks_of(mesh),
        replicas=math.prod(
            mesh.size(dim)
            for dim, placement in enumerate(placements)
            if placement.is_replicate() or placement.is_partial()
        ),
        global_numel=grad.numel(),
        local_numel=local.numel(),
        partial_dims=partial_dims,
        dtype=local.dtype,
        device=local.device,
        shard_key=tuple(
            c
            for c, placement in zip(coordinate, placements, strict=True)
            if not placement.is_replicate()
        ),
        replicated=math.prod(mesh.size(d) for d in replicate_dims),
        replica_index=_ravel(
            [coordinate[d] for d in replicate_dims], [mesh.size(d) for d in replicate_dims]
        ),
        replicate_slice=ranks_of(mesh, tuple(replicate_dims) or None),
        shard_sizes=tuple(
            mesh.size(d) for d, placement in enumerate(placements) if not placement.is_replicate()
        ),
        replicate_dims=tuple(replicate_dims),
    )


# Sets of a mesh's ranks, one per mesh object and slice, shared by the holdings on it: a set has
# the size of the mesh, and a model's gradients lie on a few meshes.
_mesh_ranks: ScopedCache[tuple[int, tuple[int, ...] | None], tuple[DeviceMesh, frozenset[int]]]
_mesh_ranks = ScopedCache(256)


def ranks_of(mesh: DeviceMesh, fixed: tuple[int, ...] | None = None) -> frozenset[int]:
    """The ranks of ``mesh`` (with ``fixed``, those at this rank's coordinates along those
    dims, any along the others; empty where this rank is not in the mesh)."""
    found = _mesh_ranks.get((id(mesh), fixed))
    if found is None:  # the mesh is kept with its set, so that its id is not reused
        found = _mesh_ranks.put((id(mesh), fixed), (mesh, _ranks(mesh, fixed)))
    return found[1]


def _ranks(mesh: DeviceMesh, fixed: tuple[int, ...] | None) -> frozenset[int]:
    if fixed is None:
        return frozenset(mesh.mesh.flatten().tolist())
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return frozenset()
    index = tuple(coordinate[d] if d in fixed else slice(None) for d in range(mesh.ndim))
    return frozenset(mesh.mesh[index].flatten().tolist())


def _ravel(coordinates: list[int], sizes: list[int]) -> int:
    index = 0
    for coordinate, size in zip(coordinates, sizes, strict=True):
        index = index * size + coordinate
    return index


@dataclass(frozen=True)
class Counts:
    """What the rank maps say of a layout's gradients on this rank.

    Attributes:
        error: why the copy count of some gradient cannot be derived (the first), or None.
        weights: each gradient's :func:`weight`, in the order asked for.
        coverage: each gradient's :func:`coverage` term, in input order.
    """

    error: str | None
    weights: list[float]
    coverage: list[int]


def counts(
    held: list[Holding], at: Stages, distinct: list[frozenset[int] | None], order: list[int]
) -> Counts:
    """The :class:`Counts` of a layout, its weights in the order ``order`` (input indices)."""
    errors = (layout_error(h, at, d) for h, d in zip(held, distinct, strict=True))
    return Counts(
        error=next((e for e in errors if e is not None), None),
        weights=[weight(held[i], at, distinct[i]) for i in order],
        coverage=[coverage(h, at) for h in held],
    )


def weight(held: Holding, at: Stages, distinct: frozenset[int] | None) -> float:
    """``1 / copies``: the weight of this rank's contribution for ``held``.

    Args:
        held: what this rank holds of the gradient.
        at: the stages of the world.
        distinct: ranks of the group along which the gradient's copies differ, or None.
    """
    distinct_size = len(distinct) if distinct else 1
    return len(held.mesh_ranks) * distinct_size / (held.replicas * at.size)


def layout_error(held: Holding, at: Stages, distinct: frozenset[int] | None) -> str | None:
    """Why the copy count of ``held`` cannot be derived from rank maps, or None when it can."""
    rank = dist.get_rank()
    if rank not in held.mesh_ranks:
        return None  # an empty shard: it contributes nothing whatever its weight
    if held.mesh_ranks & at.pp_ranks != {rank}:
        return (
            f"a gradient's mesh holds ranks of other pipeline stages ({held.description}; "
            f"pp_group ranks {sorted(at.pp_ranks)}): a parameter lives in one stage"
        )
    copies_of_mesh = at.size / len(held.mesh_ranks)
    if distinct is not None:
        if distinct & held.mesh_ranks != {rank} or distinct & at.pp_ranks != {rank}:
            return (
                f"distinct_along group (ranks {sorted(distinct)}) overlaps the mesh of "
                f"{held.description} or the pipeline group: it must run across copies of the mesh"
            )
        copies_of_mesh /= len(distinct)
    if copies_of_mesh < 1 or copies_of_mesh != int(copies_of_mesh):
        return (
            f"{held.description}: its mesh ({len(held.mesh_ranks)} ranks) "
            f"{'and its distinct_along group ' if distinct else ''}do not tile a stage of "
            f"{at.size} ranks"
        )
    return None


def coverage(held: Holding, at: Stages) -> int:
    """This rank's term of the self-check for ``held``; the terms of a stage sum to zero when every
    rank of the stage holds a shard of the gradient on its own copy of the mesh."""
    contributed = len(held.mesh_ranks) * held.local_numel
    if at.is_reference:
        contributed -= at.size * held.replicas * held.global_numel
    return contributed


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
    held: Holding, at: Stages, lowest: int, distinct: frozenset[int] | None
) -> CopyGroup | None:
    """This rank's :class:`CopyGroup` for ``held``, or None where it holds nothing of it.

    The copies are the ranks at the same place of the other copies of the mesh in the stage
    (cosets, as :func:`weight` counts them), times the Replicate dims inside the mesh. The
    reference is the copy at coordinate 0 along the Replicate dims in the mesh copy that holds the
    stage's lowest rank ``lowest``, which every member of that copy can see in its own rank map.
    With ``distinct``, the copies of the mesh run across blocks made of ``distinct`` groups: the
    block holding ``lowest`` is visible from a plain gradient (its block is its group) or when
    the stage holds one block only; otherwise the group shrinks to the Replicate dims, and copies
    across blocks are not compared.

    Args:
        held: what this rank holds of the gradient, for a layout without ``layout_error``.
        at: the stages of the world.
        lowest: the lowest rank of this rank's stage.
        distinct: ranks of the group along which the gradient's copies differ, or None.
    """
    if dist.get_rank() not in held.mesh_ranks:
        return None
    key = held.shard_key
    in_reference_block = lowest in held.mesh_ranks
    share = held.replicate_slice
    confined = False
    if distinct is not None:
        key += (sorted(distinct).index(dist.get_rank()),)
        if len(held.mesh_ranks) == 1:
            in_reference_block = lowest in distinct
            share = distinct
        else:  # the group shrinks to the Replicate dims of this rank's own mesh copy
            in_reference_block, confined = True, True
    return CopyGroup(
        size=copies(held, at, distinct),
        is_reference=in_reference_block and held.replica_index == 0,
        key=key,
        share=share,
        confined=confined,
    )


def copy_slots(
    held: list[Holding],
    at: Stages,
    distinct: list[frozenset[int] | None],
    order: list[int],
    elsewhere: list[bool],
) -> tuple[list[int], list[tuple[int, int, torch.dtype]]]:
    """A slot per group of copies of this rank's stage, gradients in the order ``order``
    (input indices), except those compared ``elsewhere`` (in their copies' own process groups):
    the slot of each gradient (0 where it has none), and per gradient with slots, how many
    groups it has, their number of copies and its dtype. The same on every rank of the stage
    that passed the layout (:func:`copy_slot`)."""
    slot_of = [0] * len(held)
    per_gradient: list[tuple[int, int, torch.dtype]] = []
    first = 0
    for index in order:
        count = copies(held[index], at, distinct[index])
        if count > 1 and not elsewhere[index]:
            group, groups = copy_slot(held[index], at, distinct[index])
            slot_of[index] = first + group
            per_gradient.append((groups, count, held[index].dtype))
            first += groups
    return slot_of, per_gradient


def copies(held: Holding, at: Stages, distinct: frozenset[int] | None) -> int:
    """How many ranks of a stage hold the values of each shard of ``held`` (see
    :func:`copy_group`), from its layout alone: the same on every rank that passed it."""
    mesh_copies = max(at.size // len(held.mesh_ranks), 1)
    if distinct is not None:
        # A gradient on a mesh of several ranks: the other blocks cannot be seen from here.
        mesh_copies = 1 if len(held.mesh_ranks) > 1 else max(mesh_copies // len(distinct), 1)
    return mesh_copies * held.replicated


def copy_slot(held: Holding, at: Stages, distinct: frozenset[int] | None) -> tuple[int, int]:
    """``(index, count)``: where this rank's copy group of ``held`` sits among the gradient's
    groups, and how many groups the gradient has in a stage; the count is the same on every rank
    that passed the same layout, the index the same on every member of a group.

    A group is named by its shard (the coordinates along the dims that split the gradient), its
    place in ``distinct``, and, where it is confined to a mesh copy, that copy's lowest rank.

    Args:
        held: what this rank holds of the gradient.
        at: the stages of the world.
        distinct: ranks of the group along which the gradient's copies differ, or None.
    """
    rank = dist.get_rank()
    count = math.prod(held.shard_sizes)
    index = _ravel(list(held.shard_key), list(held.shard_sizes)) if held.shard_key else 0
    if distinct is not None:
        count *= len(distinct)
        index = index * len(distinct) + (sorted(distinct).index(rank) if rank in distinct else 0)
        if len(held.mesh_ranks) > 1 and at.size > len(held.mesh_ranks) * len(distinct):
            count *= dist.get_world_size()  # confined to its mesh copy (see copy_group)
            index = index * dist.get_world_size() + min(held.mesh_ranks)
    return index, count


def universe(group: CopyGroup, held: Holding, stage: frozenset[int]) -> frozenset[int]:
    """The ranks that the shares of ``group``'s members cover, each exactly once: the stage's
    ranks ``stage``, or this rank's mesh copy where the group is confined to it.

    Every member names the same set: the members of a group confined to a mesh copy all lie in
    it.
    """
    return held.mesh_ranks if group.confined else stage


def mixes_shards(grad: Tensor, group_ranks: frozenset[int]) -> bool:
    """Whether averaging ``grad`` over the ranks ``group_ranks`` would mix different shards.

    True when two ranks of the group sit on one line of ``grad``'s mesh along a dim that shards it
    (FSDP2 grads averaged over their own dp group): they hold different elements, whatever the
    shapes. Read from the mesh's rank map, as the copies are.
    """
    if not isinstance(grad, DTensor):
        return False
    spec = dtensor_spec(grad)
    mesh = spec.mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return False
    for dim, placement in enumerate(spec.placements):
        if not is_shard(placement) or mesh.size(dim) == 1:
            continue
        line = list(coordinate)
        line[dim] = slice(None)  # type: ignore[call-overload]
        if len(group_ranks.intersection(mesh.mesh[tuple(line)].tolist())) > 1:
            return True
    return False
