"""torch's grouping of tensors by (device, dtype), in the order that decides a stacked norm's bits."""

from __future__ import annotations

import torch
from torch import Tensor

from credit.parallel._compat import group_by_device_and_dtype as _grouped


def group_by_device_and_dtype(
    tensors: list[Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    """``tensors`` grouped in torch's order (the order decides the bits of a stacked norm)."""
    return {key: group for key, (group, _) in _grouped(tensors).items()}


def group_indices_by_device_and_dtype(
    tensors: list[Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Indices into ``tensors`` grouped as :func:`group_by_device_and_dtype` groups them."""
    return {key: indices for key, (_, indices) in _grouped(tensors).items()}
