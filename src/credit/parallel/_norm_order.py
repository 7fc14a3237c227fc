"""The order torch stacks per-gradient norms in, and index tensors into it.

torch's ``get_total_norm`` groups tensors by (device, dtype) and stacks their norms group by group;
every norm here stacks them in that order, so that its reductions are torch's. An :class:`Order`
is built once per layout (by the plan, ``_norm_plan``, or per list of (dtype, device) for a norm
on one rank) and keeps the index tensors its callers ask for: a report's segments, a scaler's set
of gradients (each costs one host-to-device copy, the first time).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from credit.parallel._foreach import group_indices_by_device_and_dtype
from credit.parallel._scoped import ScopedCache

# Orders kept for norms on one rank (a training loop uses a few).
_MAX_ORDERS = 64
# Index tensors kept per order (a report's grouping, the gradients of each scaler's flags).
_MAX_INDICES = 16


@dataclass(eq=False)
class Order:
    """The order torch stacks per-gradient norms in, and index tensors into it.

    Attributes:
        groups: the input indices by (device, dtype), in torch's order, with the device.
        stacked: the input index of each stacked norm.
        device: where the stacked norms live.
    """

    groups: list[tuple[torch.device, list[int]]]
    stacked: list[int]
    device: torch.device
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


_orders: ScopedCache[Hashable, Order] = ScopedCache(_MAX_ORDERS)


def order_of(local: list[Tensor]) -> Order:
    """The :class:`Order` of tensors reduced on this rank alone, kept per (dtype, device) list."""
    key = tuple((t.dtype, t.device) for t in local)
    order = _orders.get(key)
    if order is None:
        order = order_on(local, local[0].device if local else torch.device("cpu"))
        _orders.put(key, order)
    return order


def order_on(local: list[Tensor], device: torch.device) -> Order:
    """A new :class:`Order` of ``local``, its index tensors to live on ``device``."""
    groups = []
    if local:
        grouped = group_indices_by_device_and_dtype(local)
        groups = [(where, indices) for (where, _), indices in grouped.items()]
    return Order(groups, [index for _, indices in groups for index in indices], device)
