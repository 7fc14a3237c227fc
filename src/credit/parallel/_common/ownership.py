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

from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from credit.parallel._common.compat import dtensor_spec, is_shard
from credit.parallel._common.holdings import Holding
from credit.parallel._common.stages import Stages


@dataclass(frozen=True)
class Counts:
    """What the rank maps say of a layout's gradients on this rank.

    Attributes:
        errors: per gradient, why its copy count cannot be derived (:func:`layout_error`), or
            None; in input order.
        weights: each gradient's :func:`weight`, in the order asked for.
        coverage: each gradient's :func:`coverage` term, in input order.
        copies: each gradient's :func:`copies`, in input order.
    """

    errors: list[str | None]
    weights: list[float]
    coverage: list[int]
    copies: list[int]

    @property
    def error(self) -> str | None:
        """The first of :attr:`errors`, or None."""
        return next((e for e in self.errors if e is not None), None)


def counts(
    holdings: list[Holding],
    stages: Stages,
    distinct: list[frozenset[int] | None],
    order: list[int],
) -> Counts:
    """The :class:`Counts` of a layout, its weights in the order ``order`` (input indices)."""
    pairs = list(zip(holdings, distinct, strict=True))
    return Counts(
        errors=[layout_error(h, stages, d) for h, d in pairs],
        weights=[weight(holdings[i], stages, distinct[i]) for i in order],
        coverage=[coverage(h, stages) for h in holdings],
        copies=[copies(h, stages, d) for h, d in pairs],
    )


def weight(holding: Holding, stages: Stages, distinct: frozenset[int] | None) -> float:
    """``1 / copies``: the weight of this rank's contribution for ``holding``.

    Args:
        holding: what this rank holds of the gradient.
        at: the stages of the world.
        distinct: ranks of the group along which the gradient's copies differ, or None.
    """
    distinct_size = len(distinct) if distinct else 1
    return len(holding.mesh_ranks) * distinct_size / (holding.replicas * stages.size)


def layout_error(holding: Holding, stages: Stages, distinct: frozenset[int] | None) -> str | None:
    """Why the copy count of ``holding`` cannot be derived from rank maps, or None when it can."""
    rank = dist.get_rank()
    if rank not in holding.mesh_ranks:
        return None  # an empty shard: it contributes nothing whatever its weight
    if holding.mesh_ranks & stages.pp_ranks != {rank}:
        return (
            f"a gradient's mesh holds ranks of other pipeline stages ({holding.description}; "
            f"pp_group ranks {sorted(stages.pp_ranks)}): a parameter lives in one stage"
        )
    copies_of_mesh = stages.size / len(holding.mesh_ranks)
    if distinct is not None:
        if distinct & holding.mesh_ranks != {rank} or distinct & stages.pp_ranks != {rank}:
            return (
                f"distinct_along group (ranks {sorted(distinct)}) overlaps the mesh of "
                f"{holding.description} or the pipeline group: it must run across copies of the mesh"
            )
        copies_of_mesh /= len(distinct)
    if copies_of_mesh < 1 or copies_of_mesh != int(copies_of_mesh):
        return (
            f"{holding.description}: its mesh ({len(holding.mesh_ranks)} ranks) "
            f"{'and its distinct_along group ' if distinct else ''}do not tile a stage of "
            f"{stages.size} ranks"
        )
    return None


def coverage(holding: Holding, stages: Stages) -> int:
    """This rank's term of the self-check for ``holding``; the terms of a stage sum to zero when every
    rank of the stage holds a shard of the gradient on its own copy of the mesh."""
    contributed = len(holding.mesh_ranks) * holding.local_numel
    if stages.is_reference:
        contributed -= stages.size * holding.replicas * holding.global_numel
    return contributed


def copies(holding: Holding, stages: Stages, distinct: frozenset[int] | None) -> int:
    """How many ranks of a stage hold the values of each shard of ``holding`` (see
    :func:`copy_group`), from its layout alone: the same on every rank that passed it."""
    mesh_copies = max(stages.size // len(holding.mesh_ranks), 1)
    if distinct is not None:
        # A gradient on a mesh of several ranks: the other blocks cannot be seen from here.
        mesh_copies = 1 if len(holding.mesh_ranks) > 1 else max(mesh_copies // len(distinct), 1)
    return mesh_copies * holding.replicated


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
