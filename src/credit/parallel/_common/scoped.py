"""Caches that belong to the process group they were learned under.

What the library learns once and keeps (what a rank holds of a gradient, a layout's plan and its
proof, the ranks of a pipeline stage, the replica check's plans) comes from rank maps read under
one default process group. A group destroyed and formed again in the same process (an in-process
restart after a rank left) may give this process another rank and another world: every such
entry is stale then. A :class:`ScopedCache` drops its entries as soon as the default group is
another object than the one they were learned under, so a re-formed group starts from nothing
proven. A process group object has one rank and one world size for its whole life, so its
identity is the whole key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

import torch.distributed as dist

_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")


def _default_group() -> object:
    """The default process group object, or None without one."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


class ScopedCache(Generic[_K, _V]):
    """At most ``limit`` entries, least recently used dropped first, all dropped when the
    default process group changes.

    Args:
        limit: how many entries to keep.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._entries: OrderedDict[_K, _V] = OrderedDict()
        self._group: object = None  # kept alive, so that its identity cannot be reused

    def get(self, key: _K) -> _V | None:
        """The entry of ``key`` learned under the current default group, or None."""
        self._follow_group()
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def get_many(self, keys: list[_K]) -> list[_V | None]:
        """:meth:`get` of each of ``keys``, the default group looked up once."""
        self._follow_group()
        found = [self._entries.get(key) for key in keys]
        for key, value in zip(keys, found, strict=True):
            if value is not None:
                self._entries.move_to_end(key)
        return found

    def put(self, key: _K, value: _V) -> _V:
        """Keep ``value`` for ``key`` under the current default group; returns ``value``."""
        self._follow_group()
        self._entries[key] = value
        if len(self._entries) > self._limit:
            self._entries.popitem(last=False)
        return value

    def _follow_group(self) -> None:
        group = _default_group()
        if group is not self._group:
            self._entries.clear()
            self._group = group
