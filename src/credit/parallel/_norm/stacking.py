"""How torch stacks per-gradient norms (its order), and index tensors into the stack.

torch's ``get_total_norm`` groups tensors by (device, dtype) and stacks their norms group by group;
every norm here stacks them in that order, so that its reductions are torch's. A :class:`Stacking`
is built once per layout (by the plan, or per list of (dtype, device) for a norm
on one rank) and keeps the index tensors its callers ask for: a report's segments, a scaler's set
of gradients (each costs one host-to-device copy, the first time).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from credit.parallel._common.compat import group_indices_by_device_and_dtype
from credit.parallel._common.scoped import ScopedCache

# Stackings kept for norms on one rank (a training loop uses a few).
_MAX_STACKINGS = 64
# Index tensors kept per stacking (a report's grouping, the gradients of each scaler's flags).
_MAX_INDICES = 16


@dataclass(eq=False)
class Stacking:
    """The order torch stacks per-gradient norms in, and index tensors into it.

    Attributes:
        groups: the input indices by (device, dtype), in torch's order, with the device.
        stacked: the input index of each stacked norm.
        device: where the stacked norms live.
        whole: one group holds every tensor, in input order (the stacked order is the input
            order: a call takes the input list as it is).
    """

    groups: list[tuple[torch.device, list[int]]]
    stacked: list[int]
    device: torch.device
    whole: bool = False
    _indices: ScopedCache[Hashable, list[Tensor]] = field(
        default_factory=lambda: ScopedCache(_MAX_INDICES)
    )

    def positions(self, inputs: list[int]) -> Tensor:
        """The places of the norms of gradients ``inputs`` (input indices) in the stacked order,
        as an index tensor on the device."""

        def build() -> list[list[int]]:
            place = {index: position for position, index in enumerate(self.stacked)}
            return [[place[index] for index in inputs]]

        return self.indices(("inputs", tuple(inputs)), build)[0]

    def segments(self, segment_of: list[int] | None) -> Tensor:
        """The segment of each stacked norm (default: all in segment 0), as an index tensor."""
        key = ("segments", tuple(segment_of) if segment_of is not None else None)
        return self.indices(
            key, lambda: [[segment_of[i] if segment_of else 0 for i in self.stacked]]
        )[0]

    def indices(self, key: Hashable, build: Callable[[], list[list[int]]]) -> list[Tensor]:
        """The index lists that ``build`` returns (positions in the stacked order, or a segment
        per stacked norm), as index tensors on the device: built once per ``key``, in one
        host-to-device copy, then kept."""
        found = self._indices.get(key)
        if found is None:
            lists = build()
            flat = [position for positions in lists for position in positions]
            packed = torch.zeros(0, dtype=torch.int64, device=self.device)
            if flat:
                packed = torch.tensor(flat, dtype=torch.int64, device=self.device)
            found = self._indices.put(key, list(packed.split([len(p) for p in lists])))
        return found


_stackings: ScopedCache[Hashable, Stacking] = ScopedCache(_MAX_STACKINGS)


def stacking_of(local: list[Tensor]) -> Stacking:
    """The :class:`Stacking` of tensors reduced on this rank alone, kept per (dtype, device) list."""
    key = tuple((t.dtype, t.device) for t in local)
    stacking = _stackings.get(key)
    if stacking is None:
        stacking = stacking_on(local, local[0].device if local else torch.device("cpu"))
        _stackings.put(key, stacking)
    return stacking


def stacking_on(local: list[Tensor], device: torch.device) -> Stacking:
    """A new :class:`Stacking` of ``local``, its index tensors to live on ``device``."""
    groups = []
    if local:
        grouped = group_indices_by_device_and_dtype(local)
        groups = [(where, indices) for (where, _), indices in grouped.items()]
    stacked = [index for _, indices in groups for index in indices]
    whole = len(groups) == 1 and stacked == list(range(len(local)))
    return Stacking(groups, stacked, device, whole)
