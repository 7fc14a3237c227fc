"""The pipeline stages of the world as a rank sees them, read from its pipeline group.

Every rank of a pipeline stage holds every parameter of that stage; the stages split the world in
``count`` equal parts, one rank of each in every pipeline group. What the stages must learn from
each other (the lowest rank of a stage, the ranks of a stage) is learned by the subsystem that
needs it, in its own collective; this module reads rank lists alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

from credit.parallel._common.scoped import ScopedCache


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
    stages = Stages(
        size=world // len(ranks),
        count=len(ranks),
        index=ranks.index(rank),
        is_reference=0 in ranks,
        pp_ranks=frozenset(ranks),
    )
    return _stages.put(pp_group, stages)
