"""torch's grouping of tensors by (device, dtype) and its choice of foreach kernels."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)


def group_by_device_and_dtype(
    tensors: list[Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    """``tensors`` grouped in torch's order (the order decides the bits of a stacked norm)."""
    grouped = _group_tensors_by_device_and_dtype([tensors])  # type: ignore[list-item]
    return {key: lists[0] for key, (lists, _) in grouped.items()}  # type: ignore[misc]


def group_indices_by_device_and_dtype(
    tensors: list[Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Indices into ``tensors`` grouped as :func:`group_by_device_and_dtype` groups them."""
    grouped = _group_tensors_by_device_and_dtype([tensors], with_indices=True)  # type: ignore[list-item]
    return {key: indices for key, (_, indices) in grouped.items()}


def use_foreach(foreach: bool | None, tensors: list[Tensor], device: torch.device) -> bool:
    """torch's rule: foreach where supported when None; True demands support."""
    if (foreach is None and _has_foreach_support(tensors, device)) or (
        foreach and _device_has_foreach_support(device)
    ):
        return True
    if foreach:
        raise RuntimeError(
            f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
        )
    return False
