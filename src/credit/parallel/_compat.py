"""The private torch APIs the library relies on, one function per concern.

DTensor's public accessors cost microseconds of autograd bookkeeping per call, which adds up over
thousands of gradients per step; these read the same state directly.
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor, Placement, Shard

try:  # the right-to-left shard of FSDP2 + TP; no longer a Shard subclass in recent torch
    from torch.distributed.tensor.placement_types import _StridedShard

    _SHARD_TYPES: tuple[type, ...] = (Shard, _StridedShard)
except ImportError:  # pragma: no cover - torch without _StridedShard
    _SHARD_TYPES = (Shard,)


def local_tensor(tensor: Tensor) -> Tensor:
    """The local shard of a DTensor (``to_local()`` without its autograd bookkeeping), or ``tensor``."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def is_shard(placement: Placement) -> bool:
    """Whether ``placement`` splits the tensor across its mesh dim (strided shards included)."""
    return isinstance(placement, _SHARD_TYPES) or placement.is_shard()
