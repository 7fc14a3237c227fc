"""What the pipeline stages learn together: each stage's lowest rank, and where each stage's
groups of copies sit in the norm's vector, the same on every rank.

A stage's lowest rank (whose copy of a plain replica is the reference) is learned once per
pipeline group, in one all_reduce (MIN) of one number per stage (:func:`lowest_rank_of_stage`).

Every group of copies has a slot of its own in the norm's all_reduce (``copies``). Under pipeline
stages a rank knows its own stage's groups only, and another stage may meet a new layout on any
call, seen by its own ranks alone; yet every rank must send a vector of the same length, or gloo
aborts and NCCL hangs. So every rank keeps, per pipeline group, a region of slots per stage
(:class:`Regions`), and the regions are the same on every rank by construction: every rank starts
from empty regions and changes them only from numbers that every rank reads from the same
all_reduce (each stage's slot count, which every norm's all_reduce under stages carries), by the
same rule. A region only grows, to the largest count its stage has sent. A stage whose layout fits
its region writes its groups' sums there; one that does not yet fit (a layout with more groups
than any of its stage before it) writes zeros, and asks for the proof that every rank then joins,
with the regions grown by that very call (``proof.act_on_decisions``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from credit.parallel._common.scoped import ScopedCache
from credit.parallel._common.stages import Stages

# The lowest rank of this rank's stage, learned once per pipeline group.
_lowest_by_pp_group: ScopedCache[ProcessGroup, int] = ScopedCache(64)


def lowest_rank_of_stage(
    stages: Stages, pp_group: ProcessGroup | None, device: torch.device
) -> int:
    """0 within a single stage; under pipeline stages the lowest rank of this rank's stage,
    learned once per pp_group in one all_reduce (MIN) of one number per stage, and one read."""
    if pp_group is None:
        return 0
    lowest = _lowest_by_pp_group.get(pp_group)
    if lowest is None:
        lowest_of = torch.full(
            (stages.count,), dist.get_world_size(), dtype=torch.int64, device=device
        )
        lowest_of[stages.index].fill_(dist.get_rank())
        dist.all_reduce(lowest_of, op=dist.ReduceOp.MIN)
        lowest = _lowest_by_pp_group.put(pp_group, int(lowest_of[stages.index]))
    return lowest


@dataclass(frozen=True)
class Regions:
    """How many slots of the copies' sums each stage has in the norm's vector.

    Attributes:
        sizes: the slots of each stage, in stage order.
    """

    sizes: tuple[int, ...]

    def fits(self, stage: int, count: int) -> bool:
        """Whether ``count`` slots of ``stage`` fit in its region."""
        return count <= self.sizes[stage]

    def grown(self, counts: Sequence[float]) -> Regions:
        """The regions grown to hold ``counts`` slots per stage (read from an all_reduce)."""
        return Regions(
            tuple(max(size, int(count)) for size, count in zip(self.sizes, counts, strict=True))
        )


# Per pipeline group: as many as a process uses (one per model split, in practice).
_agreed: ScopedCache[ProcessGroup, Regions] = ScopedCache(64)


def agreed(pp_group: ProcessGroup, stage_count: int) -> Regions:
    """The regions every rank holds for ``pp_group`` (empty before its first norm)."""
    return _agreed.get(pp_group) or Regions((0,) * stage_count)


def keep(pp_group: ProcessGroup, regions: Regions) -> None:
    """Keep the regions that every rank read from the same all_reduce, for the next call."""
    _agreed.put(pp_group, regions)
