"""What this rank holds of each gradient, read from its DTensor spec (or its shape) alone.

A :class:`Holding` is the host-side description of a gradient's layout on this rank: its mesh and
the mesh's ranks, its shard's coordinates, its Replicate and Partial dims. Holdings are cached per
DTensor spec object (FSDP2 and TP reuse them across steps), per layout, and per list of layouts,
under the process group they were read under (``scoped``).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from credit.parallel._common.compat import dtensor_spec, local_tensor
from credit.parallel._common.scoped import ScopedCache

# Holdings are cached per DTensor spec object (FSDP2 and TP reuse them across steps) and per
# layout, up to this many of each, under the process group they were read under.
_MAX_CACHED = 1 << 16


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
        entry = (tuple(_holdings_of(grads)), specs)
        _by_list.put(key, entry)
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
        replica_index=flat_index(
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


def flat_index(coordinates: list[int], sizes: list[int]) -> int:
    """The row-major index of ``coordinates`` in a grid of ``sizes``."""
    index = 0
    for coordinate, size in zip(coordinates, sizes, strict=True):
        index = index * size + coordinate
    return index
